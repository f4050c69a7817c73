"""The grouped matmul of the routed experts: row r of x times the weight of its group, rows sorted by group.

  y[r] = x[r] @ w[g(r)],   g(r) = the group whose range [start_g, start_g + size_g) holds r; rows past the last
                           group give 0                          (jax.lax.ragged_dot's contract)
`grouped_matmul` picks the implementation for the backend being traced for (glm_jax/model/platform.py):
  tpu:    `megablox_grouped_matmul`, jax's Pallas grouped matmul (megablox: gmm forward and for dx, tgmm for dw); only
          the row tiles that hold real rows run (at most ceil(real rows / 256) + groups - 1), however large the buffer.
  cpu:    `tiled_grouped_matmul`: rows cut into tiles of `cpu_tile(rows, E)` rows (the mean group size as a power of
          two in [4, 128]); each (tile, group) pair that overlaps is one [tile, in] @ [in, out] matmul with the other
          groups' rows zeroed, at most ceil(rows / tile) + E - 1 of them (XLA:CPU's own ragged_dot multiplies every
          row by every group's weight); a custom_vjp gives dx and dw the same shape. tiled_swiglu.py goes further.
  other:  jax.lax.ragged_dot (GPU lowers it to grouped kernels).
All take operands in any float dtype (megablox: bfloat16 or float32) and accumulate in fp32
(preferred_element_type); the TPU and CPU backwards multiply the cotangent in the operands' dtype.
Why these kernels and tiles, with their measurements: docs/kernels.md, "The routed experts' grouped matmuls".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm as megablox_gmm, make_group_metadata, tgmm as megablox_tgmm

from glm_jax.model.platform import current_platform

CPU_TILE = 128  # the largest row tile on CPU: training's (tests/model/test_grouped_matmul.py covers sizes around it)
CPU_MIN_TILE = 4  # the smallest: decoding's
TPU_ROW_TILE = 256  # megablox's row tile: bounds the padding at a group boundary (< 256 rows a group)
TPU_MAX_TILE = 1024  # megablox's in / out tiles: whole dims up to this (fewer re-reads of each operand tile)


def tpu_tiling(k: int, n: int) -> tuple[int, int, int]:
  """megablox's (rows, in, out) tiles for a [rows, k] x [k, n] grouped matmul, the same for its dx ([rows, n] x
  [n, k]) and dw calls: in and out tiles of min(1024, max(k, n) rounded up to 128). megablox's default 128^3 tiles
  re-read each operand tile so often that glm5_744b's expert matmuls are HBM-bound (docs/kernels.md)."""
  t = min(TPU_MAX_TILE, -(-max(k, n) // 128) * 128)
  return TPU_ROW_TILE, t, t


def cpu_tile(rows: int, groups: int) -> int:
  """The CPU row tile for `rows` rows over `groups` groups: ceil(rows / groups) rounded up to a power of two, within
  [CPU_MIN_TILE, CPU_TILE] (docs/kernels.md, "The routed experts' grouped matmuls", says why)."""
  mean = -(-rows // max(groups, 1))
  return min(CPU_TILE, max(CPU_MIN_TILE, 1 << (mean - 1).bit_length()))


def grouped_matmul(
  x: jax.Array,
  w: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: jnp.dtype = jnp.float32,
  *,
  zero_past: bool = True,
) -> jax.Array:
  """jax.lax.ragged_dot(x [rows, in], w [groups, in, out], group_sizes [groups]) -> [rows, out], by backend.
  zero_past=False: the rows past the last group (in y and in dx) may be left undefined where that saves a pass
  over them (megablox leaves them unwritten), for a caller that never reads them."""
  platform = current_platform()
  if platform == "cpu":
    tile = cpu_tile(x.shape[0], w.shape[0])
    return tiled_grouped_matmul(x, w, group_sizes, tile, jnp.dtype(preferred_element_type))
  if platform == "tpu":
    return megablox_grouped_matmul(x, w, group_sizes, preferred_element_type, zero_past=zero_past)
  return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type)


def megablox_grouped_matmul(
  x: jax.Array,
  w: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: jnp.dtype = jnp.float32,
  *,
  tiling: tuple[int, int, int] | None = None,
  interpret: bool = False,
  zero_past: bool = True,
) -> jax.Array:
  """ragged_dot's result with megablox's gmm / tgmm kernels; interpret=True runs them in Pallas interpret mode (any
  backend). The rows are padded to a whole number of row tiles; rows past the groups, which the kernels leave
  unwritten (in y and in dx), are set to 0, or left undefined with zero_past=False (whatever x holds there: tgmm
  masks the rows it loads with a select, so undefined rows of x or dy never reach dw)."""
  if x.dtype not in (jnp.bfloat16, jnp.float32) or w.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"megablox_grouped_matmul: x {x.dtype} and w {w.dtype}; the kernel takes bfloat16 or float32")
  rows = x.shape[0]
  tiling = tiling or tpu_tiling(x.shape[1], w.shape[2])
  pad = -rows % tiling[0]
  y = _megablox(
    jnp.pad(x, ((0, pad), (0, 0))),
    w,
    group_sizes.astype(jnp.int32),
    jnp.dtype(preferred_element_type),
    tuple(tiling),
    interpret,
    zero_past,
  )
  return y[:rows]


def zero_past_groups(a: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """a [rows, ...] with the rows past the last group set to 0 (ragged_dot's contract for y and dx)."""
  past = jnp.arange(a.shape[0]) >= jnp.sum(group_sizes)
  return jnp.where(past.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.zeros((), a.dtype), a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _megablox(x, w, group_sizes, out_dtype, tiling, interpret, zero_past):
  y = megablox_gmm(x, w, group_sizes, out_dtype, tiling, interpret=interpret)
  return zero_past_groups(y, group_sizes) if zero_past else y


def _megablox_fwd(x, w, group_sizes, out_dtype, tiling, interpret, zero_past):
  return _megablox(x, w, group_sizes, out_dtype, tiling, interpret, zero_past), (x, w, group_sizes)


def _megablox_bwd(out_dtype, tiling, interpret, zero_past, res, dy):
  del out_dtype
  x, w, group_sizes = res
  dy = dy.astype(x.dtype)
  dx = megablox_gmm(dy, w, group_sizes, x.dtype, tiling, transpose_rhs=True, interpret=interpret)
  dx = zero_past_groups(dx, group_sizes) if zero_past else dx
  dw = megablox_tgmm(
    x.swapaxes(0, 1), dy, group_sizes, jnp.float32, tiling, num_actual_groups=w.shape[0], interpret=interpret
  )
  return dx, dw.astype(w.dtype), None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def _visits(group_sizes: jax.Array, n_tiles: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The (tile, group) pairs whose rows overlap, in row order: (tile index [V], group [V], real [V]) for the static
  bound V = n_tiles + groups - 1; pairs past the real ones repeat the last and are marked not real."""
  groups = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  first = starts // tile
  count = jnp.where(group_sizes > 0, (ends - 1) // tile - first + 1, 0)
  offsets = jnp.cumsum(count) - count  # visits before group g
  v = jnp.arange(n_tiles + groups - 1)
  group = jnp.clip(jnp.searchsorted(offsets + count, v, side="right"), 0, groups - 1)
  real = v < jnp.sum(count)
  tile_idx = jnp.where(real, first[group] + v - offsets[group], 0)
  return tile_idx.astype(jnp.int32), group.astype(jnp.int32), real


def _tiles(rows: int, tile: int, group_sizes: jax.Array):
  """(number of tiles, the padding that makes rows a whole number of tiles, each group's (start, end) rows)."""
  n_tiles = -(-rows // tile)
  ends = jnp.cumsum(group_sizes)
  return n_tiles, ((0, n_tiles * tile - rows), (0, 0)), (ends - group_sizes, ends)


def _tile_rows(x_pad, bounds, visit, tile):
  """The tile's rows of x that belong to the visit's group (others zeroed), and where the tile starts."""
  t, g, real = visit
  starts, ends = bounds
  start = t * tile
  rows = start + jnp.arange(tile)
  keep = (rows >= starts[g]) & (rows < ends[g]) & real
  xs = jax.lax.dynamic_slice_in_dim(x_pad, start, tile, 0)
  return jnp.where(keep[:, None], xs, jnp.zeros_like(xs)), start


def _varying_axes(a: jax.Array) -> frozenset:
  """The mesh axes `a` varies over inside a shard_map (check_vma); empty outside one."""
  return frozenset(getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", ()))


def varying_like(a: jax.Array, *operands) -> jax.Array:
  """`a` made to vary over every mesh axis the operands vary over: inside a shard_map a loop carry must have the
  type its body returns."""
  axes = tuple(sorted(frozenset().union(*map(_varying_axes, operands)) - _varying_axes(a)))
  return jax.lax.pcast(a, axes, to="varying") if axes else a


def _forward(x, w, group_sizes, tile, out_dtype):
  rows = x.shape[0]
  n_tiles, pad, bounds = _tiles(rows, tile, group_sizes)
  x_pad = jnp.pad(x, pad)

  def body(y, visit):
    xs, start = _tile_rows(x_pad, bounds, visit, tile)
    out = jnp.dot(xs, w[visit[1]], preferred_element_type=out_dtype)
    y = jax.lax.dynamic_update_slice_in_dim(y, jax.lax.dynamic_slice_in_dim(y, start, tile, 0) + out, start, 0)
    return y, None

  y0 = varying_like(jnp.zeros((n_tiles * tile, w.shape[-1]), out_dtype), x, w, group_sizes)
  y, _ = jax.lax.scan(body, y0, _visits(group_sizes, n_tiles, tile))
  return y[:rows]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tiled_grouped_matmul(
  x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int = CPU_TILE, out_dtype: jnp.dtype = jnp.float32
) -> jax.Array:
  """ragged_dot's result computed tile by tile (see the module docstring); differentiable in x and w."""
  return _forward(x, w, group_sizes, tile, out_dtype)


def _fwd(x, w, group_sizes, tile, out_dtype):
  return _forward(x, w, group_sizes, tile, out_dtype), (x, w, group_sizes)


def _bwd(tile, out_dtype, res, dy):
  del out_dtype
  x, w, group_sizes = res
  dx = _forward(dy.astype(x.dtype), jnp.swapaxes(w, 1, 2), group_sizes, tile, jnp.float32).astype(x.dtype)
  n_tiles, pad, bounds = _tiles(x.shape[0], tile, group_sizes)
  x_pad, dy_pad = jnp.pad(x, pad), jnp.pad(dy, pad)

  def body(dw, visit):
    xs, start = _tile_rows(x_pad, bounds, visit, tile)
    dys = _tile_rows(dy_pad, bounds, visit, tile)[0].astype(x.dtype)  # masked too: rows past the groups may be NaN
    g = visit[1]
    contrib = jnp.dot(xs.T, dys, preferred_element_type=jnp.float32)
    return dw.at[g].add(contrib), None

  dw0 = varying_like(jnp.zeros(w.shape, jnp.float32), x, dy, group_sizes)
  dw, _ = jax.lax.scan(body, dw0, _visits(group_sizes, n_tiles, tile))
  return summed_like(dx, x), summed_like(dw, w).astype(w.dtype), None


def summed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """Inside a shard_map, an operand may be the same on devices where the other one differs (w replicated over a
  token axis, x over the tensor axis of tensor-parallel experts): its cotangent is the sum over those devices,
  as autodiff of ragged_dot gives it."""
  axes = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
  return jax.lax.psum(ct, axes) if axes else ct


tiled_grouped_matmul.defvjp(_fwd, _bwd)


@functools.lru_cache(maxsize=256)
def _grid_tiles(group_sizes: tuple[int, ...], m: int, tm: int, visit_empty_groups: bool) -> int:
  """The row tiles megablox's grid visits (make_group_metadata, run eagerly: a cost report asks again for the same
  groups in every layer of every program it reads)."""
  _, tiles = make_group_metadata(
    group_sizes=jnp.asarray(group_sizes, jnp.int32),
    m=m,
    tm=tm,
    start_group=0,
    num_nonzero_groups=len(group_sizes),
    visit_empty_groups=visit_empty_groups,
  )
  return int(tiles)


def megablox_grid_cost(
  kernel: str,
  m: int,
  k: int,
  n: int,
  group_sizes,
  *,
  tiling: tuple[int, int, int] | None = None,
  in_bytes: int = 2,
  out_bytes: int = 4,
) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of one megablox call as its grid runs for these group sizes (a host-side count, for cost
  reports; megablox's own cost_estimate assumes every row of the static buffer is real).

  kernel "gmm": [m, k] x [G, k, n] -> [m, n] (the forward and dx); "tgmm": [k, m]^T-style [m, k] x [m, n] ->
  [G, k, n] (dw). The grid visits megablox's active row tiles (make_group_metadata: each group's rows rounded
  out to whole tiles; tgmm also one tile for each empty group) x ceil(n / tn) x ceil(k / tk) steps, each a full
  tm x tk x tn tile product, padding included. Bytes: every step reads its lhs and rhs tiles (an rhs tile only
  once per run of one group when k is a single tile, as Pallas skips re-fetching an unchanged block), and each
  output tile is written once per visit."""
  tm, tk, tn = tiling or tpu_tiling(k, n)
  sizes = tuple(int(g) for g in np.asarray(group_sizes))  # on the host: a count, not a computation to compile
  tiles = _grid_tiles(sizes, -(-m // tm) * tm, tm, kernel == "tgmm")
  tiles_k, tiles_n = -(-k // tk), -(-n // tn)
  steps = tiles * tiles_k * tiles_n
  flops = 2.0 * steps * tm * tk * tn
  groups_visited = sum(g > 0 for g in sizes) if kernel == "gmm" else len(sizes)
  if kernel == "gmm":
    rhs_reads = steps if tiles_k > 1 else tiles_n * groups_visited
    moved = steps * tm * tk * in_bytes + rhs_reads * tk * tn * in_bytes + tiles * tiles_n * tm * tn * out_bytes
  elif kernel == "tgmm":
    moved = steps * (tk * tm + tm * tn) * in_bytes + groups_visited * tiles_k * tiles_n * tk * tn * out_bytes
  else:
    raise ValueError(f"megablox_grid_cost: kernel={kernel!r}; 'gmm' or 'tgmm'")
  return flops, float(moved)
