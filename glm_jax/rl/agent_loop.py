"""The agent loop: many multi-turn tool episodes decoded together on the KV cache, each continuing from its cache.

  loop = AgentLoop(graphdef, model_cfg, tokenizer, AgentParams(max_turns=4, max_turn_tokens=64, cache_len=512))
  result = loop.run(params, rest, trajectories, envs, key)      # trajectories: rl/trajectory.py, one per episode
  result.trajectories[b].tokens / .loss_mask / .logprobs; result.rewards, result.turns, result.finish

One episode a row. The prompts are prefilled once; then, turn after turn: (1) every live row samples until a stop
token of the chat format (`<|observation|>`, `<|user|>`, `<|endoftext|>`), max_turn_tokens or a full cache, each
token fed as it is drawn (one jit-compiled lax.while_loop, as the Sampler's); (2) on the host the turn joins the
row's Trajectory (ids and sampler log-probs kept), is parsed, and goes to the row's environment (`env.step(turn)`,
chat.parse_assistant's dict plus "stop"; a batch's environments run side by side in threads), which returns the
observation messages, whether the episode is done and the reward so far; (3) the observations' ids and the next
generation prompt are fed to the rows' caches in one forward (model.decode_tokens), and decoding goes on: nothing is
prefilled again. An episode ends when its environment says so, when the model wrote `<|endoftext|>` or ran out of
tokens, or after max_turns. `reprefill=True` prefills each live row's whole sequence every turn instead (the same
tokens greedy; experiments/agent_tools.py measures the difference). A malformed tool call is the environment's to
answer; the loop counts it (`tool_errors`). Observations are padded to a power of two and decode turns have one
shape, so compiles stay few. `script` (tests) forces a row's turn to given ids, scored by the model's log-probs.
One device; the Sampler holds the sharded decode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax import chat
from glm_jax.data.tokenizer import Tokenizer
from glm_jax.inference.sampler import pad_prompts
from glm_jax.inference.sampling import MIN_TEMPERATURE, sample_token, tempered_log_softmax
from glm_jax.model.config import ModelConfig
from glm_jax.rl.trajectory import Trajectory


class StepResult(Protocol):
  messages: list[dict]  # what answers the model's turn (tool messages, or a user reply)
  done: bool
  reward: float


class Stepper(Protocol):
  def step(self, turn: dict) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class AgentParams:
  max_turns: int = 4  # the model's turns an episode, at most
  max_turn_tokens: int = 64  # tokens the model may write in one turn
  cache_len: int = 512  # an episode's whole sequence (prompt, turns, observations), at most
  temperature: float = 1.0  # 0: greedy
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("max_turns", "max_turn_tokens", "cache_len"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}; must be a positive integer")
    if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
      raise ValueError(f"temperature={self.temperature!r}; must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r}; must be in (0, 1]")


@dataclasses.dataclass
class LoopResult:
  trajectories: list[Trajectory]
  rewards: list[float]
  turns: list[int]  # the model's turns each episode took
  finish: list[str]  # "done" (its environment ended it), "stop" (the model ended it with <|endoftext|>, or stopped
  # with nothing to answer it), "max_turns", "turn_tokens" (a turn ran out of max_turn_tokens), "length" (the cache)
  tool_calls: int  # well-formed tool calls, all episodes
  tool_errors: int  # malformed ones (chat.parse_assistant's errors)
  sampled_tokens: int
  seconds: float
  logits: list[list[np.ndarray]] | None = None  # with return_logits: per row, per sampled token, its logits [V]
  # through the serving engines: the oldest weight version that made a turn (None here: the weights given to run)
  weight_version: Any = None


def _bucket(n: int) -> int:
  return max(8, 1 << (n - 1).bit_length())


def _prefill(graphdef, params, rest, prompts_BT, lens_B, *, cache_len):
  model = nnx.merge(graphdef, params, rest)
  logits_BTV, cache = model.prefill(prompts_BT, cache_len)
  return logits_BTV[jnp.arange(prompts_BT.shape[0]), lens_B - 1], cache


def _extend(graphdef, params, rest, cache, tokens_BT, lens_B, pos_B):
  """Feeds row b's lens[b] tokens at slots pos[b].. (the padding after them lands on stale slots): the logits after
  each row's last one, and the cache."""
  model = nnx.merge(graphdef, params, rest)
  logits_BTV, _, cache = model.decode_tokens(tokens_BT, pos_B, cache)
  return logits_BTV[jnp.arange(tokens_BT.shape[0]), jnp.maximum(lens_B - 1, 0)], cache


