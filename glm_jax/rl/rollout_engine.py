"""A rollout engine apart from the trainer: a worker process that generates GRPO's rollouts, over a socket.

  rl.async_rollouts=True, rl.rollout_process=True     (configs/grpo_tiny.py; glm_jax/rl/trainer.py)

The trainer's ProcessRolloutWorker (the thread RolloutWorker's interface: push_weights, start, get, stop) starts
`python -m glm_jax.rl.rollout_engine <config.json>`, which builds the run's sampler, tasks and reward function (or an
agentic run's agent loop, environments and tools) from the config, listens on a loopback port it prints, and serves
one connection (multiprocessing.connection, after a challenge-response on a random key passed in the environment):
  trainer -> worker   ("weights", version, params, rest)   host arrays, tagged with their policy version
                      ("generate", index)                 make rollout `index` (rollout.step_rollout)
                      ("stop",)
  worker -> trainer   ("heartbeat", version)              every rl.heartbeat_every seconds, from its own thread
                      ("rollout", index, Rollout)         made with the newest weights the worker holds
                      ("error", message)                  the worker failed (its traceback)
Both sides authenticate within rl.handshake_timeout; a worker that exits or misses rl.heartbeat_timeout is replaced
and its unanswered requests sent again (a rollout index reaches the trainer at most once), up to
rl.max_worker_restarts. Logs: <workdir>/rollout/worker-<n>.log (pid in worker-<n>.pid). The handshake's deadlines,
staleness and restarts in full: docs/post_training.md, "GRPO, distillation and asynchronous rollouts".
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import jax
import ml_collections
from absl import logging

AUTHKEY_ENV = "GLM_JAX_ROLLOUT_AUTHKEY"
HOST = "127.0.0.1"  # the worker listens on loopback only


def tokenizer_path(config_path: str) -> str:
  """Where an agentic run's worker reads the run's tokenizer (its record, data/tokenizer.py): beside the config."""
  return os.path.join(os.path.dirname(config_path), "tokenizer.json")


def worker_argv(config_path: str) -> list[str]:
  """The worker process's command line (the tests put stand-ins that misbehave in its place)."""
  return [sys.executable, "-m", "glm_jax.rl.rollout_engine", config_path]


