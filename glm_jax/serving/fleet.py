"""N serving engines behind SGLang's router (the `sglang-router` package, the router slime fronts its SGLang engines
with), supervised: what launch/router.py runs and what an RL run's rollouts go through (glm_jax/rl/rollout_server.py).

Every engine is a process serving glm_jax/serving/server.py's app on 127.0.0.1 at port + 1 + i (its command line from
`engine_argv`); the router listens on `host`:`port` (a non-loopback host needs an API key), its Prometheus metrics on
127.0.0.1 at port + N + 1. The engines take no key: the router's guards the way in. The router proxies SGLang's
/generate and OpenAI's /v1/completions and /v1/chat/completions; a trainer's POST /update_weights goes to each engine.

The supervisor: an engine whose process ends, or whose /health fails 3 times running, is taken out of the router
(DELETE /workers/<id>), started again (engine_argv is asked again: it names the newest weights, an RL run's last
pushed ones, launch/router.py's the workdir's latest checkpoint, and the engine reports their version), warmed with
one generation (GET /health_generate: its first compile) and put back (POST /workers). The router
retries a request whose engine fails before answering (connection refused or reset, 5xx: up to 5 tries) on another
one, so a non-streamed request in flight on an engine that dies is answered by another; a stream cut off midway ends
without its [DONE]. A router that exits is started again. Children run in sessions of their own and die with the
supervisor (Linux's PR_SET_PDEATHSIG), even when it is killed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from absl import logging

API_KEY_ENV = "GLM_JAX_API_KEY"  # launch/serve.py's
FAILURES = 3  # /health failures running before an engine that still runs is restarted
ROUTER_GRACE_S = 5  # the router's wait for requests in flight when it stops
# The router's entry point, the API key (if any) read from the environment rather than the command line (ps shows it).
ROUTER_MAIN = (
  "import os, sys; from sglang_router.launch_router import main; "
  f"key = os.environ.get({API_KEY_ENV!r}); sys.argv += ['--api-key', key] if key else []; main()"
)


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL_PORTS = (32768, 60999)  # Linux's default range


def ephemeral_ports(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
  """The first and last port the kernel gives an outgoing connection or a bind to port 0: Linux's setting where it
  can be read, else Linux's default."""
  try:
    with open(path) as f:
      first, last = (int(x) for x in f.read().split())
    return first, last
  except (OSError, ValueError):
    return LINUX_EPHEMERAL_PORTS


def free_port_run(n: int, rng: random.Random | None = None) -> int:
  """A loopback port p with p .. p + n - 1 free and outside the kernel's ephemeral range (a router, its engines and
  its metrics take a run of ports).

  The ports are bound later, the router's metrics port many seconds later (after the engines start); until then the
  kernel may give a free port of its ephemeral range to any process's outgoing connection, while a port outside it
  goes only to whoever binds it by number. The run is chosen at random (a fresh generator, so processes choosing at
  the same time seldom meet), each port checked free."""
  rng = rng or random.Random()
  first, last = ephemeral_ports()
  # where the run's first port may lie: below the ephemeral range (and above the privileged ports), or above it
  spans = [(lo, hi) for lo, hi in ((1024, first - n), (last + 1, 65536 - n)) if lo <= hi]
  if not spans:
    raise RuntimeError(f"the kernel's ephemeral ports {first}-{last} ({EPHEMERAL_RANGE_FILE}) leave no run of {n}")
  for _ in range(100):
    lo, hi = rng.choices(spans, weights=[hi - lo + 1 for lo, hi in spans])[0]
    base = rng.randint(lo, hi)
    if all(_is_free(base + i) for i in range(n)):
      return base
  raise RuntimeError(f"no run of {n} free loopback ports outside the ephemeral range {first}-{last}")


def _is_free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def _die_with_parent() -> None:
  """In a child: killed when the supervisor ends, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
  if sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
  # A session of its own: a Ctrl-C at the terminal reaches the supervisor only, which stops the children in order.
  return subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=_die_with_parent)


def _stop(proc: subprocess.Popen | None, wait_s: float) -> None:
  if proc is None or proc.poll() is not None:
    return
  proc.terminate()
  try:
    proc.wait(wait_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


def call(method: str, url: str, key: str | None = None, body: Any = None, timeout: float = 5.0) -> Any:
  """One HTTP request; the JSON reply. Raises OSError (urllib's errors among them) when it fails."""
  headers = {"Content-Type": "application/json"}
  if key:
    headers["Authorization"] = f"Bearer {key}"
  data = None if body is None else json.dumps(body).encode()
  with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=timeout) as r:
    return json.loads(r.read() or b"null")


@dataclasses.dataclass
class Engine:
  index: int
  url: str
  proc: subprocess.Popen | None = None
  version: Any = None  # the weight version its /health reported last
  failures: int = 0  # /health failures running
  retry_at: float = 0.0  # a failed restart is tried again from then on


@dataclasses.dataclass(frozen=True)
class RouterOptions:
  policy: str = "cache_aware"  # sglang-router's: cache_aware, manual (X-SMG-Routing-Key), round_robin, random
  health_every: int = 5  # seconds between the router's health checks of an engine
  start_timeout: float = 900.0  # seconds an engine may take to start and warm up
  router_args: str = ""  # more sglang-router flags, as on its command line


