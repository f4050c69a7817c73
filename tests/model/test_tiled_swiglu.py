"""The CPU experts' fused SwiGLU (glm_jax/model/tiled_swiglu.py) equals the three projections written with
jax.lax.ragged_dot, in value and in the gradients of x and the three weights (empty groups, one group, sizes off
the tile, groups that share a tile, rows past the last group), and visits one tile per `tile` rows of each group;
expert_swiglu's decode-sized calls (on the small tiles grouped_matmul.cpu_tile gives them) equal a row-by-row
SwiGLU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.model import grouped_ffn, tiled_swiglu as ts
from glm_jax.model.platform import target_platform
from glm_jax.model.grouped_matmul import cpu_tile
from tests.model.test_grouped_matmul import CASES, SMALL_ROWS


def ragged_dot_swiglu(xs, gs, gate, up, down, dtype, out_dtype=jnp.float32):
  """The reference: each projection one ragged_dot, products in `dtype` accumulated in fp32."""
  mm = lambda a, w, out=jnp.float32: jax.lax.ragged_dot(a, w.astype(dtype), gs, preferred_element_type=out)
  h = (jax.nn.silu(mm(xs, gate)) * mm(xs, up)).astype(dtype)
  return mm(h, down, out_dtype)


def operands(sizes, dtype, seed=0, extra_rows=3, d=6, i=5):
  rng = np.random.default_rng(seed)
  rows, e = sum(sizes) + extra_rows, len(sizes)
  xs = jnp.asarray(rng.standard_normal((rows, d)), dtype)
  gate, up = (jnp.asarray(rng.standard_normal((e, d, i)), jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((e, i, d)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
  return xs, jnp.asarray(sizes, jnp.int32), gate, up, down, ct


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_equals_ragged_dot_in_value_and_gradients(name, dtype, tol):
  sizes, tile = CASES[name]
  xs, gs, gate, up, down, ct = operands(sizes, dtype)

  def value_and_grads(fn):
    loss = lambda *a: jnp.sum(fn(a[0], gs, *a[1:], dtype).astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(xs, gate, up, down)

  fused = lambda xs, gs, gate, up, down, dtype: ts.tiled_swiglu(xs, gs, gate, up, down, dtype, jnp.float32, tile)
  y_ref = ragged_dot_swiglu(xs, gs, gate, up, down, dtype)
  y = jax.jit(fused, static_argnums=5)(xs, gs, gate, up, down, dtype)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=tol * max(1.0, float(jnp.max(jnp.abs(y_ref)))))
  assert not np.any(np.asarray(y)[sum(sizes) :])  # rows past the last group
  (_, g_ref), (_, g_got) = value_and_grads(ragged_dot_swiglu), value_and_grads(fused)
  for a, b in zip(g_ref, g_got):
    assert a.dtype == b.dtype
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(b, a, atol=tol * max(1.0, float(np.max(np.abs(a)))))


def per_row_swiglu(xs, sizes, gate, up, down):
  """Row r through the SwiGLU of the group it falls in, one row at a time (fp32); 0 past the last group."""
  mm = lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32)
  groups = np.repeat(np.arange(len(sizes)), sizes)
  rows = [mm(jax.nn.silu(mm(xs[r], gate[g])) * mm(xs[r], up[g]), down[g]) for r, g in enumerate(groups)]
  return jnp.stack(rows + [jnp.zeros((xs.shape[1],), jnp.float32)] * (xs.shape[0] - len(groups)))


@pytest.mark.parametrize("name", list(SMALL_ROWS))
def test_small_row_counts_equal_a_row_by_row_swiglu(name):
  """expert_swiglu traced for the CPU (the fused loop on the tile its rows give) against per_row_swiglu: value and
  the gradients of xs and the three weights to 1e-5 of their scale in fp32."""
  sizes, extra, tile = SMALL_ROWS[name]
  xs, gs, gate, up, down, ct = operands(sizes, jnp.float32, extra_rows=extra)
  assert cpu_tile(xs.shape[0], len(sizes)) == tile

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3)))(xs, gate, up, down)

  ours = lambda *a: grouped_ffn.expert_swiglu(a[0], gs, *a[1:], jnp.float32)
  with target_platform("cpu"):
    y, (_, got) = jax.jit(ours)(xs, gate, up, down), value_and_grads(ours)
  reference = lambda *a: per_row_swiglu(a[0], sizes, *a[1:])
  y_ref, (_, ref) = reference(xs, gate, up, down), value_and_grads(reference)
  for a, b in zip((y_ref, *ref), (y, *got)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * max(1.0, float(np.max(np.abs(a)))))
  assert not np.any(np.asarray(y)[sum(sizes) :])


def test_tiles_are_each_groups_rows_cut_from_its_first_row():
  """Sizes [5, 0, 7, 20, 0, 3] in tiles of 8: group 0 rows 0-4 (one tile at 0), group 2 rows 5-11 (at 5), group 3
  rows 12-31 (at 12, 20, 28), group 5 rows 32-34 (at 32): 6 tiles of the static bound ceil(38 / 8) + 6 = 11."""
  t = ts._tiles(38, jnp.asarray([5, 0, 7, 20, 0, 3]), tile=8)  # pylint: disable=protected-access
  n = int(t.count)
  assert n == 6 and len(t.group) == 11 and int(t.ends[-1]) == 35  # rows in groups
  assert list(zip(np.asarray(t.group)[:n].tolist(), np.asarray(t.start)[:n].tolist())) == [
    (0, 0),
    (2, 5),
    (3, 12),
    (3, 20),
    (3, 28),
    (5, 32),
  ]


def test_the_cpu_trace_takes_the_fused_loop_and_others_the_grouped_matmuls():
  xs, gs, gate, up, down, _ = operands([4, 0, 9], jnp.float32)
  for platform, fused in (("cpu", True), ("gpu", False)):
    with target_platform(platform):
      jaxpr = str(jax.make_jaxpr(lambda *a: grouped_ffn.expert_swiglu(*a, jnp.float32))(xs, gs, gate, up, down))
    assert ("custom_vjp_call" in jaxpr and "ragged_dot" not in jaxpr) == fused, platform
