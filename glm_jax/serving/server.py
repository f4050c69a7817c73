"""The engine over HTTP: a FastAPI app (served by uvicorn, launch/serve.py) with SGLang's native endpoints and
OpenAI's.

  POST /generate              SGLang's: token ids (or text) in; token ids, text and log-probabilities out (what RL
                              rollouts need); "stream", batches of input_ids, stop at EOS unless ignore_eos
  POST /v1/completions        OpenAI completions: prompt (text or ids), n, max_tokens, temperature, top_p, seed, stop,
                              logprobs, stream
  POST /v1/chat/completions   OpenAI chat in GLM-5's chat format (glm_jax/chat.py): tools, content,
                              reasoning_content and tool_calls, enable_thinking / clear_thinking, stream
  GET  /v1/models, /health, /health_generate, /get_model_info, /get_server_info, /get_load
  POST /abort_request, /update_weights (new weights between engine steps, with a version)
Every generation's response carries the weight version its samples were admitted under. Bad requests get OpenAI's
error object with a 4xx status and the server goes on serving; a client that disconnects from a stream aborts its
request. With `api_key` every request but /health and /health_generate must send `Authorization: Bearer <key>`. The
engine steps in a thread of its own (`EngineThread`); handlers add requests under its lock and read their events
from an asyncio queue. Each endpoint's fields and errors: docs/serving.md, "The server's endpoints".
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from absl import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from glm_jax import chat
from glm_jax.inference.sampling import SamplingParams
from glm_jax.serving.engine import Engine, Event


def is_loopback(host: str) -> bool:
  """Whether binding `host` keeps a server on this machine (launch/serve.py and launch/router.py want an API key
  otherwise)."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