class ProcessRolloutWorker:
  """Rollouts from a worker process (module docstring), replaced when it stops answering. The worker builds its
  sampler, tasks and reward from `config` (a reward function is found by its name in the worker's process);
  `served` maps the trainer's params to what the sampler reads (quantization-aware runs pack them); an agentic run
  (rl.tokenizer="model") passes its `tokenizer`."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, served=lambda p: p, tokenizer=None):
    rl = config.rl
    self._config, self._served = config, served
    self._tokenizer = None  # an agentic run's tokenizer, as a checkpoint records it (the worker rebuilds it)
    if rl.tokenizer == "model":
      if tokenizer is None:
        raise ValueError("ProcessRolloutWorker: rl.tokenizer='model' needs the run's tokenizer (tokenizer=...)")
      self._tokenizer = tokenizer.record()
    self._dir = os.path.join(workdir, "rollout")
    self._max_pending, self._timeout = rl.max_pending, float(rl.heartbeat_timeout)
    self._start_timeout, self._max_restarts = float(rl.worker_start_timeout), rl.max_worker_restarts
    self._handshake_timeout = float(rl.handshake_timeout)
    self._authkey = secrets.token_bytes(16)
    self._lock = threading.Lock()
    self._weights: tuple[int, Any, Any] | None = None  # the newest pushed, as host arrays
    self._inbox: queue.Queue = queue.Queue()  # (worker number, message)
    self._outstanding: set[int] = set()  # requested, not yet delivered to the trainer
    self._delivered: set[int] = set()
    self._next_index = 0
    self.replaced = 0  # workers replaced after they stopped answering
    self._worker = None  # the live _Connection
    self._n = 0  # workers started

  # --- the RolloutWorker interface ---

  def push_weights(self, version: int, params, rest) -> None:
    """Makes (params, rest) the weights of the next rollouts; returns once they are queued for sending."""
    with self._lock:
      if self._weights is not None and version < self._weights[0]:
        raise ValueError(
          f"push_weights: version {version} is older than the worker's {self._weights[0]}; weights go forward only"
        )
      self._weights = (version, *jax.device_get((self._served(params), rest)))
      if self._worker is not None:
        self._worker.send(("weights", *self._weights))

  def start(self, first_index: int = 0) -> ProcessRolloutWorker:
    if self._weights is None:
      raise RuntimeError("ProcessRolloutWorker.start: push_weights first")
    os.makedirs(self._dir, exist_ok=True)
    self._config_path = os.path.join(self._dir, "config.json")
    with open(self._config_path, "w") as f:
      json.dump(self._config.to_dict(), f)
    if self._tokenizer is not None:
      with open(tokenizer_path(self._config_path), "w") as f:
        json.dump(self._tokenizer, f)
    self._next_index = first_index
    self._spawn()
    for _ in range(self._max_pending):
      self._request()
    return self

  def get(self, timeout: float = 600.0):
    """The next rollout to arrive (never one already delivered); replaces a worker that stops answering."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      try:
        n, msg = self._inbox.get(timeout=0.5)
      except queue.Empty:
        self._check_health()
        continue
      if n != self._worker.n:
        continue  # from a worker already replaced
      kind = msg[0]
      if kind == "heartbeat":
        self._worker.last_seen = time.monotonic()
      elif kind == "closed":
        self._replace("its process exited (the connection closed)")
      elif kind == "error":
        raise RuntimeError(f"the rollout worker failed: {msg[1]}")
      elif kind == "rollout":
        self._worker.last_seen = time.monotonic()
        index, rollout = msg[1], msg[2]
        if index in self._delivered or index not in self._outstanding:
          continue  # a retried request answered twice: trained once
        self._outstanding.discard(index)
        self._delivered.add(index)
        self._request()
        return rollout
    raise TimeoutError(f"no rollout from the worker in {timeout:.0f} s (log: {self._worker.log})")

  def stop(self) -> None:
    if self._worker is not None:
      self._worker.close(graceful=True)
      self._worker = None

  # --- the worker processes ---

  def _request(self) -> None:
    index = self._next_index
    self._next_index += 1
    self._outstanding.add(index)
    self._worker.send(("generate", index))

  def _check_health(self) -> None:
    w = self._worker
    if w.proc.poll() is not None:
      self._replace(f"its process exited with code {w.proc.returncode}")
    elif time.monotonic() - w.last_seen > (self._timeout if w.heard else self._start_timeout):
      self._replace(f"no heartbeat in {self._timeout if w.heard else self._start_timeout:.0f} s")

  def _replace(self, why: str) -> None:
    old = self._worker
    logging.warning(
      "rollout worker %d stopped answering (%s): replacing it and retrying %d requests",
      old.n,
      why,
      len(self._outstanding),
    )
    old.close(graceful=False)
    self._count_replacement(old.n, why, old.log)
    self._spawn()
    for index in sorted(self._outstanding):
      self._worker.send(("generate", index))

  def _count_replacement(self, n: int, why: str, log: str) -> None:
    if self.replaced >= self._max_restarts:
      raise RuntimeError(
        f"rollout worker {n} stopped answering ({why}) after rl.max_worker_restarts="
        f"{self._max_restarts} replacements; see {log}"
      )
    self.replaced += 1

  def _spawn(self) -> None:
    """Starts a worker and gives it the newest weights; one that does not start is replaced like one that stops."""
    while True:
      self._n += 1
      try:
        self._worker = _Connection(
          self._n,
          self._config_path,
          self._dir,
          self._authkey,
          self._inbox,
          self._start_timeout,
          self._handshake_timeout,
        )
        break
      except _DidNotStart as e:
        logging.warning("%s", e)
        self._count_replacement(e.n, f"it did not start: {e.why}", e.log)
    with self._lock:
      self._worker.send(("weights", *self._weights))


class _DidNotStart(RuntimeError):
  def __init__(self, n: int, log: str, why: str):
    super().__init__(f"rollout worker {n} did not start ({why}); see {log}")
    self.n, self.log, self.why = n, log, why


class HandshakeError(ConnectionError):
  """A connection that did not authenticate: the message names why (no answer in time, another key, closed)."""


def authenticate(sock: socket.socket, authkey: bytes, timeout: float, *, server: bool) -> Connection:
  """multiprocessing's mutual challenge-response (what its Listener.accept and Client do, the server challenging
  first) on a connected socket, in at most `timeout` seconds: at the deadline the socket is shut down, which ends a
  read blocked on a peer that stays silent (or that sends a byte at a time). Returns the connection; `sock` is closed
  either way. Raises HandshakeError naming the cause."""
  conn = Connection(os.dup(sock.fileno()))  # the handshake reads through its own descriptor; `sock` is for shutdown
  lock, state = threading.Lock(), {"done": False, "expired": False}

  def expire():
    with lock:
      if not state["done"]:
        state["expired"] = True
        _shutdown(sock)

  timer = threading.Timer(max(timeout, 0.0), expire)
  timer.daemon = True
  timer.start()
  error = None
  try:
    if server:
      deliver_challenge(conn, authkey)
      answer_challenge(conn, authkey)
    else:
      answer_challenge(conn, authkey)
      deliver_challenge(conn, authkey)
  except AuthenticationError as e:
    error = f"wrong authentication key ({e})"
  except EOFError:
    error = "the peer closed the connection"
  except (OSError, AssertionError, ValueError) as e:  # (answer_challenge asserts on a malformed challenge)
    error = f"{type(e).__name__}: {e}"
  with lock:
    state["done"] = True
    timer.cancel()
  if state["expired"]:
    error = f"handshake not completed within {timeout:.3g} s"
  sock.close()
  if error is not None:
    conn.close()
    raise HandshakeError(error)
  return conn


