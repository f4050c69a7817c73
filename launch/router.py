r"""Serves a run's model from N engine processes behind SGLang's router (the `sglang-router` package, the router slime
fronts its SGLang engines with), and keeps them up.

  pip install sglang-router   # 0.3.2 was used
  python launch/router.py --config=configs/glm5_tiny.py --workdir=workdirs/glm5_tiny --engines=2 [--port=8000]
  curl localhost:8000/generate -H 'Content-Type: application/json' \
      -d '{"text": "In the beginning", "sampling_params": {"max_new_tokens": 32}}'

Every engine is a launch/serve.py on 127.0.0.1 at --port + 1 + i, given --config (with the --config.* overrides of
this command line), --workdir and --engine_flags (its other flags: --engine_flags="--pages=512 --max_running=32");
--host, --port and --api_key are the router's (a non-loopback --host needs the key, as for serve.py). The engines,
on loopback, take no key: the router's guards the way in. The
router's Prometheus metrics are on 127.0.0.1 at --port + N + 1. It proxies SGLang's /generate and OpenAI's
/v1/completions and /v1/chat/completions; a trainer's POST /update_weights goes to each engine.

--policy=cache_aware (the router's default) sends a request to the engine whose prefix tree matches its text (or
input_ids) best while the engines' loads stay within its thresholds, so a conversation, whose every turn extends the
last, keeps to one engine and its prefix cache; --policy=manual keeps each value of the X-SMG-Routing-Key header on
one engine (a session id); round_robin and random ignore the text. More router flags: --router_args="--cache-threshold
0.5 ...".

The supervisor: an engine whose process ends, or whose /health fails 3 times running, is taken out of the router
(DELETE /workers/<id>), started again (it restores the workdir's latest checkpoint), warmed with one generation
(GET /health_generate: its first compile), set to the weight version the engines last reported (POST /update_weights
with {"weight_version": ...} when its checkpoint's step is not that) and put back (POST /workers). The router
retries a request whose engine fails before answering (connection refused or reset, 5xx: up to 5 tries) on another
one, so a non-streamed request in flight on an engine that dies is answered by another; a stream cut off midway
ends without its [DONE] (the client sees the body end early). A router that exits is started again. SIGTERM or
SIGINT stops the router, then the engines, and exits with 128 + the signal's number.
"""

import ctypes
import dataclasses
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Any

from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli
from glm_jax.serving.server import is_loopback
from glm_jax.train.config import invalid
from glm_jax.train.lifecycle import Stopped

