r"""Prints text sampled from a training run's latest checkpoint.

  python launch/sample.py --config=configs/glm5_tiny.py --workdir=workdirs/glm5_tiny \
      --prompt="In the beginning" --max_new_tokens=64 --temperature=0.8

--config must be the run's config (with the same overrides), so the model and tokenizer match. Decoding
re-runs the full forward over a fixed-size buffer each token (no KV cache; fine for small models).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from glm_jax import data as data_lib
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.trainer import create_train_state, model_config_for_stage

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: workdirs/<config name>).")
_PROMPT = flags.DEFINE_string("prompt", "In the beginning", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  workdir = _WORKDIR.value or f"workdirs/{config.get('name', 'run')}"
  model_cfg = model_config_for_stage(config)
  tokenizer = data_lib.load_tokenizer(config.data)
  data_lib.check_vocab(tokenizer, model_cfg.vocab_size)
  checkpointer = Checkpointer(workdir, save_every=1, keep=1)
  step = checkpointer.latest_step()
  if step is None:
    raise app.UsageError(f"--workdir={workdir}: no checkpoint found in {checkpointer.directory}")
  checkpointer.check_compatible(config.to_dict())
  graphdef, state, _, _ = create_train_state(config, model_cfg)
  state = checkpointer.restore(step, state)
  checkpointer.close()
  model = nnx.merge(graphdef, state.params, state.rest)

  prompt = tokenizer.encode(_PROMPT.value) or [tokenizer.eos_id]
  length = len(prompt) + _MAX_NEW.value
  if length > model_cfg.max_position_embeddings:
    raise app.UsageError(f"prompt + max_new_tokens = {length} > max_position_embeddings "
                         f"{model_cfg.max_position_embeddings}")

  @jax.jit
  def next_token(buffer, t, key):
    logits = model(buffer, compute_mtp=False).logits[0, t - 1]
    if _TEMPERATURE.value <= 0:
      return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / _TEMPERATURE.value).astype(jnp.int32)

  buffer = np.full((1, length), tokenizer.pad_id, np.int32)
  buffer[0, :len(prompt)] = prompt
  key = jax.random.key(_SEED.value)
  for t in range(len(prompt), length):
    key, sub = jax.random.split(key)
    token = int(next_token(jnp.asarray(buffer), t, sub))
    buffer[0, t] = token
    if token == tokenizer.eos_id:
      length = t + 1
      break
  print(f"[step {step}] " + tokenizer.decode(buffer[0, :length].tolist()))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
