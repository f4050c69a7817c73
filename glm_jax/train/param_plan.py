"""How each parameter is optimized: its label, weight decay and, under Muon, its matrix layout.

Each parameter gets one of three labels (`leaf_plan`):

  muon         hidden matrices: attention projections (the indexer's too), dense MLP, shared and routed experts,
               MTP eh_proj. Leading stacked axes (layers, experts) and, with muon_split, heads are batch axes:
               every 2-D matrix is orthogonalized on its own (GLM-5's "Muon Split": W_UQ, W_UK, W_UV per head).
  elementwise  the optax optimizer's (Muon's partner, AdamW by default): the matrices optimizer.partner_matrices
               matches (the embedding, lm_head, the router) and every 1-D leaf (norm weights, the indexer's
               k_norm bias); everything when the optimizer is not "muon".
  frozen       leaves `trainable` rules out: the update is exactly (negative) zero and no state is kept.

Weight decay (decoupled, lr_t * wd * W, as optax and PyTorch): every matrix (lm_head and router included),
never the embedding (a row moves only when its token occurs, so decay would shrink rare tokens) nor 1-D leaves.
A Muon layout is optax's MuonDimensionNumbers (reduction = input axes, output axes, counted from the end so
stacked axes are batch axes); kv_b_proj under muon_split is cut along its last axis into W_UK and W_UV first
(`split_sizes`, applied by glm_jax/train/head_split.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Dims

from glm_jax.train.optimizer_config import checked_optimizer_config
from glm_jax.tree_paths import Names, path_names, path_str

STACKED = ("dense_layers", "moe_layers")  # top-level subtrees whose leaves carry a leading "layers" axis
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")  # [E, in, out] under an MoE "mlp"


class LeafPlan(NamedTuple):
  """How one parameter is optimized. muon_dims: Muon's matrix layout (one per part when split)."""

  label: str  # "muon" | "elementwise" | "frozen"
  weight_decay: bool
  muon_dims: tuple[Dims, ...] = ()
  split_sizes: tuple[int, ...] = ()  # the last axis cut into these parts before Muon (kv_b_proj: W_UK, W_UV)
  logical_axes: tuple | None = None  # the parameter's logical axis names: its layout on a mesh (`orthogonalize`)


@dataclasses.dataclass(frozen=True)
class MuonLayout:
  """How `orthogonalize` sees one leaf: its matrix layout and its parameter's logical axes (None: unknown)."""

  dims: Dims
  logical_axes: tuple | None = None


def _muon_layout(
  names: Names, shapes: Mapping[Names, tuple[int, ...]], core: tuple[int, ...], split: bool
) -> tuple[tuple[Dims, ...], tuple[int, ...]]:
  """Reduction (input) and output axes, counted from the end so stacked axes are batch axes."""
  last = names[-1]
  if last == "o_proj":  # [H, v, D]: one [H*v, D] matrix
    return (Dims((-3, -2), -1),), ()
  if last == "q_b_proj" and split:  # [R, H, qk]: W_UQ_h = [R, qk] per head
    return (Dims(-3, -1),), ()
  if last == "kv_b_proj" and split:  # [R, H, dn + dv]: W_UK_h [R, dn] and W_UV_h [R, dv] per head
    return (Dims(-3, -1), Dims(-3, -1)), _kv_split(names, shapes)
  if last in ("q_b_proj", "kv_b_proj", "wq_b"):  # [R, H, k]: one [R, H*k] matrix
    return (Dims(-3, (-2, -1)),), ()
  if len(core) == 2 or (len(core) == 3 and last in EXPERT_MATRICES):  # [in, out], or [E, in, out]
    return (Dims(-2, -1),), ()
  raise ValueError(
    f"parameter {path_str(names)}: shape {core} has no Muon layout; add one to "
    "glm_jax/train/param_plan.py:_muon_layout or keep it under AdamW"
  )


