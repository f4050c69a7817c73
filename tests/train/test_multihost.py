"""Two processes on one machine train as one job (jax.distributed over localhost, gloo collectives on CPU).

launch/train.py runs as 2 processes x 2 simulated CPU devices (a 4-device fsdp mesh). Each process reads its own
rows of every global batch. Checked against an independent single-process computation of the same steps: the
global batch built here from both processes' data shards, the same initial state, the same jit step on one
device; then the checkpoint both processes wrote is restored in this single process."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from glm_jax.configs import glm5_tiny
from glm_jax import data as data_lib
from glm_jax.train import distributed, step as step_lib, trainer
from glm_jax.serving.fleet import free_port_run
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from tests.helpers import ROOT

OVERRIDES = {
  "train.steps": 2,
  "train.log_every": 1,
  "train.eval_every": 2,
  "train.checkpoint_every": 2,
  "train.async_checkpoints": False,
  "train.tensorboard": False,
  "data.batch_size": 8,
  "data.seq_len": 64,
  "data.eval_batches": 1,
  "mesh.fsdp": -1,
  # one dense and one MoE layer, no MTP: what is tested is the processes, not the depth
  "model.num_hidden_layers": 2,
  "model.num_nextn_predict_layers": 0,
}


def free_port() -> int:
  """A free loopback port outside the kernel's ephemeral range, so no outgoing connection takes it before the
  coordinator binds it (glm_jax/serving/fleet.py)."""
  return free_port_run(1)


def job_config(overrides: dict):
  """glm5_tiny with `overrides`, as launch/train.py builds it from the flags."""
  config = glm5_tiny.get_config()
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  return config


def start_two_processes(workdir: str, overrides: dict) -> list[subprocess.Popen]:
  """launch/train.py as processes 0 and 1 of one job on localhost, 2 simulated CPU devices each. The tokenizer and
  the tokenized corpus are made here first, in data.cache_dir, so the processes read them instead of each making
  them."""
  config = job_config(overrides)
  data_lib.make_train_iterator(config.data, data_lib.load_tokenizer(config.data))
  port = free_port()
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  cmd = [
    sys.executable,
    "launch/train.py",
    "--config=configs/glm5_tiny.py",
    f"--workdir={workdir}",
    f"--coordinator_address=localhost:{port}",
    "--num_processes=2",
  ]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  return [
    subprocess.Popen(
      cmd + [f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for i in range(2)
  ]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, data_cache_dir):
  """(workdir, overrides, [(exit code, stdout, stderr)] of processes 0 and 1) of the job of OVERRIDES: 2 steps,
  evaluated and checkpointed at step 2."""
  workdir = str(tmp_path_factory.mktemp("two_processes") / "run")
  overrides = {**OVERRIDES, "data.cache_dir": data_cache_dir}
  procs = start_two_processes(workdir, overrides)
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  finally:
    for p in procs:
      p.kill()
  return workdir, overrides, [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


@pytest.mark.slow  # two processes start jax and compile the step: ~1 minute
def test_two_processes_train_as_one(two_process_run):
  workdir, overrides, outs = two_process_run
  for code, _, err in outs:
    assert code == 0, err[-4000:]
  assert json.loads(outs[0][1].strip().splitlines()[-1])["step"] == 2
  assert not any(line.startswith("{") for line in outs[1][1].splitlines())  # only process 0 prints the summary
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2  # one writer

  # The same two steps in this process, on one device, from both processes' data shards.
  config = job_config(overrides)
  model_cfg = model_config_for_stage(config)
  tokenizer = data_lib.load_tokenizer(config.data)
  shards = [data_lib.make_train_iterator(config.data, tokenizer, process_index=i, process_count=2) for i in range(2)]
  graphdef, state, optimizer, schedule = trainer.create_train_state(config, model_cfg)
  train_step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)
  want = []
  for _ in range(2):
    local = [next(it) for it in shards]
    batch = {
      k: jax.numpy.asarray(np.concatenate([b[k] for b in local])) for k in ("input_ids", "segment_ids", "positions")
    }
    state, metrics = train_step(state, batch)
    want.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, want, rtol=1e-5)

  # The checkpoint both processes wrote restores here, onto one device, and holds those parameters.
  _, fresh, _, _ = trainer.create_train_state(config, model_cfg)
  with Checkpointer(workdir, read_only=True) as ckpt:
    params, _ = ckpt.restore_weights(2, fresh.params, fresh.rest)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"mode": "sometimes"}, r"distributed='sometimes' is invalid; one of \('auto', 'on', 'off'\)"),
    ({"coordinator_address": "localhost:1", "num_processes": 2}, r"given without \['process_id'\]"),
    (
      {"coordinator_address": "localhost:1", "num_processes": 2, "process_id": 2},
      r"process_id=2 is invalid; an integer in \[0, num_processes=2\)",
    ),
    ({"coordinator_address": "localhost", "num_processes": 2, "process_id": 0}, r"host:port of process 0"),
    ({"mode": "off", "coordinator_address": "localhost:1", "num_processes": 2, "process_id": 0}, r"'off' contradicts"),
  ],
)
def test_bad_distributed_arguments_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    distributed.maybe_initialize(**kwargs)


def test_auto_detection_reads_only_the_environment():
  assert distributed.multi_process_environment({}) is None
  assert distributed.multi_process_environment({"TPU_WORKER_HOSTNAMES": "t1"}) is None  # one host
  assert distributed.multi_process_environment({"TPU_WORKER_HOSTNAMES": "t1,t2"}) == "TPU_WORKER_HOSTNAMES"
  assert distributed.multi_process_environment({"SLURM_NTASKS": "1"}) is None
  assert distributed.multi_process_environment({"OMPI_COMM_WORLD_SIZE": "4"}) == "OMPI_COMM_WORLD_SIZE"
  assert distributed.maybe_initialize("auto") is False  # this machine: no cluster, nothing initialized


@pytest.mark.slow  # two processes start jax and compile the step
def test_a_preemption_notice_to_one_process_stops_both_at_the_same_step_with_a_checkpoint(two_process_run, tmp_path):
  """SIGTERM to process 1 only: jax's preemption sync manager tells process 0, both stop after the same step, the
  checkpoint of that step is written by both, and each exits 143 naming it. The job resumes a copy of
  two_process_run's (its checkpoint of step 2) to train on, so neither process initializes a state."""
  finished, overrides, outs = two_process_run
  assert [code for code, _, _ in outs] == [0, 0], "two_process_run failed: test_two_processes_train_as_one says why"
  workdir = str(tmp_path / "run")
  shutil.copytree(finished, workdir)
  overrides = {**overrides, "train.steps": 1000, "train.checkpoint_every": 500, "train.eval_every": 1000}
  procs = start_two_processes(workdir, overrides)
  metrics = os.path.join(workdir, "metrics.jsonl")

  def resumed():  # a step after the copy's last one is logged (a whole line): both processes are training
    try:
      with open(metrics) as f:
        return any(json.loads(line)["step"] > 2 for line in f if line.endswith("\n"))
    except OSError:
      return False

  try:
    deadline = time.monotonic() + 300
    while not resumed():
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.kill()
  lines = [err.strip().splitlines()[-1] for _, err in outs]
  steps = []
  for p, line, (_, err) in zip(procs, lines, outs):
    assert p.returncode == 143, err[-4000:]
    match = re.fullmatch(
      rf"stopped by SIGTERM after step (\d+): its checkpoint is in {re.escape(workdir)}/checkpoints/\1; run the "
      "same command again to resume",
      line,
    )
    assert match, line
    steps.append(int(match[1]))
  assert 2 < steps[0] == steps[1] < 1000
  with Checkpointer(workdir, read_only=True) as ckpt:
    assert ckpt.steps()[0] == steps[0]
  rows = [json.loads(line) for line in open(metrics)]
  assert [r["step"] for r in rows if "loss" in r][-1] == steps[0]
