"""The pretraining run's config: its sections, the `train` section's checks, and the model config of a DSA stage.

Everything here runs before any work starts, so a bad config stops a run with a message that names the field,
its value and what is valid, and touches nothing. `check_values` is the one check every section shares (no NaN or
infinity in any float field, every seed in [0, 2**32)); require_sections runs it on the whole config, first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from glm_jax.model import ModelConfig
from glm_jax.train.step import STAGES, xla_compiler_options


def default_train_config() -> ml_collections.ConfigDict:
  """Every field of the `train` section, with the values the shipped configs start from."""
  c = ml_collections.ConfigDict()
  c.steps = 600
  c.seed = 0
  c.dsa_stage = "dense"  # "dense" | "warmup" (indexer only, KL to dense attention) | "sparse" (top-k)
  c.init_from = ""  # a workdir whose latest checkpoint's weights start this run (e.g. dense -> warmup)
  c.allow_data_change = False  # resume a workdir under another data section or tokenizer (the data starts afresh)
  c.microbatches = 1  # gradient accumulation: the batch is split into this many parts
  c.grad_clip_norm = 1.0  # 0 = off
  c.mtp_loss_weight = 0.3  # GLM-4.5's weight early in training
  c.balance_loss_weight = 1e-4  # sequence-wise balance loss alpha
  c.indexer_loss_weight = 1.0  # the indexer KL in the sparse stage
  c.expert_bias_rate = 1e-3  # aux-loss-free bias update gamma (0 = off)
  c.loss_chunk = 0  # tokens of a row the LM / MTP head and loss take at a time (0 = all: [B, T, V] logits)
  c.embedding_grad_shrink = 1.0  # GLM-130B's EGS alpha (0.1 there): the embedding gets alpha x its gradient; 1 = off
  c.spike_factor = 3.0  # skip a step whose loss exceeds this x its running mean (0 = off)
  c.spike_min_steps = 50  # ... once this many steps have passed
  c.spike_ema = 0.99  # decay of that running mean
  c.max_consecutive_skips = 10  # stop the run (non-zero exit) after this many skipped steps in a row; 0 = never
  c.xla_flags = ""  # XLA:TPU flags for the step's compile, "--xla_name=value ..." (as LIBTPU_INIT_ARGS); TPU only
  c.log_every = 10
  c.eval_every = 200
  c.checkpoint_every = 200
  c.keep_checkpoints = 2
  c.async_checkpoints = True
  c.tensorboard = True
  return c


def require_sections(config: ml_collections.ConfigDict, needed: Sequence[str], purpose: str, example: str) -> None:
  """Raises ValueError naming the sections of `needed` that `config` lacks (and an example config that has them),
  then checks every value of the whole config with check_values. Every entry point calls this first with the whole
  config (the pretraining and SFT trainer's check_config, validate_rl_config for GRPO and distillation, so the
  sweep's per-point check too, and the AOT compiles), so no NaN, infinity or bad seed gets past it to any work."""
  missing = [s for s in needed if s not in config]
  if missing:
    raise ValueError(
      f"config {config.get('name', '?')!r} has no {missing} section(s); {purpose} needs {list(needed)} (see {example})"
    )
  check_values(config)


# Seeds: every key of the code's PRNGs is 32 bits. jax.random.key (jax_enable_x64 off, as here) keeps a seed's low 32
# bits, so 2**32 is seed 0 again and -1 is 2**32 - 1; from 2**63 up it raises OverflowError; numpy's default_rng (the
# RL prompts) refuses a negative seed mid-run; Grain's shuffle takes [0, 2**32). Every seed is one of [0, 2**32).
SEED_RANGE = (0, 2**32)
SEED_VALID = "must be an integer in [0, 2**32) (the PRNG keys are 32-bit: jax keeps a seed's low 32 bits)"
FINITE_VALID = "must be a finite number"


def is_seed_field(name: str) -> bool:
  """A config field that seeds a PRNG: `seed` (train, rl, teachers.<name>) or `<what>_seed` (data.shuffle_seed)."""
  return name == "seed" or name.endswith("_seed")


def check_seed(field: str, value) -> None:
  """Raises invalid() unless `value` is an integer in SEED_RANGE (a bool is not a seed)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not SEED_RANGE[0] <= value < SEED_RANGE[1]:
    invalid(field, value, SEED_VALID)


def check_finite(field: str, value) -> None:
  """Raises invalid() when `value` is a float that is NaN or infinite, or a list / tuple holding one (anything else
  passes: its own section's check judges it)."""
  if _is_float(value) and not math.isfinite(value):
    invalid(field, value, FINITE_VALID)
  if isinstance(value, (list, tuple)):
    bad = [i for i, v in enumerate(value) if _is_float(v) and not math.isfinite(v)]
    if bad:
      invalid(field, value, f"every entry {FINITE_VALID} (entry {bad[0]} is {value[bad[0]]!r})")


def _is_float(value) -> bool:
  return isinstance(value, (float, np.floating))


def _is_section(value) -> bool:
  return isinstance(value, (Mapping, ml_collections.ConfigDict, ml_collections.FrozenConfigDict))


def config_leaves(config: ml_collections.ConfigDict | Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(`section.field` path, value) of every field of `config`, through nested sections (data.glm, sft.train_step,
  teachers.<name>.model, optimizer.hparams, ...) and the dicts inside list / tuple fields (`field[i].key`)."""
  for key, value in config.items():
    path = f"{prefix}{key}"
    if _is_section(value):
      yield from config_leaves(value, f"{path}.")
      continue
    yield path, value
    if isinstance(value, (list, tuple)):
      for i, item in enumerate(value):
        if _is_section(item):
          yield from config_leaves(item, f"{path}[{i}].")


def check_values(config: ml_collections.ConfigDict | Mapping[str, Any]) -> None:
  """The one check of the values every section shares, before any work: every float field of every section (and
  every float in a list or tuple field) must be finite, and every seed field (is_seed_field) an integer in
  [0, 2**32). A failure is invalid()'s ValueError naming `section.field`, the value and what is valid.

  No field takes inf as a meaning: each optional term or guard is turned off by 0 (train.grad_clip_norm,
  train.spike_factor, rl.kl_coef, model.moe_capacity_factor, ...), and the timeouts (rl.heartbeat_timeout, ...) are
  finite numbers of seconds. The ranges of each field are its own section's checks, which run after this one."""
  for path, value in config_leaves(config):
    if is_seed_field(path.rsplit(".", 1)[-1]):
      check_seed(path, value)
    else:
      check_finite(path, value)


_LOOP_POSITIVE_INTS = ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints")
_STEP_NON_NEGATIVE = (
  "grad_clip_norm",
  "mtp_loss_weight",
  "balance_loss_weight",
  "indexer_loss_weight",
  "expert_bias_rate",
  "spike_factor",
)


def invalid(field: str, value, valid: str):
  """Raises the ValueError every config check raises: the field, its value and what is valid."""
  raise ValueError(f"{field}={value!r} is invalid; {valid}")


def validate_train_config(train: ml_collections.ConfigDict) -> None:
  """The `train` section: the loop's fields, the DSA stage, init_from and the step's fields."""
  for field in _LOOP_POSITIVE_INTS:
    if not isinstance(train[field], int) or train[field] <= 0:
      invalid(f"train.{field}", train[field], "must be a positive integer")
  if train.dsa_stage not in STAGES:
    invalid("train.dsa_stage", train.dsa_stage, f"one of {STAGES}")
  if not isinstance(train.max_consecutive_skips, int) or train.max_consecutive_skips < 0:
    invalid("train.max_consecutive_skips", train.max_consecutive_skips, "must be an integer >= 0 (0 = never stop)")
  if not isinstance(train.allow_data_change, bool):
    invalid("train.allow_data_change", train.allow_data_change, "True or False")
  if not isinstance(train.init_from, str):
    invalid("train.init_from", train.init_from, "a workdir path or ''")
  chunk = train.loss_chunk
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    invalid("train.loss_chunk", chunk, "an integer >= 0 that divides data.seq_len (0 = the whole sequence at once)")
  egs = train.embedding_grad_shrink
  if isinstance(egs, bool) or not isinstance(egs, (int, float)) or not 0 < egs <= 1:
    invalid("train.embedding_grad_shrink", egs, "a number in (0, 1] (GLM-130B's 0.1; 1 = off)")
  validate_step_config(train, "train")
  xla_compiler_options(train.xla_flags)  # a ValueError naming the bad token


def validate_step_config(step: ml_collections.ConfigDict, where: str) -> None:
  """The fields make_train_step reads besides dsa_stage (microbatches, the loss weights, grad_clip_norm,
  expert_bias_rate and the spike guard's), in the section `where` (named in the messages)."""
  if not isinstance(step.microbatches, int) or step.microbatches <= 0:
    invalid(f"{where}.microbatches", step.microbatches, "must be a positive integer")
  for field in _STEP_NON_NEGATIVE:
    if not step[field] >= 0:
      invalid(f"{where}.{field}", step[field], "must be >= 0")
  if not isinstance(step.spike_min_steps, int) or step.spike_min_steps < 0:
    invalid(f"{where}.spike_min_steps", step.spike_min_steps, "must be an integer >= 0")
  if not 0 <= step.spike_ema < 1:
    invalid(f"{where}.spike_ema", step.spike_ema, "must be in [0, 1)")


def model_config_for_stage(config: ml_collections.ConfigDict) -> ModelConfig:
  """The model config with attention dense in the dense and warm-up stages and DSA in the sparse stage."""
  cfg = ModelConfig.from_dict(config.model)
  stage = config.train.dsa_stage
  if stage == "sparse":
    if not cfg.use_dsa:
      raise ValueError("train.dsa_stage='sparse' needs model.use_dsa=True")
    if config.data.seq_len <= cfg.index_topk:
      raise ValueError(
        f"train.dsa_stage='sparse' with data.seq_len={config.data.seq_len} <= "
        f"model.index_topk={cfg.index_topk}: top-k would select every key; lower index_topk"
      )
    return cfg
  return cfg.replace(use_dsa=False)
