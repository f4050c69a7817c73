"""Weights handed to engines by directory (glm_jax/serving/weights.py) and the RL run's checks of rollouts through the
engines (rl.rollout_server, glm_jax/rl/config.py)."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
import glm_jax.configs.grpo_tiny
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import config as rl_config
from glm_jax.serving.weights import ARRAYS, META, load_weights, save_weights


@pytest.fixture(scope="module")
def tiny():
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  return cfg, *nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)


def test_a_weights_directory_loads_back_bit_for_bit(tiny, tmp_path):
  cfg, graphdef, params, rest = tiny
  path = save_weights(str(tmp_path / "w"), params, rest, cfg, version=7, tokenizer={"kind": "char"})
  assert sorted(os.listdir(path)) == sorted([META, ARRAYS]) and not os.path.exists(path + f".tmp{os.getpid()}")
  meta, graphdef2, params2, rest2 = load_weights(path, cfg)
  assert meta["version"] == 7 and meta["tokenizer"] == {"kind": "char"} and graphdef2 == graphdef
  for a, b in ((params, params2), (rest, rest2)):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_bad_weights_directories_are_named(tiny, tmp_path):
  cfg, _, params, rest = tiny
  with pytest.raises(FileNotFoundError, match="no meta.json there"):
    load_weights(str(tmp_path / "missing"), cfg)
  path = save_weights(str(tmp_path / "w"), params, rest, cfg, version=1, tokenizer={"kind": "char"})
  with pytest.raises(ValueError, match=r"holds another model than the engine serves: \{'hidden_size': \(32, 64\)\}"):
    load_weights(path, cfg.replace(hidden_size=32))
  with open(os.path.join(path, META)) as f:
    meta = json.load(f)
  meta["model"]["moe_intermediate_size"] = 16  # the arrays are the 32-wide experts'
  with open(os.path.join(path, META), "w") as f:
    json.dump(meta, f)
  # the first array that differs: the 2 MoE layers' 8 experts' down projections, [2, 8, I, D] with I = 32 in the file
  want = r"params/moe_layers/mlp/down_proj is float32\[2, 8, 32, 64\], the model's float32\[2, 8, 16, 64\]"
  with pytest.raises(ValueError, match=want):
    load_weights(path)


def test_rollouts_through_the_engines_are_checked_by_name():
  def config(**rl):
    c = glm_jax.configs.grpo_tiny.get_config()
    c.rl.update(dict(async_rollouts=True, rollout_server=True) | rl)
    return c

  rl_config.validate_rl_config(config())
  rl_config.validate_rl_config(config(async_rollouts=False))  # a rollout a step, from the step's weights
  for changes, message in (
    ({"rollout_process": True}, r"rl.rollout_process=True is invalid; with rl.rollout_server=True: one rollout"),
    ({"speculate": 2}, r"rl.speculate=2 is invalid; with rl.rollout_server=True: .* without MTP drafts"),
    ({"rollout_engines": 0}, r"rl.rollout_engines=0 is invalid; must be a positive integer"),
    ({"rollout_max_running": True}, r"rl.rollout_max_running=True is invalid; must be a positive integer"),
  ):
    with pytest.raises(ValueError, match=message):
      rl_config.validate_rl_config(config(**changes))