def _decode_turn(graphdef, params, rest, cache, logits_BV, pos_B, live_B, limit_B, forced_BN, key, *, n, stop_ids,
                 temperature, top_p, return_logits):  # fmt: skip
  """Row b samples (or takes forced[b, i] >= 0) and feeds tokens at slots pos[b].. until it emits a stop id or
  limit[b] tokens; rows not live take no part. Returns the tokens [B, n], their log-probs, the count a row,
  whether it stopped at a stop id, the cache, and with return_logits the logits each token was drawn from."""
  model = nnx.merge(graphdef, params, rest)
  b = pos_B.shape[0]
  rows = jnp.arange(b)
  stops = jnp.asarray(stop_ids, jnp.int32)
  st = dict(
    i=jnp.zeros((), jnp.int32),
    tokens=jnp.zeros((b, n), jnp.int32),
    logp=jnp.zeros((b, n), jnp.float32),
    count=jnp.zeros((b,), jnp.int32),
    stopped=jnp.zeros((b,), bool),
    done=~live_B | (limit_B <= 0),
    logits=logits_BV,
    cache=cache,
    key=key,
  )
  if return_logits:
    st["drawn"] = jnp.zeros((b, n, logits_BV.shape[-1]), jnp.float32)

  def body(st):
    key, sub = jax.random.split(st["key"])
    tok, logp = sample_token(st["logits"], sub, temperature, top_p)
    i = st["count"]
    if forced_BN.shape[1]:  # a scripted row: its token, with the model's log-prob of it (the sampler's formula)
      forced = forced_BN[rows, jnp.minimum(i, n - 1)]
      all_logp = tempered_log_softmax(st["logits"], temperature)
      forced_logp = jnp.take_along_axis(all_logp, jnp.maximum(forced, 0)[:, None], axis=-1)[:, 0]
      tok, logp = jnp.where(forced >= 0, forced, tok), jnp.where(forced >= 0, forced_logp, logp)
    live = ~st["done"]
    new = dict(
      st,
      i=st["i"] + 1,
      key=key,
      tokens=st["tokens"].at[rows, i].set(jnp.where(live, tok, st["tokens"][rows, i])),
      logp=st["logp"].at[rows, i].set(jnp.where(live, logp, 0.0)),
      count=i + live,
    )
    if return_logits:
      new["drawn"] = st["drawn"].at[rows, i].set(jnp.where(live[:, None], st["logits"], st["drawn"][rows, i]))
    hit = live & jnp.isin(tok, stops)
    new["stopped"] = st["stopped"] | hit
    new["done"] = st["done"] | hit | (new["count"] >= limit_B)
    logits, new["cache"] = model.decode(tok, pos_B + i, st["cache"])  # a finished row writes a stale slot
    new["logits"] = jnp.where(live[:, None], logits, st["logits"])
    return new

  def cond(st):
    return (st["i"] < n) & ~jnp.all(st["done"])

  st = jax.lax.while_loop(cond, body, st)
  return st["tokens"], st["logp"], st["count"], st["stopped"], st["cache"], st.get("drawn")


