"""Shared by the model tests: modules with random parameters, built without per-shape XLA compiles."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def init_module(ctor, seed, scale=0.3):
  """Builds a module abstractly and fills it from numpy (no per-shape XLA compiles): weights N(0, scale^2),
  norm scales and biases 1 + N(0, 0.2^2), so that every parameter matters to the outputs."""
  graphdef, state = nnx.split(nnx.eval_shape(ctor))
  rng = np.random.default_rng(seed)

  def fill(path, a):
    is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
    z = rng.standard_normal(a.shape)
    return jnp.asarray(1 + 0.2 * z if is_norm else scale * z, a.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))
