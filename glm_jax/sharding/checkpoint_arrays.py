"""A checkpoint's weights read onto a mesh, slice by slice, from any Orbax TrainState item.

  params, rest = checkpoint_arrays.read_weights(state_dir, params, rest)

Each stored array is opened with tensorstore through Orbax's own read spec (a training run's OCDBT checkpoint, or
the zarr3 one glm_jax/convert/stream.py writes), and jax.make_array_from_callback asks for each local device's
slice of it, so a process reads only what its devices hold: never a whole stacked array unless one device holds it,
and never the optimizer state. Train.init_from, rl.init_from and launch/sample.py load weights this way.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax import nnx

from glm_jax.tree_paths import path_str

METADATA = "_METADATA"


def orbax_name(kind: str, path: tuple) -> str:
  """The array's name in an Orbax TrainState item: "params.moe_layers.mlp.gate_proj.value"."""
  return ".".join(tree_keys(kind, path))


def tree_keys(kind: str, path: tuple) -> tuple[str, ...]:
  """The array's keys in the item's `_METADATA` tree (its tree_metadata is keyed by their tuple's str)."""
  return (kind, *map(str, path), "value")


def leaf_kind(variable) -> str:
  """The TrainState field a model variable is saved under: "params" for an nnx.Param, else "rest"."""
  return "params" if isinstance(variable, nnx.Param) else "rest"


def state_metadata(state_dir: str) -> dict[str, Any]:
  """The item's `_METADATA` (Orbax's tree of arrays and its storage flags); a missing or unreadable one is an error
  naming it."""
  path = os.path.join(state_dir, METADATA)
  try:
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
  except FileNotFoundError as e:
    raise ValueError(f"{state_dir}: not an Orbax checkpoint item (no {METADATA})") from e
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: cannot be read ({e})") from e
  if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
    raise ValueError(f"{path}: no tree_metadata object")
  return meta


def is_weights_only(state_dir: str) -> bool:
  """Whether a state item holds only weights (a converted checkpoint), not a whole TrainState."""
  return not any(key.startswith("('opt_state'") for key in state_metadata(state_dir)["tree_metadata"])


class StateArrays:
  """The arrays of an Orbax state item, opened on demand with tensorstore through Orbax's read spec (OCDBT or
  not, zarr2 or zarr3): `open(kind, path)` -> a tensorstore that reads any slice."""

  def __init__(self, state_dir: str):
    self.state_dir = state_dir
    meta = state_metadata(state_dir)
    self.keys = set(meta["tree_metadata"])
    self._ocdbt, self._zarr3 = bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False))
    self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._ocdbt)

  def has(self, kind: str, path: tuple) -> bool:
    return str(tree_keys(kind, path)) in self.keys

  def open(self, kind: str, path: tuple) -> ts.TensorStore:
    info = ocp.type_handlers.ParamInfo(
      name=orbax_name(kind, path),
      parent_dir=epath.Path(self.state_dir),
      use_zarr3=self._zarr3,
      ts_context=self._context,
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
    try:
      return ts.open(spec, open=True, read=True, context=self._context).result()
    except ValueError as e:
      raise ValueError(
        f"{self.state_dir}: array {orbax_name(kind, path)} cannot be opened ({str(e).splitlines()[0][:200]})"
      ) from e


def read_slice(array: ts.TensorStore, index: tuple, dtype) -> np.ndarray:
  """One device's slice of a stored array, as `dtype` (the only place weights are read; tests instrument it)."""
  return np.asarray(array[index].read().result(), dtype)


def _index_key(index: tuple) -> tuple:
  return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def read_weights(
  state_dir: str, params: nnx.State, rest: nnx.State, *, where: str | None = None
) -> tuple[nnx.State, nnx.State]:
  """(params, rest) with every array read from the Orbax state item `state_dir` (any TrainState checkpoint, or a
  converted one) onto the sharding of the array it replaces, or of the ShapeDtypeStruct standing for it (one
  device when it has none), one device's slice at a time: a process reads only its devices' slices. A missing or
  differently shaped array is a ValueError naming it and `where` (default: the directory)."""
  where = where or state_dir
  arrays = StateArrays(state_dir)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def fill(tree: nnx.State, kind: str, noun: str) -> nnx.State:
    out = []
    for path, var in nnx.to_flat_state(tree):
      if not arrays.has(kind, path):
        raise ValueError(f"{where}: no {noun} array at {path_str(path)}")
      stored = arrays.open(kind, path)
      if tuple(stored.shape) != tuple(var.shape):
        raise ValueError(
          f"{where}: {noun} {path_str(path)} has shape {list(stored.shape)}, the model expects {list(var.shape)}"
        )
      sharding = getattr(var.get_value(), "sharding", None) or device  # an array's, or an abstract target's
      cache: dict[tuple, np.ndarray] = {}  # devices holding the same slice (replicas) share one read

      def slice_of(index, stored=stored, cache=cache, dtype=var.dtype):
        key = _index_key(index)
        if key not in cache:
          cache[key] = read_slice(stored, index, dtype)
        return cache[key]

      out.append((path, var.replace(value=jax.make_array_from_callback(tuple(var.shape), sharding, slice_of))))
    return nnx.from_flat_state(out)

  return fill(params, "params", "parameter"), fill(rest, "rest", "variable")
