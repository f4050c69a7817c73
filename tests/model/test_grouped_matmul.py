"""The routed experts' grouped matmul: the CPU tiled path and the TPU path (megablox's kernels, in Pallas interpret
mode here) equal jax.lax.ragged_dot in value and in both gradients (empty groups, every row in one group, group
sizes off the tile, rows past the last group), the tiled path visits exactly the (tile, group) pairs that overlap,
the backend choice follows the platform being traced for, and the CPU tile follows the rows (decode-sized calls on
small tiles, equal to a row-by-row computation around the tile rule's steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.model import grouped_matmul as gm
from glm_jax.model.platform import target_platform

CASES = {  # group sizes, tile
  "empty_groups": ([5, 0, 7, 20, 0, 3], 8),
  "one_group": ([35, 0, 0, 0], 8),
  "no_rows": ([0, 0, 0], 8),
  "off_tile": ([3, 1, 2], 16),
  "on_tile": ([8, 8, 16], 8),
  "cpu_tile": ([130, 1, 0, 126, 300], gm.CPU_TILE),
}


SMALL_ROWS = {  # decode-sized calls through the platform's choice: group sizes, rows past the groups, cpu_tile's tile
  "decode_batch1": ([1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0], 0, 4),  # 1 token x top-4 of 16 experts
  "decode_batch8": ([3, 0, 2, 5, 1, 4, 0, 2, 1, 3, 0, 2, 4, 1, 2, 2], 0, 4),  # 8 x top-4: groups past one tile
  "mean_4": ([9, 0, 7, 4, 1, 0, 6, 5], 0, 4),  # 32 rows over 8 groups: ceil(32 / 8) = 4, the last tile-4 size
  "mean_5": ([9, 0, 7, 4, 1, 0, 6, 5], 1, 8),  # one row past them: ceil(33 / 8) = 5, the first tile-8 size
  "mean_17": ([20, 0, 33, 15], 0, 32),  # 68 rows over 4 groups: ceil(68 / 4) = 17 -> 32
}


def per_row_grouped_matmul(x, w, sizes):
  """ragged_dot written row by row: row r times the weight of the group it falls in, 0 past the last group."""
  groups = np.repeat(np.arange(len(sizes)), sizes)
  zero = jnp.zeros((w.shape[2],), jnp.float32)
  rows = [jnp.dot(x[r], w[g], preferred_element_type=jnp.float32) for r, g in enumerate(groups)]
  return jnp.stack(rows + [zero] * (x.shape[0] - len(groups)))


def test_the_cpu_tile_is_the_mean_group_size_as_a_power_of_two_within_4_and_128():
  """Decoding (batch x top-4 rows over 16 experts) on small tiles; training's 8192 rows on CPU_TILE."""
  got = {rows: gm.cpu_tile(rows, 16) for rows in (0, 4, 32, 64, 65, 128, 256, 2048, 2049, 8192)}
  assert got == {0: 4, 4: 4, 32: 4, 64: 4, 65: 8, 128: 8, 256: 16, 2048: 128, 2049: 128, 8192: gm.CPU_TILE}


@pytest.mark.parametrize("name", list(SMALL_ROWS))
def test_small_row_counts_equal_a_row_by_row_computation(name):
  """grouped_matmul traced for the CPU, on the tile its rows give, against a per-row loop: value and both
  gradients to 1e-5 of their scale in fp32."""
  sizes, extra, tile = SMALL_ROWS[name]
  x, w, gs, ct = operands(sizes, jnp.float32, extra_rows=extra)
  assert gm.cpu_tile(x.shape[0], len(sizes)) == tile

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w) * ct), argnums=(0, 1)))(x, w)

  with target_platform("cpu"):
    jaxpr = str(jax.make_jaxpr(lambda x, w: gm.grouped_matmul(x, w, gs))(x, w))
    y = jax.jit(lambda x, w: gm.grouped_matmul(x, w, gs))(x, w)
    _, got = value_and_grads(lambda x, w: gm.grouped_matmul(x, w, gs))
  y_ref = per_row_grouped_matmul(x, w, sizes)
  _, ref = value_and_grads(lambda x, w: per_row_grouped_matmul(x, w, sizes))
  for a, b in zip((y_ref, *ref), (y, *got)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * max(1.0, float(np.max(np.abs(a)))))
  assert not np.any(np.asarray(y)[sum(sizes) :])
  assert f"length={-(-x.shape[0] // tile) + len(sizes) - 1}" in jaxpr  # the scan over that tile's visits


def operands(sizes, dtype, seed=0, extra_rows=3):
  rng = np.random.default_rng(seed)
  rows, k, n = sum(sizes) + extra_rows, 6, 5  # rows past the last group must come out 0
  x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
  w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
  ct = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
  return x, w, jnp.asarray(sizes, jnp.int32), ct


IMPLEMENTATIONS = {  # name -> fn(x, w, group_sizes, tile) with fp32 results
  "tiled": lambda x, w, gs, tile: gm.tiled_grouped_matmul(x, w, gs, tile, jnp.dtype(jnp.float32)),
  "megablox": lambda x, w, gs, tile: gm.megablox_grouped_matmul(
    x, w, gs, jnp.float32, tiling=(tile, 128, 128), interpret=True
  ),
}


