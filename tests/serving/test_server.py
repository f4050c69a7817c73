"""The HTTP server (glm_jax/serving/server.py) under uvicorn, called with the real `openai` client and raw httpx.

- Completions and SGLang's /generate give the Sampler's greedy tokens for the prompt alone; streaming reassembles to
  the non-streamed answer; n > 1 gives n drawn completions.
- Chat with a tool: a scripted engine writes a known reply (reasoning, content, a call and the stop token); the
  message is the hand-written OpenAI message, streamed or not.
- Each bad request class gets its 4xx and OpenAI's error object; the server serves after all of them.
- A client that disconnects mid-stream aborts its request: its pages come back long before max_new_tokens.
"""

import collections
import itertools
import json
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.data import default_data_config, load_tokenizer
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.serving import Engine, EngineConfig, Event
from glm_jax.serving.server import EngineThread, ServerState, make_app

KEY = "test-key"
NAME = "glm5_tiny"


class Served:
  """make_app(state) under uvicorn on a free loopback port, in a thread; `url`, `stop()`."""

  def __init__(self, state):
    self.state = state
    self.server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=0, log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    deadline = time.time() + 60
    while not self.server.started:
      assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
      time.sleep(0.02)
    port = self.server.servers[0].sockets[0].getsockname()[1]
    self.url = f"http://127.0.0.1:{port}"

  def client(self, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

  def stop(self):
    self.server.should_exit = True
    self.thread.join(timeout=30)
    self.state.engine.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  data = default_data_config()
  data.cache_dir = str(tmp_path_factory.mktemp("cache"))
  tok = load_tokenizer(data)
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict()).replace(
    initializer_range=0.2, index_topk=8
  )
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
  return tok, cfg, graphdef, params, rest


@pytest.fixture(scope="module")
def served(setup):
  tok, cfg, graphdef, params, rest = setup
  engine = Engine(
    graphdef,
    params,
    rest,
    cfg,
    EngineConfig(num_pages=64, page_size=8, max_running=4, prefill_chunk=16, max_seq_len=128),
  )
  s = Served(ServerState(EngineThread(engine), tok, NAME, api_key=KEY))
  yield s
  s.stop()


def greedy(setup, ids, n):
  tok, cfg, graphdef, params, rest = setup
  sampling = SamplingParams(max_new_tokens=n, temperature=0.0, stop_ids=(tok.eos_id,))
  out = Sampler(graphdef, cfg, sampling)(params, rest, [ids], jax.random.key(0))
  return np.asarray(out.tokens[0, len(ids) : int(out.lengths[0])]).tolist()


def sse(lines) -> list[dict]:
  return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


