"""Short glm5_tiny training runs for the trainer's tests (tests/train/test_trainer.py, test_faults.py): the
config, the launch/train.py command, and what a run leaves in its workdir."""

import json
import os
import shutil
import subprocess

from glm_jax.configs import glm5_tiny
from tests import forked
from tests.shared_runs import copy_run

# A short run: 9 steps of 4 x 64 tokens, a checkpoint every 3 steps, every step logged.
OVERRIDES = {
  "data.seq_len": 64,
  "data.batch_size": 4,
  "data.eval_batches": 2,
  "train.steps": 9,
  "train.log_every": 1,
  "train.eval_every": 100,
  "train.checkpoint_every": 3,
  "train.tensorboard": False,
  "optimizer.warmup_steps": 2,
  "optimizer.decay_steps": 7,
}

KEEP_ALL = {"train.keep_checkpoints": 4}  # every checkpoint of a 9-step run (1, 3, 6, 9) stays


def make_config(data_cache_dir, **changes):
  config = glm5_tiny.get_config()
  for key, value in {**OVERRIDES, "data.cache_dir": data_cache_dir, **changes}.items():
    section, field = key.split(".")
    config[section][field] = value
  return config


def flag_args(data_cache_dir, **changes):
  items = {**OVERRIDES, "data.cache_dir": data_cache_dir, **changes}
  return [f"--config.{k}={v}" for k, v in items.items()]


def run_script(script, *args, timeout=600, env=None) -> subprocess.CompletedProcess:
  """`python <script> args...` from the repository root, as a user runs it (in a process forked for it:
  tests/forked.py)."""
  done = forked.run(script, *args, timeout=timeout, env=env)
  if done.killed:
    raise subprocess.TimeoutExpired([script, *args], timeout, done.stdout, done.stderr)
  return subprocess.CompletedProcess([script, *args], done.returncode, done.stdout, done.stderr)


def run_train(workdir, data_cache_dir, **changes):
  return run_script(
    "launch/train.py", "--config=configs/glm5_tiny.py", f"--workdir={workdir}", *flag_args(data_cache_dir, **changes)
  )


def strict_loads(text):
  """json.loads that refuses a bare NaN or Infinity, as strict parsers do."""

  def refuse(constant):
    raise ValueError(f"not strict JSON: a bare {constant}")

  return json.loads(text, parse_constant=refuse)


def metric_rows(workdir, name="metrics.jsonl"):
  """The rows of a metrics file, parsed strictly."""
  with open(os.path.join(workdir, name)) as f:
    return [strict_loads(line) for line in f]


def train_rows(workdir):
  return [r for r in metric_rows(workdir) if "loss" in r]


def snapshot(directory):
  """Every file under `directory` with its size and modification time."""
  return sorted(
    (
      os.path.relpath(os.path.join(d, f), directory),
      os.path.getsize(os.path.join(d, f)),
      os.stat(os.path.join(d, f)).st_mtime_ns,
    )
    for d, _, files in os.walk(directory)
    for f in files
  )


def stopped_after(run, step, target):
  """A copy at `target` of `run` as it stood after `step` (a run stopped there): its checkpoints up to `step`,
  its metrics rows up to `step`."""
  workdir = copy_run(run, target)
  os.remove(os.path.join(workdir, "stdout.txt"))  # the shared run's record of its output, not the run's
  for name in os.listdir(os.path.join(workdir, "checkpoints")):
    if int(name) > step:
      shutil.rmtree(os.path.join(workdir, "checkpoints", name))
  rows = [r for r in metric_rows(workdir) if r["step"] <= step]
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return workdir
