"""The rollout engine in its own process (glm_jax/rl/rollout_engine.py): GRPO over localhost with a worker that is
killed, then one that hangs; each is replaced, its requests retried, and no rollout is trained on twice. Its handshake:
a local client that connects first and stays silent, or answers with another key, is refused by the worker while the
trainer gets its rollouts; a "worker" that never completes the handshake is replaced within rl.handshake_timeout and
the run fails naming the cause. (That the two-process loop raises the reward as the in-process one does:
tests/rl/test_trainer.py.)"""

import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx

import glm_jax.configs.grpo_tiny
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import config as rl_config
from glm_jax.rl import rollout_engine
from glm_jax.rl import trainer as rl_trainer
from glm_jax.rl.rollout import step_problems
from glm_jax.rl.rollout_engine import HOST, HandshakeError, ProcessRolloutWorker
from glm_jax.train.step import split_model
from tests.helpers import init_module

# The three worker processes build the same sampler: with the persistent cache (passed on through the environment)
# the first compiles it and the replacements load it.


def process_config(**rl) -> ml_collections.ConfigDict:
  config = glm_jax.configs.grpo_tiny.get_config()
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
def test_a_killed_and_a_hung_worker_are_replaced_and_nothing_is_trained_twice(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  # GLM-5's asynchronous objective, as tests/rl/test_trainer.py's asynchronous run has it on the same batches: the
  # same compiled programs, which the persistent compilation cache serves to whichever of the two runs second.
  config = process_config(
    tau=2, objective="async", heartbeat_every=0.5, heartbeat_timeout=5.0, worker_start_timeout=120.0
  )
  # The faults come from the training loop, as it logs a step, so they land at the same point of the run however fast
  # the steps go: worker 1 is killed after step 3; worker 2 hangs after the fourth step trained on its rollouts (it is
  # serving: not still starting). After each fault, up to rl.max_pending rollouts the worker sent before it may still
  # be trained on; one step more needs a rollout the hung worker never makes, and worker 3 makes it.
  steps = config.rl.steps = 3 + 4 + 2 * config.rl.max_pending + 1
  log_and_eval, faults = rl_trainer._log_and_eval, {"serving": 0}

  def log_then_fault(ctx, done, metrics, *args):
    out = log_and_eval(ctx, done, metrics, *args)
    if done == 3:
      faults["killed"] = worker_pid(workdir, 1)
      os.kill(faults["killed"], signal.SIGKILL)  # the process dies: its connection closes
    elif metrics["workers_replaced"] == 1 and "stopped" not in faults:
      faults["serving"] += 1
      if faults["serving"] == 4:
        faults["stopped"] = worker_pid(workdir, 2)
        os.kill(faults["stopped"], signal.SIGSTOP)  # the process hangs: no heartbeat, its connection stays open
    return out

  monkeypatch.setattr(rl_trainer, "_log_and_eval", log_then_fault)
  summary = rl_trainer.run(config, workdir)
  second = faults["stopped"]
  assert second is not None and second != faults["killed"]
  # (At least: a heartbeat starved for 5 s, ten of them missed, on a loaded machine would replace a worker more.)
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
    ({"handshake_timeout": 0.0}, r"rl.handshake_timeout=0.0 is invalid; must be > 0 \(seconds\)"),
  ):
    with pytest.raises(ValueError, match=message):
      rl_config.validate_rl_config(process_config(**changes))


# --- the handshake: no other local process can stall the run by connecting first, or end it with another key ---


def test_the_accept_loop_refuses_silent_and_wrong_key_clients_and_takes_the_trainer(caplog):
  """The worker's accept loop (rollout_engine.accept_trainer, in a thread here) against real loopback clients: one that
  connects and stays silent, one with another key, one that sends garbage; the trainer's connect, after all three,
  authenticates at once and messages go both ways; the failures are logged by cause and address."""
  timeout, key = 1.0, secrets.token_bytes(16)
  server = socket.create_server((HOST, 0))
  port = server.getsockname()[1]
  accepted = {}
  thread = threading.Thread(target=lambda: accepted.update(conn=rollout_engine.accept_trainer(server, key, timeout)))
  with caplog.at_level(logging.WARNING):
    thread.start()
    silent = socket.create_connection((HOST, port))
    with pytest.raises(AuthenticationError, match="digest sent was rejected"):
      Client((HOST, port), authkey=secrets.token_bytes(16))
    garbage = socket.create_connection((HOST, port))
    garbage.sendall(b"\x00\x00\x10\x00" + b"x" * 64)  # a 4096-byte message announced: over the challenge's 256
    t0 = time.monotonic()
    trainer = rollout_engine.connect(port, key, timeout)
    thread.join(timeout=5)
    took = time.monotonic() - t0
    assert not thread.is_alive() and took < timeout / 2, took  # the silent client held nothing up
    trainer.send(("generate", 3))
    assert accepted["conn"].recv() == ("generate", 3)
    accepted["conn"].send(("heartbeat", None))
    assert trainer.recv() == ("heartbeat", None)
    server.close()
    assert b"#CHALLENGE#" in silent.recv(1024)  # it was challenged ...
    silent.settimeout(timeout + 2)
    assert silent.recv(1024) == b""  # ... and cut off at the deadline
    refused = lambda: [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]  # noqa: E731
    wait_for(lambda: len(refused()) >= 3, "the third refusal to be logged", timeout=5)  # (by the handshake's thread)
  refusals = refused()
  assert len(refusals) == 3, refusals
  assert any("wrong authentication key" in m for m in refusals), refusals
  assert any("bad message length" in m for m in refusals), refusals
  assert any(f"{HOST}:{silent.getsockname()[1]} (handshake not completed within 1 s)" in m for m in refusals)
  for conn in (trainer, accepted["conn"], silent, garbage):
    conn.close()