@pytest.mark.slow  # compiles the engine and the samplers
def test_completions_and_generate_are_the_samplers(setup, served):
  tok = setup[0]
  prompt = "In the beginning God created"
  ids = tok.encode(prompt)
  want = greedy(setup, ids, 12)
  out = served.client().completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
  answer = want[:-1] if want[-1] == tok.eos_id else want  # the stop token is not in the text
  assert out.choices[0].text == tok.decode(answer)
  assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want)
  assert out.choices[0].finish_reason == ("stop" if want[-1] == tok.eos_id else "length")

  stream = served.client().completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, stream=True)
  assert "".join(c.choices[0].text for c in stream) == tok.decode(answer)

  body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "return_logprob": True}
  r = httpx.post(f"{served.url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
  assert r.status_code == 200
  meta = r.json()["meta_info"]
  assert r.json()["output_ids"] == want and meta["weight_version"] == 0
  assert [t for _, t, _ in meta["output_token_logprobs"]] == want
  np.testing.assert_allclose([lp for lp, _, _ in meta["output_token_logprobs"]], out.choices[0].logprobs.token_logprobs)

  with httpx.stream(
    "POST",
    f"{served.url}/generate",
    json=dict(body, stream=True),
    headers={"Authorization": f"Bearer {KEY}"},
    timeout=120,
  ) as r:
    events = sse(list(r.iter_lines()))
  assert events[-1]["output_ids"] == want and events[-1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
  for e in events:  # cumulative: each event's ids are a prefix of the answer (tokens made between two reads come
    # together in one event)
    assert e["output_ids"] == want[: len(e["output_ids"])] and e["text"] == tok.decode(e["output_ids"])
  assert len(events) > 1

  def drawn(**seed):  # SGLang's sampling_params.sampling_seed (what its router forwards), or a top-level seed
    sp = {"max_new_tokens": 8, "temperature": 1.0} | seed.pop("sp", {})
    r = httpx.post(
      f"{served.url}/generate",
      json={"input_ids": ids, "sampling_params": sp} | seed,
      headers={"Authorization": f"Bearer {KEY}"},
      timeout=120,
    )
    return r.json()["output_ids"]

  assert drawn(sp={"sampling_seed": 3}) == drawn(seed=3) != drawn(sp={"sampling_seed": 4})
  # A batch (SGLang's list of input_ids) with one sampling_params: item i is the single request with seed 3 + i.
  sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}
  batch = httpx.post(
    f"{served.url}/generate",
    json={"input_ids": [ids, ids, ids[:3]], "sampling_params": sp},
    headers={"Authorization": f"Bearer {KEY}"},
    timeout=120,
  ).json()
  assert [b["output_ids"] for b in batch] == [
    drawn(sp={"sampling_seed": 3}),
    drawn(sp={"sampling_seed": 4}),
    drawn(sp={"sampling_seed": 5}, input_ids=ids[:3]),
  ]

  many = served.client().completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=5)
  again = served.client().completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=5)
  assert [c.text for c in many.choices] == [c.text for c in again.choices]  # seed + i: reproducible draws
  assert len({c.text for c in many.choices}) > 1


@pytest.mark.slow  # a streamed and a whole chat completion, about 4 s
def test_chat_streaming_reassembles_to_the_message(setup, served):
  messages = [{"role": "user", "content": "Who created the heaven?"}]
  full = served.client().chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
  msg = full.choices[0].message
  parts = collections.defaultdict(str)
  for c in served.client().chat.completions.create(
    model=NAME, messages=messages, max_tokens=24, temperature=0, stream=True
  ):
    delta = c.choices[0].delta
    parts["content"] += delta.content or ""
    parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
  assert (parts["content"], parts["reasoning"]) == (msg.content, msg.reasoning_content)


class ScriptedEngine:
  """The Engine interface the server uses, answering every request with `ids`, a token a step (finish reason "stop"
  at their end), a step taking `delay` seconds; `aborted` lists the requests aborted; with `fail` set, a step raises."""

  def __init__(self, ids, delay=0.0):
    self.ids, self.version, self.requests, self.delay = ids, 0, {}, delay
    self.config, self.stats = EngineConfig(max_seq_len=4096), collections.Counter()
    self.free_pages, self.used_pages = 255, 0
    self.num_running = self.num_waiting = 0
    self.aborted, self.fail, self._ids = [], False, itertools.count()

  def check_request(self, prompt, sampling):
    pass

  def add(self, prompt, sampling, seed=0):
    rid = next(self._ids)
    self.requests[rid] = (list(prompt), 0)
    return rid

  def abort(self, rid):
    self.aborted.append(rid)
    return self.requests.pop(rid, None) is not None

  def has_work(self):
    return bool(self.requests)

  def step(self):
    if self.fail:
      raise RuntimeError("a scripted failure")
    time.sleep(self.delay)
    events = []
    for rid, (prompt, i) in list(self.requests.items()):
      done = i + 1 == len(self.ids)
      events.append(Event(rid, self.ids[i], -0.5, "stop" if done else None))
      self.requests[rid] = (prompt, i + 1)
      if done:
        del self.requests[rid]
    return events


TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "calc",
      "description": "Evaluates arithmetic.",
      "parameters": {"type": "object", "properties": {"expr": {"type": "string"}, "digits": {"type": "integer"}}},
    },
  }
]
REPLY = (
  "Let me compute it: 三十七 × 九十一. </think>I will use the calculator – é.<tool_call>calc<arg_key>expr</arg_key>"
  "<arg_value>37*91</arg_value><arg_key>digits</arg_key><arg_value>4</arg_value></tool_call><|observation|>"
)


def test_chat_with_a_tool(setup):
  tok = setup[0]
  s = Served(ServerState(EngineThread(ScriptedEngine(tok.encode_chat(REPLY))), tok, NAME, api_key=KEY))
  try:
    messages = [{"role": "user", "content": "What is 37*91?"}]
    out = s.client().chat.completions.create(model=NAME, messages=messages, tools=TOOLS)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    # (the non-ASCII characters take several byte-level tokens each: a stream must not send half of one)
    want = ("I will use the calculator – é.", "Let me compute it: 三十七 × 九十一.")
    assert (msg.content, msg.reasoning_content) == want
    [call] = msg.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "37*91", "digits": 4}

    parts, calls, reasons = collections.defaultdict(str), [], []
    for c in s.client().chat.completions.create(model=NAME, messages=messages, tools=TOOLS, stream=True):
      delta = c.choices[0].delta
      parts["content"] += delta.content or ""
      parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
      calls += delta.tool_calls or []
      reasons.append(c.choices[0].finish_reason)
    assert (parts["content"], parts["reasoning"]) == (msg.content, msg.reasoning_content)
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]
    assert reasons[-1] == "tool_calls"
  finally:
    s.stop()


def test_bad_requests_get_their_4xx_and_the_server_goes_on(setup, served):
  client = served.client()
  cases = [
    (lambda: served.client("wrong").completions.create(model=NAME, prompt="a", max_tokens=2), 401, "invalid_api_key"),
    (lambda: client.completions.create(model="gpt-4", prompt="a", max_tokens=2), 404, "model_not_found"),
    (lambda: client.completions.create(model=NAME, prompt="a " * 200, max_tokens=2), 400, "context_length_exceeded"),
    (lambda: client.completions.create(model=NAME, prompt=[5, 9999], max_tokens=2), 400, "invalid_prompt"),
    (lambda: client.completions.create(model=NAME, prompt="a", max_tokens=2, temperature=-1), 400, None),
    (lambda: client.completions.create(model=NAME, prompt="a", max_tokens=0), 400, None),
    (lambda: client.completions.create(model=NAME, prompt="a", max_tokens=2, top_p=1.5), 400, None),
    (lambda: client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}]), 400, None),
  ]
  for call, status, code in cases:
    with pytest.raises(openai.APIStatusError) as e:
      call()
    assert e.value.status_code == status, e.value
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if code:
      assert err["code"] == code
  headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
  for raw in (b"{not json", b"[1, 2]", b'{"prompt": 5, "max_tokens": 2}', b'{"prompt": "a", "max_tokens": "many"}'):
    r = httpx.post(f"{served.url}/v1/completions", content=raw, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"], raw
  r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "a", "temperature": -1}, headers=headers, timeout=60)
  assert r.json()["error"]["param"] == "temperature"
  assert httpx.get(f"{served.url}/health_generate", headers=headers, timeout=60).status_code == 200
  # A router's probes need no key (as on SGLang's servers); everything else does.
  assert httpx.get(f"{served.url}/health", timeout=60).json()["status"] == "ok"
  r = httpx.get(f"{served.url}/get_server_info", timeout=60)
  assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
  out = client.completions.create(model=NAME, prompt="In the beginning", max_tokens=3, temperature=0)
  assert out.usage.completion_tokens >= 1


