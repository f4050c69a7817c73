"""The device mesh and the one table that maps the model's logical axis names onto it.

Mesh axes (config.mesh): data (pure data parallelism), fsdp (data parallelism that also shards parameters
and optimizer state), expert (MoE experts; tokens are split over it too), context (the sequence: context
parallelism, glm_jax/model/context_parallel.py; parameters and optimizer state are split over it too, as over
fsdp), tensor (attention heads, MLP and expert width, vocabulary). A size of -1 takes the remaining devices.

Axis types are Auto: shardings are given for the state and the batch and GSPMD propagates them through the
step. Explicit axes (jax 0.10's make_mesh default) would type every intermediate's sharding and require
annotating each einsum of the model; Auto keeps the model code mesh-free, at the price of trusting XLA's
propagation (which the multi-device tests check against one device).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from glm_jax.mesh_axes import BATCH_AXES, CONTEXT, MESH_AXES


# Logical axis name (the model's parameter metadata) -> mesh axis (or axes, major first), or None for replicated.
# The model dimension is split over context as well as fsdp: a context axis holds whole sequences' worth of
# devices that would otherwise each keep a full replica of the fsdp shard (the 128K config's context=32 would
# multiply parameter and optimizer memory by 32), and over expert: the dense weights (attention, shared expert,
# embeddings) would otherwise be whole on each expert shard (under glm5_744b's fsdp 64 x expert 8, split 64 ways
# rather than 512; docs/pods.md has the memory this saves). A routed expert's own weights take expert for their
# experts dimension first, so their model dimension stays on fsdp x context.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
  "layers": None,
  "vocab": "tensor",
  "embed": ("fsdp", CONTEXT, "expert"),
  "mlp": "tensor",
  "heads": "tensor",
  "index_heads": "tensor",
  "qk_head_dim": None,
  "kv_head_dim": None,
  "v_head_dim": None,
  "index_head_dim": None,
  # q_b_proj, kv_b_proj and the indexer's wq_b have no embed axis: without these two their stacks (9.4 GiB fp32
  # each for glm5_744b) would sit whole on every chip under tensor=1
  "q_lora": ("fsdp", CONTEXT, "expert"),
  "kv_lora": ("fsdp", CONTEXT, "expert"),
  "experts": "expert",
  "expert_mlp": "tensor",
  "experts_router": None,
  "norm": None,
  "mtp_in": None,
}


# Decoding's weight layout: the dense weights whole on each expert shard (split over fsdp x context only), as a
# decode step would otherwise all-gather them over expert for every token; the routed experts as in training.
DECODE_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
  **LOGICAL_AXIS_RULES,
  "embed": ("fsdp", CONTEXT),
  "q_lora": ("fsdp", CONTEXT),
  "kv_lora": ("fsdp", CONTEXT),
}


def default_mesh_config() -> ml_collections.ConfigDict:
  """Fully sharded data parallelism over whatever devices there are (-1 = the remaining devices); one device
  trains unsharded."""
  return ml_collections.ConfigDict(dict(data=1, fsdp=-1, expert=1, context=1, tensor=1))


def mesh_shape(mesh_cfg: Mapping[str, int], n_devices: int) -> tuple[int, ...]:
  """Axis sizes in MESH_AXES order, with a -1 resolved; errors name the sizes involved."""
  sizes = [mesh_cfg.get(a, 1) for a in MESH_AXES]
  for a, s in zip(MESH_AXES, sizes):
    if not isinstance(s, int) or (s < 1 and s != -1):
      raise ValueError(f"mesh.{a}={s!r} is invalid; a positive integer or -1 (the remaining devices)")
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh: {dict(zip(MESH_AXES, sizes))} has more than one -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n_devices % known:
      raise ValueError(
        f"mesh: {dict(zip(MESH_AXES, sizes))}: the fixed axes multiply to {known}, which does not "
        f"divide the {n_devices} devices"
      )
    sizes[sizes.index(-1)] = n_devices // known
  if math.prod(sizes) != n_devices:
    raise ValueError(
      f"mesh: {dict(zip(MESH_AXES, sizes))} multiplies to {math.prod(sizes)}, but there are {n_devices} devices"
    )
  return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """The mesh for config.mesh over `devices` (default: all of jax.devices(), every host's).

  Devices of several TPU slices (multislice: device.slice_index differs) make a hybrid mesh: config.mesh describes
  one slice, laid out over its chips by ICI, and the `data` axis is that many times larger, its new part across
  the slices over the data-center network (as jax's create_hybrid_device_mesh builds it): only the data-parallel
  gradient reduction crosses DCN."""
  from jax.experimental import mesh_utils

  devices = list(jax.devices() if devices is None else devices)
  # TPU slices only: a multi-process CPU job may number its processes' devices as slices too.
  slices = len({getattr(d, "slice_index", 0) or 0 for d in devices}) if devices[0].platform == "tpu" else 1
  if slices > 1:
    if len(devices) % slices:
      raise ValueError(f"mesh: {len(devices)} devices do not split evenly over {slices} slices")
    ici = mesh_shape(mesh_cfg, len(devices) // slices)
    dcn = tuple(slices if a == "data" else 1 for a in MESH_AXES)
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
  shape = mesh_shape(mesh_cfg, len(devices))
  try:
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):  # e.g. simulated CPU devices of no topology
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry, as a tuple (() for a replicated dimension)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def logical_to_spec(
  axes: Sequence[str | None], rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_AXIS_RULES
) -> P:
  """A PartitionSpec for logical axes; a mesh axis used twice keeps only its first use."""
  used, out = set(), []
  for name in axes:
    if name is not None and name not in rules:
      raise ValueError(f"logical axis {name!r} has no rule; add it to LOGICAL_AXIS_RULES ({sorted(rules)})")
    mesh_axes = tuple(a for a in entry_axes(rules.get(name) if name is not None else None) if a not in used)
    used.update(mesh_axes)
    out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return P(*out)


def spec_for_mesh(spec: P, mesh) -> P:
  """`spec` with each multi-axis entry reduced to the axes of size > 1 in `mesh` (a bare name when one is left,
  the first name when none is): the same layout, written as for a mesh without those axes (so a mesh whose context
  axis has size 1 gives the specs of one without a context axis)."""
  out = []
  for entry in spec:
    axes = entry_axes(entry)
    if len(axes) > 1:
      kept = tuple(a for a in axes if mesh.shape.get(a, 1) > 1) or axes[:1]
      entry = kept[0] if len(kept) == 1 else kept
    out.append(entry)
  return P(*out)


def divisible_spec(spec: P, shape: Sequence[int], mesh) -> P:
  """`spec` for `mesh` (spec_for_mesh) with the entries whose mesh axes do not divide their dimension replicated
  (an optimizer-state leaf shaped unlike its parameter; a matrix whose row count no axis product divides)."""
  spec = spec_for_mesh(spec, mesh)
  return P(
    *(
      e
      if all(a in mesh.shape for a in entry_axes(e)) and d % math.prod(mesh.shape[a] for a in entry_axes(e)) == 0
      else None
      for e, d in zip(spec, shape)
    )
  )


def checked_spec(spec: P, shape: Sequence[int], mesh: Mesh, what: str) -> P:
  """`spec` for `mesh` (spec_for_mesh), after checking every sharded dimension divides by its mesh axes' size
  (else a clear error)."""
  spec = spec_for_mesh(spec, mesh)
  for dim, entry in zip(shape, spec):
    axes = entry_axes(entry)
    size = math.prod(mesh.shape[a] for a in axes)
    if axes and dim % size:
      over = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
      raise ValueError(
        f"{what}: dimension of size {dim} is sharded over {over} of size {size}, which does not "
        f"divide it; change config.mesh.{' / config.mesh.'.join(axes)} or the model size"
      )
  return spec


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [B, T]: B split over every batch-like axis, T over the context axis."""
  return NamedSharding(mesh, P(BATCH_AXES, CONTEXT))
