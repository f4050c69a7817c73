"""Muon Split's head splitting: a leaf cut along its last axis before Muon, the parts concatenated after.

kv_b_proj [R, H, dn + dv] holds W_UK_h and W_UV_h side by side for every head; GLM-5 orthogonalizes them
separately (per head). optax orthogonalizes whole leaves, so `split_heads` wraps the Muon transformation: the
leaves whose plan has split_sizes (glm_jax/train/param_plan.py) become `Parts`, a pytree node whose children
optax treats as leaves of their own, and the updates' parts are concatenated back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from glm_jax.train.param_plan import LeafPlan, MuonLayout, lookup
from glm_jax.tree_paths import Names


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Parts:
  """One leaf cut along its last axis (a pytree node, so optax treats each part as its own leaf)."""

  parts: tuple


def split_heads(inner: optax.GradientTransformation, plan: dict[Names, LeafPlan]) -> optax.GradientTransformation:
  """Runs `inner` on the tree with each leaf whose plan has split_sizes replaced by its parts along the last
  axis, and concatenates the parts of the resulting updates back."""

  def split(tree):
    def cut(path, x):
      sizes = lookup(plan, path).split_sizes
      if not sizes:
        return x
      bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
      return Parts(tuple(jnp.split(x, bounds, axis=-1)))

    return jax.tree_util.tree_map_with_path(cut, tree)

  def merge(tree):
    return jax.tree.map(
      lambda x: jnp.concatenate(x.parts, axis=-1) if isinstance(x, Parts) else x,
      tree,
      is_leaf=lambda x: isinstance(x, Parts),
    )

  def init_fn(params):
    return inner.init(split(params))

  def update_fn(updates, state, params=None):
    new, state = inner.update(split(updates), state, None if params is None else split(params))
    return merge(new), state

  return optax.GradientTransformation(init_fn, update_fn)


def muon_layouts(plan: dict[Names, LeafPlan]) -> Callable:
  """tree -> a tree of MuonLayouts shaped like the split tree (a Parts of layouts where a leaf was cut)."""

  def layout_of(path, x):
    lp = lookup(plan, path)
    layouts = tuple(MuonLayout(d, lp.logical_axes) for d in lp.muon_dims)
    return Parts(layouts) if isinstance(x, Parts) else layouts[0]

  def fn(tree):
    return jax.tree_util.tree_map_with_path(layout_of, tree, is_leaf=lambda x: isinstance(x, Parts))

  return fn
