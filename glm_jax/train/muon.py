"""Muon's direction with its matrices spread over the mesh: momentum, Newton-Schulz, the update's shape scale.

GLM-5 (G5 appendix A, as GLM-4.5) trains with Muon: momentum 0.95 (Nesterov), 5 Newton-Schulz steps, the
orthogonalized update rescaled so its RMS matches AdamW's (0.2, Moonlight):

  O = NS5(m^)                       m^ = Nesterov momentum of the gradient, NS5 = 5 quintic Newton-Schulz steps
  u = -lr_t (rms sqrt(max(fan_in, fan_out)) O + wd W)          (optax.contrib consistent_rms; Moonlight, 2502.16982)
An exactly orthogonal fan_in x fan_out matrix has RMS 1/sqrt(max(fan_in, fan_out)), so u's RMS would be
lr_t * muon_update_rms. The quintic (3.4445, -4.7750, 2.0315) does not converge to 1 (its singular values land
in about [0.68, 1.14] for well-conditioned matrices), so RMS(u) = lr_t * muon_update_rms * (quadratic mean of
O's singular values) ~ 0.8-0.95 x lr_t * muon_update_rms.

The arithmetic is optax.contrib's (its momentum, its Newton-Schulz, its scale_by_shape), written here against
optax's public API (optax 0.2.8 exports neither its Newton-Schulz nor scale_by_shape) and with one addition
optax cannot express: `orthogonalize` places whole matrices on the devices of a mesh. Weight decay and the
learning rate are applied after this, in glm_jax/train/optimizers.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonState

from glm_jax.model.platform import current_platform
from glm_jax.sharding.mesh import divisible_spec, entry_axes, logical_to_spec
from glm_jax.train.param_plan import MuonLayout, matrix_axes


def newton_schulz(x: jax.Array, ns_coeffs: jax.Array, ns_steps: int, eps: float) -> jax.Array:
  """Muon's orthogonalization of each matrix of x [batch, m, n], as optax.contrib computes it (Frobenius
  preconditioning): a matrix with more rows than columns is transposed, divided by its Frobenius norm + eps,
  then ns_steps quintic steps  X <- a X + (b A + c A A) X,  A = X X^T,  (a, b, c) = ns_coeffs  (Keller Jordan)."""

  def one(x):
    transposed = x.shape[0] > x.shape[1]
    if transposed:
      x = x.T
    x = x / (jnp.linalg.norm(x, ord="fro") + eps)
    c = ns_coeffs.astype(x.dtype)

    def step(_, x):
      a = x @ x.T
      return c[0] * x + (c[1] * a + c[2] * a @ a) @ x

    x = jax.lax.fori_loop(0, ns_steps, step, x, unroll=True)
    return x.T if transposed else x

  return jax.vmap(one)(x)


def _newton_schulz(x: jax.Array, n_matrix_in: int, ns_coeffs: jax.Array, ns_steps: int, eps: float) -> jax.Array:
  """newton_schulz on x [batch, *in axes, *out axes] (the first n_matrix_in axes after batch are in)."""
  shape = x.shape
  m = math.prod(shape[1 : 1 + n_matrix_in])
  return newton_schulz(x.reshape(shape[0], m, -1), ns_coeffs, ns_steps, eps).reshape(shape)


def _exchange(x: jax.Array, axes: tuple[str, ...], split: int, concat: int) -> jax.Array:
  """jax.lax.all_to_all(x, axes, split, concat, tiled=True) inside a shard_map. For a dimension split over several
  mesh axes (the model dimension over fsdp x context) on XLA:CPU, the same result by an all-gather and a slice:
  XLA:CPU's HLO verifier rejects the tuple all-to-all it lowers such an exchange to (one over an axis tuple, or
  one per axis). Other backends, TPU among them, take the all-to-all."""
  if len(axes) == 1 or current_platform() != "cpu":
    return jax.lax.all_to_all(x, axes, split, concat, tiled=True)
  whole = jax.lax.all_gather(x, axes, axis=concat, tiled=True)
  size = x.shape[split] // math.prod(jax.lax.axis_size(a) for a in axes)
  return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(axes) * size, size, axis=split)


def _split_over_replicas(x: jax.Array, replicas: tuple[str, ...], fn: Callable) -> jax.Array:
  """fn(x) (row-wise over axis 0) inside a shard_map where the devices along `replicas` all hold the same x:
  each computes ceil(rows / n) rows and a psum assembles them (no padding to n rows, so a leaf of 3 matrices on
  512 replicas stays 3 matrices). Slices are clamped to stay in bounds; rows another device owns are zeroed."""
  n = math.prod(jax.lax.axis_size(a) for a in replicas)
  rows = x.shape[0]
  chunk = -(-rows // n)
  r = jax.lax.axis_index(replicas)
  start = jnp.minimum(r * chunk, rows - chunk)
  y = fn(jax.lax.dynamic_slice_in_dim(x, start, chunk, 0))
  owned = (start + jnp.arange(chunk)) >= r * chunk
  y = jnp.where(owned.reshape((chunk,) + (1,) * (y.ndim - 1)), y, jnp.zeros_like(y))
  out = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((rows,) + y.shape[1:], y.dtype), y, start, 0)
  return jax.lax.psum(out, replicas)


def orthogonalize(
  x: jax.Array, layout: MuonLayout, ns_coeffs: jax.Array, ns_steps: int, eps: float = 1e-8
) -> jax.Array:
  """Newton-Schulz orthogonalization (`newton_schulz`) of every matrix of x; on a mesh, each device does whole matrices.

  optax reshapes a leaf to [batch, in, out] (stacked layers, experts and split heads merged into one batch axis)
  and vmaps Newton-Schulz over it. Under a mesh that loses the parameter's sharding (experts split over
  `expert` are no block of a layers-major merged axis), and XLA, left to itself, computes every Gram matrix
  X X^T on every device with a sharded contraction (for glm5_744b's routed experts f32[75 * 256, 2048, 2048] a
  chip, 322 GB) or, given a batch-sharded target, reshards through a full all-gather of the leaf (24 GiB a MoE
  layer pair). So, under a mesh with more than one device and a known parameter layout, a shard_map does it
  explicitly. On each device, with the local block [batch_l, *in_l, *out_l]:
    1. pad batch_l with zero matrices (Newton-Schulz maps them to zero) to a multiple of the number of devices
       over which the matrix dimensions are split (fsdp on the model dimension, tensor on a width);
    2. per mesh axis sharding a matrix dimension, an all-to-all that splits the batch and gathers that
       dimension: the device now holds batch_l / (those axes' sizes) whole matrices;
    3. the devices along mesh axes that do not shard the leaf at all (replicas: e.g. expert for attention
       weights) hold the same matrices: each orthogonalizes its share and a psum assembles them;
    4. the all-to-alls in reverse put every matrix back in the parameter's layout.
  The arithmetic per matrix is `newton_schulz`'s, so the result is the same on any mesh (and on one device).
  """
  ndim = x.ndim
  matrix_in, matrix_out = matrix_axes(layout.dims, ndim)
  batch_axes = tuple(i for i in range(ndim) if i not in matrix_in + matrix_out)
  order = batch_axes + matrix_in + matrix_out
  inverse = tuple(sorted(range(ndim), key=lambda i: order[i]))
  n_in = len(matrix_in)

  def local_orthogonalize(xl: jax.Array, matrix_sharding: tuple = (), replicas: tuple = ()) -> jax.Array:
    xl = xl.transpose(order)
    batch_shape = xl.shape[: len(batch_axes)]
    b = math.prod(batch_shape)
    xl = xl.reshape((b,) + xl.shape[len(batch_axes) :])
    group = math.prod(mesh.shape[a] for _, axes in matrix_sharding for a in axes)
    xl = jnp.pad(xl, ((0, -b % group),) + ((0, 0),) * (xl.ndim - 1))
    # Batch split, matrix dimension gathered; the way back undoes it.
    for pos, axes in matrix_sharding:
      xl = _exchange(xl, axes, 0, pos)
    if replicas:
      y = _split_over_replicas(xl, replicas, lambda part: _newton_schulz(part, n_in, ns_coeffs, ns_steps, eps))
    else:
      y = _newton_schulz(xl, n_in, ns_coeffs, ns_steps, eps)
    for pos, axes in reversed(matrix_sharding):
      y = _exchange(y, axes, pos, 0)
    return y[:b].reshape(batch_shape + y.shape[1:]).transpose(inverse)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or layout.logical_axes is None or len(layout.logical_axes) != ndim:
    return local_orthogonalize(x)
  spec = divisible_spec(logical_to_spec(layout.logical_axes), x.shape, mesh)
  used = {a for e in spec for a in entry_axes(e)}
  matrix_sharding = tuple(
    (1 + order[len(batch_axes) :].index(i), entry_axes(spec[i]))
    for i in matrix_in + matrix_out
    if math.prod(mesh.shape[a] for a in entry_axes(spec[i])) > 1
  )
  replicas = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
  fn = functools.partial(local_orthogonalize, matrix_sharding=matrix_sharding, replicas=replicas)
  return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


def scale_by_muon(
  ns_coeffs: tuple[float, float, float],
  ns_steps: int,
  beta: float,
  nesterov: bool,
  layouts: Callable,
  mu_dtype=None,
  eps: float = 1e-8,
) -> optax.GradientTransformation:
  """Muon's direction: optax.contrib.scale_by_muon's momentum (bias-corrected, Nesterov) and Newton-Schulz
  (Frobenius preconditioning), with `orthogonalize` placing the matrices on the mesh. State: optax's MuonState.
  layouts(updates): a tree of MuonLayout shaped like the updates."""

  def init_fn(params):
    return MuonState(
      count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params, dtype=mu_dtype), ns_coeffs=jnp.asarray(ns_coeffs)
    )

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:  # beta * m_hat(t + 1) + (1 - beta) * g_hat(t), as optax
      mu_hat = jax.tree.map(
        lambda m, g: beta * m + (1 - beta) * g,
        optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
        optax.tree.bias_correction(updates, beta, count),
      )
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    out = jax.tree.map(lambda x, lay: orthogonalize(x, lay, state.ns_coeffs, ns_steps, eps), mu_hat, layouts(updates))
    return out, MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_shape(layouts: Callable, consistent_rms: float | None) -> optax.GradientTransformation:
  """Rescales each orthogonalized matrix by its shape, as optax.contrib's scale_by_shape: by
  sqrt(max(fan_in, fan_out)) * consistent_rms (Moonlight, 2502.16982: an orthogonal matrix's RMS is
  1 / sqrt(max(fan_in, fan_out)), so the update's RMS becomes consistent_rms), or, with None, by
  sqrt(max(1, fan_out / fan_in)) (Keller Jordan's width scaling). layouts(updates): MuonLayouts shaped like the
  updates. Stateless."""

  def scale(u: jax.Array, layout: MuonLayout) -> jax.Array:
    fan_in, fan_out = (math.prod(u.shape[a] for a in axes) for axes in matrix_axes(layout.dims, u.ndim))
    if consistent_rms is None:
      return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * u
    return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * u

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(scale, updates, layouts(updates)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
