"""Any run's latest weights, with the config and the tokenizer it recorded, for sampling and packing.

  run = restore.load_run("workdirs/grpo_tiny")          # the config and tokenizer the checkpoint recorded
  run = restore.load_run(workdir, config)                # a config of one's own: its model must be the run's
  params = restore.served_params(run.config, run.params)  # as its trainer evaluates them (packed under QAT)
  model = restore.load_packed_model("workdirs/tiny_w4a8")  # launch/quantize.py's output, with its config

It reads <workdir>/checkpoints/<step>/ of every run this codebase writes (glm_jax/train/checkpoint.py): pretraining
and SFT, GRPO and distillation (a CharVocab's record or, agentic, the model's tokenizer), converted checkpoints, a
distillation's teachers (<workdir>/teachers/<name>) and an RL run's warm start (<workdir>/init); only the weights
(params and rest), onto one device, from the newest step that restores. The model sampled: a config with train and
data sections gives its DSA stage's model (model_config_for_stage: DSA in the sparse stage only), any other its model
section as it is; under a weight-only quant section trained with QAT, served_params packs the weights, which computes
the QAT forward's logits. A config of one's own must describe the same model: its model section compared field by
field and, but for a converted checkpoint, train.dsa_stage; fields that do not change the parameters
(model.attention_impl, model.index_topk) may differ. `--config.x=v` overrides of the recorded config:
config_file_argv rewrites a launch script's command line to load it as a config file (launch/recorded_config.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import ml_collections
from absl import logging
from flax import nnx

from glm_jax.data import Tokenizer, check_vocab, load_tokenizer
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model.quantization import default_quant_config, pack_params, quant_plan
from glm_jax.quant.packed import read_meta
from glm_jax.rl.tasks import CharVocab
from glm_jax.train.checkpoint import INIT_FROM_FREE_FIELDS, Checkpointer, describe_tokenizer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.packed_checkpoint import is_packed, load_packed


@dataclasses.dataclass(frozen=True)
class Run:
  """A run's latest weights, as load_run returns them (params unquantized: served_params packs them under QAT)."""

  step: int
  config: ml_collections.ConfigDict  # the recorded config, or the one given
  model_cfg: ModelConfig
  graphdef: Any
  params: Any
  rest: Any
  tokenizer: Tokenizer | CharVocab


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The model a config samples (module docstring): its DSA stage's for a pretraining or SFT config, else its model."""
  if "train" in config and "data" in config:
    return model_config_for_stage(config)
  return ModelConfig.from_dict(config.model)


def tokenizer_from_record(record: dict | None, where: str, config: ml_collections.ConfigDict) -> Tokenizer | CharVocab:
  """The tokenizer a checkpoint or a packed model recorded: a tokenizers JSON or a CharVocab (the tasks' vocabulary);
  without a record (a checkpoint saved before runs recorded one), config.data's, else the tasks' CharVocab for an RL
  config."""
  if record is None:
    logging.warning("%s records no tokenizer (saved before runs recorded one); using its config's", where)
    if "data" in config:
      return load_tokenizer(config.data)
    if "rl" in config and config.rl.get("tokenizer", "") != "model":
      return CharVocab()
    raise ValueError(f"{where} records no tokenizer and its config has no data section to build one from")
  if "json" in record:
    return Tokenizer.from_record(record)
  try:
    return CharVocab.from_record(record)
  except ValueError as e:
    raise ValueError(f"{where}: the recorded tokenizer {describe_tokenizer(record)} cannot be rebuilt ({e})") from e