def test_a_client_gone_mid_stream_aborts_its_request(setup, served):
  engine = served.state.engine.engine
  free = engine.free_pages
  before, aborted = engine.stats["decode_tokens"], engine.stats["finished_abort"]
  body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 120, "temperature": 1.0}, "stream": True}
  with httpx.stream(
    "POST", f"{served.url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
  ) as r:
    lines = r.iter_lines()
    assert sse([next(lines), next(lines), next(lines)])  # three tokens, then the client goes
  deadline = time.time() + 30
  while engine.free_pages != free or engine.num_running:
    assert time.time() < deadline, "the request was not aborted"
    time.sleep(0.05)
  assert engine.stats["decode_tokens"] - before < 100 and engine.stats["finished_abort"] == aborted + 1


@pytest.mark.parametrize("path", ["/abort_request", "/abort"])
def test_abort_by_id_ends_a_running_stream(setup, served, path):
  """A streamed /generate's id (meta_info.id, what SGLang's clients abort by) posted to the abort endpoint: the stream
  ends with finish reason abort well before its max_new_tokens, its pages come back; an id not running is
  {"aborted": false}."""
  engine = served.state.engine.engine
  free, auth = engine.free_pages, {"Authorization": f"Bearer {KEY}"}
  body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 120, "temperature": 1.0}, "stream": True}
  with httpx.stream("POST", f"{served.url}/generate", json=body, headers=auth, timeout=60) as r:
    lines = r.iter_lines()
    rid = sse([next(lines)])[0]["meta_info"]["id"]
    assert httpx.post(f"{served.url}{path}", json={"rid": rid}, headers=auth).json() == {"aborted": True}
    last = sse(list(lines))[-1]
  assert last["meta_info"]["finish_reason"] == {"type": "abort"} and len(last["output_ids"]) < 120
  deadline = time.time() + 30
  while engine.free_pages != free:
    assert time.time() < deadline, "the aborted request kept its pages"
    time.sleep(0.05)
  assert httpx.post(f"{served.url}{path}", json={"rid": rid}, headers=auth).json() == {"aborted": False}


def test_stop_strings_cut_the_text_and_abort_the_request(setup):
  """A completion whose text reaches a stop string ends there, streamed or not: the text before it, finish reason
  "stop", the tokens up to the one that completed it, and the engine's request aborted (not run to max_tokens)."""
  tok = setup[0]
  ids = [i for piece in ["12", ",", ",", "34"] + ["5"] * 40 for i in tok.encode(piece)]
  engine = ScriptedEngine(ids, delay=0.02)  # a second for all 44 tokens: the stop string comes long before
  s = Served(ServerState(EngineThread(engine), tok, NAME, api_key=KEY))
  try:
    out = s.client().completions.create(model=NAME, prompt="x", max_tokens=60, stop=[",,", "zz"], temperature=0)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == ("12", "stop")
    assert out.usage.completion_tokens == len(tok.encode("12")) + 2  # the two "," tokens that make the stop string
    streamed = "".join(
      c.choices[0].text
      for c in s.client().completions.create(model=NAME, prompt="x", max_tokens=60, stop=",,", stream=True)
    )
    assert streamed == "12"
    deadline = time.time() + 10
    while len(engine.aborted) < 2:  # both requests aborted, long before the 44 scripted tokens ran out
      assert time.time() < deadline, engine.aborted
      time.sleep(0.05)
  finally:
    s.stop()


def test_a_failing_engine_step_is_a_503_and_unhealthy_until_a_step_succeeds(setup):
  tok = setup[0]
  engine = ScriptedEngine(tok.encode("fine"))
  s = Served(ServerState(EngineThread(engine), tok, NAME, api_key=KEY))
  headers = {"Authorization": f"Bearer {KEY}"}
  try:
    engine.fail = True
    r = httpx.post(f"{s.url}/generate", json={"input_ids": [5, 6]}, headers=headers, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    assert httpx.get(f"{s.url}/health", timeout=60).status_code == 503
    engine.fail = False
    r = httpx.post(f"{s.url}/generate", json={"input_ids": [5, 6]}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"] == tok.encode("fine")
    assert httpx.get(f"{s.url}/health", timeout=60).status_code == 200
  finally:
    s.stop()
