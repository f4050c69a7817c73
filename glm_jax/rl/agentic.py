"""Agentic rollouts: the rollout function interface, its default (group_size episodes a task through the agent
loop), and the batch the RL step trains on.

A rollout function (slime's customizable rollout) takes a RolloutContext and the step's prompts, [(label, task)],
and returns Samples: one or several a prompt (fan-out), each a finished Trajectory with its reward and the group
its advantage is normalized in. It may run episodes in any way the context allows (`ctx.run_episodes`: the agent
loop on the policy's weights), branch on a verifier (run more episodes for a prompt whose first answers fail),
or rewrite rewards. A custom one is named by import path in rl.rollout_fn ("package.module:function"):

  def my_rollout(ctx: RolloutContext, prompts: list[tuple[str, dict]], key) -> list[Sample]:
    samples = default_rollout(ctx, prompts, key)
    ...
    return samples

`to_rollout` lays Samples out as the RL step's batch (glm_jax/rl/rollout.py Rollout): tokens right-padded to the
agent loop's cache_len, response_mask = the trajectories' loss mask (the model's tokens only: reasoning, content,
tool calls; prompt and tool results masked), rollout_logp = the sampler's log-probs, one group id a sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from glm_jax.data.conversations import pack_conversations, tokenize_conversation
from glm_jax.data.tokenizer import Tokenizer
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import tasks as tasks_lib
from glm_jax.rl.agent_loop import AgentLoop, AgentParams, LoopResult
from glm_jax.rl.environment import Environment
from glm_jax.rl.rollout import Rollout
from glm_jax.rl.tools import ToolRunner
from glm_jax.rl.trajectory import Trajectory


@dataclasses.dataclass
class Sample:
  trajectory: Trajectory
  reward: float
  group: int  # samples of one group share their advantage's mean and std (the prompt's index by default)
  label: str  # the config's tasks.<label> the task came from
  task: dict
  finish: str  # agent_loop.LoopResult.finish's reason
  metadata: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RolloutContext:
  """What a rollout function may use: the agent loop and the policy's weights (as served), the environments by
  label, the tokenizer, group_size, the weights' version, and the render options."""

  loop: AgentLoop
  params: Any
  rest: Any
  envs: Mapping[str, Environment]
  tokenizer: Tokenizer
  group_size: int
  version: int
  enable_thinking: bool = True
  clear_thinking: bool = True
  stats: dict = dataclasses.field(default_factory=dict)  # the loops' totals, for the step's metrics

  def run_episodes(self, items: Sequence[tuple[str, dict]], key: jax.Array) -> LoopResult:
    """One episode each of `items` [(label, task)], through the agent loop on this context's weights."""
    episodes = [self.envs[label].reset(task) for label, task in items]
    trajs = [
      Trajectory(
        self.tokenizer,
        e.messages,
        tools=e.tools,
        enable_thinking=self.enable_thinking,
        clear_thinking=self.clear_thinking,
        version=self.version,
      )
      for e in episodes
    ]
    result = self.loop.run(self.params, self.rest, trajs, episodes, key)
    for k in ("tool_calls", "tool_errors", "sampled_tokens"):
      self.stats[k] = self.stats.get(k, 0) + getattr(result, k)
    if result.weight_version is not None:  # episodes through the serving engines: the oldest weights of any turn
      self.stats["weight_version"] = min(result.weight_version, self.stats.get("weight_version", result.weight_version))
    self.stats["loop_s"] = self.stats.get("loop_s", 0.0) + result.seconds
    return result


RolloutFn = Callable[[RolloutContext, list[tuple[str, dict]], jax.Array], list[Sample]]


