r"""Serves a run's model from N engine processes behind SGLang's router (the `sglang-router` package, the router slime
fronts its SGLang engines with), and keeps them up.

  pip install sglang-router   # 0.3.2 was used
  bash scripts/with_env.sh python launch/router.py --config=configs/glm5_tiny.py --workdir=workdirs/glm5_tiny \
      --engines=2 [--port=8000]
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

The supervisor (glm_jax/serving/fleet.py): an engine whose process ends, or whose /health fails 3 times running, is
taken out of the router, started again (it restores the workdir's latest checkpoint, and reports that checkpoint's
step as its weight version), warmed with one generation and put back; the router retries a non-streamed request whose
engine died on another one. SIGTERM or SIGINT stops the router, then the engines, and exits with 128 + the signal's
number.
"""

import importlib.util
import os
import shlex
import signal
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli

cli.require_extra("serve", "fastapi", "uvicorn", "httpx", "sglang_router")

from glm_jax.serving.fleet import API_KEY_ENV, Fleet, RouterOptions  # noqa: E402
from glm_jax.serving.server import is_loopback  # noqa: E402
from glm_jax.train.config import invalid  # noqa: E402
from glm_jax.train.lifecycle import Stopped  # noqa: E402

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


def engine_args(argv: list[str]) -> list[str]:
  """launch/serve.py's flags for every engine: --config with this command line's overrides, --workdir, and
  --engine_flags."""
  args = [f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}"]
  args += [a for a in argv[1:] if a.startswith("--config.")]
  if _WORKDIR.value:
    args.append(f"--workdir={_WORKDIR.value}")
  return args + shlex.split(_ENGINE_FLAGS.value)


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
  serve = [sys.executable, os.path.join(os.path.dirname(__file__), "serve.py"), *engine_args(sys.argv)]
  options = RouterOptions(_POLICY.value, _HEALTH_EVERY.value, _START_TIMEOUT.value, _ROUTER_ARGS.value)
  fleet = Fleet(lambda p: [*serve, "--host=127.0.0.1", f"--port={p}"], _ENGINES.value, host, port, key, options)
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