def _kv_split(names: Names, shapes: Mapping[Names, tuple[int, ...]]) -> tuple[int, int]:
  """(qk_nope_head_dim, v_head_dim) from the sibling shapes: qk_rope = kv_a_proj_with_mqa's last axis minus
  kv_lora_rank, qk_nope = q_b_proj's last axis minus qk_rope."""
  attn = names[:-1]
  need = (attn + ("kv_a_proj_with_mqa",), attn + ("kv_a_layernorm", "weight"), attn + ("q_b_proj",))
  missing = [n for n in need if n not in shapes]
  if missing:
    raise ValueError(
      f"muon_split: cannot read qk_nope_head_dim for {path_str(names)}; missing "
      f"{[path_str(n) for n in missing]} (set muon_split=False to orthogonalize it whole)"
    )
  rope = shapes[need[0]][-1] - shapes[need[1]][-1]
  nope = shapes[need[2]][-1] - rope
  width = shapes[names][-1]
  if not 0 < nope < width:
    raise ValueError(f"muon_split: {path_str(names)} last axis {width} cannot split at qk_nope_head_dim={nope}")
  return nope, width - nope


def _trainable_flags(trainable, params, names_list: list[Names]) -> dict[Names, bool]:
  if trainable is None:
    return {n: True for n in names_list}
  if callable(trainable):
    return {n: bool(trainable(n)) for n in names_list}
  flags = {path_names(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(trainable)}
  missing = [n for n in names_list if n not in flags]
  if missing:
    raise ValueError(
      f"trainable: no flag for {[path_str(n) for n in missing[:5]]}"
      f"{' ...' if len(missing) > 5 else ''}; pass a bool tree shaped like params or a "
      "predicate on path names"
    )
  return {n: flags[n] for n in names_list}


def leaf_plan(opt_cfg: Mapping[str, Any] | None, params, *, trainable=None) -> dict[Names, LeafPlan]:
  """{path names: LeafPlan} for every leaf of `params` (an nnx.State of Params or its pure dict; arrays or
  ShapeDtypeStructs). trainable: None (all), a bool tree shaped like params, or a predicate on path names,
  e.g. `lambda names: "indexer" in names`."""
  cfg = checked_optimizer_config(opt_cfg)
  leaves = [(path_names(p), tuple(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(params)]
  shapes = dict(leaves)
  logical = _logical_axes(params)
  flags = _trainable_flags(trainable, params, [n for n, _ in leaves])
  partner_matrix = re.compile(cfg.partner_matrices)
  plan = {}
  for names, shape in leaves:
    core = shape[1:] if names[0] in STACKED else shape
    decay = len(core) >= 2 and names[-1] != "embedding"
    if not flags[names]:
      plan[names] = LeafPlan("frozen", False)
    elif cfg.name != "muon" or len(core) < 2 or partner_matrix.search(path_str(names)):
      plan[names] = LeafPlan("elementwise", decay)
    else:
      dims, sizes = _muon_layout(names, shapes, core, cfg.muon_split)
      plan[names] = LeafPlan("muon", decay, dims, sizes, logical.get(names))
  return plan


def _logical_axes(params) -> dict[Names, tuple]:
  """{path names: logical axis names} of the leaves that carry them (nnx Params' out_sharding metadata)."""
  out = {}
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for path, leaf in leaves:
    if isinstance(leaf, nnx.Variable):
      axes = leaf.get_metadata().get("out_sharding")
      if axes is not None:
        out[path_names(path)] = tuple(axes)
  return out


def matrix_axes(dims: Dims, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(input axes, output axes) of a Muon layout for an array of `ndim` dimensions, non-negative; the other
  axes are batch axes (one matrix each)."""

  def axes(a) -> tuple[int, ...]:
    return tuple(x % ndim for x in (a if isinstance(a, (tuple, list)) else (a,)))

  return axes(dims.reduction_axis), axes(dims.output_axis)


def lookup(plan: dict[Names, LeafPlan], path) -> LeafPlan:
  names = path_names(path)
  if names not in plan:
    raise ValueError(f"optimizer: parameter {path_str(names)} was not in the params tree the optimizer was built for")
  return plan[names]