class ApiError(Exception):
  """A request the server refuses: status, message, param, code (OpenAI's error object)."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def response(self) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
    body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
    return JSONResponse(body, status_code=self.status)


class _ApiKey:
  """ASGI middleware: with state.api_key set, a request without `Authorization: Bearer <key>` gets a 401. /health and
  /health_generate answer without the key, as SGLang's servers do: a router probes them unauthenticated. (A plain
  ASGI wrapper: starlette's @app.middleware("http") runs each streamed response through a task and a memory stream
  of its own, which slows streaming; docs/serving.md, "Serving benchmarks".)"""

  def __init__(self, app, state: ServerState):
    self.app, self.state = app, state

  async def __call__(self, scope, receive, send):
    key = self.state.api_key
    if key is not None and scope["type"] == "http" and not scope["path"].startswith("/health"):
      given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ").strip()
      if not secrets.compare_digest(given.encode(), key.encode()):
        error = ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)", None, "invalid_api_key")
        await error.response()(scope, receive, send)
        return
    await self.app(scope, receive, send)


class EngineThread:
  """An Engine stepping in a thread of its own. `add` (a coroutine) queues a request and returns its id and the
  asyncio queue its events arrive on; `abort` never waits (the engine thread takes it before its next step), so an
  event loop never blocks on a step; `update_weights` waits for the step in progress (call it from a worker thread);
  `stop` from any thread. A step that raises fails the requests in it with finish reason "error" and sets `error`
  (the server's /health answers 503) until a step succeeds again; the thread itself never dies of it."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
    self._aborts: collections.deque[int] = collections.deque()
    self._stopped = False
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  async def add(self, prompt: list[int], sampling: SamplingParams, seed: int) -> tuple[int, asyncio.Queue]:
    """Queues a request from a coroutine (waiting for the lock in a worker thread: a step may hold it)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def add():
      with self._lock:
        rid = self.engine.add(prompt, sampling, seed=seed)
        self._queues[rid] = (loop, queue)
      return rid

    rid = await asyncio.to_thread(add)
    self._wake.set()
    return rid, queue

  def abort(self, rid: int) -> bool:
    """Ends the request before the next step; False if it is not running here (unknown or over)."""
    found = rid in self._queues
    self._aborts.append(rid)
    self._wake.set()
    return found

  def update_weights(self, params, rest, version) -> None:
    with self._lock:
      self.engine.update_weights(params, rest, version)

  def stop(self) -> None:
    self._stopped = True
    self._wake.set()
    self._thread.join(timeout=30)

  def _run(self) -> None:
    while not self._stopped:
      try:
        busy = self._step()
      except Exception:  # a bug in the bookkeeping: logged, and the thread goes on serving
        logging.exception("the engine thread's loop failed")
        busy = False
      if not busy:
        self._wake.wait(timeout=1.0)
        self._wake.clear()

  def _step(self) -> bool:
    with self._lock:
      while self._aborts:
        self.engine.abort(self._aborts.popleft())
      if not self.engine.has_work():
        return False
      try:
        events = self.engine.step()
        self.error = None
      except Exception as e:  # a broken step (non-finite weights, say) fails its requests, not the server
        logging.exception("engine step failed")
        events = [Event(rid, None, None, "error") for rid in list(self._queues)]
        for rid in list(self._queues):
          self.engine.abort(rid)
        self.error = e
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for ev in events:
      target = self._queues.get(ev.rid)
      if target is None:
        continue
      if ev.finish_reason:
        del self._queues[ev.rid]
      by_loop.setdefault(target[0], []).append((target[1], ev))
    for loop, items in by_loop.items():  # one wake-up of each event loop a step, not one an event
      try:
        loop.call_soon_threadsafe(_deliver, items)
      except RuntimeError:  # the loop is closed: nobody is listening to these requests any more
        for _, ev in items:
          self._aborts.append(ev.rid)
    return True


def _deliver(items) -> None:
  for queue, ev in items:
    queue.put_nowait(ev)


@dataclasses.dataclass
class ServerState:
  engine: EngineThread
  tokenizer: Any  # glm_jax.data.Tokenizer
  model_name: str
  api_key: str | None = None
  load_weights: Callable[[dict], tuple[Any, Any, Any]] | None = None  # /update_weights body -> (params, rest, version)
  started: float = dataclasses.field(default_factory=time.time)


# ---- request fields


def _field(body: dict, name: str, kind, default=None, *, where: str | None = None):
  """body[name] checked against `kind` (a type or a tuple of types), default when absent or null."""
  value = body.get(name, default)
  if value is None:
    return default
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
    names = " or ".join(k.__name__ for k in kinds)
    raise ApiError(400, f"{where or name}: expected {names}, got {json.dumps(value)[:80]}", name, "invalid_type")
  return value


def _sampling(body: dict, stop_ids: tuple[int, ...], max_key: str, default_max: int) -> tuple[SamplingParams, int]:
  """SamplingParams and the seed from an OpenAI-style body (max_tokens etc.), each bad value refused by name."""
  max_new = _field(body, max_key, int, default_max)
  temperature = _field(body, "temperature", (int, float), 1.0)
  top_p = _field(body, "top_p", (int, float), 1.0)
  seed = _field(body, "seed", int, 0)
  try:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p))
  except ValueError as e:
    param = str(e).split("=", 1)[0]
    raise ApiError(
      400, str(e).replace("max_new_tokens", max_key), max_key if param == "max_new_tokens" else param
    ) from e
  if not 0 <= seed < 2**31:
    raise ApiError(400, f"seed={seed}; must be in [0, 2**31)", "seed")
  return dataclasses.replace(sampling, stop_ids=tuple(stop_ids)), seed


def _prompt_ids(state: ServerState, prompt: Any, where: str) -> list[int]:
  if isinstance(prompt, str):
    try:
      return state.tokenizer.encode(prompt)
    except (ValueError, KeyError) as e:  # a character vocabulary without one of its characters, say
      raise ApiError(400, f"{where}: the tokenizer cannot encode it: {e}", where, "invalid_prompt") from e
  if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    return list(prompt)
  raise ApiError(400, f"{where}: expected a string or a list of token ids", where, "invalid_type")


def _check(state: ServerState, ids: list[int], sampling: SamplingParams, where: str) -> None:
  try:
    state.engine.engine.check_request(ids, sampling)
  except ValueError as e:
    code = "context_length_exceeded" if "max_seq_len" in str(e) or "pages" in str(e) else "invalid_prompt"
    raise ApiError(400, f"{where}: {e}", where, code) from e


# ---- running requests


@dataclasses.dataclass
class Generation:
  tokens: list[int] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  version: Any = None  # the weight version the request was admitted under (the oldest that made its tokens)
  rid: int | None = None  # the engine's id of the request (POST /abort_request takes it)


async def _stream(state: ServerState, ids: list[int], sampling: SamplingParams, seed: int) -> AsyncIterator[Generation]:
  """Runs one request, yielding its Generation as new tokens come (every token that arrived since the last yield at
  once: a consumer that falls behind the engine gets fewer, larger updates) and at the end; aborts the request if
  the caller stops listening (a client gone)."""
  rid, queue = await state.engine.add(ids, sampling, seed)
  gen, over = Generation(rid=rid), False  # over: the engine ended it (a caller may set gen's finish reason itself)
  try:
    while not over:
      ev = await queue.get()
      while True:
        if ev.token is not None:
          gen.tokens.append(ev.token)
          gen.logps.append(ev.logp)
        gen.finish_reason, over = ev.finish_reason, ev.finish_reason is not None
        gen.version = ev.version if gen.version is None else gen.version
        if over or queue.empty():
          break
        ev = queue.get_nowait()
      yield gen
  finally:
    if not over:
      state.engine.abort(rid)


async def _run(state: ServerState, ids: list[int], sampling: SamplingParams, seed: int) -> Generation:
  last = Generation()
  async for gen in _stream(state, ids, sampling, seed):
    last = gen
  return last


def _text_stop(text: str, stops: list[str]) -> int | None:
  """Where the first stop string starts in `text`, or None."""
  hits = [text.find(s) for s in stops if s and s in text]
  return min(hits) if hits else None


def _sse(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


def _finish(reason: str | None) -> str | None:
  return {"error": "abort"}.get(reason, reason)


# ---- the chat reply, as far as it is known


def reply(text: str, thinking: bool, tools: list | None) -> dict:
  """The assistant message of a reply's text (what followed the generation prompt, stop string excluded): with
  thinking on, the text up to `</think>` is the reasoning (all of it while `</think>` has not come: a thought cut off
  by max_tokens), the rest parsed by chat.parse_assistant; with it off, all of it parsed."""
  reasoning, rest = "", text
  if thinking:
    reasoning, end, after = text.partition("</think>")
    rest = after if end else ""
  parsed = chat.parse_assistant(rest, tools=tools or None)
  parsed["reasoning_content"] = reasoning.strip()
  return parsed


def reply_so_far(text: str, thinking: bool) -> tuple[str, str]:
  """(reasoning, content) of a reply still being written, each a prefix of what `reply` gives once it ends: the
  trailing whitespace held back (the end strips it) and nothing from an unclosed <tool_call> on."""
  cut = text.rfind("<tool_call>")
  if cut != -1 and "</tool_call>" not in text[cut:]:
    text = text[:cut]
  parsed = reply(text, thinking, None)
  return parsed["reasoning_content"], parsed["content"]


def _openai_calls(calls: list[dict]) -> list[dict]:
  return [
    {
      "id": f"call_{uuid.uuid4().hex[:24]}",
      "type": "function",
      "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
    }
    for c in calls
  ]


# ---- the app


def make_app(state: ServerState) -> FastAPI:
  app = FastAPI(title="glm-jax serving engine")
  app.state.serving = state
  tok = _Decoding(state.tokenizer)
  chat_stops = tuple(tok.chat_ids[s] for s in chat.STOP_STRINGS) if _can_chat(tok) else ()

  app.add_middleware(_ApiKey, state=state)

  @app.exception_handler(ApiError)
  async def api_error(request, e: ApiError):
    return e.response()

  @app.exception_handler(RequestValidationError)
  async def bad_body(request, e: RequestValidationError):
    return ApiError(400, f"malformed request body: {e.errors()[0].get('msg', e)}", None, "invalid_json").response()

  @app.exception_handler(HTTPException)
  async def http_error(request, e: HTTPException):
    return ApiError(e.status_code, str(e.detail), None, None).response()

  async def body_of(request: Request) -> dict:
    try:
      body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
      raise ApiError(400, f"malformed JSON: {e}", None, "invalid_json") from e
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body

  def check_model(body: dict) -> None:
    model = body.get("model")
    if model is not None and model != state.model_name:
      raise ApiError(
        404, f"The model {model!r} does not exist; this server serves {state.model_name!r}", "model", "model_not_found"
      )

  def version() -> Any:
    return state.engine.engine.version

  # ---- health and info

  @app.get("/health")
  async def health():
    if not state.engine.alive or state.engine.error is not None:
      why = (
        "the engine thread is gone"
        if not state.engine.alive
        else f"the engine's last step failed: {state.engine.error}"
      )
      raise ApiError(503, why, None, "engine_error")
    return {"status": "ok", "weight_version": version()}

  @app.get("/health_generate")
  async def health_generate():
    gen = await asyncio.wait_for(_run(state, [tok.eos_id], SamplingParams(max_new_tokens=1, temperature=0.0), 0), 60)
    if len(gen.tokens) != 1:
      raise ApiError(503, f"the engine did not generate (finish reason {gen.finish_reason})", None, "engine_error")
    return {"status": "ok", "weight_version": version()}

  @app.get("/v1/models")
  async def models():
    return {
      "object": "list",
      "data": [{"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "glm-jax"}],
    }

  @app.get("/get_model_info")
  @app.get("/model_info")
  async def model_info():
    return {
      "model_path": state.model_name,
      "served_model_name": state.model_name,
      "tokenizer_path": getattr(tok, "name", None),
      "is_generation": True,
    }

  @app.get("/get_server_info")
  @app.get("/server_info")
  async def server_info():
    eng = state.engine.engine
    return {
      "model_path": state.model_name,
      "served_model_name": state.model_name,
      "weight_version": version(),
      "engine": dataclasses.asdict(eng.config),
      "running": eng.num_running,
      "waiting": eng.num_waiting,
      "free_pages": eng.free_pages,
      "stats": dict(eng.stats),
    }

  @app.get("/get_load")
  async def load():  # SGLang's load report (the router's power_of_two policy reads it)
    eng = state.engine.engine
    return [
      {
        "dp_rank": 0,
        "num_reqs": eng.num_running,
        "num_waiting_reqs": eng.num_waiting,
        "num_tokens": eng.used_pages * eng.config.page_size,
      }
    ]

  @app.post("/abort_request")  # SGLang's name; /abort the same
  @app.post("/abort")
  async def abort_request(request: Request):
    rid = _field(await body_of(request), "rid", (int, str))
    found = state.engine.abort(int(rid)) if str(rid).isdigit() else False
    return {"aborted": found}

  @app.post("/update_weights")
  async def update_weights(request: Request):
    body = await body_of(request)
    if state.load_weights is None:
      raise ApiError(400, "this server was started without a weight source (launch/serve.py --workdir)", None, None)
    try:
      params, rest, new_version = await asyncio.to_thread(state.load_weights, body)
    except Exception as e:  # the files named are the client's: whatever is wrong with them is a bad request
      raise ApiError(400, f"update_weights: {type(e).__name__}: {e}", None, "bad_weights") from e
    await asyncio.to_thread(state.engine.update_weights, params, rest, new_version)  # waits for the step in progress
    return {"success": True, "weight_version": new_version}

  # ---- SGLang's native generate

  @app.post("/generate")
  async def generate(request: Request):
    body = await body_of(request)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):  # a batch: SGLang's list of prompts
      sps = body.get("sampling_params") or {}
      sps = sps if isinstance(sps, list) else [sps] * len(ids)
      if len(sps) != len(ids) or _field(body, "stream", bool, False):
        raise ApiError(400, "a batch of input_ids takes one sampling_params each (or one for all), no stream", None)
      # every item checked before any runs: a bad one refuses the batch. One sampling_params for all (SGLang's router
      # forwards only that form): item i draws with its seed + i, so a group of one prompt gets distinct samples.
      items = [native_request(dict(body, input_ids=x, sampling_params=sp)) for x, sp in zip(ids, sps)]
      if not isinstance(body.get("sampling_params"), list):
        items = [(x, sampling, _seed(seed, i), logp) for i, (x, sampling, seed, logp) in enumerate(items)]
      gens = await asyncio.gather(*(_run(state, *item[:3]) for item in items))
      _raise_failed(gens)
      return [native_output(item, gen) for item, gen in zip(items, gens)]
    item = native_request(body)
    if not _field(body, "stream", bool, False):
      gen = await _run(state, *item[:3])
      _raise_failed([gen])
      return native_output(item, gen)

    async def events():
      async for gen in _stream(state, *item[:3]):
        yield _sse(native_output(item, gen))
      yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")

  def native_request(body: dict) -> tuple[list[int], SamplingParams, int, bool]:
    """A /generate body's (prompt ids, sampling, seed, whether to return log-probabilities), checked."""
    if body.get("input_ids") is not None:
      ids = _prompt_ids(state, _field(body, "input_ids", list), "input_ids")
    else:
      ids = _prompt_ids(state, _field(body, "text", str, None) or "", "text")
    sp = _field(body, "sampling_params", dict, {})
    stop_ids = _field(sp, "stop_token_ids", list, [], where="sampling_params.stop_token_ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
      raise ApiError(400, "sampling_params.stop_token_ids: expected a list of token ids", "stop_token_ids")
    if not _field(sp, "ignore_eos", bool, False, where="sampling_params.ignore_eos"):  # SGLang stops at EOS too
      stop_ids = [*stop_ids, tok.eos_id]
    # the seed: SGLang's sampling_params.sampling_seed (what its router forwards), or seed there or at the top level
    seed = next((x for x in (sp.get("sampling_seed"), sp.get("seed"), body.get("seed")) if x is not None), None)
    sampling, seed = _sampling({**sp, "seed": seed}, stop_ids, "max_new_tokens", 128)
    _check(state, ids, sampling, "input_ids")
    return ids, sampling, seed, _field(body, "return_logprob", bool, False)

  def native_output(item, gen: Generation) -> dict:
    ids, _, _, with_logp = item
    meta = {
      "finish_reason": None if gen.finish_reason is None else {"type": _finish(gen.finish_reason)},
      "prompt_tokens": len(ids),
      "completion_tokens": len(gen.tokens),
      "weight_version": version() if gen.version is None else gen.version,
      "id": str(gen.rid),  # what POST /abort_request takes
    }
    if with_logp:
      meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(gen.tokens, gen.logps)]
    stop = gen.finish_reason == "stop" and gen.tokens and gen.tokens[-1] in item[1].stop_ids
    text = tok.decode(gen.tokens[:-1] if stop else gen.tokens)  # the stop token's text is not in it (SGLang's way)
    return {"text": text, "output_ids": list(gen.tokens), "meta_info": meta}

  # ---- OpenAI completions

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await body_of(request)
    check_model(body)
    ids = _prompt_ids(state, body.get("prompt"), "prompt")
    stops = _field(body, "stop", (str, list), [])
    stops = [stops] if isinstance(stops, str) else stops
    if not all(isinstance(x, str) and x for x in stops) or len(stops) > 4:
      raise ApiError(400, f"stop={json.dumps(stops)[:80]}: up to 4 non-empty strings", "stop", "invalid_type")
    n = _field(body, "n", int, 1)
    if not 1 <= n <= 64:
      raise ApiError(400, f"n={n}; must be in [1, 64]", "n")
    sampling, seed = _sampling(body, (tok.eos_id,), "max_tokens", 16)
    _check(state, ids, sampling, "prompt")
    with_logp = _field(body, "logprobs", int, None) is not None
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"

    def result(gen: Generation) -> tuple[str, int, bool]:
      """(the completion's text, the tokens it took, whether a stop string ended it): the stop token and anything
      from a stop string on are not in the text; the tokens are counted up to the one that completed the string."""
      tokens = gen.tokens[:-1] if gen.tokens and gen.tokens[-1] in sampling.stop_ids else gen.tokens
      text = tok.decode(tokens)
      at = _text_stop(text, stops)
      if at is None:
        return text, len(gen.tokens), False
      used = next(i for i in range(1, len(tokens) + 1) if _text_stop(tok.decode(tokens[:i]), stops) is not None)
      return text[:at], used, True

    def sendable(gen: Generation) -> str:
      """What a stream may send so far: a prefix of the final text (not a half-decoded character, nor what could
      begin a stop string)."""
      text, _, stopped = result(gen)
      if stopped or gen.finish_reason is not None:
        return text
      text = text.rstrip("\ufffd")
      for size in range(min(len(text), max((len(x) for x in stops), default=1) - 1), 0, -1):
        if any(x.startswith(text[-size:]) for x in stops):
          return text[:-size]
      return text

    def choice(i: int, gen: Generation, text: str, used: int, stopped: bool) -> dict:
      logprobs = None
      if with_logp:
        logprobs = {"tokens": [tok.decode([t]) for t in gen.tokens[:used]], "token_logprobs": gen.logps[:used]}
      reason = "stop" if stopped else _finish(gen.finish_reason)
      return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}

    if not _field(body, "stream", bool, False):
      cut = lambda g: result(g)[2]  # noqa: E731
      gens = await asyncio.gather(
        *(_stopped_by_text(_stream(state, ids, sampling, _seed(seed, i)), cut) for i in range(n))
      )
      _raise_failed(gens)
      results = [result(g) for g in gens]
      done = sum(used for _, used, _ in results)
      return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [choice(i, g, *r) for i, (g, r) in enumerate(zip(gens, results))],
        "usage": {"prompt_tokens": len(ids) * n, "completion_tokens": done, "total_tokens": len(ids) * n + done},
        "weight_version": _versions(gens, version()),
      }
    if n != 1:
      raise ApiError(400, "stream with n > 1 is not supported; stream one completion a request", "n")

    async def events():
      sent = ""
      stream = _stream(state, ids, sampling, seed)
      try:
        async for gen in stream:
          text, used, stopped = result(gen)
          now = sendable(gen)
          last = stopped or gen.finish_reason is not None
          if now.startswith(sent) and (len(now) > len(sent) or last):
            chunk = dict(choice(0, gen, now[len(sent) :], used, stopped), logprobs=None)
            if not last:
              chunk["finish_reason"] = None
            sent = now
            yield _sse(
              {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": [chunk],
              }
            )
          if stopped:
            break
      finally:
        await stream.aclose()  # a stop string ended it early: the engine's request is aborted
      yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")

  # ---- OpenAI chat

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await body_of(request)
    check_model(body)
    if not chat_stops:
      raise ApiError(
        400,
        f"this server's tokenizer ({getattr(tok, 'name', '?')}) cannot encode GLM-5's chat format; use "
        "/v1/completions or /generate",
        None,
        "chat_unsupported",
      )
    messages = _field(body, "messages", list)
    if not messages:
      raise ApiError(400, "messages: expected a non-empty list of messages", "messages", "invalid_type")
    tools = _field(body, "tools", list, None)
    kwargs = _field(body, "chat_template_kwargs", dict, {})
    thinking = _field({**kwargs, **body}, "enable_thinking", bool, True)
    clear = _field({**kwargs, **body}, "clear_thinking", bool, True)
    try:
      text = chat.render(
        messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking, clear_thinking=clear
      )
    except ValueError as e:
      raise ApiError(400, str(e), "messages", "invalid_messages") from e
    ids = tok.encode_chat(text)
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling, seed = _sampling(body, chat_stops, max_key, 256)
    _check(state, ids, sampling, "messages")
    n = _field(body, "n", int, 1)
    if not 1 <= n <= 64:
      raise ApiError(400, f"n={n}; must be in [1, 64]", "n")
    with_logp = _field(body, "logprobs", bool, False)
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"

    def text_of(gen: Generation) -> str:
      body_tokens = [t for t in gen.tokens if t not in chat_stops]  # the stop token is not part of the reply
      return tok.decode(body_tokens)

    def finish(gen: Generation, message: dict) -> str | None:
      if gen.finish_reason == "stop" and message["tool_calls"]:
        return "tool_calls"
      return _finish(gen.finish_reason)

    def message_of(gen: Generation) -> dict:
      parsed = reply(text_of(gen), thinking, tools)
      msg = {"role": "assistant", "content": parsed["content"], "reasoning_content": parsed["reasoning_content"]}
      msg["tool_calls"] = _openai_calls(parsed["tool_calls"]) or None
      if parsed["errors"]:
        msg["tool_call_errors"] = parsed["errors"]
      return msg

    def logprobs_of(gen: Generation) -> dict | None:
      if not with_logp:
        return None
      return {
        "content": [
          {"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
          for t, lp in zip(gen.tokens, gen.logps)
        ]
      }

    if not _field(body, "stream", bool, False):
      gens = await asyncio.gather(*[_run(state, ids, sampling, _seed(seed, i)) for i in range(n)])
      _raise_failed(gens)
      choices = []
      for i, gen in enumerate(gens):
        msg = message_of(gen)
        choices.append({"index": i, "message": msg, "logprobs": logprobs_of(gen), "finish_reason": finish(gen, msg)})
      done = sum(len(g.tokens) for g in gens)
      return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": len(ids) * n, "completion_tokens": done, "total_tokens": len(ids) * n + done},
        "weight_version": _versions(gens, version()),
      }
    if n != 1:
      raise ApiError(400, "stream with n > 1 is not supported; stream one completion a request", "n")

    def chunk(delta: dict, reason: str | None = None) -> str:
      return _sse(
        {
          "id": cid,
          "object": "chat.completion.chunk",
          "created": created,
          "model": state.model_name,
          "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }
      )

    async def events():
      yield chunk({"role": "assistant", "content": ""})
      sent_r = sent_c = ""
      gen = Generation()
      async for gen in _stream(state, ids, sampling, seed):
        if gen.finish_reason is not None:
          continue  # the stream's last item: the message below
        # not a half-decoded character (U+FFFD until its last byte's token comes): only text that stays
        reasoning, content = reply_so_far(text_of(gen).rstrip("\ufffd"), thinking)
        delta = {}
        if len(reasoning) > len(sent_r) and reasoning.startswith(sent_r):
          delta["reasoning_content"], sent_r = reasoning[len(sent_r) :], reasoning
        if len(content) > len(sent_c) and content.startswith(sent_c):
          delta["content"], sent_c = content[len(sent_c) :], content
        if delta:
          yield chunk(delta)
      msg = message_of(gen)
      delta = {}
      if msg["reasoning_content"][len(sent_r) :]:
        delta["reasoning_content"] = msg["reasoning_content"][len(sent_r) :]
      if msg["content"][len(sent_c) :]:
        delta["content"] = msg["content"][len(sent_c) :]
      if msg["tool_calls"]:
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(msg["tool_calls"])]
      yield chunk(delta, finish(gen, msg))
      yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")

  return app


