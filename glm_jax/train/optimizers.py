"""The pretraining optimizer: Muon for the hidden matrices with GLM-5's "Muon Split" (and an optax optimizer, AdamW
by default, for the rest), or any optax optimizer by name.

`make_optimizer(opt_cfg, params, trainable=...)` assembles it from the pieces, one idea a module:
  glm_jax/train/optimizer_config.py   the config section (every field, GLM-5's values) and the LR schedule
  glm_jax/train/param_plan.py         each parameter's label (muon / elementwise / frozen), weight decay, layout
  glm_jax/train/head_split.py         W_UK / W_UV cut apart before Muon and joined after (Muon Split)
  glm_jax/train/muon.py               momentum, Newton-Schulz with whole matrices spread over the mesh, the
                                      update's shape scale (RMS matched to AdamW's, 0.2)
Muon leaves: split_heads(scale_by_muon -> scale_by_shape) -> decoupled weight decay -> learning rate.
Elementwise leaves: the optax optimizer (optimizer.name, or Muon's partner) with the same schedule and decay mask.
Frozen leaves: exactly -0.0, no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from glm_jax.train.head_split import muon_layouts, split_heads
from glm_jax.train.muon import scale_by_muon, scale_by_shape
from glm_jax.train.optimizer_config import (
  checked_optimizer_config,
  elementwise_field,
  learning_rate_schedule,
  optax_optimizer,
)
from glm_jax.train.param_plan import leaf_plan, lookup


def zero_updates() -> optax.GradientTransformation:
  """Frozen leaves: updates of -0.0 and no state. p + (-0.0) == p bitwise for every p (+0.0 would turn a
  -0.0 parameter into +0.0), so optax.apply_updates leaves frozen parameters bitwise unchanged."""
  return optax.GradientTransformation(
    lambda params: optax.EmptyState(),
    lambda updates, state, params=None: (jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates), state),
  )


def make_optimizer(opt_cfg: Mapping[str, Any] | None, params, *, trainable=None) -> optax.GradientTransformation:
  """The pretraining optimizer for `params` (an nnx.State of Params or its pure dict; shapes are enough).
  It takes gradients (clipped by the trainer) and returns updates for optax.apply_updates; init and update
  accept the params tree in either form. Labels, layouts and decay per leaf: `leaf_plan`."""
  cfg = checked_optimizer_config(opt_cfg)
  plan = leaf_plan(cfg, params, trainable=trainable)
  schedule = learning_rate_schedule(cfg)
  mu_dtype = None if cfg.mu_dtype is None else jnp.dtype(cfg.mu_dtype)

  def labels(tree):
    return jax.tree_util.tree_map_with_path(lambda p, _: lookup(plan, p).label, tree)

  def decay_mask(tree):
    return jax.tree_util.tree_map_with_path(lambda p, _: lookup(plan, p).weight_decay, tree)

  layouts = muon_layouts(plan)
  orthogonalize = optax.chain(
    scale_by_muon(
      ns_coeffs=tuple(cfg.muon_ns_coeffs),
      ns_steps=int(cfg.muon_ns_steps),
      beta=cfg.muon_momentum,
      nesterov=cfg.muon_nesterov,
      layouts=layouts,
      mu_dtype=mu_dtype,
    ),
    scale_by_shape(layouts, consistent_rms=cfg.muon_update_rms),
  )
  muon = optax.chain(
    split_heads(orthogonalize, plan),
    optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
    optax.scale_by_learning_rate(schedule),
  )
  elementwise = optax_optimizer(
    cfg, elementwise_field(cfg), schedule=schedule, decay_mask=decay_mask, mu_dtype=mu_dtype
  )
  return optax.partition({"muon": muon, "elementwise": elementwise, "frozen": zero_updates()}, labels)