def connect(port: int, authkey: bytes, timeout: float) -> Connection:
  """The trainer's end: connects to a worker's loopback port and authenticates both ways, in `timeout` seconds in
  all. Raises HandshakeError naming the cause."""
  deadline = time.monotonic() + timeout
  try:
    sock = socket.create_connection((HOST, port), timeout=timeout)
  except OSError as e:
    raise HandshakeError(f"could not connect ({e})") from None
  sock.setblocking(True)  # bounded by authenticate's deadline instead
  return authenticate(sock, authkey, deadline - time.monotonic(), server=False)


def accept_trainer(server: socket.socket, authkey: bytes, timeout: float) -> Connection:
  """The worker's end: the first connection to the listening `server` that authenticates with the trainer's key.
  Each connection is authenticated in a thread of its own, within `timeout` seconds of being accepted, so one that
  stays silent holds up nothing; one that fails is logged and closed and the worker goes on listening. Raises
  TimeoutError when none has authenticated in 2 * timeout seconds (the trainer that started this worker is gone)."""
  trainers: queue.Queue = queue.Queue()

  def handshake(sock: socket.socket, peer) -> None:
    try:
      trainers.put(authenticate(sock, authkey, timeout, server=True))
    except HandshakeError as e:
      logging.warning("rollout worker: refused a connection from %s:%d (%s)", peer[0], peer[1], e)

  server.settimeout(0.1)  # the loop below checks for an authenticated trainer between accepts
  deadline = time.monotonic() + 2 * timeout
  while time.monotonic() < deadline:
    try:
      return trainers.get_nowait()
    except queue.Empty:
      pass
    try:
      sock, peer = server.accept()
    except TimeoutError:
      continue
    sock.setblocking(True)
    threading.Thread(target=handshake, args=(sock, peer), daemon=True, name=f"handshake-{peer[1]}").start()
  try:
    return trainers.get_nowait()  # (one that authenticated as the time ran out)
  except queue.Empty:
    pass
  raise TimeoutError(
    f"rollout worker: no trainer authenticated within {2 * timeout:g} s (2 * rl.handshake_timeout) of the port "
    "being printed; exiting"
  )


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass  # already closed by the peer


class _Connection:
  """One worker process and its connection: a sender thread (the trainer never waits on a slow socket) and a
  receiver thread that puts (n, message) in the trainer's inbox, ("closed",) when the connection ends."""

  def __init__(
    self,
    n: int,
    config_path: str,
    folder: str,
    authkey: bytes,
    inbox: queue.Queue,
    start_timeout: float,
    handshake_timeout: float,
  ):
    self.n, self.log = n, os.path.join(folder, f"worker-{n}.log")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # glm_jax's parent
    env = {
      **os.environ,
      AUTHKEY_ENV: authkey.hex(),
      "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    with open(self.log, "w") as log:
      self.proc = subprocess.Popen(
        worker_argv(config_path),
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
        text=True,
      )
    with open(os.path.join(folder, f"worker-{n}.pid"), "w") as f:
      f.write(str(self.proc.pid))
    port = self._read_port(start_timeout)
    try:
      self.conn = connect(port, authkey, handshake_timeout)
    except HandshakeError as e:
      self._kill()
      raise _DidNotStart(n, self.log, f"the handshake on port {port} failed: {e}") from None
    self.last_seen, self.heard = time.monotonic(), False
    self._out: queue.Queue = queue.Queue()
    self._inbox = inbox
    threading.Thread(target=self._send_loop, daemon=True, name=f"rollout-send-{n}").start()
    threading.Thread(target=self._receive_loop, daemon=True, name=f"rollout-recv-{n}").start()

  def _read_port(self, timeout: float) -> int:
    box: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: box.put(self.proc.stdout.readline()), daemon=True).start()
    try:
      line = box.get(timeout=timeout)
    except queue.Empty:
      line = ""
    if not line.startswith("PORT "):
      self._kill()
      raise _DidNotStart(self.n, self.log, f"no port within {timeout:g} s")
    return int(line.split()[1])

  def _kill(self) -> None:
    self.proc.kill()
    self.proc.wait()

  def send(self, msg) -> None:
    self._out.put(msg)

  def _send_loop(self) -> None:
    while True:
      msg = self._out.get()
      if msg is None:
        return
      try:
        self.conn.send(msg)
      except (OSError, EOFError, ValueError):
        return  # the receiver reports the closed connection

  def _receive_loop(self) -> None:
    while True:
      try:
        msg = self.conn.recv()
      except (OSError, EOFError, ValueError):
        self._inbox.put((self.n, ("closed",)))
        return
      if msg[0] == "heartbeat":
        self.heard = True
      self._inbox.put((self.n, msg))

  def close(self, graceful: bool) -> None:
    if graceful:
      self.send(("stop",))
    self._out.put(None)
    try:
      self.proc.wait(timeout=10 if graceful else 0.1)
    except subprocess.TimeoutExpired:
      pass
    if self.proc.poll() is None:
      self._kill()
    try:
      self.conn.close()
    except OSError:
      pass