class Fleet:
  """N engines and the router in front of them: start, supervise (`check`, once a second), stop. engine_argv(port):
  the command line of an engine serving on 127.0.0.1:port (called again for each restart, so it may name the newest
  weights)."""

  def __init__(
    self,
    engine_argv: Callable[[int], list[str]],
    n: int,
    host: str,
    port: int,
    key: str | None,
    options: RouterOptions = RouterOptions(),
  ):
    self.engine_argv, self.options = engine_argv, options
    self.host, self.port, self.key = host, port, key
    self.engines = [Engine(i, f"http://127.0.0.1:{port + 1 + i}") for i in range(n)]
    self.router: subprocess.Popen | None = None
    self.router_url = f"http://127.0.0.1:{port}"
    self.engine_env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    self.router_env = dict(self.engine_env, **({API_KEY_ENV: key} if key else {}))

  # ---- engines

  def launch(self, e: Engine) -> None:
    port = urllib.parse.urlsplit(e.url).port
    e.proc = _spawn(self.engine_argv(port), self.engine_env)
    e.failures = 0

  def wait_ready(self, e: Engine) -> None:
    """Waits for the engine's /health and warms it: one generation compiles its steps before traffic comes. Its
    weight version is what it loaded (engine_argv's weights), never relabelled: a name given to other weights would
    make the trainer's staleness accounting wrong."""
    deadline = time.time() + self.options.start_timeout
    while True:
      if e.proc.poll() is not None:
        raise ChildProcessError(f"engine {e.index} ({e.url}) exited with code {e.proc.returncode} while starting")
      if time.time() > deadline:
        raise TimeoutError(f"engine {e.index} ({e.url}) did not answer /health in {self.options.start_timeout} s")
      try:
        e.version = call("GET", f"{e.url}/health")["weight_version"]
        break
      except OSError:
        time.sleep(0.5)
    call("GET", f"{e.url}/health_generate", timeout=self.options.start_timeout)

  def restart(self, e: Engine, why: str) -> None:
    logging.warning("engine %d (%s) %s: taking it out of the router and restarting it", e.index, e.url, why)
    self.remove_worker(e.url)
    _stop(e.proc, 5)
    try:
      self.launch(e)
      self.wait_ready(e)
      self.add_worker(e.url)
    except OSError as err:  # it exited, an HTTP call failed, or it timed out
      logging.error("engine %d (%s) did not come back (%s); trying again in 10 s", e.index, e.url, err)
      _stop(e.proc, 5)
      e.retry_at = time.time() + 10
      return
    logging.info(
      "engine %d (pid %d) is back in the router: %s, weight version %s", e.index, e.proc.pid, e.url, e.version
    )

  # ---- the router

  def start_router(self, urls: list[str]) -> None:
    n = len(self.engines)
    args = [
      *("--worker-urls", *urls),
      *("--host", self.host, "--port", str(self.port), "--policy", self.options.policy),
      *("--health-check-interval-secs", str(self.options.health_every), "--health-check-timeout-secs", "5"),
      *("--health-failure-threshold", "2", "--health-success-threshold", "1"),
      *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.port + n + 1)),
      *("--shutdown-grace-period-secs", str(ROUTER_GRACE_S), "--log-level", "warn"),
      *shlex.split(self.options.router_args),
    ]
    self.router = _spawn([sys.executable, "-c", ROUTER_MAIN, *args], self.router_env)
    deadline = time.time() + 120
    while len(self.healthy_workers()) < len(urls):
      if self.router.poll() is not None:
        raise ChildProcessError(f"the router exited with code {self.router.returncode} (its log is above)")
      if time.time() > deadline:
        raise TimeoutError(f"the router did not list {urls} as healthy in 120 s")
      time.sleep(0.5)

  def workers(self) -> list[dict]:
    try:
      return call("GET", f"{self.router_url}/workers", self.key)["workers"]
    except OSError:
      return []

  def healthy_workers(self) -> list[str]:
    return [w["url"] for w in self.workers() if w["is_healthy"]]

  def remove_worker(self, url: str) -> None:
    for w in self.workers():
      if w["url"] == url:
        try:
          call("DELETE", f"{self.router_url}/workers/{w['id']}", self.key)
        except OSError as err:
          logging.warning("the router did not remove %s: %s", url, err)

  def add_worker(self, url: str) -> None:
    call("POST", f"{self.router_url}/workers", self.key, {"url": url})  # queued: 202
    deadline = time.time() + 60
    while url not in self.healthy_workers():
      if time.time() > deadline:
        raise TimeoutError(f"the router did not list {url} as healthy in 60 s")
      time.sleep(0.2)

  # ---- the whole

  def start(self) -> None:
    for e in self.engines:  # started together: their checkpoints load at once
      self.launch(e)
    for e in self.engines:
      self.wait_ready(e)
      logging.info("engine %d (pid %d) is up: %s, weight version %s", e.index, e.proc.pid, e.url, e.version)
    self.start_router([e.url for e in self.engines])

  def check(self) -> None:
    """One round of supervision: each engine's process and /health, the weight version it serves, the router."""
    for e in self.engines:
      if time.time() < e.retry_at:
        continue
      if e.proc is None or e.proc.poll() is not None:
        self.restart(e, f"exited (code {None if e.proc is None else e.proc.returncode})")
        continue
      try:
        version = call("GET", f"{e.url}/health")["weight_version"]
      except OSError:
        e.failures += 1
        if e.failures >= FAILURES:
          self.restart(e, f"failed /health {e.failures} times running")
        continue
      e.failures = 0
      e.version = version  # a trainer's /update_weights may have changed it
    if self.router.poll() is not None:
      logging.warning("the router exited (code %d); starting it again", self.router.returncode)
      self.start_router([e.url for e in self.engines if e.proc is not None and e.proc.poll() is None])

  def stop(self) -> None:
    _stop(self.router, ROUTER_GRACE_S + 5)
    for e in self.engines:
      if e.proc is not None and e.proc.poll() is None:
        e.proc.terminate()
    for e in self.engines:
      _stop(e.proc, 30)
