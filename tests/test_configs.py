"""Every config under configs/ and each of its variants loads as `launch/train.py --config=...` loads it and passes
the checks its trainer makes before any work (glm_jax/sweep.py: load_config, check_config); configs/common.py's
sections are the library's defaults, and its variant parser names what is wrong."""

import glob
import importlib
import os

import pytest

from glm_jax.configs import common
from glm_jax import sweep
from glm_jax.model.config import ModelConfig
from glm_jax.rl.config import default_rl_config
from glm_jax.train.config import model_config_for_stage
from tests.helpers import ROOT

CONFIG_FILES = sorted(
  os.path.relpath(p, ROOT)
  for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
  if os.path.basename(p) not in ("__init__.py", "common.py")
)
# each config file with "" (no variant) and each of its VARIANTS
CASES = [
  (path, variant)
  for path in CONFIG_FILES
  for variant in (
    "",
    *getattr(importlib.import_module(f"glm_jax.configs.{os.path.basename(path)[:-3]}"), "VARIANTS", ()),
  )
]


def test_every_config_file_is_covered():
  names = {os.path.basename(p) for p in CONFIG_FILES}
  assert {"glm5_tiny.py", "glm5_744b.py", "glm5_744b_128k.py", "glm5_744b_200k.py", "grpo_tiny.py"} <= names
  assert ("configs/glm5_744b_200k.py", "warmup") in CASES and ("configs/glm5_tiny.py", "smoke") in CASES
  # every post-training config (RL, SFT, distillation) has a run of seconds
  for path in CONFIG_FILES:
    config = sweep.load_config(os.path.join(ROOT, path), [])
    if config.get("trainer", "pretrain") != "pretrain":
      assert (path, "smoke") in CASES, f"{path} ({config.trainer}) has no :smoke variant"


@pytest.mark.parametrize("path, variant", CASES, ids=[f"{os.path.basename(p)[:-3]}:{v}" for p, v in CASES])
def test_config_loads_and_passes_its_checks(path, variant):
  config = sweep.load_config(os.path.join(ROOT, path) + (f":{variant}" if variant else ""), [])
  sweep.check_config(config)
  model = ModelConfig.from_dict(config.model)
  assert set(config.model) == set(ModelConfig.defaults())  # every model field is there for a flag to override
  if config.get("trainer", "pretrain") in ("pretrain", "sft"):
    assert model_config_for_stage(config).num_hidden_layers == model.num_hidden_layers


def test_the_sections_are_the_library_defaults():
  assert ModelConfig.from_dict(common.model()) == ModelConfig()  # GLM-5 744B-A40B as released
  assert ModelConfig.from_dict(common.model(hidden_size=96)) == ModelConfig(hidden_size=96)
  assert common.rl(group_size=4).to_dict() == {**default_rl_config().to_dict(), "group_size": 4}
  with pytest.raises(
    ValueError,
    match=r"configs\.common\.model: unknown field\(s\) \['hiden_size'\]; valid fields: "
    r"\[.*'hidden_size'",
  ):
    common.model(hiden_size=96)


def test_a_none_default_takes_a_typed_flag():
  """Fields whose default is None (indexer_types, pad_token_id, ...) still take --config.model.<field>= values."""
  config = sweep.load_config(
    os.path.join(ROOT, "configs/glm5_tiny.py"), ["--config.model.indexer_types=FSF", "--config.model.pad_token_id=3"]
  )
  model = ModelConfig.from_dict(config.model)
  assert model.indexer_types == ("full", "shared", "full") and model.pad_token_id == 3


def test_variants_parse_names_and_typed_values():
  v = common.variants("smoke, steps=50,fast=true", "configs/x.py", ("long", "smoke"), steps=int, fast=bool)
  assert (v.long, v.smoke, v.steps, v.fast) == (False, True, 50, True)
  assert common.variants("", "configs/x.py", ("long",), steps=int).to_dict() == {"long": False, "steps": None}
  with pytest.raises(
    ValueError,
    match=r"configs/x\.py has no variant 'smok'; its variants: \['long', 'smoke'\], "
    r"and steps=<int>",
  ):
    common.variants("smok", "configs/x.py", ("long", "smoke"), steps=int)
  with pytest.raises(ValueError, match=r"configs/x\.py: variant 'steps=many': 'many' is not a valid int"):
    common.variants("steps=many", "configs/x.py", (), steps=int)
  with pytest.raises(
    ValueError,
    match=r"configs/glm5_tiny\.py has no variant 'tiny'; its variants: \['long', "
    r"'smoke'\]",
  ):
    sweep.load_config(os.path.join(ROOT, "configs/glm5_tiny.py:tiny"), [])