def default_rollout(ctx: RolloutContext, prompts: list[tuple[str, dict]], key: jax.Array) -> list[Sample]:
  """group_size episodes of each prompt, batched in one agent loop; group = the prompt's index."""
  items = [(label, task) for label, task in prompts for _ in range(ctx.group_size)]
  result = ctx.run_episodes(items, key)
  return [
    Sample(traj, reward, i // ctx.group_size, label, task, finish)
    for i, ((label, task), traj, reward, finish) in enumerate(
      zip(items, result.trajectories, result.rewards, result.finish)
    )
  ]


def load_rollout_fn(path: str) -> RolloutFn:
  """rl.rollout_fn: "" for default_rollout, else the function at the import path; ValueError naming the field."""
  if not path:
    return default_rollout
  try:
    fn = tasks_lib.load_import_path(path)
  except ValueError as e:
    raise ValueError(f"rl.rollout_fn={path!r}: {e}") from e
  if not callable(fn):
    raise ValueError(f"rl.rollout_fn={path!r} is {type(fn).__name__}, not a function (ctx, prompts, key) -> samples")
  return fn


def check_samples(samples: Any, fn: str) -> list[Sample]:
  """The rollout function's result, checked: a non-empty list of Samples with finite rewards."""
  if not isinstance(samples, list) or not samples or not all(isinstance(s, Sample) for s in samples):
    raise ValueError(f"rl.rollout_fn={fn!r} returned {type(samples).__name__}; expected a non-empty list of Sample")
  for i, s in enumerate(samples):
    if not np.isfinite(s.reward):
      raise ValueError(f"rl.rollout_fn={fn!r}: sample {i} has reward {s.reward}; rewards must be finite")
  return samples


def group_advantages_by_id(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
  """losses.group_advantages for groups given by id (any sizes, as a fan-out rollout makes them): (R - mean_g) /
  (std_g + 1e-6), std with ddof=1; a group of one gets 0."""
  from glm_jax.rl.losses import STD_EPS

  rewards, groups = np.asarray(rewards, np.float64), np.asarray(groups)
  out = np.zeros(len(rewards), np.float32)
  for g in np.unique(groups):
    rows = groups == g
    if rows.sum() > 1:
      r = rewards[rows]
      out[rows] = (r - r.mean()) / (r.std(ddof=1) + STD_EPS)
  return out


def to_rollout(samples: list[Sample], version: int, width: int, pad_id: int, seconds: float = 0.0) -> Rollout:
  """Samples as the RL step's batch (module docstring); `problems` holds each sample's (label, task)."""
  n = len(samples)
  tokens = np.full((n, width), pad_id, np.int32)
  mask = np.zeros((n, width), bool)
  logp = np.zeros((n, width), np.float32)
  for i, s in enumerate(samples):
    a = s.trajectory.arrays(width, pad_id)
    tokens[i], mask[i], logp[i] = a["tokens"], a["loss_mask"].astype(bool), a["logprobs"]
  return Rollout(
    version=version,
    problems=[(s.label, s.task) for s in samples],
    tokens=tokens,
    response_mask=mask,
    rollout_logp=logp,
    prompt_lens=np.asarray([s.trajectory.spans[0].end for s in samples], np.int32),
    lengths=np.asarray([len(s.trajectory.tokens) for s in samples], np.int32),
    finished=np.asarray([s.finish in ("done", "stop") for s in samples]),
    rewards=np.asarray([s.reward for s in samples], np.float32),
    failures=[],
    seconds=seconds,
    groups=np.asarray([s.group for s in samples]),
  )


def agentic_metrics(samples: list[Sample], stats: Mapping[str, Any]) -> dict[str, float]:
  """What a step logs of its episodes beyond Rollout.metrics: success (reward 1) rate, mean turns, tool-call
  validity, finish reasons, reward by task label."""
  calls = stats.get("tool_calls", 0) + stats.get("tool_errors", 0)
  out = {
    "success_rate": float(np.mean([s.reward >= 1.0 for s in samples])),
    "mean_turns": float(np.mean([s.trajectory.turns for s in samples])),
    "tool_calls_per_episode": calls / len(samples),
    "tool_call_validity": stats.get("tool_calls", 0) / calls if calls else 1.0,
  }
  for reason in ("done", "stop", "max_turns", "turn_tokens", "length"):
    out[f"finish/{reason}"] = float(np.mean([s.finish == reason for s in samples]))
  for label in sorted({s.label for s in samples}):
    out[f"reward/{label}"] = float(np.mean([s.reward for s in samples if s.label == label]))
  if stats.get("loop_s"):
    out["sampled_tokens_per_s"] = stats.get("sampled_tokens", 0) / stats["loop_s"]
  return out


def mixed_items(environments, rng: np.random.Generator, n: int) -> list[tuple[str, dict]]:
  """n (label, task) drawn from [(label, environment, weight)] by weight (each environment samples its own)."""
  weights = np.asarray([w for _, _, w in environments], np.float64)
  which = rng.choice(len(environments), size=n, p=weights / weights.sum())
  out: list[tuple[str, dict] | None] = [None] * n
  for k, (label, env, _) in enumerate(environments):
    rows = np.flatnonzero(which == k)
    for r, task in zip(rows, env.sample(rng, len(rows)) if len(rows) else []):
      out[r] = (label, task)
  return out


def demonstration_batch(
  environments, tokenizer: Tokenizer, rng: np.random.Generator, batch_size: int, seq_len: int
) -> dict[str, np.ndarray]:
  """An agentic SFT batch: the environments' scripted demonstrations (drawn by weight) rendered in the chat format,
  loss on the model's turns (glm_jax/data/conversations.py), packed into batch_size rows of seq_len tokens."""
  examples = []
  while True:
    ((label, task),) = mixed_items(environments, rng, 1)
    env = next(e for name, e, _ in environments if name == label)
    messages = env.demonstration(task)
    examples.append(tokenize_conversation(tokenizer, messages, tools=env.reset(task).tools))
    if len(examples[-1][0]) > seq_len:
      raise ValueError(
        f"sft.seq_len={seq_len}: a {label!r} demonstration takes {len(examples[-1][0])} tokens; raise sft.seq_len"
      )
    batch, used = pack_conversations(examples, batch_size, seq_len, tokenizer.pad_id)
    if used < len(examples):
      return pack_conversations(examples[:-1], batch_size, seq_len, tokenizer.pad_id)[0]


def make_agent_loops(graphdef, model_cfg: ModelConfig, rl: ml_collections.ConfigDict, tokenizer: Tokenizer):
  """(the rollouts' AgentLoop: rl.temperature, rl.top_p, in rl.rollout_dtype when it differs; the evaluation's:
  greedy, in the model's dtype), with rl.max_turns, rl.max_turn_tokens and rl.cache_len."""
  agent = dict(max_turns=rl.max_turns, max_turn_tokens=rl.max_turn_tokens, cache_len=rl.cache_len)
  sampling_graphdef = graphdef
  if rl.rollout_dtype and rl.rollout_dtype != model_cfg.dtype:  # the train/inference mismatch IcePop filters
    rollout_cfg = model_cfg.replace(dtype=rl.rollout_dtype)
    sampling_graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(rollout_cfg, nnx.Rngs(0))))
  sampling = AgentLoop(
    sampling_graphdef, model_cfg, tokenizer, AgentParams(temperature=rl.temperature, top_p=rl.top_p, **agent)
  )
  return sampling, AgentLoop(graphdef, model_cfg, tokenizer, AgentParams(temperature=0.0, **agent))