def _open_run(workdir: str, field: str) -> Checkpointer:
  """A read-only Checkpointer of `workdir` once it is known to hold a complete step; else an error naming the flag."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  valid = "give a run's directory: launch/train.py's --workdir or launch/convert.py's --out_dir"
  init = os.path.join(workdir, "init")
  if os.path.isdir(os.path.join(init, "checkpoints")):  # an RL run before its first checkpoint: its warm start
    valid += f" ({init} holds this run's warm start: {field}={init})"
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{field}={workdir}: no checkpoints directory ({directory} does not exist); {valid}")
  checkpointer = Checkpointer(workdir, read_only=True)
  if not checkpointer.steps():
    checkpointer.close()
    raise FileNotFoundError(
      f"{field}={workdir}: no complete checkpoint in {directory} (a run stopped before its first save has none); "
      + valid
    )
  return checkpointer


def _recorded_config(checkpointer: Checkpointer, workdir: str, field: str) -> ml_collections.ConfigDict:
  """The config the newest step with a readable one recorded."""
  for step in checkpointer.steps():
    try:
      config = checkpointer.recorded_config(step)
    except Exception:  # noqa: BLE001 - an unreadable step: the one before it (as restore_latest_weights does)
      continue
    if config is None:
      raise ValueError(
        f"{field}={workdir}: step {step} records no config (written before checkpoints recorded one); pass the "
        "run's --config"
      )
    return ml_collections.ConfigDict(config)
  raise ValueError(
    f"{field}={workdir}: no step of {checkpointer.directory} has a readable config; pass the run's --config"
  )


def recorded_config(workdir: str, field: str = "--workdir") -> ml_collections.ConfigDict:
  """The config the newest readable step of `workdir` recorded."""
  with _open_run(workdir, field) as checkpointer:
    return _recorded_config(checkpointer, workdir, field)


def load_run(
  workdir: str,
  config: ml_collections.ConfigDict | None = None,
  *,
  check: Callable[[ml_collections.ConfigDict], None] | None = None,
  field: str = "--workdir",
) -> Run:
  """The latest weights of `workdir` (any run; module docstring) with its tokenizer, under `config` (None: the
  recorded config; else checked against it). `check` is called with the config before any weight is read."""
  with _open_run(workdir, field) as checkpointer:
    if config is None:
      config = _recorded_config(checkpointer, workdir, field)
    else:  # restore_run's comparison, less the optimizer (only the weights are read)
      weights_only = checkpointer.weights_only(checkpointer.steps()[0])
      checkpointer.check_compatible(
        config.to_dict(),
        sections=("model",),
        train_fields=() if weights_only else ("dsa_stage",),
        free=INIT_FROM_FREE_FIELDS,
      )
    if check is not None:
      check(config)
    cfg = model_config(config)
    record = checkpointer.recorded_tokenizer(checkpointer.steps()[0])
    tokenizer = tokenizer_from_record(record, f"{field}={workdir}", config)
    check_tokenizer(tokenizer, cfg)
    graphdef, params, rest = abstract_model(cfg)
    step, (params, rest) = checkpointer.restore_latest_weights(params, rest)
  return Run(step, config, cfg, graphdef, params, rest, tokenizer)


def check_tokenizer(tokenizer: Tokenizer | CharVocab, cfg: ModelConfig) -> None:
  """ValueError when the tokenizer has ids the model cannot read or write."""
  if isinstance(tokenizer, CharVocab):
    tokenizer.check_model_vocab(cfg.vocab_size)
  else:
    check_vocab(tokenizer, cfg.vocab_size)


def abstract_model(cfg: ModelConfig):
  """(graphdef, params, rest) of the model, as ShapeDtypeStructs: the target weights are read onto."""
  return nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param, ...)


def qat_section(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict | None:
  """The quant section a run trained with (its library defaults under it), or None when it has none or 'none'."""
  if "quant" not in config or config.quant.get("scheme", "none") == "none":
    return None
  q = default_quant_config()
  q.update(config.quant.to_dict())
  return q


def served_params(config: ml_collections.ConfigDict, params):
  """The weights as the run's trainer evaluates them: packed by its quant section (QAT), else as they are."""
  q = qat_section(config)
  return params if q is None else pack_params(params, quant_plan(params, q))


@dataclasses.dataclass(frozen=True)
class PackedRun:
  """A packed model (launch/quantize.py) with the config and tokenizer it recorded."""

  step: int
  scheme: str
  config: ml_collections.ConfigDict
  model_cfg: ModelConfig
  graphdef: Any
  params: Any  # packed
  rest: Any
  tokenizer: Tokenizer | CharVocab


def packed_config(directory: str, field: str = "--packed") -> ml_collections.ConfigDict:
  """The config a packed model recorded (its source run's)."""
  try:
    meta = read_meta(directory)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"{field}={directory}: {e}") from e
  return ml_collections.ConfigDict(meta["config"])


def load_packed_model(
  directory: str,
  config: ml_collections.ConfigDict | None = None,
  *,
  check: Callable[[ml_collections.ConfigDict], None] | None = None,
  field: str = "--packed",
) -> PackedRun:
  """The packed model of `directory` under `config` (None: the recorded one; else its model must be the packed one's,
  which load_packed checks). `check` is called with the config before any weight is read."""
  recorded = packed_config(directory, field)  # a directory that holds no packed model is named by its flag
  config = recorded if config is None else config
  if check is not None:
    check(config)
  cfg = model_config(config)
  packed = load_packed(directory, cfg)
  if packed.tokenizer is None:
    raise ValueError(
      f"{field}={directory}: the packed model records no tokenizer (packed.json's 'tokenizer' is null); decoding text "
      "needs the tokenizer its run recorded: pack a run whose checkpoint records one"
    )
  tokenizer = tokenizer_from_record(packed.tokenizer, f"{field}={directory}", config)
  check_tokenizer(tokenizer, cfg)
  return PackedRun(
    packed.meta["source"]["step"],
    packed.meta["quant"]["scheme"],
    config,
    cfg,
    packed.graphdef,
    packed.params,
    packed.rest,
    tokenizer,
  )


def _flag_value(argv: list[str], name: str) -> str | None:
  """The last value absl would give --name in argv (--name=v, -name=v, --name v)."""
  value = None
  for i, arg in enumerate(argv):
    for prefix in (f"--{name}", f"-{name}"):
      if arg.startswith(prefix + "="):
        value = arg[len(prefix) + 1 :]
      elif arg == prefix and i + 1 < len(argv):
        value = argv[i + 1]
  return value


def config_file_argv(argv: list[str], config_file: str) -> list[str]:
  """argv with --config=<config_file>:<the run> added when it overrides --config.* fields without a --config: the
  run is --packed's directory when given, else --workdir's (launch/recorded_config.py loads its recorded config)."""
  if any(a in ("--config", "-config") or a.startswith(("--config=", "-config=")) for a in argv):
    return argv
  if not any(a.startswith(("--config.", "-config.")) for a in argv):
    return argv
  source = _flag_value(argv, "packed") or _flag_value(argv, "workdir") or ""
  return [argv[0], f"--config={config_file}:{source}", *argv[1:]]


def get_config(source: str) -> ml_collections.ConfigDict:
  """The recorded config of `source`: a packed model's directory, or a run's (launch/recorded_config.py)."""
  try:
    if not source:
      raise ValueError(
        "--config.* overrides without --config apply to the run's recorded config: give the run (--workdir, or "
        "--packed) or its --config"
      )
    return packed_config(source) if is_packed(source) else recorded_config(source)
  except (OSError, ValueError) as e:  # config_flags reports an OSError in one line (anything else with a traceback)
    raise OSError(str(e)) from e
