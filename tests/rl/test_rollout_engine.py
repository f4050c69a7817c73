"""The rollout engine in its own process (glm_jax/rl/rollout_engine.py): GRPO over localhost with a worker that is
killed, then one that hangs; each is replaced, its requests retried, and no rollout is trained on twice. (That the
two-process loop raises the reward as the in-process one does: tests/rl/test_trainer.py.)"""

import json
import os
import signal
import threading
import time

import jax.numpy as jnp
import ml_collections
import pytest

import configs.grpo_tiny
from glm_jax.rl import config as rl_config
from glm_jax.rl import trainer as rl_trainer
from glm_jax.rl.rollout_engine import ProcessRolloutWorker

# The three worker processes build the same sampler: with the persistent cache (passed on through the environment)
# the first compiles it and the replacements load it.


def process_config(**rl) -> ml_collections.ConfigDict:
  config = configs.grpo_tiny.get_config()
  config.sft.steps = 0
  config.rl.update(
    dict(
      tensorboard=False,
      async_rollouts=True,
      rollout_process=True,
      prompts_per_step=8,
      group_size=4,
      eval_prompts=8,
      eval_every=1000,
      checkpoint_every=1000,
    ),
    **rl,
  )
  return config


def metric_steps(workdir) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [json.loads(line) for line in open(path) if '"rollout_index"' in line]


def wait_for(condition, what: str, timeout: float = 240.0) -> None:
  t0 = time.monotonic()
  while not condition():
    if time.monotonic() - t0 > timeout:
      raise TimeoutError(f"waited {timeout:.0f} s for {what}")
    time.sleep(0.2)


def worker_pid(workdir, n: int) -> int | None:
  path = os.path.join(workdir, "rollout", f"worker-{n}.pid")
  return int(open(path).read()) if os.path.exists(path) else None


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A killed child stays a zombie until reaped: read its state.
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow  # three worker processes start (imports and the sampler's compile each)
def test_a_killed_and_a_hung_worker_are_replaced_and_nothing_is_trained_twice(tmp_path):
  workdir = str(tmp_path)
  # 40 steps: worker 2 is stopped only after 4 steps on its rollouts are seen, and by then it may have made many more
  # (with a warm compilation cache a step takes well under a second); 24 left it nothing to hang on in one CI run.
  steps = 40
  config = process_config(steps=steps, tau=2, heartbeat_every=0.5, heartbeat_timeout=10.0, worker_start_timeout=120.0)
  result = {}

  def train():
    try:
      result["summary"] = rl_trainer.run(config, workdir)
    except BaseException as e:  # noqa: BLE001  (re-raised below)
      result["error"] = e

  thread = threading.Thread(target=train)
  thread.start()
  try:
    wait_for(lambda: len(metric_steps(workdir)) >= 3 or "error" in result, "3 steps")
    first = worker_pid(workdir, 1)
    os.kill(first, signal.SIGKILL)  # the process dies: its connection closes
    # Three steps trained on worker 2's rollouts (it is serving: not still starting), then it hangs.
    wait_for(
      lambda: sum(r.get("workers_replaced") == 1 for r in metric_steps(workdir)) >= 4 or "error" in result,
      "4 steps after the first replacement",
    )
    second = worker_pid(workdir, 2)
    assert second is not None and second != first
    os.kill(second, signal.SIGSTOP)  # the process hangs: no heartbeat, its connection stays open
  finally:
    thread.join(timeout=600)
  if "error" in result:
    raise result["error"]
  summary = result["summary"]
  # (At least: a heartbeat starved for 10 s on a loaded machine would replace a worker more.)
  assert summary["step"] == steps and summary["workers_replaced"] >= 2
  assert not alive(second)  # a stopped process does not exit by itself: the trainer killed it
  assert worker_pid(workdir, 3) is not None
  rows = metric_steps(workdir)
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  indices = [r["rollout_index"] for r in rows]
  assert len(set(indices)) == len(indices), indices  # no rollout trained on twice
  assert all(r["staleness"] <= 2 for r in rows) and rows[-1]["workers_replaced"] == summary["workers_replaced"]


def test_weights_go_forward_only_and_the_config_is_checked(tmp_path):
  worker = ProcessRolloutWorker(process_config(), str(tmp_path))
  worker.push_weights(5, {"w": jnp.ones(2)}, {})
  with pytest.raises(ValueError, match="push_weights: version 3 is older than the worker's 5; weights go forward only"):
    worker.push_weights(3, {"w": jnp.ones(2)}, {})
  for changes, message in (
    (
      {"async_rollouts": False},
      r"rl.rollout_process=True is invalid; .* set "
      r"rl.async_rollouts=True",
    ),
    (
      {"heartbeat_timeout": 0.5},
      r"rl.heartbeat_timeout=0.5 is invalid; must exceed "
      r"rl.heartbeat_every=1.0",
    ),
    ({"max_worker_restarts": -1}, r"rl.max_worker_restarts=-1 is invalid"),
  ):
    with pytest.raises(ValueError, match=message):
      rl_config.validate_rl_config(process_config(**changes))