@dataclasses.dataclass(frozen=True)
class AgenticRun:
  """What an agentic run's rollouts read of it: a training run's RunContext has these fields (glm_jax/rl/context.py);
  the rollout process (glm_jax/rl/rollout_engine.py) builds this from the config."""

  config: ml_collections.ConfigDict
  environments: list  # [(label, environment, weight)]
  sampler: AgentLoop  # the rollouts' (make_agent_loops)
  vocab: Tokenizer
  rollout_fn: RolloutFn


def rollout_context(run_ctx, loop: AgentLoop, params, rest, group_size: int, version: int) -> RolloutContext:
  """A RolloutContext of a run (an AgenticRun, or a training run's RunContext)."""
  rl = run_ctx.config.rl
  return RolloutContext(
    loop=loop,
    params=params,
    rest=rest,
    envs={label: env for label, env, _ in run_ctx.environments},
    tokenizer=run_ctx.vocab,
    group_size=group_size,
    version=version,
    enable_thinking=rl.enable_thinking,
    clear_thinking=rl.clear_thinking,
  )


def step_rollout(run_ctx, params, rest, version: int, index: int, group_size: int) -> Rollout:
  """Rollout `index` of an agentic run: its tasks drawn by weight from (rl.seed, index), rl.rollout_fn's samples
  (checked) with a key of (rl.seed, index), laid out by to_rollout with the episodes' metrics."""
  rl = run_ctx.config.rl
  t0 = time.perf_counter()
  prompts = mixed_items(run_ctx.environments, np.random.default_rng((rl.seed, index)), rl.prompts_per_step)
  ctx = rollout_context(run_ctx, run_ctx.sampler, params, rest, group_size, version)
  key = jax.random.fold_in(jax.random.key(rl.seed), index)
  samples = check_samples(run_ctx.rollout_fn(ctx, prompts, key), rl.rollout_fn)
  version = ctx.stats.pop("weight_version", version)  # through the engines: the weights that made the episodes
  rollout = to_rollout(samples, version, rl.cache_len, run_ctx.vocab.pad_id, time.perf_counter() - t0)
  rollout.index = index
  rollout.extra_metrics = agentic_metrics(samples, ctx.stats)
  return rollout


@contextlib.contextmanager
def serving_tools(environments, rl: ml_collections.ConfigDict):
  """The tool workers of an agentic run's environments (one ToolRunner for all their tools, rl.tool_timeout,
  rl.tool_max_output_chars, rl.tool_workers), served to each tool environment while the block runs; nothing
  without tools."""
  tools = {}
  for _, env, _ in environments:
    for tool in getattr(env, "tools", ()) or ():
      tools.setdefault(tool.name, tool)
  if not tools:
    yield None
    return
  runner = ToolRunner(
    list(tools.values()),
    timeout=rl.tool_timeout,
    max_output_chars=rl.tool_max_output_chars,
    num_workers=rl.tool_workers,
  )
  with runner:
    for _, env, _ in environments:
      if hasattr(env, "serve"):
        env.serve(runner)
    try:
      yield runner
    finally:
      for _, env, _ in environments:
        if hasattr(env, "serve"):
          env.serve(None)