def serve(config_path: str) -> None:
  """The worker process: builds the run's sampler, tasks and reward from the config (an agentic run's: its agent
  loop, environments, tool workers and rollout function, and the tokenizer the trainer wrote beside the config),
  prints its port, and serves the trainer's requests (module docstring) until told to stop or the connection ends."""
  from flax import nnx

  from glm_jax.model import GlmMoeDsa, ModelConfig

  with open(config_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  model_cfg = ModelConfig.from_dict(config.model)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(model_cfg, nnx.Rngs(0))))  # the weights come by message
  if config.rl.tokenizer == "model":
    from glm_jax.data.tokenizer import Tokenizer
    from glm_jax.rl import agentic
    from glm_jax.rl.config import environment_mix

    with open(tokenizer_path(config_path)) as f:
      vocab = Tokenizer.from_record(json.load(f))
    environments = environment_mix(config)
    sampler, _ = agentic.make_agent_loops(graphdef, model_cfg, config.rl, vocab)
    run = agentic.AgenticRun(config, environments, sampler, vocab, agentic.load_rollout_fn(config.rl.rollout_fn))
    with agentic.serving_tools(environments, config.rl):  # the tool workers, children of this process
      _serve(config, lambda p, r, version, index: agentic.step_rollout(run, p, r, version, index, config.rl.group_size))
    return
  from glm_jax.rl import rewards as rewards_lib, tasks as tasks_lib
  from glm_jax.rl.config import task_mix
  from glm_jax.rl.rollout import make_sampler, step_rollout

  vocab = tasks_lib.CharVocab()
  tasks_and_weights = task_mix(config)
  sampler = make_sampler(graphdef, model_cfg, config.rl, tasks_and_weights, vocab)
  reward_fn = rewards_lib.make_reward_fn(config.rl.reward, vocab)
  _serve(
    config,
    lambda params, rest, version, index: step_rollout(
      sampler, params, rest, tasks_and_weights, config.rl, reward_fn, version, index, config.rl.group_size
    ),
  )


def _serve(config: ml_collections.ConfigDict, produce) -> None:
  """Listens, authenticates the trainer and answers its messages; `produce(params, rest, version, index)` makes
  rollout `index`."""
  rl = config.rl
  server = socket.create_server((HOST, 0))
  print(f"PORT {server.getsockname()[1]}", flush=True)
  try:
    conn = accept_trainer(server, bytes.fromhex(os.environ[AUTHKEY_ENV]), float(rl.handshake_timeout))
  finally:
    server.close()  # one trainer: nothing else may connect
  send_lock = threading.Lock()
  state = {"weights": None}
  have_weights = threading.Condition()
  requests: queue.Queue = queue.Queue()

  def send(msg):
    with send_lock:
      conn.send(msg)

  def receive():
    try:
      while True:
        msg = conn.recv()
        if msg[0] == "weights":
          with have_weights:  # (the trainer sends versions in order: ProcessRolloutWorker.push_weights)
            state["weights"] = msg[1:]
            have_weights.notify_all()
        elif msg[0] == "generate":
          requests.put(msg[1])
        elif msg[0] == "stop":
          break
    except (OSError, EOFError):
      pass
    requests.put(None)

  def heartbeat():
    while True:
      with have_weights:
        version = None if state["weights"] is None else state["weights"][0]
      try:
        send(("heartbeat", version))
      except (OSError, ValueError):
        return
      time.sleep(float(rl.heartbeat_every))

  threading.Thread(target=receive, daemon=True).start()
  threading.Thread(target=heartbeat, daemon=True).start()
  try:
    while True:
      index = requests.get()
      if index is None:
        break
      with have_weights:
        have_weights.wait_for(lambda: state["weights"] is not None)
        version, params, rest = state["weights"]
      rollout = produce(params, rest, version, index)
      send(("rollout", index, rollout))
  except Exception:  # noqa: BLE001  (reported to the trainer, which raises it)
    try:
      send(("error", traceback.format_exc()))
    except (OSError, ValueError):
      pass
    raise
  finally:
    conn.close()


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  serve(sys.argv[1])
  os._exit(0)  # the daemon threads hold the connection: leave without waiting for them
