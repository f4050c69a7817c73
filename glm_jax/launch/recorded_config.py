"""A run's recorded config as a config file: the config its checkpoint (or packed model) saved, for overrides.

  bash scripts/with_env.sh python launch/sample.py --config=launch/recorded_config.py:workdirs/grpo_tiny \
      --config.model.attention_impl=pallas

launch/sample.py and launch/quantize.py load it themselves when given --config.* overrides without --config (from
--packed's directory when given, else --workdir's); glm_jax/restore.py reads the record.
"""

from glm_jax import restore


def get_config(source: str = ""):
  return restore.get_config(source)
