"""The one quantizer (glm_jax/quant/quantizer.py) and the packed weights' matmuls (glm_jax/quant/packed.py) against
plain numpy formulas and hand-computed values:

  q = 2^(bits-1) - 1,  scale_g = max_{i in g} |w_i| / q,  code_i = clip(round_half_even(w_i / scale_g), -q, q)

XLA's fp32 division is not correctly rounded (on the CPU, as on TPU, it multiplies by a reciprocal: x / 7 differs
from numpy's quotient in the last bit for about half of all x), so a scale may be one ulp from numpy's; the
codes are compared exactly, and the dequantized values against codes times the scales the quantizer returned.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.quant import packed as P
from glm_jax.quant.quantizer import dequantize, fake_quant, pack_int4, quantize, unpack_int4


def np_quantize(w, bits, group, axis):
  """The spec in numpy fp32: (codes int8, scales fp32), groups of `group` along `axis` (None: the whole axis)."""
  q = np.float32(2 ** (bits - 1) - 1)
  w = np.moveaxis(np.asarray(w, np.float32), axis, -1)
  n = w.shape[-1]
  g = n if group is None else group
  wg = w.reshape(w.shape[:-1] + (n // g, g))
  scale = (np.abs(wg).max(-1, keepdims=True) / q).astype(np.float32)
  safe = np.where(scale > 0, scale, np.float32(1))
  codes = np.clip(np.round(wg / safe), -q, q).astype(np.int8)
  return np.moveaxis(codes.reshape(w.shape), -1, axis), np.moveaxis(scale[..., 0], -1, axis)


def test_a_hand_computed_int4_group():
  """Group of 8 with max |w| = 7: scale 1, so each code is w rounded half to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2,
  -2.5 -> -2); the next group is all zero: scale 0, codes 0, dequantized 0 (no NaN)."""
  w = jnp.asarray([[7.0, 0.5, 1.5, 2.5, -2.5, -7.0, 3.49, -0.51] + [0.0] * 8], jnp.float32)
  codes, scales = quantize(w, bits=4, group_size=8)
  np.testing.assert_array_equal(codes, [[7, 0, 2, 2, -2, -7, 3, -1] + [0] * 8])
  np.testing.assert_array_equal(scales, [[1.0, 0.0]])
  np.testing.assert_array_equal(dequantize(codes, scales, group_size=8), [[7, 0, 2, 2, -2, -7, 3, -1] + [0] * 8])
  assert codes.dtype == jnp.int8 and scales.dtype == jnp.float32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group, axis", [(8, -1), (None, -1), (4, 0), (None, 0)])
def test_codes_and_scales_equal_the_numpy_formula(bits, group, axis):
  """Random rows with an all-zero group, a single outlier (its group's other codes collapse towards 0) and a
  negative extreme (code exactly -q, never -q-1): codes, scales and dequantized values equal the formula."""
  rng = np.random.default_rng(bits)
  w = rng.standard_normal((8, 32)).astype(np.float32)
  w[1, :] = 0.0  # along axis -1 an all-zero row; along axis 0, zero entries in every column's groups
  w[2:, 8:16] = 0.0  # along axis -1 with groups of 8: an all-zero group
  w[3, 5] = 1000.0  # a single outlier
  w[4, 20] = -50.0  # a negative extreme
  codes, scales = quantize(jnp.asarray(w), bits=bits, group_size=group, axis=axis)
  want_codes, want_scales = np_quantize(w, bits, group, axis)
  np.testing.assert_array_equal(np.asarray(codes), want_codes)
  np.testing.assert_array_max_ulp(np.asarray(scales), want_scales, maxulp=1)
  np.testing.assert_array_equal(np.asarray(scales) == 0, want_scales == 0)  # the all-zero groups, exactly
  q = 2 ** (bits - 1) - 1
  assert int(codes.min()) >= -q and int(codes.max()) <= q
  if axis == -1:
    assert codes[4, 20] == -q and codes[3, 5] == q
  g = w.shape[axis] if group is None else group
  got_scales = np.moveaxis(np.asarray(scales), axis, -1)
  want = (
    np.moveaxis(want_codes, axis, -1).astype(np.float32).reshape(got_scales.shape + (g,)) * got_scales[..., None]
  ).reshape(np.moveaxis(w, axis, -1).shape)
  got = np.moveaxis(np.asarray(dequantize(codes, scales, group_size=group, axis=axis)), axis, -1)
  np.testing.assert_array_equal(got, want)
  assert np.isfinite(got).all()


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(bits=4, group_size=4), r"group_size=4 does not divide axis 0 of size 10"),
    (dict(bits=3, group_size=None), r"bits=3; the quantizer supports \(4, 8\)"),
    (dict(bits=8, group_size=0), r"group_size=0; must be a positive integer or None"),
    (dict(bits=8, group_size=None, axis=2), r"axis=2 is out of range for an array of shape \(10,\)"),
  ],
)
def test_bad_arguments_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    quantize(jnp.ones((10,)), **kwargs)


def test_int4_bytes_hold_two_codes_each():
  """Every pair of codes in [-8, 7] round-trips; the byte holds the even entry in its low nibble, two's
  complement: [-1, 2] -> 0x2F, [7, -8] -> 0x87."""
  a, b = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8), indexing="ij")
  codes = jnp.asarray(np.stack([a.ravel(), b.ravel()], -1), jnp.int8)  # [256, 2]
  packed = pack_int4(codes)
  assert packed.shape == (256, 1) and packed.dtype == jnp.uint8
  want = ((a.ravel() & 0xF) | ((b.ravel() & 0xF) << 4)).astype(np.uint8)[:, None]
  np.testing.assert_array_equal(np.asarray(packed), want)
  np.testing.assert_array_equal(pack_int4(jnp.asarray([[-1, 2, 7, -8]], jnp.int8)), [[0x2F, 0x87]])
  np.testing.assert_array_equal(unpack_int4(packed), codes)
  with pytest.raises(ValueError, match=r"last axis of shape \(2, 3\) is odd"):
    pack_int4(jnp.zeros((2, 3), jnp.int8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fake_quant_forward_is_the_packed_value_and_its_gradient_passes_straight_through(dtype):
  """Forward: dequantize(quantize(w)) bit for bit, in w's dtype. Backward: d sum(c * fake_quant(w)) / dw = c."""
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((4, 64)), dtype)
  c = jnp.asarray(rng.standard_normal((4, 64)), dtype)
  fq = fake_quant(w, bits=4, group_size=16)
  codes, scales = quantize(w, bits=4, group_size=16)
  assert fq.dtype == dtype
  np.testing.assert_array_equal(np.asarray(fq), np.asarray(dequantize(codes, scales, group_size=16, dtype=dtype)))
  g = jax.grad(lambda w: jnp.sum(c * fake_quant(w, bits=4, group_size=16)))(w)
  assert g.dtype == dtype
  np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_packed_weight_of_two_contracted_axes_and_a_leading_axis():
  """A [3, 4, 16, 6] stack with contracted axes (4, 16): quantized along the flattened 64 inputs in groups of 16;
  dequantized it equals the numpy formula and the fake-quantized weight bit for bit; a slice of the stack along
  its leading axis is the packed slice; int4 codes take half the last axis in uint8."""
  rng = np.random.default_rng(1)
  w = rng.standard_normal((3, 4, 16, 6)).astype(np.float32)
  p = P.pack_weight(jnp.asarray(w), bits=4, group_size=16, contracted_axes=2, free_axes=1)
  assert p.codes.shape == (3, 4, 16, 3) and p.codes.dtype == jnp.uint8 and p.scales.shape == (3, 4, 6)
  assert p.shape == (3, 4, 16, 6) and p.nbytes == 3 * 4 * 16 * 3 + 3 * 4 * 6 * 4
  codes, scales = np_quantize(w.reshape(3, 64, 6), 4, 16, 1)
  np.testing.assert_array_equal(np.asarray(P.weight_codes(p)), codes)
  np.testing.assert_array_max_ulp(np.asarray(p.scales), scales, maxulp=1)
  want = (codes.astype(np.float32) * np.repeat(np.asarray(p.scales), 16, axis=1)).reshape(3, 4, 16, 6)
  np.testing.assert_array_equal(np.asarray(P.dequantize_weight(p)), want)
  np.testing.assert_array_equal(
    np.asarray(P.fake_quant_weight(jnp.asarray(w), bits=4, group_size=16, contracted_axes=2, free_axes=1)), want
  )
  one = jax.tree.map(lambda a: a[1], p)
  np.testing.assert_array_equal(np.asarray(P.dequantize_weight(one)), want[1])


