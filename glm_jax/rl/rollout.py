"""Rollouts: a batch of sampled answers with their rewards, made synchronously or by a background worker.

`make_sampler` builds the KV-cache sampler of a run (rl.temperature, rl.top_p, optionally in rl.rollout_dtype;
or greedy, for evaluation); `make_rollout` samples group_size answers to each problem and scores them with the
reward function; `greedy_accuracy` is the mean reward of greedy answers on held-out problems.

Asynchronous RL (GLM-5 section on agentic RL, Eq. 3-5): a RolloutWorker thread keeps generating batches with the
newest weights it has been given, each batch tagged with the version of those weights; the trainer takes
batches from its queue, drops those more than `tau` versions older than its own weights (`is_stale`), and
pushes new weights after each update with `push_weights`, a reference swap under a lock: the trainer never
waits for generation to finish, and the worker picks the new weights up at its next batch. (jax arrays are
immutable, so the worker's reference stays valid while the trainer moves on; the RL steps do not donate their
input state for this reason.) glm_jax/rl/rollout_engine.py runs the same worker in its own process.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from glm_jax.inference.sampler import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import rewards as rewards_lib, tasks as tasks_lib
from glm_jax.rl.tasks import CharVocab


@dataclasses.dataclass
class Rollout:
  """One batch of sampled sequences (numpy, the sampler's layout) and what the trainer needs from it."""

  version: int  # the policy version whose weights generated it
  problems: list  # [N] the Problem each row answers
  tokens: np.ndarray  # [N, S]
  response_mask: np.ndarray  # [N, S] bool
  rollout_logp: np.ndarray  # [N, S]
  prompt_lens: np.ndarray  # [N]
  lengths: np.ndarray  # [N]
  finished: np.ndarray  # [N] bool: ended with a stop token
  rewards: np.ndarray  # [N] float32
  failures: list[str]  # reward-function failures (their samples got reward 0)
  seconds: float = 0.0  # generation + scoring time
  index: int = -1  # the rollout's number in the run (step_rollout's index: its prompts and key), -1 for others
  groups: np.ndarray | None = None  # [N] each row's advantage group (agentic rollouts); None: consecutive group_size
  extra_metrics: dict = dataclasses.field(default_factory=dict)  # logged beside metrics() (agentic: success, turns)

  def responses(self) -> list[list[int]]:
    return [self.tokens[i, p:n].tolist() for i, (p, n) in enumerate(zip(self.prompt_lens, self.lengths))]

  def metrics(self) -> dict[str, float]:
    """The logged statistics of the batch: reward, response lengths, truncation, reward failures, time."""
    resp_lens = self.lengths - self.prompt_lens
    return dict(
      reward_mean=float(np.mean(self.rewards)),
      reward_std=float(np.std(self.rewards)),
      response_len_mean=float(np.mean(resp_lens)),
      response_len_max=int(np.max(resp_lens)),
      truncated_frac=float(np.mean(~self.finished)),
      reward_failures=len(self.failures),
      rollout_s=self.seconds,
      **self.extra_metrics,
    )

  def train_batch(self, **extra) -> dict[str, jax.Array]:
    """The RL step's batch (glm_jax/rl/step.py): tokens, response_mask, rollout_logp and `extra` (advantages,
    ref_logp, teacher_logp), as device arrays."""
    return dict(
      tokens=jnp.asarray(self.tokens),
      response_mask=jnp.asarray(self.response_mask),
      rollout_logp=jnp.asarray(self.rollout_logp),
      **{k: jnp.asarray(v) for k, v in extra.items()},
    )


def make_sampler(
  graphdef,
  model_cfg: ModelConfig,
  rl: ml_collections.ConfigDict,
  tasks_and_weights,
  vocab: CharVocab,
  *,
  greedy: bool = False,
) -> Sampler:
  """The sampler of rollouts (rl.temperature, rl.top_p; in rl.rollout_dtype when it differs from the model's), or
  with greedy the evaluation's (temperature 0, the model's dtype); prompts are padded to the tasks' longest. With
  rl.speculate = k both draft k tokens a round with the MTP layer (glm_jax/inference/speculative.py): the same
  distribution, and the log-probabilities, of the main model."""
  width = max(t.max_prompt_len for t, _ in tasks_and_weights)
  sampling = SamplingParams(
    max_new_tokens=rl.max_new_tokens,
    temperature=0.0 if greedy else rl.temperature,
    top_p=1.0 if greedy else rl.top_p,
    stop_ids=(vocab.eos_id,),
    pad_id=vocab.pad_id,
  )
  if rl.rollout_dtype and rl.rollout_dtype != model_cfg.dtype and not greedy:
    # The inference engine in another precision than the trainer: the train/inference mismatch IcePop filters.
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(model_cfg.replace(dtype=rl.rollout_dtype), nnx.Rngs(0))))
  return Sampler(graphdef, model_cfg, sampling, width=width, speculate=rl.speculate or None)


