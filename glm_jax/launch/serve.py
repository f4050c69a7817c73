r"""Serves a run's model over HTTP: the serving engine (glm_jax/serving/engine.py) behind SGLang's native and OpenAI's
endpoints (glm_jax/serving/server.py), under uvicorn.

  bash scripts/with_env.sh python launch/serve.py --config=configs/glm5_tiny.py \
      --workdir=workdirs/glm5_tiny [--port=8000]
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "glm5_tiny", "prompt": "In the beginning", "max_tokens": 32}'

The model is the run's latest checkpoint (--config must be the run's config), or a packed
(quantized) model with --packed; text is encoded with the tokenizer the checkpoint records. The engine's page pool
and batch: --pages, --page_size, --max_running, --prefill_rows, --prefill_chunk, --max_seq_len, --decode_steps
(glm_jax/serving/engine_flags.py); --speculate=k drafts k tokens a round with the model's MTP layer (the same greedy
text, the same distribution sampled). `POST /update_weights` reloads the workdir's latest checkpoint (a trainer that
saved newer weights) and tags what follows with {"weight_version": ...} from the request's body (default: the
checkpoint's step).

The server binds to 127.0.0.1. Another --host (0.0.0.0: every interface) needs an API key, --api_key or the
GLM_JAX_API_KEY environment variable, which every request must then send as `Authorization: Bearer <key>`.
"""

import os

from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli

cli.require_extra("serve", "fastapi", "uvicorn")

import uvicorn  # noqa: E402

from glm_jax.serving import Engine, EngineConfig, engine_flags  # noqa: E402
from glm_jax.serving.server import EngineThread, ServerState, is_loopback, make_app  # noqa: E402
from glm_jax.train.config import check_values, invalid, model_config_for_stage  # noqa: E402
from glm_jax.train.packed_checkpoint import load_packed  # noqa: E402
from glm_jax.train.trainer import restore_run  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: workdirs/<config name>).")
_PACKED = flags.DEFINE_string("packed", None, "A packed (quantized) model's directory (launch/quantize.py).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind; not a loopback one without an API key.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string(
  "api_key", None, "Requests must send 'Authorization: Bearer <key>' (env GLM_JAX_API_KEY)."
)
_NAME = flags.DEFINE_string("model_name", None, "The model's name in the API (default: the config's name).")
_ENGINE = engine_flags.define(EngineConfig(prefill_chunk=64))
API_KEY_ENV = "GLM_JAX_API_KEY"


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  api_key = _API_KEY.value or os.environ.get(API_KEY_ENV) or None
  if not is_loopback(_HOST.value) and api_key is None:
    invalid(
      "--host",
      _HOST.value,
      f"is not a loopback address: serving beyond this machine needs an API key (--api_key or {API_KEY_ENV})",
    )
  if not 1 <= _PORT.value < 65536:
    invalid("--port", _PORT.value, "must be in [1, 65535]")
  config = _CONFIG.value
  check_values(config)
  engine_config = _ENGINE()
  workdir = _WORKDIR.value or f"workdirs/{config.get('name', 'run')}"
  load_weights = None
  if _PACKED.value:
    from glm_jax.data import Tokenizer

    packed = load_packed(_PACKED.value, model_config_for_stage(config), need_tokenizer=True)
    tokenizer, version = Tokenizer.from_record(packed.tokenizer), packed.meta["source"]["step"]
    graphdef, model_cfg, params, rest = packed.graphdef, packed.model_cfg, packed.params, packed.rest
  else:
    run = restore_run(config, workdir)
    tokenizer, version = run.tokenizer, run.step
    graphdef, model_cfg, params, rest = run.graphdef, run.model_cfg, run.state.params, run.state.rest

    def load_weights(body: dict):
      new = restore_run(config, workdir)
      return new.state.params, new.state.rest, body.get("weight_version", new.step)

  engine_config.check(model_cfg)
  engine = Engine(graphdef, params, rest, model_cfg, engine_config, version=version)
  name = _NAME.value or config.get("name", "glm-jax")
  state = ServerState(EngineThread(engine), tokenizer, name, api_key=api_key, load_weights=load_weights)
  logging.info("serving %s (weight version %s) on http://%s:%d", name, version, _HOST.value, _PORT.value)
  try:
    uvicorn.run(make_app(state), host=_HOST.value, port=_PORT.value, log_level="info")
  finally:
    state.engine.stop()


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