class AgentLoop:
  """Multi-turn tool episodes for one model (module docstring). graphdef, params, rest: nnx.split(model, nnx.Param,
  ...)'s; tokenizer: the model's, able to chat (Tokenizer.chat_ids)."""

  def __init__(self, graphdef, cfg: ModelConfig, tokenizer: Tokenizer, params: AgentParams, *, reprefill=False):
    self.cfg, self.tokenizer, self.params, self.reprefill = cfg, tokenizer, params, reprefill
    if params.cache_len > cfg.max_position_embeddings:
      raise ValueError(
        f"cache_len={params.cache_len} exceeds model.max_position_embeddings={cfg.max_position_embeddings}"
      )
    self._stop_ids = tuple(tokenizer.chat_ids[s] for s in chat.STOP_STRINGS)  # refuses a tokenizer that cannot chat
    self._observation_id = tokenizer.chat_ids["<|observation|>"]
    self._prefill = jax.jit(functools.partial(_prefill, graphdef), static_argnames="cache_len")
    self._extend = jax.jit(functools.partial(_extend, graphdef))
    self._decode = {}  # (return_logits, scripted) -> the jitted turn
    self._graphdef = graphdef

  def _decode_fn(self, return_logits: bool, scripted: bool):
    key = (return_logits, scripted)
    if key not in self._decode:
      p = self.params
      self._decode[key] = jax.jit(
        functools.partial(
          _decode_turn,
          self._graphdef,
          n=p.max_turn_tokens,
          stop_ids=self._stop_ids,
          temperature=p.temperature,
          top_p=p.top_p,
          return_logits=return_logits,
        )
      )
    return self._decode[key]

  def run(
    self,
    params,
    rest,
    trajectories: Sequence[Trajectory],
    envs: Sequence[Stepper],
    key: jax.Array,
    *,
    script: Callable[[int, int], Sequence[int]] | None = None,
    return_logits: bool = False,
  ) -> LoopResult:
    """Runs every episode to its end. trajectories: each episode's start (its prompt rendered with the
    environment's tools); envs: one a trajectory. script(row, turn) -> the ids that row writes in that turn
    (turn 1-based; tests' scripted policy). Returns the finished trajectories and what they did."""
    p, tok = self.params, self.tokenizer
    trajs = list(trajectories)
    if len(envs) != len(trajs):
      raise ValueError(f"{len(trajs)} trajectories but {len(envs)} environments; one environment an episode")
    if not trajs:
      raise ValueError("trajectories: empty batch; need at least one episode")
    for i, t in enumerate(trajs):
      if t.tokenizer is not tok:
        raise ValueError(f"trajectories[{i}] uses another tokenizer than the loop's ({tok.name})")
      if len(t.tokens) + 1 > p.cache_len:
        raise ValueError(
          f"trajectories[{i}]: a prompt of {len(t.tokens)} tokens leaves no room in cache_len={p.cache_len}"
        )
    t0 = time.perf_counter()
    b = len(trajs)
    rewards, finish = [0.0] * b, [""] * b
    live = np.ones(b, bool)
    tool_calls = tool_errors = sampled = 0
    drawn: list[list[np.ndarray]] = [[] for _ in range(b)]
    logits, cache, pos = self._start(params, rest, trajs, list(range(b)), None)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(b, 32))
    try:
      for turn in range(1, p.max_turns + 1):
        limit = np.where(live, np.minimum(p.max_turn_tokens, p.cache_len - pos), 0).astype(np.int32)
        forced = np.zeros((b, 0), np.int32)
        if script is not None:
          forced = np.full((b, p.max_turn_tokens), -1, np.int32)
          for r in np.flatnonzero(live):
            ids = list(script(int(r), turn))[: p.max_turn_tokens]
            forced[r, : len(ids)] = ids
        key, sub = jax.random.split(key)
        decode = self._decode_fn(return_logits, script is not None)
        toks, logp, count, stopped, cache, drawn_BNV = decode(
          params, rest, cache, logits, jnp.asarray(pos), jnp.asarray(live), jnp.asarray(limit), jnp.asarray(forced),
          sub,
        )  # fmt: skip
        toks, logp, count, stopped = map(np.asarray, (toks, logp, count, stopped))
        if not np.isfinite(logp).all():
          raise FloatingPointError("the agent loop drew tokens with non-finite log-probabilities: broken weights?")
        stepping = []
        for r in np.flatnonzero(live):
          n = int(count[r])
          parsed = trajs[r].add_sample(toks[r, :n], logp[r, :n])
          parsed["stop"] = trajs[r].stop
          sampled += n
          pos[r] += n
          if return_logits:
            drawn[r] += list(np.asarray(drawn_BNV[r, :n]))
          tool_calls += len(parsed["tool_calls"])
          tool_errors += len(parsed["errors"])
          stepping.append((r, parsed))
        results = list(pool.map(lambda rp: envs[rp[0]].step(rp[1]), stepping))
        feed: dict[int, list[int]] = {}
        for (r, parsed), res in zip(stepping, results):
          rewards[r] = float(res.reward)
          end, ids = after_turn(trajs[r], parsed, res, turn, p)
          if end is not None:
            live[r], finish[r] = False, end
          else:
            feed[r] = ids
        if not feed:
          break
        logits, cache, pos = self._continue(params, rest, trajs, feed, logits, cache, pos)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
    return LoopResult(
      trajectories=trajs,
      rewards=rewards,
      turns=[t.turns for t in trajs],
      finish=finish,
      tool_calls=tool_calls,
      tool_errors=tool_errors,
      sampled_tokens=sampled,
      seconds=time.perf_counter() - t0,
      logits=drawn if return_logits else None,
    )

  def _start(self, params, rest, trajs, rows, old):
    """Prefills `rows`' whole sequences (all rows at the start; with reprefill, the live ones each turn) into a
    fresh cache, keeping the other rows' logits and cache from `old` (they are done)."""
    b = len(trajs)
    pad = self.tokenizer.pad_id
    seqs = [trajs[r].tokens if r in rows else [pad] for r in range(b)]
    prompts_BT, lens_B = pad_prompts(seqs, pad, _bucket(max(len(s) for s in seqs)))
    logits, cache = self._prefill(
      params, rest, jnp.asarray(prompts_BT), jnp.asarray(lens_B), cache_len=self.params.cache_len
    )
    return logits, cache, lens_B.astype(np.int64)

  def _continue(self, params, rest, trajs, feed, logits, cache, pos):
    """The fed rows' observations into their caches (or, with reprefill, their whole sequences prefilled again)."""
    if self.reprefill:
      new_logits, cache, lens = self._start(params, rest, trajs, list(feed), None)
      rows = np.asarray(list(feed))
      pos = pos.copy()
      pos[rows] = lens[rows]
      return new_logits, cache, pos
    b = len(trajs)
    width = _bucket(max(len(ids) for ids in feed.values()))
    tokens = np.full((b, width), self.tokenizer.pad_id, np.int32)
    lens = np.zeros(b, np.int32)
    for r, ids in feed.items():
      tokens[r, : len(ids)], lens[r] = ids, len(ids)
    new_logits, cache = self._extend(params, rest, cache, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(pos))
    return new_logits, cache, pos + lens


