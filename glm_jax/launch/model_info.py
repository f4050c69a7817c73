r"""Sizes a config and, when it is small enough, runs it: one JSON line on stdout.

  bash scripts/with_env.sh python launch/model_info.py --config=configs/glm5_744b.py     # counts only (abstract shapes)
  bash scripts/with_env.sh python launch/model_info.py --config=configs/glm5_tiny.py --forward_tokens=128 \
      --config.model.index_topk=16

Prints {"config", "total", "active", "mtp"} (parameter counts, see glm_jax.model.param_counts) and, with
--forward_tokens > 0, the logits' shape, the mean next-token cross-entropy of the freshly initialized
model on random tokens (about ln(vocab_size)) and the wall time of the jit-compiled forward.
"""

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from glm_jax import cli, strict_json
from glm_jax.model import GlmMoeDsa, ModelConfig, param_counts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_FORWARD_TOKENS = flags.DEFINE_integer("forward_tokens", 0, "Run one forward pass over this many tokens.")
_MAX_FORWARD_PARAMS = 2e9


def main(argv):
  del argv
  config = _CONFIG.value
  cfg = ModelConfig.from_dict(config.model)
  info = {"config": config.get("name", "?"), **param_counts(cfg)}
  if _FORWARD_TOKENS.value > 0:
    if info["total"] > _MAX_FORWARD_PARAMS:
      raise app.UsageError(
        f"--forward_tokens: the model has {info['total']:.3e} parameters; forward passes "
        f"here are for configs under {_MAX_FORWARD_PARAMS:.0e}"
      )
    graphdef, state = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)))
    ids = jax.random.randint(jax.random.key(1), (1, _FORWARD_TOKENS.value), 0, cfg.vocab_size)

    @jax.jit
    def loss(state, ids):
      logits = nnx.merge(graphdef, state)(ids).logits
      logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
      return logits, -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    loss(state, ids)  # compile
    start = time.perf_counter()
    logits, value = jax.block_until_ready(loss(state, ids))
    info.update(
      logits_shape=list(logits.shape),
      init_loss=float(value),
      ln_vocab=float(jnp.log(cfg.vocab_size)),
      forward_seconds=round(time.perf_counter() - start, 4),
    )
  print(strict_json.dumps(info))


if __name__ == "__main__":
  cli.run(main)
