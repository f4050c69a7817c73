"""The agent loop (glm_jax/rl/agent_loop.py) against hand-built sequences and the full forward pass.

- A scripted policy (fixed text, its ids forced through the loop) on three ragged episodes: each episode's ids,
  loss mask and spans equal the tokenization of hand-written chat text, piece by piece; the environments got the
  parsed calls; finish reasons and rewards are the scripted ones.
- The logits each model token was drawn from, continuing on the cache across observations, equal the full forward
  pass over the final sequence (fp32, CPU), and the sampler's log-probs equal the trainer's recomputation
  (rl/step.py token_logprobs) on exactly the loss-mask-1 tokens.
- Greedy decoding continuing on the cache and re-prefilling every turn write the same tokens.
- Tools that raise, sleep past the timeout and flood, called by a scripted policy through the loop: each call's
  observation is the runner's bounded error or cut result, counted by kind, and every episode goes on to its answer.
"""

import dataclasses
import re
import threading

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.data import default_data_config, load_tokenizer
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl.agent_loop import AgentLoop, AgentParams, describe
from glm_jax.rl.environment import ToolEnvironment
from glm_jax.rl.tools import ToolRunner
from glm_jax.rl.step import token_logprobs
from glm_jax.rl.trajectory import Trajectory


@dataclasses.dataclass
class Step:
  messages: list
  done: bool
  reward: float


class ScriptedEnv:
  """Answers each tool call with "<name>:<turn>"; done after `turns` answers, with reward = its turn count."""

  def __init__(self, turns):
    self.turns, self.seen = turns, []

  def step(self, turn):
    self.seen.append(turn)
    n = len(self.seen)
    answers = [{"role": "tool", "content": f"{c['function']['name']}:{n}"} for c in turn["tool_calls"]]
    return Step(answers or [{"role": "tool", "content": "no call"}], n >= self.turns, float(n))


