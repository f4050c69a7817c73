r"""Pretrains GLM-5 from a config; resumes from --workdir's latest checkpoint.

  python launch/train.py --config=configs/glm5_tiny.py                 # the embedded corpus, on CPU
  python launch/train.py --config=configs/glm5_tiny.py --workdir=/tmp/run1 \
      --config.train.steps=50 --config.optimizer.lr=3e-3 --config.train.dsa_stage=warmup

Any config field can be overridden as --config.<section>.<field>=value; an unknown field is an error.
Metrics go to <workdir>/metrics.jsonl and <workdir>/tensorboard, checkpoints to <workdir>/checkpoints.
The run ends by printing one JSON line: eval_loss and unigram_entropy (nats per token), step, and more.
"""

import json

from absl import app, flags, logging
from ml_collections import config_flags

from glm_jax.train.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: workdirs/<config name>).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO; -v 0 brings it back
  config = _CONFIG.value
  workdir = _WORKDIR.value or f"workdirs/{config.get('name', 'run')}"
  print(json.dumps(train_and_evaluate(config, workdir)), flush=True)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