def after_turn(traj: Trajectory, parsed: dict, res: StepResult, turn: int, p: AgentParams):
  """What follows turn `turn` of an episode (its ids already in `traj`, `parsed` them parsed, `res` its
  environment's answer): (the episode's finish reason, None) when it ends here, else (None, the observation's ids,
  appended to traj: what the model is fed before its next turn). The agent loop's rule, and the rollouts' through
  the serving engines (glm_jax/rl/rollout_server.py)."""
  if res.done:
    return "done", None
  if parsed["stop"] is None:  # the turn ran out of tokens: its text is cut, the episode ends
    return ("turn_tokens" if len(traj.tokens) - traj.spans[-1].start == p.max_turn_tokens else "length"), None
  if parsed["stop"] == "<|endoftext|>" or not res.messages:
    return "stop", None
  if turn == p.max_turns:
    return "max_turns", None
  # Appended only with room for it and a token after in the cache; else the episode ends here.
  ids = traj.add_observation(res.messages, max_ids=p.cache_len - len(traj.tokens) - 1)
  return ("length", None) if ids is None else (None, ids)


def describe(result: LoopResult) -> dict[str, Any]:
  """A JSON-able summary: episodes, mean reward and turns, finish reasons, tool-call validity, tokens/s."""
  calls = result.tool_calls + result.tool_errors
  return {
    "episodes": len(result.trajectories),
    "mean_reward": float(np.mean(result.rewards)),
    "mean_turns": float(np.mean(result.turns)),
    "finish": {k: result.finish.count(k) for k in sorted(set(result.finish))},
    "tool_calls": calls,
    "tool_call_validity": result.tool_calls / calls if calls else None,
    "sampled_tokens": result.sampled_tokens,
    "sampled_tokens_per_s": result.sampled_tokens / result.seconds if result.seconds else None,
  }
