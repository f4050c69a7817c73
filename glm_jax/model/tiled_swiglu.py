"""The routed experts' SwiGLU on the CPU: every projection of a tile of rows in one loop step, forward and backward.

  y[r] = (silu(x[r] W_gate_g) * (x[r] W_up_g)) W_down_g,   g = the group of row r (rows sorted by group; rows past
                                                            the last group give 0)
grouped_ffn.expert_swiglu's result without three separate grouped matmuls: each group's rows are cut into tiles of
`tile` rows from the group's first row (only the real tiles visited: the loop's trip count is traced); a forward step
takes a tile through all three projections, a backward step through all six products (dx and the three weight
gradients), so a MoE layer runs two loops where three grouped matmuls run nine. grouped_ffn picks the tile by the
call's rows (grouped_matmul.cpu_tile). A tile's rows past its group are overwritten by the next group's tile (y,
dx) and zeroed in x, dy and the kept projections (no weight gradient, even from NaN rows past the last group); the
gate and up projections are kept (fp32, [rows, I]) for the backward, as autodiff of the grouped matmuls keeps them.
Precision as grouped_matmul's CPU path: `dtype` operands, fp32 accumulation, cotangents cast to the operand dtype
before each product, weight gradients summed in fp32.
Measurements: docs/kernels.md, "The routed experts' grouped matmuls".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm_jax.model.grouped_matmul import CPU_TILE, summed_like, varying_like, zero_past_groups


class _Tiles(NamedTuple):
  group: jax.Array  # [V] the group of each tile (V = ceil(rows / tile) + G, the static bound)
  start: jax.Array  # [V] its first row
  count: jax.Array  # int32 scalar: the real tiles, a prefix of the V
  ends: jax.Array  # [G] one past each group's last row


def _tiles(rows: int, group_sizes: jax.Array, tile: int) -> _Tiles:
  groups = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  per_group = -(-sizes // tile)
  before = jnp.cumsum(per_group) - per_group  # tiles of the groups before g
  v = jnp.arange(-(-rows // tile) + groups, dtype=jnp.int32)
  group = jnp.clip(jnp.searchsorted(before + per_group, v, side="right"), 0, groups - 1).astype(jnp.int32)
  start = (ends - sizes)[group] + (v - before[group]) * tile
  return _Tiles(group, start.astype(jnp.int32), jnp.sum(per_group).astype(jnp.int32), ends)


def _pad(a: jax.Array, tile: int) -> jax.Array:
  return jnp.pad(a, ((0, tile), (0, 0)))


def _slice(a: jax.Array, start: jax.Array, tile: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(a, start, tile, 0)


def _put(a: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
  return jax.lax.dynamic_update_slice_in_dim(a, rows.astype(a.dtype), start, 0)


def _forward(xs, group_sizes, gate, up, down, dtype, out_dtype, tile):
  """(y [rows, D] in out_dtype, gate and up projections [rows + tile, I] fp32, the tiles)."""
  rows, inter = xs.shape[0], gate.shape[-1]
  t = _tiles(rows, group_sizes, tile)
  x_pad = _pad(xs.astype(dtype), tile)
  w_gate, w_up, w_down = gate.astype(dtype), up.astype(dtype), down.astype(dtype)

  def body(i, carry):
    y, a_all, b_all = carry
    g, start = t.group[i], t.start[i]
    x_t = _slice(x_pad, start, tile)
    a = jnp.dot(x_t, w_gate[g], preferred_element_type=jnp.float32)
    b = jnp.dot(x_t, w_up[g], preferred_element_type=jnp.float32)
    h = (jax.nn.silu(a) * b).astype(dtype)
    out = jnp.dot(h, w_down[g], preferred_element_type=jnp.float32)
    return _put(y, out, start), _put(a_all, a, start), _put(b_all, b, start)

  y0 = jnp.zeros((rows + tile, w_down.shape[-1]), out_dtype)
  ab0 = jnp.zeros((rows + tile, inter), jnp.float32)
  operands = (xs, group_sizes, gate, up, down)
  init = tuple(varying_like(z, *operands) for z in (y0, ab0, ab0))
  y, a_all, b_all = jax.lax.fori_loop(0, t.count, body, init)
  return zero_past_groups(y[:rows], group_sizes), a_all, b_all, t


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def tiled_swiglu(
  xs: jax.Array,
  group_sizes: jax.Array,
  gate_EDI: jax.Array,
  up_EDI: jax.Array,
  down_EID: jax.Array,
  dtype: jnp.dtype,
  out_dtype: jnp.dtype = jnp.float32,
  tile: int = CPU_TILE,
) -> jax.Array:
  """Row r of xs [rows, D] through the SwiGLU expert of its group: [rows, D] in out_dtype (module docstring)."""
  return _forward(xs, group_sizes, gate_EDI, up_EDI, down_EID, dtype, out_dtype, tile)[0]


def _fwd(xs, group_sizes, gate, up, down, dtype, out_dtype, tile):
  y, a_all, b_all, t = _forward(xs, group_sizes, gate, up, down, dtype, out_dtype, tile)
  return y, (xs, group_sizes, gate, up, down, a_all, b_all, t)


def _bwd(dtype, out_dtype, tile, res, dy):
  del out_dtype
  xs, group_sizes, gate, up, down, a_all, b_all, t = res  # t: the forward's tiles
  rows = xs.shape[0]
  x_pad, dy_pad = _pad(xs.astype(dtype), tile), _pad(dy.astype(dtype), tile)
  w_gate, w_up, w_down = gate.astype(dtype), up.astype(dtype), down.astype(dtype)

  def body(i, carry):
    dx, dgate, dup, ddown = carry
    g, start = t.group[i], t.start[i]
    # Rows of the next group, or past the last group (whose xs may hold anything, NaN included): no gradient
    mine = (start + jnp.arange(tile) < t.ends[g])[:, None]
    keep = lambda a: jnp.where(mine, a, jnp.zeros((), a.dtype))
    x_t = keep(_slice(x_pad, start, tile))
    dy_t = keep(_slice(dy_pad, start, tile))
    a, b = keep(_slice(a_all, start, tile)), keep(_slice(b_all, start, tile))
    silu_a = jax.nn.silu(a)
    h = (silu_a * b).astype(dtype)
    dh = jnp.dot(dy_t, w_down[g].T, preferred_element_type=jnp.float32)
    sig = jax.nn.sigmoid(a)
    da = (dh * b * sig * (1 + a * (1 - sig))).astype(dtype)  # d silu(a) / da = sig(a) (1 + a (1 - sig(a)))
    db = (dh * silu_a).astype(dtype)
    dx_t = jnp.dot(da, w_gate[g].T, preferred_element_type=jnp.float32) + jnp.dot(
      db, w_up[g].T, preferred_element_type=jnp.float32
    )
    add = lambda acc, lhs, rhs: acc.at[g].add(jnp.dot(lhs.T, rhs, preferred_element_type=jnp.float32))
    return _put(dx, dx_t, start), add(dgate, x_t, da), add(dup, x_t, db), add(ddown, h, dy_t)

  operands = (xs, dy, group_sizes, gate, up, down)
  init = (
    jnp.zeros((rows + tile, xs.shape[1]), jnp.float32),
    jnp.zeros(gate.shape, jnp.float32),
    jnp.zeros(up.shape, jnp.float32),
    jnp.zeros(down.shape, jnp.float32),
  )
  dx, dgate, dup, ddown = jax.lax.fori_loop(0, t.count, body, tuple(varying_like(z, *operands) for z in init))
  dx = zero_past_groups(dx[:rows], group_sizes).astype(xs.dtype)
  return (
    summed_like(dx, xs),
    None,
    summed_like(dgate, gate).astype(gate.dtype),
    summed_like(dup, up).astype(up.dtype),
    summed_like(ddown, down).astype(down.dtype),
  )


tiled_swiglu.defvjp(_fwd, _bwd)