QUESTIONS = ["What is 37*91?", "Hi", "Count the verses of Genesis 1, then of Genesis 2, please."]
CALL = "Check.</think><tool_call>calc<arg_key>expr</arg_key><arg_value>{x}</arg_value></tool_call><|observation|>"
ANSWER = "Done.</think>It is {x}.<|endoftext|>"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  cfg = default_data_config()
  cfg.cache_dir = str(tmp_path_factory.mktemp("cache"))
  tok = load_tokenizer(cfg)
  model_cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  model_cfg = model_cfg.replace(index_topk=8, initializer_range=0.2)  # DSA selects past 8 tokens
  model = GlmMoeDsa(model_cfg, nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return tok, model_cfg, model, graphdef, params, rest


def scripted_texts(row, turn):
  """Row 0: two calls then an answer; row 1: answers at once; row 2: calls until its environment ends it."""
  if row == 1 or (row == 0 and turn == 3):
    return ANSWER.format(x=row * 10 + turn)
  return CALL.format(x=f"{row}+{turn}" * (turn if row == 2 else 1))


@pytest.fixture(scope="module")
def scripted(setup):
  tok, model_cfg, _, graphdef, params, rest = setup
  # cache_len: room for a prompt with a tool's block (the flooding tools test)
  loop = AgentLoop(graphdef, model_cfg, tok, AgentParams(max_turns=4, max_turn_tokens=48, cache_len=640))
  envs = [ScriptedEnv(9), ScriptedEnv(9), ScriptedEnv(2)]
  trajs = [Trajectory(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
  result = loop.run(
    params,
    rest,
    trajs,
    envs,
    jax.random.key(0),
    script=lambda r, t: tok.encode_chat(scripted_texts(r, t)),
    return_logits=True,
  )
  return result, envs, loop


def test_a_scripted_policy_through_the_loop_is_the_hand_built_sequence(setup, scripted):
  tok = setup[0]
  result, envs, _ = scripted
  turns = {0: 3, 1: 1, 2: 2}
  for r, q in enumerate(QUESTIONS):
    pieces = [(f"[gMASK]<sop><|user|>{q}<|assistant|><think>", 0, "prompt")]
    for t in range(1, turns[r] + 1):
      pieces.append((scripted_texts(r, t), 1, "sample"))
      if scripted_texts(r, t).endswith("<|observation|>") and not (r == 2 and t == 2):
        pieces.append((f"<tool_response>calc:{t}</tool_response><|assistant|><think>", 0, "observation"))
    traj = result.trajectories[r]
    assert traj.tokens == [i for text, _, _ in pieces for i in tok.encode_chat(text)], r
    assert traj.loss_mask == [m for text, m, _ in pieces for _ in tok.encode_chat(text)], r
    assert [s.kind for s in traj.spans] == [kind for _, _, kind in pieces]
    assert [len(tok.encode_chat(text)) for text, _, _ in pieces] == [s.end - s.start for s in traj.spans]
  assert result.turns == [3, 1, 2]
  assert result.finish == ["stop", "stop", "done"]  # row 2's environment ended it after its second call
  assert [len(e.seen) for e in envs] == [3, 1, 2] and envs[0].seen[2]["stop"] == "<|endoftext|>"
  assert result.rewards == [3.0, 1.0, 2.0]  # every turn went to the environment, the final answers too
  assert [c["function"]["arguments"]["expr"] for c in (t["tool_calls"][0] for t in envs[2].seen)] == ["2+1", "2+22+2"]
  assert result.tool_calls == 4 and result.tool_errors == 0
  assert describe(result)["tool_call_validity"] == 1.0


def test_cache_continuation_gives_the_full_forwards_logits_and_log_probs(setup, scripted):
  tok, _, model, *_ = setup
  result, _, _ = scripted
  width = max(len(t.tokens) for t in result.trajectories)  # one batch: padding after a row changes nothing before
  batch = np.stack([t.arrays(width)["tokens"] for t in result.trajectories])
  logits_all = np.asarray(jax.jit(lambda x: model(x, compute_mtp=False).logits)(batch))
  recomputed_all = np.asarray(jax.jit(lambda x: token_logprobs(model, x))(batch))  # the trainer's, temperature 1
  for r, traj in enumerate(result.trajectories):
    sampled = np.flatnonzero(traj.loss_mask)
    np.testing.assert_allclose(np.stack(result.logits[r]), logits_all[r, sampled - 1], atol=5e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(traj.logprobs)[sampled], recomputed_all[r, sampled], atol=5e-5)
    assert len(sampled) > 0 and (np.asarray(traj.logprobs)[np.asarray(traj.loss_mask) == 0] == 0).all()


class FloodingEnv:
  """Answers every turn with a tool result of `n` words."""

  def __init__(self, n):
    self.n = n

  def step(self, turn):
    return Step([{"role": "tool", "content": " ".join(["word"] * self.n)}], False, 0.5)


def test_an_observation_past_the_cache_ends_the_episode_unappended(setup, scripted):
  tok, _, _, _, params, rest = setup
  loop = scripted[2]  # cache_len 256: the same compiled turns
  trajs = [Trajectory(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
  envs = [FloodingEnv(5), FloodingEnv(400), FloodingEnv(5)]
  result = loop.run(params, rest, trajs, envs, jax.random.key(0), script=lambda r, t: tok.encode_chat(CALL.format(x=r)))
  assert result.finish[1] == "length" and result.turns[1] == 1 and trajs[1].spans[-1].kind == "sample"
  assert all(len(t.tokens) <= 256 for t in trajs) and result.rewards[1] == 0.5
  assert result.finish[0] == result.finish[2] == "max_turns" and result.turns[0] == 4


@pytest.mark.slow  # a second loop, compiling the re-prefills at each width
def test_greedy_continuation_and_reprefill_write_the_same_tokens(setup):
  tok, model_cfg, _, graphdef, params, rest = setup
  agent = AgentParams(max_turns=3, max_turn_tokens=32, cache_len=192, temperature=0.0)

  def script(r, t):  # the first turn forced to a call; later ones the model's own (greedy) until max_turn_tokens
    return tok.encode_chat(CALL.format(x=r)) if t == 1 else []

  outs = []
  for reprefill in (False, True):
    loop = AgentLoop(graphdef, model_cfg, tok, agent, reprefill=reprefill)
    trajs = [Trajectory(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    outs.append(loop.run(params, rest, trajs, [ScriptedEnv(9) for _ in QUESTIONS], jax.random.key(1), script=script))
  for a, b in zip(*(o.trajectories for o in outs)):
    assert a.tokens == b.tokens and a.spans[-1].kind == "sample" and len(a.spans) == 4
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=5e-5)
  assert outs[0].finish == outs[1].finish


def test_bad_loop_parameters_are_named():
  for field, value, match in [
    ("max_turns", 0, "max_turns=0; must be a positive integer"),
    ("cache_len", 1.5, "cache_len=1.5; must be a positive integer"),
    ("temperature", float("nan"), "temperature=nan"),
    ("top_p", 0.0, r"top_p=0.0; must be in \(0, 1\]"),
  ]:
    with pytest.raises(ValueError, match=match):
      AgentParams(**{field: value})


class OneToolEnv(ToolEnvironment):
  """Offers one tool; the answer "ok" ends an episode with reward 1."""

  name = "one_tool"

  def __init__(self, tool):
    super().__init__()
    self.tools = (tool,)


@pytest.mark.slow  # waits out a sleeping tool's timeout, about 4 s
def test_raising_sleeping_and_flooding_tools_are_bounded_and_reported_through_the_loop(setup, scripted):
  from tests.rl.test_tools import TEST_TOOLS

  tok, _, _, _, params, rest = setup
  loop = scripted[2]
  offered = {t.name: t for t in TEST_TOOLS}
  calls = [("boom", "message", "the disk is on fire"), ("sleepy", "seconds", "30"), ("flood", "n", "100000")]
  envs = [OneToolEnv(offered[name]) for name, _, _ in calls]
  timeout, max_chars = 1.0, 100
  with ToolRunner([offered[n] for n, _, _ in calls], timeout=timeout, max_output_chars=max_chars, num_workers=3) as run:
    for env in envs:
      env.serve(run)
    episodes = [env.reset({"question": f"Use {name}.", "answer": "ok"}) for env, (name, _, _) in zip(envs, calls)]
    trajs = [Trajectory(tok, e.messages, tools=e.tools) for e in episodes]

    def script(row, turn):
      name, key, value = calls[row]
      text = f"</think><tool_call>{name}<arg_key>{key}</arg_key><arg_value>{value}</arg_value></tool_call>"
      return tok.encode_chat(text + "<|observation|>" if turn == 1 else "</think>ok<|endoftext|>")

    result = loop.run(params, rest, trajs, episodes, jax.random.key(0), script=script)
    counts = run.counts
  observed = []
  for traj in result.trajectories:
    (span,) = [s for s in traj.spans if s.kind == "observation"]
    observed.append(tok.decode(traj.tokens[span.start : span.end]))
  assert "<tool_response>error: tool 'boom' raised RuntimeError: the disk is on fire</tool_response>" in observed[0]
  assert f"<tool_response>error: tool 'sleepy' timed out after {timeout:g} s and was stopped" in observed[1]
  cut = re.search(r"<tool_response>(x+)\n\[output truncated: (\d+) characters, the first (\d+) shown\]", observed[2])
  assert cut and int(cut[2]) == 100000 and len(cut[1]) == int(cut[3]) < max_chars, observed[2]
  assert {k: v for k, v in counts.items() if v} == {"error": 1, "timeout": 1, "truncated": 1}
  assert result.finish == ["done"] * 3 and result.rewards == [1.0] * 3 and result.turns == [2, 2, 2]
  assert result.tool_calls == 3 and result.tool_errors == 0


@pytest.mark.slow  # an engine served over HTTP and the loop's turns compiled for new weights (about 25 s)
def test_episodes_through_the_serving_engine_are_the_agent_loops(setup):
  """rl.rollout_server's agent loop (glm_jax/rl/rollout_server.py ApiAgentLoop: a POST /generate a turn to an engine
  served over HTTP, the episode's whole sequence each time) against the in-process AgentLoop, greedy, on weights
  whose lm_head has the column of <|observation|> swapped with that of the token greedy decoding writes first (so
  turns end in <|observation|> and episodes run several turns): the same tokens, loss masks, spans, finish
  reasons, rewards and tool counts, log-probabilities within fp32 rounding (the engine's paged cache and batch),
  tagged with the engine's weight version; the engine prefilled each history once (its prefix cache)."""
  from glm_jax.rl.rollout_server import ApiAgentLoop, ServerRolloutWorker
  from glm_jax.serving import Engine, EngineConfig
  from glm_jax.serving.server import EngineThread, ServerState
  from tests.serving.test_server import Served

  tok, model_cfg, _, graphdef, params, rest = setup
  agent = AgentParams(max_turns=3, max_turn_tokens=16, cache_len=160, temperature=0.0)

  def start():
    return [Trajectory(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]

  def envs():
    return [ScriptedEnv(9) for _ in QUESTIONS]

  first = AgentLoop(graphdef, model_cfg, tok, agent).run(params, rest, start(), envs(), jax.random.key(2))
  t = first.trajectories[0].tokens[first.trajectories[0].spans[1].start]
  o = tok.chat_ids["<|observation|>"]
  params = jax.tree.map(lambda x: x, params)  # new Variables: the fixture's weights stay as they are
  head = params["lm_head"].get_value()
  params["lm_head"].set_value(head.at[:, [t, o]].set(head[:, [o, t]]))

  want = AgentLoop(graphdef, model_cfg, tok, agent).run(params, rest, start(), envs(), jax.random.key(2))
  assert max(want.turns) > 1  # observations fed and continued from
  # pages for every token of the three episodes: no cached page is evicted
  config = EngineConfig(num_pages=80, page_size=8, max_running=4, prefill_chunk=32, max_seq_len=agent.cache_len)
  engine = Engine(graphdef, params, rest, model_cfg, config, version=7)
  served = Served(ServerState(EngineThread(engine), tok, "policy"))
  try:
    worker = ServerRolloutWorker.__new__(ServerRolloutWorker)  # its retrying POST, to this one engine
    worker.router_url, worker._stop = served.url, threading.Event()
    with httpx.Client(timeout=120) as client:
      loop = ApiAgentLoop(tok, agent, lambda body: worker._post(client, body))
      got = loop.run(None, None, start(), envs(), jax.random.key(2))
  finally:
    served.stop()
  assert got.weight_version == 7 and all(traj.version == 7 for traj in got.trajectories)
  for a, b in zip(got.trajectories, want.trajectories):
    assert a.tokens == b.tokens and a.loss_mask == b.loss_mask and a.spans == b.spans
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=5e-5)
  for field in ("finish", "rewards", "turns", "tool_calls", "tool_errors", "sampled_tokens"):
    assert getattr(got, field) == getattr(want, field), field
  # A turn after the first re-sends the history: the whole pages of what the turns before fed (up to the last
  # sampled token, never fed) come from the prefix cache.
  cached = 0
  for traj in got.trajectories:
    samples = [s for s in traj.spans if s.kind == "sample"]
    cached += sum((before.end - 1) // 8 * 8 for before in samples[:-1])
  assert engine.stats["prefix_cached_tokens"] == cached > 0
