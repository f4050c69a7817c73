"""The optimizer's config section and its learning-rate schedule.

`default_optimizer_config()` lists every field `make_optimizer` reads (glm_jax/train/optimizers.py), with GLM-5's
published values where there are any; a config may give only some of them (`checked_optimizer_config` fills in
the rest and checks every value). The schedule is a linear warmup, then cosine, linear or constant decay.

The optimizer is "muon" (GLM-5's: Muon for the hidden matrices, `partner` for the other leaves) or any optax
optimizer by its name in optax (big_vision's manner): "adamw", "lion", "sgd", "adafactor", ... Such an
optimizer (Muon's partner too) gets the learning-rate schedule, the fields below its signature takes (b1, b2, eps,
weight_decay with the decay mask, mu_dtype) and `hparams`, any of its other keyword arguments.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import optax

SCHEDULES = ("cosine", "linear", "constant")


def default_optimizer_config() -> ml_collections.ConfigDict:
  """Every field `make_optimizer` reads. GLM-5 publishes the optimizer, momentum, NS steps, update RMS, split
  and the LR range (2e-4 -> 4e-5); warmup/decay lengths, betas and weight decay are not published."""
  c = ml_collections.ConfigDict()
  c.name = "muon"  # "muon" or an optax optimizer's name ("adamw", "lion", ...)
  c.partner = "adamw"  # muon: the optax optimizer of the leaves Muon does not take
  # muon: a regex on a parameter's path ("moe_layers/mlp/router") for the matrices its partner keeps (1-D leaves
  # go to the partner anyway): the embedding (sparse rows), the head and the router
  c.partner_matrices = r"(^|/)(embedding|lm_head|router)$"
  c.hparams = ml_collections.ConfigDict()  # the optax optimizer's (Muon's partner's) other keyword arguments
  c.lr = 2e-4  # peak learning rate, shared by the Muon and AdamW groups (the RMS matching makes that sane)
  c.lr_init = 0.0  # learning rate at step 0; warmup goes linearly from here to lr
  c.lr_end = 4e-5  # after decay_steps of decay (ignored by "constant")
  c.warmup_steps = 2000
  c.decay_steps = 100_000  # steps of decay after the warmup; then lr_end for ever
  c.schedule = "cosine"  # "cosine" | "linear" | "constant" (after the warmup)
  c.b1 = 0.9  # AdamW, Lion, ... (each optax optimizer whose signature takes them)
  c.b2 = 0.95
  c.eps = 1e-8
  c.weight_decay = 0.1  # decoupled, multiplied by the learning rate; which leaves: glm_jax/train/param_plan.py
  c.muon_momentum = 0.95
  c.muon_nesterov = True
  c.muon_ns_steps = 5
  c.muon_ns_coeffs = (3.4445, -4.7750, 2.0315)  # the quintic of Keller Jordan / Moonlight / optax
  c.muon_update_rms = 0.2  # RMS target of the orthogonalized update; None: optax's sqrt(max(1, out/in))
  c.muon_split = True  # W_UQ per head; W_UK and W_UV per head, separately
  c.mu_dtype = ml_collections.config_dict.placeholder(str)  # moment dtype; None: the parameter's dtype
  return c


def checked_optimizer_config(opt_cfg: Mapping[str, Any] | None) -> ml_collections.ConfigDict:
  """opt_cfg over the defaults (a config may give only some fields); unknown fields and bad values raise,
  naming the field, its value and what is valid."""
  cfg = default_optimizer_config()
  given = dict(opt_cfg.items()) if opt_cfg is not None else {}
  unknown = sorted(set(given) - set(cfg.keys()))
  if unknown:
    raise ValueError(f"optimizer config: unknown field(s) {unknown}; valid fields: {sorted(cfg.keys())}")
  for k, v in given.items():
    if k == "hparams":  # free-form: whatever the named optimizer takes
      cfg.hparams = ml_collections.ConfigDict(dict(v))
    else:
      cfg[k] = tuple(v) if k == "muon_ns_coeffs" else v
  optax_optimizer(cfg, elementwise_field(cfg))  # an unknown name or hyperparameter raises, naming it
  try:
    re.compile(cfg.partner_matrices)
  except (re.error, TypeError) as e:
    raise ValueError(
      f"optimizer config: partner_matrices={cfg.partner_matrices!r}; expected a regular expression "
      f"on parameter paths ({e})"
    ) from None
  # Each comparison is false for NaN, so a NaN fails it; an infinity is refused, with every non-finite value of the
  # config, by glm_jax/train/config.py's check_values, which the trainers run before this.
  checks = (
    ("schedule", cfg.schedule in SCHEDULES, f"one of {SCHEDULES}"),
    ("lr", cfg.lr > 0, "> 0"),
    ("lr_init", cfg.lr_init >= 0, ">= 0"),
    ("lr_end", cfg.lr_end >= 0, ">= 0"),
    ("warmup_steps", int(cfg.warmup_steps) == cfg.warmup_steps and cfg.warmup_steps >= 0, "an int >= 0"),
    ("decay_steps", int(cfg.decay_steps) == cfg.decay_steps and cfg.decay_steps > 0, "an int > 0"),
    ("weight_decay", cfg.weight_decay >= 0, ">= 0"),
    ("b1", 0 <= cfg.b1 < 1, "in [0, 1)"),
    ("b2", 0 <= cfg.b2 < 1, "in [0, 1)"),
    ("eps", cfg.eps >= 0, ">= 0"),
    ("muon_momentum", 0 <= cfg.muon_momentum < 1, "in [0, 1)"),
    ("muon_ns_steps", int(cfg.muon_ns_steps) == cfg.muon_ns_steps and cfg.muon_ns_steps >= 1, "an int >= 1"),
    ("muon_ns_coeffs", len(cfg.muon_ns_coeffs) == 3, "three numbers (a, b, c)"),
    ("muon_update_rms", cfg.muon_update_rms is None or cfg.muon_update_rms > 0, "None or > 0"),
  )
  for field, ok, valid in checks:
    if not ok:
      raise ValueError(f"optimizer config: {field}={cfg[field]!r}; expected {valid}")
  return cfg


def _factory(cfg: ml_collections.ConfigDict, field: str) -> Callable[..., optax.GradientTransformation]:
  name = cfg[field]
  factory = getattr(optax, name, None) if isinstance(name, str) and not name.startswith("_") else None
  if factory is None or not callable(factory) or "learning_rate" not in inspect.signature(factory).parameters:
    raise ValueError(
      f"optimizer config: {field}={name!r}; expected "
      + ("'muon' or " if field == "name" else "")
      + "the name of an optax optimizer (optax.<name> "
      "taking a learning_rate), e.g. 'adamw', 'lion', 'sgd', 'adafactor'"
    )
  return factory


def elementwise_field(cfg: ml_collections.ConfigDict) -> str:
  """The field that names the optax optimizer: `name`, or under Muon `partner`."""
  return "partner" if cfg.name == "muon" else "name"


def optax_optimizer(
  cfg: ml_collections.ConfigDict, field: str, *, schedule=None, decay_mask=None, mu_dtype=None
) -> optax.GradientTransformation:
  """optax.<cfg[field]> with the schedule (a constant lr when None), the fields its signature takes (b1, b2, eps,
  weight_decay under decay_mask, mu_dtype) and cfg.hparams. A hyperparameter it does not take, or weight decay
  for one without it, raises, naming the field."""
  factory = _factory(cfg, field)
  takes = inspect.signature(factory).parameters
  kwargs = {
    k: v
    for k, v in dict(
      b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask, mu_dtype=mu_dtype
    ).items()
    if k in takes
  }
  if cfg.weight_decay and "weight_decay" not in takes:
    raise ValueError(
      f"optimizer config: weight_decay={cfg.weight_decay!r}; optax.{cfg[field]} ({field}) takes no "
      "weight decay: set it to 0"
    )
  extra = dict(cfg.hparams)
  unknown = sorted(set(extra) - set(takes) - {"learning_rate"})
  if unknown:
    raise ValueError(
      f"optimizer config: hparams {unknown} are not arguments of optax.{cfg[field]}; it takes "
      f"{sorted(set(takes) - {'learning_rate'})}"
    )
  return factory(schedule if schedule is not None else cfg.lr, **{**kwargs, **extra})


def learning_rate_schedule(opt_cfg: Mapping[str, Any] | None) -> optax.Schedule:
  """Linear warmup lr_init -> lr over warmup_steps (step warmup_steps is the first at lr), then
  cosine: lr_end + (lr - lr_end) (1 + cos(pi s / decay_steps)) / 2,  linear: lr + (lr_end - lr) s / decay_steps,
  or constant lr, with s = step - warmup_steps clipped to decay_steps."""
  cfg = checked_optimizer_config(opt_cfg)
  if cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, int(cfg.decay_steps), alpha=cfg.lr_end / cfg.lr)
  elif cfg.schedule == "linear":
    decay = optax.linear_schedule(cfg.lr, cfg.lr_end, int(cfg.decay_steps))
  else:
    decay = optax.constant_schedule(cfg.lr)
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(cfg.lr_init, cfg.lr, int(cfg.warmup_steps))
  return optax.join_schedules([warmup, decay], [int(cfg.warmup_steps)])
