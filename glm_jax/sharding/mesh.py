"""The device mesh and the one table that maps the model's logical axis names onto it.

Mesh axes (config.mesh): data (pure data parallelism), fsdp (data parallelism that also shards parameters
and optimizer state), expert (MoE experts; tokens are split over it too), tensor (attention heads, MLP and
expert width, vocabulary). A size of -1 takes the remaining devices.

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

from glm_jax.mesh_axes import BATCH_AXES, MESH_AXES


# Logical axis name (the model's parameter metadata) -> mesh axis, or None for replicated.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "index_heads": "tensor",
    "qk_head_dim": None,
    "kv_head_dim": None,
    "v_head_dim": None,
    "index_head_dim": None,
    "q_lora": "fsdp",  # q_b_proj, kv_b_proj and the indexer's wq_b have no embed axis: without these their
    "kv_lora": "fsdp",  # stacks (9.4 GiB fp32 each for glm5_744b) would sit whole on every chip under tensor=1
    "experts": "expert",
    "expert_mlp": "tensor",
    "experts_router": None,
    "norm": None,
    "mtp_in": None,
}


def default_mesh_config() -> ml_collections.ConfigDict:
  """Fully sharded data parallelism over whatever devices there are (-1 = the remaining devices); one device
  trains unsharded."""
  return ml_collections.ConfigDict(dict(data=1, fsdp=-1, expert=1, tensor=1))


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
      raise ValueError(f"mesh: {dict(zip(MESH_AXES, sizes))}: the fixed axes multiply to {known}, which does not "
                       f"divide the {n_devices} devices")
    sizes[sizes.index(-1)] = n_devices // known
  if math.prod(sizes) != n_devices:
    raise ValueError(f"mesh: {dict(zip(MESH_AXES, sizes))} multiplies to {math.prod(sizes)}, but there are "
                     f"{n_devices} devices")
  return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """The mesh for config.mesh over `devices` (default: all of jax.devices(), every host's)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  try:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):  # e.g. simulated CPU devices of no topology
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None], rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES) -> P:
  """A PartitionSpec for logical axes; a mesh axis used twice keeps only its first use."""
  used, out = set(), []
  for name in axes:
    if name is not None and name not in rules:
      raise ValueError(f"logical axis {name!r} has no rule; add it to LOGICAL_AXIS_RULES ({sorted(rules)})")
    mesh_axis = rules.get(name) if name is not None else None
    if mesh_axis in used:
      mesh_axis = None
    if mesh_axis is not None:
      used.add(mesh_axis)
    out.append(mesh_axis)
  return P(*out)


def checked_spec(spec: P, shape: Sequence[int], mesh: Mesh, what: str) -> P:
  """`spec`, after checking every sharded dimension divides by its mesh axis size (else a clear error)."""
  for dim, axis in zip(shape, spec):
    if axis is not None and dim % mesh.shape[axis]:
      raise ValueError(f"{what}: dimension of size {dim} is sharded over mesh axis {axis!r} of size "
                       f"{mesh.shape[axis]}, which does not divide it; change config.mesh.{axis} or the model size")
  return spec


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [B, T]: B split over every batch-like axis."""
  return NamedSharding(mesh, P(BATCH_AXES, None))