def test_a_worker_that_no_trainer_reaches_exits_and_a_closed_port_is_named():
  timeout = 0.3
  server = socket.create_server((HOST, 0))
  port = server.getsockname()[1]
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match=r"no trainer authenticated within 0.6 s \(2 \* rl.handshake_timeout\)"):
    rollout_engine.accept_trainer(server, secrets.token_bytes(16), timeout)
  assert 2 * timeout <= time.monotonic() - t0 < 2 * timeout + 1
  server.close()
  with pytest.raises(HandshakeError, match="could not connect .*Connection refused"):
    rollout_engine.connect(port, secrets.token_bytes(16), timeout)


# Stand-ins for the worker process that never complete the handshake (each prints a port, then stays up).
FAKE_WORKER = """
import os, socket, sys, time
from multiprocessing.connection import Connection, deliver_challenge

server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
if sys.argv[1] == "no_listener":
  server.close()
print(f"PORT {port}", flush=True)
if sys.argv[1] == "wrong_key":
  sock, _ = server.accept()
  try:
    deliver_challenge(Connection(sock.detach()), os.urandom(16))
  except Exception:
    pass
time.sleep(600)
"""


@pytest.mark.parametrize(
  "fake, cause",
  [
    ("silent", r"handshake not completed within 1 s"),
    ("wrong_key", r"wrong authentication key \(digest sent was rejected\)"),
    ("no_listener", r"could not connect \(.*Connection refused\)"),
  ],
  ids=["silent", "wrong_key", "no_listener"],
)
def test_a_worker_that_never_completes_the_handshake_is_replaced_then_the_run_fails_naming_why(
  tmp_path, monkeypatch, fake, cause
):
  timeout = 1.0
  monkeypatch.setattr(rollout_engine, "worker_argv", lambda config_path: [sys.executable, "-c", FAKE_WORKER, fake])
  worker = ProcessRolloutWorker(process_config(handshake_timeout=timeout, max_worker_restarts=1), str(tmp_path))
  worker.push_weights(0, {"w": jnp.ones(2)}, {})
  log = os.path.join(tmp_path, "rollout", "worker-2.log")
  t0 = time.monotonic()
  with pytest.raises(
    RuntimeError,
    match=rf"rollout worker 2 stopped answering \(it did not start: the handshake on port \d+ failed: {cause}\) "
    rf"after rl.max_worker_restarts=1 replacements; see {log}",
  ):
    worker.start()
  took = time.monotonic() - t0
  assert worker.replaced == 1
  assert took < 2 * timeout + 10, took  # two fakes, each given up at the deadline (at most), plus their start
  if fake == "silent":
    assert took >= 2 * timeout, took
  for n in (1, 2):
    assert not alive(worker_pid(tmp_path, n))  # each fake was killed


def model_weights(config: ml_collections.ConfigDict):
  """Random weights of the config's model, filled from numpy (no per-shape XLA compiles: 9 s of them cold here)."""
  _, params, rest = split_model(init_module(lambda: GlmMoeDsa(ModelConfig.from_dict(config.model), nnx.Rngs(0)), 0))
  return params, rest


@pytest.mark.slow  # a worker process compiles its sampler, or loads it from the cache (the test above made it)
def test_clients_that_connect_before_the_trainer_are_refused_and_the_trainer_gets_its_rollouts(tmp_path, monkeypatch):
  """A real worker; between its port being printed and the trainer connecting, two other local clients connect: one
  stays silent, the other answers the challenge with another key. The worker logs and refuses each by its cause; the
  trainer's handshake completes within rl.handshake_timeout (the silent client, still connected, does not hold it
  up) and its rollouts come from that same worker (no replacement is allowed)."""
  timeout = 3.0
  config = process_config(handshake_timeout=timeout, max_worker_restarts=0, worker_start_timeout=240.0)
  intruders, port_read = [], {}
  read_port = rollout_engine._Connection._read_port

  def read_port_then_intrude(self, start_timeout):
    port = read_port(self, start_timeout)
    intruders.append(socket.create_connection((HOST, port)))  # silent
    with pytest.raises(AuthenticationError):
      Client((HOST, port), authkey=secrets.token_bytes(16))
    port_read["t"] = time.monotonic()
    return port

  monkeypatch.setattr(rollout_engine._Connection, "_read_port", read_port_then_intrude)
  worker = ProcessRolloutWorker(config, str(tmp_path))
  worker.push_weights(7, *model_weights(config))
  causes = ("handshake not completed within 3 s", "wrong authentication key")
  try:
    worker.start()
    handshake_s = time.monotonic() - port_read["t"]
    rollout = worker.get(timeout=240)
    log = os.path.join(tmp_path, "rollout", "worker-1.log")
    logged = lambda: all(why in open(log).read() for why in causes)  # noqa: E731
    wait_for(logged, "the worker's log of both refusals", timeout=2 * timeout)
  finally:
    worker.stop()
    for sock in intruders:
      sock.close()
  assert handshake_s < timeout, handshake_s
  assert worker.replaced == 0 and worker_pid(tmp_path, 2) is None
  assert (rollout.index, rollout.version) == (0, 7)
  rows = step_problems(rl_config.task_mix(config), config.rl, 0)
  group = config.rl.group_size
  assert [p.prompt_ids for p in rollout.problems] == [p.prompt_ids for p in rows for _ in range(group)]
  assert rollout.tokens.shape[0] == config.rl.prompts_per_step * group
  refusals = [line for line in open(log) if "refused a connection" in line]
  assert len(refusals) == 2 and all(any(why in line for line in refusals) for why in causes), refusals
