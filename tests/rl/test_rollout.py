"""The asynchronous rollout worker: rollouts carry the version of the weights that made them, a push changes the
weights of the next rollout without waiting for the current one, stale rollouts are recognized, errors surface."""

import threading

import numpy as np
import pytest

from glm_jax.rl.rollout import Rollout, RolloutWorker, is_stale


def fake_rollout(version: int, index: int) -> Rollout:
  z = np.zeros((1, 4))
  return Rollout(
    version=version,
    problems=[index],
    tokens=z.astype(np.int32),
    response_mask=z.astype(bool),
    rollout_logp=z,
    prompt_lens=np.ones(1, np.int32),
    lengths=np.ones(1, np.int32),
    finished=np.ones(1, bool),
    rewards=np.zeros(1, np.float32),
    failures=[],
  )


def test_is_stale():
  # trainer at version 5: with tau = 1 a rollout of version 4 is used, one of version 3 is dropped
  assert not is_stale(5, 5, 0) and is_stale(4, 5, 0)
  assert not is_stale(4, 5, 1) and is_stale(3, 5, 1)
  assert not is_stale(0, 2, 2) and is_stale(0, 3, 2)


def test_worker_tags_rollouts_with_the_pushed_version():
  """The worker generates with whatever weights were pushed last; generation is gated here so the test decides
  when each rollout is made. A push lands while a rollout is in flight; the next rollout uses it."""
  gate = [threading.Event() for _ in range(4)]
  seen = []

  def produce(params, rest, version, index):
    gate[index].wait(timeout=30)
    seen.append((params, version))
    return fake_rollout(version, index)

  worker = RolloutWorker(produce, max_pending=1)
  worker.push_weights(0, "w0", None)
  worker.start()
  gate[0].set()
  assert worker.get(timeout=30).version == 0
  worker.push_weights(1, "w1", None)  # rollout 1 may already be waiting on its gate with w0 or w1
  gate[1].set()
  r1 = worker.get(timeout=30)
  worker.push_weights(3, "w3", None)
  gate[2].set()
  r2 = worker.get(timeout=30)
  gate[3].set()
  worker.stop()
  assert r1.version in (0, 1) and r2.version in (1, 3) and r2.version >= r1.version
  assert all(p == f"w{v}" for p, v in seen)  # params and version always travel together
  # what a trainer at version 3 with tau = 1 keeps: only rollouts of version >= 2
  assert is_stale(r1.version, 3, 1) and (r2.version == 3) != is_stale(r2.version, 3, 1)


def test_worker_error_surfaces_in_get():
  def produce(params, rest, version, index):
    raise ZeroDivisionError("reward server down")

  worker = RolloutWorker(produce)
  worker.push_weights(0, None, None)
  worker.start()
  with pytest.raises(RuntimeError, match="the rollout worker failed") as info:
    worker.get(timeout=30)
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  worker.stop()


def test_worker_needs_weights_first():
  with pytest.raises(RuntimeError, match="push_weights first"):
    RolloutWorker(lambda *a: None).start()
  with pytest.raises(ValueError, match="max_pending=0"):
    RolloutWorker(lambda *a: None, max_pending=0)