def make_rollout(
  sampler: Sampler, params, rest, problems, group_size: int, key, reward_fn, version: int, id_prefix: str
) -> Rollout:
  """Samples group_size answers to each problem (rows grouped by problem) and scores them."""
  t0 = time.perf_counter()
  rows = [p for p in problems for _ in range(group_size)]
  out = jax.device_get(sampler(params, rest, [p.prompt_ids for p in rows], key))
  rollout = Rollout(
    version=version,
    problems=rows,
    tokens=np.asarray(out.tokens),
    response_mask=np.asarray(out.response_mask),
    rollout_logp=np.asarray(out.logp),
    prompt_lens=np.asarray(out.prompt_lens),
    lengths=np.asarray(out.lengths),
    finished=np.asarray(out.finished),
    rewards=np.zeros(len(rows), np.float32),
    failures=[],
  )
  rollout.rewards, rollout.failures = rewards_lib.score(
    reward_fn, rows, rollout.responses(), [f"{id_prefix}/{i}" for i in range(len(rows))]
  )
  rollout.seconds = time.perf_counter() - t0
  return rollout


def step_problems(tasks_and_weights, rl: ml_collections.ConfigDict, index: int):
  """The problems of rollout `index`: a function of (rl.seed, index), so a resumed run, or a rollout worker that
  replaces a failed one, draws the same prompts."""
  return tasks_lib.mixed_prompts(tasks_and_weights, np.random.default_rng((rl.seed, index)), rl.prompts_per_step)


def step_rollout(
  sampler: Sampler,
  params,
  rest,
  tasks_and_weights,
  rl: ml_collections.ConfigDict,
  reward_fn,
  version: int,
  index: int,
  group_size: int,
) -> Rollout:
  """Rollout `index` of a run: its problems (step_problems), group_size answers each, sampled with a key that
  depends on (rl.seed, index) by the weights of `version`."""
  key = jax.random.fold_in(jax.random.key(rl.seed), index)
  rollout = make_rollout(
    sampler,
    params,
    rest,
    step_problems(tasks_and_weights, rl, index),
    group_size,
    key,
    reward_fn,
    version,
    f"step{index}",
  )
  rollout.index = index
  return rollout


def greedy_accuracy(sampler: Sampler, params, rest, problems, reward_fn) -> float:
  """Mean reward of greedy answers (the model's best guess) on fixed held-out problems."""
  rollout = make_rollout(sampler, params, rest, problems, 1, jax.random.key(0), reward_fn, 0, "eval")
  return float(np.mean(rollout.rewards))


def is_stale(rollout_version: int, trainer_version: int, tau: int) -> bool:
  """A rollout generated with weights more than tau versions behind the trainer's is dropped (Eq. 3-5)."""
  return trainer_version - rollout_version > tau


def put_until_stopped(q: queue.Queue, item, stop: threading.Event) -> None:
  """Puts `item` in the bounded queue `q`, waiting while it is full, unless `stop` is set meanwhile (a rollout
  worker's producer: the trainer may stop taking rollouts)."""
  while not stop.is_set():
    try:
      q.put(item, timeout=0.5)
      return
    except queue.Full:
      continue


class RolloutWorker:
  """Generates rollouts on a background thread: `produce(params, rest, version, index) -> Rollout` with the
  newest pushed weights, into a queue of at most `max_pending` batches (the worker waits when it is full)."""

  def __init__(self, produce: Callable[[Any, Any, int, int], Rollout], *, max_pending: int = 2):
    if max_pending < 1:
      raise ValueError(f"max_pending={max_pending}; must be >= 1")
    self._produce = produce
    self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
    self._lock = threading.Lock()
    self._weights: tuple[int, Any, Any] | None = None
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)

  def push_weights(self, version: int, params, rest) -> None:
    """Makes (params, rest) the weights of the next batch; returns at once."""
    with self._lock:
      self._weights = (version, params, rest)

  def start(self) -> RolloutWorker:
    if self._weights is None:
      raise RuntimeError("RolloutWorker.start: push_weights first")
    self._thread.start()
    return self

  def get(self, timeout: float = 600.0) -> Rollout:
    """The oldest pending rollout; re-raises an error the worker hit."""
    while True:
      if self._error is not None:
        raise RuntimeError("the rollout worker failed") from self._error
      try:
        return self._queue.get(timeout=min(timeout, 1.0))
      except queue.Empty:
        timeout -= 1.0
        if timeout <= 0:
          raise TimeoutError("no rollout from the worker in time") from None

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=60)

  def _run(self) -> None:
    index = 0
    try:
      while not self._stop.is_set():
        with self._lock:
          version, params, rest = self._weights
        put_until_stopped(self._queue, self._produce(params, rest, version, index), self._stop)
        index += 1
    except BaseException as e:  # surfaced to the trainer by get()
      logging.exception("rollout worker failed")
      self._error = e