def np_int_matmul(x, w, bits, group):
  """y = s_x[m] * sum_g s_w[g, n] * sum_{k in g} xq[m, k] wq[k, n], in float64 from the spec's codes."""
  xq, sx = np_quantize(x, 8, None, -1)
  wq, sw = np_quantize(w, bits, group, 0)
  k = w.shape[0]
  g = k if group is None else group
  acc = np.einsum("mgk,gkn->mgn", xq.reshape(-1, k // g, g).astype(np.int64), wq.reshape(k // g, g, -1))
  return np.einsum("mgn,gn->mn", acc.astype(np.float64), sw.astype(np.float64)) * sx.astype(np.float64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [None, 16])
def test_integer_matmul_equals_the_formula(bits, group):
  """W8A8 / W4A8: per-token activation scales, per-channel (or per-group) weight scales, integer products."""
  rng = np.random.default_rng(bits)
  x = rng.standard_normal((5, 64)).astype(np.float32)
  w = rng.standard_normal((64, 8)).astype(np.float32)
  p = P.pack_weight(jnp.asarray(w), bits=bits, group_size=group, act_bits=8)
  y = np.asarray(P.int_matmul(jnp.asarray(x), p, "cpu"))
  want = np_int_matmul(x, w, bits, group)
  np.testing.assert_allclose(y, want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_integer_grouped_matmul_equals_the_formula_row_by_row(bits):
  """The routed experts: rows sorted by expert (2 to expert 0, none to 1, 3 to 2), each row times its expert's
  packed weight; the sixth row is past the groups and gives 0."""
  rng = np.random.default_rng(bits)
  x = rng.standard_normal((6, 32)).astype(np.float32)
  w = rng.standard_normal((3, 32, 8)).astype(np.float32)
  p = P.pack_weight(jnp.asarray(w), bits=bits, group_size=None, act_bits=8)
  y = np.asarray(P.int_grouped_matmul(jnp.asarray(x), p, jnp.asarray([2, 0, 3], jnp.int32), "cpu"))
  expert = [0, 0, 2, 2, 2]
  want = np.stack([np_int_matmul(x[r : r + 1], w[e], bits, None)[0] for r, e in enumerate(expert)])
  np.testing.assert_allclose(y[:5], want, rtol=0, atol=1e-6 * np.abs(want).max())
  np.testing.assert_array_equal(y[5], np.zeros(8))
