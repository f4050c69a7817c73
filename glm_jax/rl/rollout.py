"""Rollouts: a batch of sampled answers with their rewards, made synchronously or by a background worker.

Asynchronous RL (GLM-5 section on agentic RL, Eq. 3-5): a RolloutWorker thread keeps generating batches with the
newest weights it has been given, each batch tagged with the version of those weights; the trainer takes
batches from its queue, drops those more than `tau` versions older than its own weights (`is_stale`), and
pushes new weights after each update with `push_weights`, a reference swap under a lock: the trainer never
waits for generation to finish, and the worker picks the new weights up at its next batch. (jax arrays are
immutable, so the worker's reference stays valid while the trainer moves on; the RL steps do not donate their
input state for this reason.)
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Callable

import numpy as np
from absl import logging


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

  def responses(self) -> list[list[int]]:
    return [self.tokens[i, p:n].tolist() for i, (p, n) in enumerate(zip(self.prompt_lens, self.lengths))]


def is_stale(rollout_version: int, trainer_version: int, tau: int) -> bool:
  """A rollout generated with weights more than tau versions behind the trainer's is dropped (Eq. 3-5)."""
  return trainer_version - rollout_version > tau


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
        rollout = self._produce(params, rest, version, index)
        index += 1
        while not self._stop.is_set():
          try:
            self._queue.put(rollout, timeout=0.5)
            break
          except queue.Full:
            continue
    except BaseException as e:  # surfaced to the trainer by get()
      logging.exception("rollout worker failed")
      self._error = e