class _Decoding:
  """The tokenizer, whose decode never raises: an id it cannot decode (a model's vocabulary wider than a character
  vocabulary's, say) is U+FFFD in the text; the ids themselves are what RL reads."""

  def __init__(self, tokenizer):
    self._tok = tokenizer

  def __getattr__(self, name):
    return getattr(self._tok, name)

  def decode(self, ids) -> str:
    try:
      return self._tok.decode(ids)
    except (ValueError, KeyError, IndexError, OverflowError):
      return "".join(self._one(i) for i in ids)

  def _one(self, i: int) -> str:
    try:
      return self._tok.decode([i])
    except (ValueError, KeyError, IndexError, OverflowError):
      return "\ufffd"


def _seed(seed: int, i: int) -> int:
  """The seed of a request's i-th sample (n > 1, a batch): seed + i, kept in [0, 2**31)."""
  return (seed + i) % 2**31


def _versions(gens, current):
  """The weight version of a response: its samples' (the version each was admitted under), one if they agree."""
  versions = [current if g.version is None else g.version for g in gens]
  return versions[0] if all(v == versions[0] for v in versions) else versions


def _raise_failed(gens) -> None:
  """A sample the engine failed (a step that raised) fails the response: 503, which a router retries elsewhere."""
  if any(g.finish_reason == "error" for g in gens):
    raise ApiError(503, "the engine failed while generating this request; try again", None, "engine_error")


async def _stopped_by_text(stream: AsyncIterator[Generation], cut) -> Generation:
  """Runs a stream until it ends or its text reaches a stop string (then it is aborted: finish reason "stop")."""
  gen = Generation()
  try:
    async for gen in stream:
      if cut(gen):
        gen.finish_reason = "stop"
        break
  finally:
    await stream.aclose()  # aborts the request if it is still running
  return gen


def _can_chat(tokenizer) -> bool:
  try:
    tokenizer.chat_ids  # noqa: B018
  except (ValueError, AttributeError):  # a tokenizer without the format's tokens, or a character vocabulary
    return False
  return True