# Parsed here too, so that a bad --config.* override fails before any engine starts.
_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: workdirs/<config name>).")
_ENGINE_FLAGS = flags.DEFINE_string("engine_flags", "", "launch/serve.py's other flags, for every engine.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "The router's interface; not a loopback one without an API key.")
_PORT = flags.DEFINE_integer("port", 8000, "The router's port; the engines take the next ones.")
_API_KEY = flags.DEFINE_string(
  "api_key", None, "Requests must send 'Authorization: Bearer <key>' (env GLM_JAX_API_KEY)."
)
_ENGINES = flags.DEFINE_integer("engines", 2, "Engine processes (launch/serve.py) behind the router.")
_POLICY = flags.DEFINE_enum(
  "policy", "cache_aware", ["cache_aware", "manual", "round_robin", "random"], "The router's load balancing policy."
)
_ROUTER_ARGS = flags.DEFINE_string("router_args", "", "More sglang-router flags, as on its command line.")
_HEALTH_EVERY = flags.DEFINE_integer("health_every", 5, "Seconds between the router's health checks of an engine.")
_START_TIMEOUT = flags.DEFINE_integer("start_timeout", 900, "Seconds an engine may take to start and warm up.")

API_KEY_ENV = "GLM_JAX_API_KEY"  # launch/serve.py's
FAILURES = 3  # /health failures running before an engine that still runs is restarted
ROUTER_GRACE_S = 5  # the router's wait for requests in flight when it stops
# The router's entry point, the API key (if any) read from the environment rather than the command line (ps shows it).
ROUTER_MAIN = (
  "import os, sys; from sglang_router.launch_router import main; "
  f"key = os.environ.get({API_KEY_ENV!r}); sys.argv += ['--api-key', key] if key else []; main()"
)


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


def engine_args(argv: list[str]) -> list[str]:
  """launch/serve.py's flags for every engine: --config with this command line's overrides, --workdir, and
  --engine_flags."""
  args = [f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}"]
  args += [a for a in argv[1:] if a.startswith("--config.")]
  if _WORKDIR.value:
    args.append(f"--workdir={_WORKDIR.value}")
  return args + shlex.split(_ENGINE_FLAGS.value)


@dataclasses.dataclass
class Engine:
  index: int
  url: str
  proc: subprocess.Popen | None = None
  version: Any = None  # the weight version its /health reported last
  failures: int = 0  # /health failures running
  retry_at: float = 0.0  # a failed restart is tried again from then on


class Fleet:
  """N engines and the router in front of them: start, supervise (`check`, once a second), stop."""

  def __init__(self, argv: list[str], n: int, host: str, port: int, key: str | None):
    self.serve_args = [sys.executable, os.path.join(os.path.dirname(__file__), "serve.py"), *engine_args(argv)]
    self.host, self.port, self.key = host, port, key
    self.engines = [Engine(i, f"http://127.0.0.1:{port + 1 + i}") for i in range(n)]
    self.router: subprocess.Popen | None = None
    self.router_url = f"http://127.0.0.1:{port}"
    self.version: Any = None  # the weight version the engines serve (the newest one an engine reported)
    self.engine_env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    self.router_env = dict(self.engine_env, **({API_KEY_ENV: key} if key else {}))

  # ---- engines

  def launch(self, e: Engine) -> None:
    port = urllib.parse.urlsplit(e.url).port
    e.proc = _spawn([*self.serve_args, "--host=127.0.0.1", f"--port={port}"], self.engine_env)
    e.failures = 0

  def wait_ready(self, e: Engine, version: Any = None) -> None:
    """Waits for the engine's /health, gives it `version` (the weight version the others serve, when its
    checkpoint's step is not that name: POST /update_weights reloads the checkpoint under that name), then warms it:
    one generation compiles its steps before traffic comes."""
    deadline = time.time() + _START_TIMEOUT.value
    while True:
      if e.proc.poll() is not None:
        raise ChildProcessError(f"engine {e.index} ({e.url}) exited with code {e.proc.returncode} while starting")
      if time.time() > deadline:
        raise TimeoutError(f"engine {e.index} ({e.url}) did not answer /health in {_START_TIMEOUT.value} s")
      try:
        e.version = call("GET", f"{e.url}/health")["weight_version"]
        break
      except OSError:
        time.sleep(0.5)
    if version is not None and e.version != version:
      call("POST", f"{e.url}/update_weights", body={"weight_version": version}, timeout=_START_TIMEOUT.value)
      e.version = version
    call("GET", f"{e.url}/health_generate", timeout=_START_TIMEOUT.value)

  def restart(self, e: Engine, why: str) -> None:
    logging.warning("engine %d (%s) %s: taking it out of the router and restarting it", e.index, e.url, why)
    self.remove_worker(e.url)
    _stop(e.proc, 5)
    try:
      self.launch(e)
      self.wait_ready(e, self.version)
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
      *("--host", self.host, "--port", str(self.port), "--policy", _POLICY.value),
      *("--health-check-interval-secs", str(_HEALTH_EVERY.value), "--health-check-timeout-secs", "5"),
      *("--health-failure-threshold", "2", "--health-success-threshold", "1"),
      *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.port + n + 1)),
      *("--shutdown-grace-period-secs", str(ROUTER_GRACE_S), "--log-level", "warn"),
      *shlex.split(_ROUTER_ARGS.value),
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
    self.version = self.engines[0].version
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
      if version != e.version:  # new weights (a trainer's /update_weights): what a restarted engine gets
        e.version = self.version = version
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


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if importlib.util.find_spec("sglang_router") is None:
    raise ValueError("the router is the sglang-router package: pip install sglang-router")
  key = _API_KEY.value or os.environ.get(API_KEY_ENV) or None
  host, port = _HOST.value, _PORT.value
  if not is_loopback(host) and key is None:
    invalid(
      "--host",
      host,
      f"is not a loopback address: serving beyond this machine needs an API key (--api_key or {API_KEY_ENV})",
    )
  if _ENGINES.value < 1:
    invalid("--engines", _ENGINES.value, "must be at least 1")
  if not (1 <= port and port + _ENGINES.value + 1 < 65536):
    invalid("--port", port, f"and the {_ENGINES.value + 1} ports after it must be in [1, 65535]")
  fleet = Fleet(sys.argv, _ENGINES.value, host, port, key)
  stop_signal = []

  def on_signal(signum, frame):
    stop_signal.append(signum)
    raise KeyboardInterrupt  # out of whatever wait it is in

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    fleet.start()
    logging.info(
      "router on http://%s:%d (%s) in front of %s", host, port, _POLICY.value, [e.url for e in fleet.engines]
    )
    while True:
      time.sleep(1)
      fleet.check()
  except KeyboardInterrupt:
    if not stop_signal:
      raise
  finally:
    for s in previous:  # a second signal while stopping does not interrupt the stop
      signal.signal(s, signal.SIG_IGN)
    fleet.stop()
    for s, handler in previous.items():
      signal.signal(s, handler)
  name = signal.Signals(stop_signal[0]).name
  raise Stopped(stop_signal[0], f"stopped by {name}: the router and its {_ENGINES.value} engines are shut down")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
