"""The pretraining run's config: its sections, the `train` section's checks, and the model config of a DSA stage.

Everything here runs before any work starts, so a bad config stops a run with a message that names the field,
its value and what is valid, and touches nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections

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
  """Raises ValueError naming the sections of `needed` that `config` lacks (and an example config that has them)."""
  missing = [s for s in needed if s not in config]
  if missing:
    raise ValueError(
      f"config {config.get('name', '?')!r} has no {missing} section(s); {purpose} needs {list(needed)} (see {example})"
    )


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
