r"""Prints text sampled from a training run's latest checkpoint.

  python launch/sample.py --config=configs/glm5_tiny.py --workdir=workdirs/glm5_tiny \
      --prompt="In the beginning" --max_new_tokens=64 --temperature=0.8

--config must be the run's config (with the same overrides), so the model and tokenizer match. Decoding
uses the KV-cache sampler (glm_jax/inference/sampler.py): one prefill, then one compiled decode step a token.
"""

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from glm_jax import data as data_lib
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.trainer import create_train_state

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: workdirs/<config name>).")
_PROMPT = flags.DEFINE_string("prompt", "In the beginning", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens with this much probability.")
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
  prompt = tokenizer.encode(_PROMPT.value) or [tokenizer.eos_id]
  try:
    sampling = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                              stop_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
    out = Sampler(graphdef, model_cfg, sampling)(state.params, state.rest, [prompt], jax.random.key(_SEED.value))
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  print(f"[step {step}] " + tokenizer.decode(np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist()))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