@pytest.mark.parametrize("impl", ["tiled", pytest.param("megablox", marks=pytest.mark.slow)])  # interpret mode
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_equals_ragged_dot_in_value_and_gradients(impl, name, dtype, tol):
  sizes, tile = CASES[name]
  x, w, gs, ct = operands(sizes, dtype)
  fn = IMPLEMENTATIONS[impl]

  def loss_and_grads(fn):
    loss = lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  ref = loss_and_grads(lambda x, w: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))
  got = loss_and_grads(lambda x, w: fn(x, w, gs, tile))
  y_ref = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
  y = jax.jit(fn, static_argnums=3)(x, w, gs, tile)
  scale = max(1.0, float(jnp.max(jnp.abs(y_ref))))
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=tol * scale)
  assert not np.any(np.asarray(y)[sum(sizes) :])  # rows past the last group
  for g_ref, g in zip(ref[1], got[1]):
    assert g.dtype == g_ref.dtype
    g_scale = max(1.0, float(jnp.max(jnp.abs(g_ref.astype(jnp.float32)))))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), atol=tol * g_scale)


def test_visits_are_the_overlapping_tile_group_pairs():
  """Sizes [5, 0, 7, 20, 0, 3] over tiles of 8 rows: group 0 is rows 0-4 (tile 0), group 2 rows 5-11 (tiles 0-1),
  group 3 rows 12-31 (tiles 1-3), group 5 rows 32-34 (tile 4): 7 products where ragged_dot's CPU lowering does
  every row against all 6 groups."""
  tiles, groups, real = gm._visits(jnp.asarray([5, 0, 7, 20, 0, 3]), n_tiles=5, tile=8)  # pylint: disable=protected-access
  n = int(np.sum(real))
  assert n == 7 and len(real) == 5 + 6 - 1 and not np.any(np.asarray(real)[n:])
  assert list(zip(np.asarray(tiles)[:n].tolist(), np.asarray(groups)[:n].tolist())) == [
    (0, 0),
    (0, 2),
    (1, 2),
    (1, 3),
    (2, 3),
    (3, 3),
    (4, 5),
  ]


@pytest.mark.parametrize("platform, want", [("cpu", "scan"), ("tpu", "pallas_call"), ("gpu", "ragged_dot")])
def test_the_backend_picks_the_implementation(platform, want):
  x, w, gs, _ = operands([4, 0, 9], jnp.float32)
  with target_platform(platform):  # a fresh function: jax caches traces by function, not by our platform
    jaxpr = str(jax.make_jaxpr(lambda *a: gm.grouped_matmul(*a))(x, w, gs))
  found = {p for p in ("pallas_call", "ragged_dot") if p in jaxpr}
  assert found == ({want} - {"scan"}) and want in jaxpr, found


@pytest.mark.parametrize("name", ["empty_groups", "one_group"])
def test_megablox_fast_cases(name):
  """Two of the megablox cases in the fast tier (the rest are slow: Pallas interpret mode)."""
  test_equals_ragged_dot_in_value_and_gradients("megablox", name, jnp.float32, 1e-5)


def test_megablox_refuses_other_dtypes_by_name():
  x, w, gs, _ = operands([4, 0, 9], jnp.float32)
  with pytest.raises(ValueError, match=r"x float16 and w float32; the kernel takes bfloat16 or float32"):
    gm.megablox_grouped_matmul(x.astype(jnp.float16), w, gs, interpret=True)


@pytest.mark.parametrize("impl", ["tiled", "megablox"])
def test_rows_past_the_groups_holding_nan_reach_nothing(impl):
  """The MoE's receive buffer is not filled (moe_parallel.py): its rows past the groups, and their cotangents, may
  hold anything. With NaN there and zero_past=False (megablox leaves those rows of y and dx undefined), y, dx on
  the groups' rows and dw equal ragged_dot's on the same rows zeroed."""
  sizes, tile = [5, 0, 7, 20, 0, 3], 8
  x, w, gs, ct = operands(sizes, jnp.float32, extra_rows=13)
  real = sum(sizes)
  poison = lambda a: a.at[real:].set(jnp.nan)
  if impl == "tiled":
    fn = lambda x, w: gm.tiled_grouped_matmul(x, w, gs, tile, jnp.dtype(jnp.float32))
  else:
    fn = lambda x, w: gm.megablox_grouped_matmul(
      x, w, gs, jnp.float32, tiling=(tile, 128, 128), interpret=True, zero_past=False
    )
  y, pull = jax.vjp(fn, poison(x), w)
  dx, dw = pull(poison(ct))
  y_ref, pull_ref = jax.vjp(
    lambda x, w: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32), x.at[real:].set(0), w
  )
  dx_ref, dw_ref = pull_ref(ct.at[real:].set(0))
  np.testing.assert_allclose(np.asarray(y)[:real], np.asarray(y_ref)[:real], atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx)[:real], np.asarray(dx_ref)[:real], atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), atol=1e-5)
