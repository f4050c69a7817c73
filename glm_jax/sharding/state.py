"""Shardings for the whole train state from the parameters' logical axes, and abstract states that carry them.

A parameter's spec comes from its `out_sharding` metadata through LOGICAL_AXIS_RULES. Optimizer-state
leaves (Adam moments, Muon momentum) are matched to the parameter whose path ends their own and take its
spec when the shapes agree (dimension by dimension where Muon split a leaf); everything else (step
counters, scalars) is replicated. The trainer creates a state under jit with these out_shardings
(glm_jax/train/trainer.py AbstractTrainState), so no host ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glm_jax.sharding.mesh import DECODE_AXIS_RULES, LOGICAL_AXIS_RULES, checked_spec, divisible_spec, logical_to_spec
from glm_jax.tree_paths import path_names, path_str


def param_specs(params: nnx.State, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> dict[tuple, P]:
  """{parameter path names: PartitionSpec} for an nnx.State (abstract or not) under the logical axis `rules`,
  divisibility checked."""
  specs = {}
  for path, var in nnx.to_flat_state(params):
    names = path_names(path)
    axes = var.get_metadata().get("out_sharding")
    if axes is None:
      raise ValueError(f"parameter {path_str(names)} has no logical axes (out_sharding metadata)")
    specs[names] = checked_spec(logical_to_spec(axes, rules), var.shape, mesh, "parameter " + path_str(names))
  return specs


def _spec_for_leaf(names: tuple, shape: tuple, specs: dict[tuple, P], mesh: Mesh) -> P:
  for start in range(len(names)):
    spec = specs.get(names[start:])
    if spec is not None and len(spec) == len(shape):
      return divisible_spec(spec, shape, mesh)
  return P()


def tree_shardings(tree: Any, specs: dict[tuple, P], mesh: Mesh) -> Any:
  """NamedShardings shaped like `tree` (any pytree of arrays / ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: NamedSharding(mesh, _spec_for_leaf(path_names(path), tuple(x.shape), specs, mesh)), tree
  )


def abstract_sharded(
  make_state: Callable[[], Any], params_of: Callable[[Any], nnx.State], mesh: Mesh
) -> tuple[Any, Any]:
  """(abstract state, shardings): `make_state()` traced abstractly (nothing allocated), every leaf a
  ShapeDtypeStruct carrying its NamedSharding, e.g. for ahead-of-time lowering. `params_of(state)` picks the
  nnx.State of parameters (and other variables) whose logical axes define the specs."""
  abstract = jax.eval_shape(make_state)
  specs = param_specs(params_of(abstract), mesh)
  shardings = tree_shardings(abstract, specs, mesh)
  return with_shardings(abstract, shardings), shardings


def with_shardings(tree: Any, shardings: Any) -> Any:
  """`tree` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs carrying `shardings` (a tree like it, or one
  sharding for every leaf)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


def weight_shardings(params: Any, rest: Any, mesh: Mesh) -> tuple[Any, Any]:
  """The (params, rest) layout on `mesh` for decoding: specs from the parameters' logical axes under
  DECODE_AXIS_RULES (training's, except that the dense weights are not split over expert)."""
  return tree_shardings((params, rest), param_specs(params, mesh, DECODE_AXIS_RULES), mesh)
