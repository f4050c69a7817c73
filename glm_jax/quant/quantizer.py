"""The one quantizer: symmetric absmax integers per group, per channel or per row.

  q = 2^(bits-1) - 1                                   7 for int4, 127 for int8
  scale_g = max_{i in g} |w_i| / q                     over each group g of `group_size` consecutive entries
                                                       along `axis` (group_size=None: the whole axis)
  code_i = clip(round(w_i / scale_g), -q, q)           round half to even; an all-zero group gives codes 0
  w_i ~ code_i * scale_g                               dequantize

Training's fake quantization (`fake_quant`: dequantize(quantize(w)) with a straight-through gradient) and the
offline packing (glm_jax/quant/packed.py) both call `quantize` here, so a trained weight and its packed form
cannot drift: the fake-quantized weight is, bit for bit, the packed weight dequantized. The formula is slime's
public INT4 QAT (groups of 128, scale = max|x| / 7, clamp to [-7, 7]) and GLM-130B's INT4 weight-only
quantization (per row, scale = max|w| / (2^(b-1) - 1)); codes never use -2^(bits-1), so the range is symmetric.

Bit-for-bit holds for one backend: XLA's fp32 division is not correctly rounded (CPU and TPU multiply by a
reciprocal), so a scale computed on another backend, or by numpy, may differ in its last bit. Training packs its
rollout weights on its own devices; an offline pack (launch/quantize.py) matches a run trained on the same backend.

int4 codes are held in int8 arrays (values in [-7, 7]); `pack_int4` stores them two to a byte (the even entry
of each pair along the last axis in the low nibble) and `unpack_int4` restores them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = (4, 8)


def qmax(bits: int) -> int:
  """The largest code: 2^(bits-1) - 1."""
  if bits not in BITS:
    raise ValueError(f"bits={bits!r}; the quantizer supports {BITS}")
  return 2 ** (bits - 1) - 1


def _grouped(shape: tuple[int, ...], group_size: int | None, axis: int) -> tuple[int, int, int]:
  """(normalized axis, groups along it, group size), checking that the group size divides the axis."""
  if not shape:
    raise ValueError("quantize: a scalar has no axis to group along")
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"axis={axis} is out of range for an array of shape {tuple(shape)}")
  axis %= len(shape)
  n = shape[axis]
  if group_size is None:
    return axis, 1, n
  if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
    raise ValueError(f"group_size={group_size!r}; must be a positive integer or None (the whole axis)")
  if n % group_size:
    raise ValueError(
      f"group_size={group_size} does not divide axis {axis} of size {n} (shape {tuple(shape)}); "
      f"use a divisor of {n} or None (the whole axis)"
    )
  return axis, n // group_size, group_size


def _split_groups(x: jax.Array, axis: int, groups: int, size: int) -> jax.Array:
  """[..., n, ...] -> [..., groups, size, ...]: a free reshape."""
  return x.reshape(x.shape[:axis] + (groups, size) + x.shape[axis + 1 :])


def quantize(w: jax.Array, *, bits: int, group_size: int | None, axis: int = -1) -> tuple[jax.Array, jax.Array]:
  """(codes int8 with w's shape, scales fp32 with w's shape but axis of size n / group_size)."""
  q = qmax(bits)
  axis, groups, size = _grouped(w.shape, group_size, axis)
  wg = _split_groups(w.astype(jnp.float32), axis, groups, size)
  scale = jnp.max(jnp.abs(wg), axis=axis + 1, keepdims=True) / q
  safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero group: w / 1 = 0, codes 0
  codes = jnp.clip(jnp.round(wg / safe), -q, q).astype(jnp.int8)
  return codes.reshape(w.shape), jnp.squeeze(scale, axis + 1)


def dequantize(
  codes: jax.Array, scales: jax.Array, *, group_size: int | None, axis: int = -1, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
  """codes * scale of their group, computed in fp32 and returned in `dtype`."""
  axis, groups, size = _grouped(codes.shape, group_size, axis)
  expected = codes.shape[:axis] + (groups,) + codes.shape[axis + 1 :]
  if tuple(scales.shape) != expected:
    raise ValueError(
      f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes.shape)} in "
      f"groups of {group_size} along axis {axis}: expected {expected}"
    )
  cg = _split_groups(codes.astype(jnp.float32), axis, groups, size)
  return (cg * jnp.expand_dims(scales.astype(jnp.float32), axis + 1)).reshape(codes.shape).astype(dtype)


@jax.custom_vjp
def _ste(w: jax.Array, w_q: jax.Array) -> jax.Array:
  return w_q


def _ste_fwd(w, w_q):
  return w_q, None


def _ste_bwd(_, g):
  return g, None  # straight through: d fake_quant(w) / dw is the identity; nothing flows into the codes


_ste.defvjp(_ste_fwd, _ste_bwd)


def fake_quant(w: jax.Array, *, bits: int, group_size: int | None, axis: int = -1) -> jax.Array:
  """dequantize(quantize(w)) in w's dtype: exactly the packed weight's values in the forward pass; in the backward
  the straight-through estimator, dL/dw = dL/dw_q (the gradient of the quantized weight, unchanged)."""
  codes, scales = quantize(jax.lax.stop_gradient(w), bits=bits, group_size=group_size, axis=axis)
  w_q = dequantize(codes, scales, group_size=group_size, axis=axis, dtype=w.dtype)
  return _ste(w, w_q)


def pack_int4(codes: jax.Array) -> jax.Array:
  """int8 codes in [-8, 7], last axis even -> uint8 with half the last axis: byte j holds code 2j in its low
  nibble and code 2j + 1 in its high nibble (two's complement)."""
  if codes.shape[-1] % 2:
    raise ValueError(f"pack_int4: the last axis of shape {tuple(codes.shape)} is odd; int4 codes go two to a byte")
  pairs = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_int4(packed: jax.Array, dtype: jnp.dtype = jnp.int8) -> jax.Array:
  """pack_int4's inverse: uint8 [..., n] -> signed codes [..., 2n] in `dtype` (int8, or jnp.int4 for a dot that
  takes 4-bit operands)."""
  b = packed.astype(jnp.int8)
  low = jnp.left_shift(b, 4) >> 4  # arithmetic shifts sign-extend the nibble
  high = b >> 4
  return jnp.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,)).astype(dtype)
