"""A quantized weight as it is stored and served, and the matmuls that take one.

A weight's axes are [lead..., contracted..., free...], counted from the end: the last `free_axes` are the
matmul's output, the `contracted_axes` before them meet the activations (one for most kernels, two for o_proj's
[heads, v_head_dim, hidden]), and any before those index independent matrices (the scanned layer axis, the
routed experts' E), so slicing a stack of packed weights along a leading axis (jax.lax.scan over layers) leaves
a packed weight. Quantization views a weight as [lead..., K, free...] (K the contracted axes flattened) and
runs `quantizer.quantize` along K: groups of `group_size` consecutive entries of K (None: all of K, the
per-output-channel scale of GLM-130B's per-row INT4 and of W8A8). `PackedWeight` holds

  codes    int8 with the weight's shape (8 bits), or uint8 with the last axis halved (4 bits, two to a byte)
  scales   fp32 [lead..., K / group_size, free...]

and, static, how it was made. Two ways to use one:
  weight-only (act_bits None)   `dequantize_weight` gives codes * scales in the parameter dtype, the very array
                                training's fake quantization produced (`fake_quant_weight`), then the ordinary
                                matmul: a QAT model and its packed form compute the same bits.
  W8A8 / W4A8 (act_bits 8)      `int_matmul` quantizes each token's activations (int8, one absmax scale a token
                                over the contracted axes), multiplies integer codes with an integer dot
                                accumulated in int32, and scales the result by the token's and the output
                                channel's (or group's) scales:
                                  y[m, n] = s_x[m] * sum_g s_w[g, n] * sum_{k in g} xq[m, k] * wq[k, n]
                                On TPU the 4-bit weight codes enter a matmul's dot as int4 (s8 x s4); the routed
                                experts' grouped dot (XLA:TPU's ragged dot, which has no 4-bit operands) and every
                                dot elsewhere take them as int8.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp

from glm_jax import paths
from glm_jax.quant.quantizer import dequantize, fake_quant, pack_int4, quantize, unpack_int4

ACT_BITS = (None, 8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
  codes: jax.Array
  scales: jax.Array
  dtype: str = dataclasses.field(metadata=dict(static=True))  # the parameter's dtype: dequantize into it
  bits: int = dataclasses.field(metadata=dict(static=True))
  group_size: int | None = dataclasses.field(metadata=dict(static=True))
  contracted_axes: int = dataclasses.field(metadata=dict(static=True))
  free_axes: int = dataclasses.field(metadata=dict(static=True))
  act_bits: int | None = dataclasses.field(metadata=dict(static=True))

  def __getitem__(self, index):
    """`param[...]` on an nnx.Param holding a packed weight gives the packed weight (the matmuls dispatch on it);
    any other indexing needs the float weight: `dequantize_weight` first."""
    if index is not Ellipsis:
      raise TypeError(f"a PackedWeight of shape {self.shape} cannot be indexed by {index!r}; dequantize it first")
    return self

  @property
  def shape(self) -> tuple[int, ...]:
    s = tuple(self.codes.shape)
    return s[:-1] + (2 * s[-1],) if self.bits == 4 else s

  @property
  def ndim(self) -> int:
    return len(self.codes.shape)

  @property
  def lead_axes(self) -> int:
    return self.ndim - self.contracted_axes - self.free_axes

  @property
  def view_shape(self) -> tuple[int, ...]:
    """[lead..., K, free...]."""
    return _view(self.shape, self.contracted_axes, self.free_axes)

  @property
  def nbytes(self) -> int:
    return self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


def _view(shape, contracted_axes: int, free_axes: int) -> tuple[int, ...]:
  if contracted_axes < 1 or free_axes < 1 or contracted_axes + free_axes > len(shape):
    raise ValueError(
      f"a weight of shape {tuple(shape)} cannot have {contracted_axes} contracted and {free_axes} "
      "free axes (at least one of each, at its end)"
    )
  lead = len(shape) - contracted_axes - free_axes
  return (
    tuple(shape[:lead]) + (math.prod(shape[lead : lead + contracted_axes]),) + tuple(shape[len(shape) - free_axes :])
  )


def pack_weight(
  w: jax.Array,
  *,
  bits: int,
  group_size: int | None,
  contracted_axes: int = 1,
  free_axes: int = 1,
  act_bits: int | None = None,
) -> PackedWeight:
  """Quantizes w along its flattened contracted axes and stores the codes (int4: two to a byte)."""
  view = _view(w.shape, contracted_axes, free_axes)
  if act_bits not in ACT_BITS:
    raise ValueError(f"act_bits={act_bits!r}; one of {ACT_BITS} (None: weight-only)")
  if bits == 4 and w.shape[-1] % 2:
    raise ValueError(f"int4 codes go two to a byte along the last axis; shape {tuple(w.shape)} has it odd")
  codes, scales = quantize(w.reshape(view), bits=bits, group_size=group_size, axis=len(view) - free_axes - 1)
  codes = codes.reshape(w.shape)
  return PackedWeight(
    pack_int4(codes) if bits == 4 else codes,
    scales,
    jnp.dtype(w.dtype).name,
    bits,
    group_size,
    contracted_axes,
    free_axes,
    act_bits,
  )


def weight_codes(p: PackedWeight, dtype: jnp.dtype = jnp.int8) -> jax.Array:
  """The integer codes in the view shape [lead..., K, free...], as `dtype` (int8, or int4 for a 4-bit dot)."""
  codes = unpack_int4(p.codes, dtype) if p.bits == 4 else p.codes.astype(dtype)
  return codes.reshape(p.view_shape)


def dequantize_weight(p: PackedWeight) -> jax.Array:
  """codes * scales in the parameter's dtype and shape: the fake-quantized weight of training, bit for bit."""
  w = dequantize(weight_codes(p), p.scales, group_size=p.group_size, axis=p.lead_axes, dtype=p.dtype)
  return w.reshape(p.shape)


def fake_quant_weight(
  w: jax.Array, *, bits: int, group_size: int | None, contracted_axes: int = 1, free_axes: int = 1
) -> jax.Array:
  """Training's view of `pack_weight` + `dequantize_weight`: the same values (quantizer.fake_quant along the
  flattened contracted axes), with the straight-through gradient."""
  view = _view(w.shape, contracted_axes, free_axes)
  return fake_quant(w.reshape(view), bits=bits, group_size=group_size, axis=len(view) - free_axes - 1).reshape(w.shape)


def _dot_operand_dtype(bits: int, platform: str) -> jnp.dtype:
  return jnp.int4 if bits == 4 and platform == "tpu" else jnp.int8


def quantize_tokens(x_MK: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Per-token activation quantization: (codes int8 [M, K], scales fp32 [M, 1]), absmax over each row."""
  return quantize(x_MK, bits=bits, group_size=None, axis=-1)


def int_matmul(x_MK: jax.Array, p: PackedWeight, platform: str) -> jax.Array:
  """W8A8 / W4A8: [M, K] activations times a packed [K, N...] weight (no batch axes), fp32 [M, N]."""
  if p.lead_axes:
    raise ValueError(
      f"int_matmul takes one matrix; shape {p.shape} has {p.lead_axes} leading axes (the routed "
      "experts use int_grouped_matmul)"
    )
  xq, sx = quantize_tokens(x_MK, p.act_bits)
  k = x_MK.shape[-1]
  n = math.prod(p.shape[p.contracted_axes :])
  wq = weight_codes(p, _dot_operand_dtype(p.bits, platform)).reshape(k, n)
  sw = p.scales.reshape(-1, n)  # [G, N]
  groups = sw.shape[0]
  if groups == 1:
    acc = jax.lax.dot(xq, wq, preferred_element_type=jnp.int32).astype(jnp.float32) * sw
  else:
    acc = jnp.einsum(
      "mgk,gkn->mgn",
      xq.reshape(-1, groups, k // groups),
      wq.reshape(groups, k // groups, n),
      preferred_element_type=jnp.int32,
    )
    acc = jnp.sum(acc.astype(jnp.float32) * sw, axis=1)
  return acc * sx


def int_grouped_matmul(x_RK: jax.Array, p: PackedWeight, group_sizes: jax.Array, platform: str) -> jax.Array:
  """W8A8 / W4A8 for the routed experts: row r of x (rows sorted by expert) times its expert's packed [K, N]
  weight, per-token activation scales, per (expert, output channel) weight scales; fp32 [R, N], rows past the last
  group 0 (ragged_dot's contract)."""
  if p.ndim != 3 or p.contracted_axes != 1 or p.group_size is not None:
    raise ValueError(
      "int_grouped_matmul takes [E, K, N] weights with per-channel scales (group_size None); got "
      f"shape {p.shape}, group_size {p.group_size}"
    )
  del platform  # int8 codes on every backend: XLA:TPU's ragged dot rejects 4-bit operands
  xq, sx = quantize_tokens(x_RK, p.act_bits)
  wq = weight_codes(p, jnp.int8)
  acc = jax.lax.ragged_dot(xq, wq, group_sizes, preferred_element_type=jnp.int32)
  ends = jnp.cumsum(group_sizes)
  group_of_row = jnp.minimum(jnp.searchsorted(ends, jnp.arange(x_RK.shape[0]), side="right"), p.shape[0] - 1)
  sw = p.scales[:, 0, :][group_of_row]  # [R, N]
  return acc.astype(jnp.float32) * sw * sx


# ------------------------------------------------------------------------------------------------ packed.json
# What launch/quantize.py writes beside a packed model's weights (glm_jax/train/packed_checkpoint.py), read back
# defensively: the file is opened without blocking and must be a regular one of at most META_MAX_BYTES, strict JSON
# (glm_jax/paths.py), and every field of the format below; anything else is a ValueError naming the file, the field,
# its value and what is valid.

META_FILE = "packed.json"
META_FORMAT = 1
META_MAX_BYTES = 100 * 2**20


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v) -> bool:
  return _is_int(v) and v >= 0


def _opt(test):
  return lambda v: v is None or test(v)


_STR = (lambda v: isinstance(v, str), "a string")
_OBJECT = (lambda v: isinstance(v, dict), "an object")
_RULE = {  # one planned parameter (glm_jax/model/quantization.py's Rule)
  "bits": (lambda v: v in (4, 8) and _is_int(v), "4 or 8"),
  "group_size": (_opt(lambda v: _is_int(v) and v > 0), "a positive integer or null (one scale per output channel)"),
  "act_bits": (lambda v: v is None or (_is_int(v) and v in ACT_BITS), "null (weight-only) or 8"),
  "contracted_axes": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
  "free_axes": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
}
_QUANT = {
  "scheme": _STR,
  "group_size": (_is_count, "a non-negative integer (0: one scale per output channel)"),
  "scope": _STR,
}
_TOKENIZER = {"name": _STR, "sha256": _STR, "vocab_size": (lambda v: _is_int(v) and v > 0, "a positive integer")}
_META = {
  "format": (lambda v: v == META_FORMAT and _is_int(v), f"{META_FORMAT} (the format this code reads)"),
  "quant": _OBJECT,
  "plan": (lambda v: isinstance(v, dict), "an object {parameter path: how it is packed}"),
  "model": (lambda v: isinstance(v, dict), "an object of the model config's fields"),
  "config": (lambda v: isinstance(v, dict), "an object (the run's config)"),
  "tokenizer": (_opt(lambda v: isinstance(v, dict)), "an object (the run's tokenizer record) or null"),
  "source": (lambda v: isinstance(v, dict), "an object (the checkpoint it was packed from)"),
  "weight_bytes": (_is_count, "a non-negative integer"),
  "unpacked_weight_bytes": (_is_count, "a non-negative integer"),
}


def _short(value, limit: int = 80) -> str:
  text = "null" if value is None else repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_fields(obj: dict, schema: dict, where: str, prefix: str) -> None:
  for key, (test, valid) in schema.items():
    if key not in obj:
      raise ValueError(f"{where}: field '{prefix}{key}' is missing; expected {valid}")
    if not test(obj[key]):
      raise ValueError(f"{where}: field '{prefix}{key}'={_short(obj[key])} is invalid; expected {valid}")


def check_meta(meta, where: str, *, need_tokenizer: bool = False) -> dict:
  """`meta` (packed.json's value, read from `where`) if it is the format's; else ValueError naming `where`, the
  field and what is valid. need_tokenizer: the reader decodes text (launch/sample.py), so the record must hold the
  tokenizer's JSON, not be null."""
  if not isinstance(meta, dict):
    raise ValueError(f"{where}: expected a JSON object, found {type(meta).__name__}")
  _check_fields(meta, _META, where, "")
  _check_fields(meta["quant"], _QUANT, where, "quant.")
  for name, rule in meta["plan"].items():
    if not isinstance(rule, dict):
      raise ValueError(f"{where}: field 'plan.{name}'={_short(rule)} is invalid; expected an object")
    _check_fields(rule, _RULE, where, f"plan.{name}.")
  tokenizer = meta["tokenizer"]
  if tokenizer is not None:
    _check_fields(tokenizer, _TOKENIZER, where, "tokenizer.")
    if "json" in tokenizer and not isinstance(tokenizer["json"], str):
      raise ValueError(f"{where}: field 'tokenizer.json'={_short(tokenizer['json'])} is invalid; expected a string")
  if need_tokenizer and (tokenizer is None or "json" not in tokenizer):
    found = "null" if tokenizer is None else f"{tokenizer['name']!r} without its JSON"
    raise ValueError(
      f"{where}: field 'tokenizer' is {found}; decoding text needs the tokenizer the run recorded (pack a run "
      "that records one)"
    )
  source = meta["source"]
  for key, (test, valid) in (("workdir", _STR), ("step", (_is_count, "a non-negative integer"))):
    if key in source and not test(source[key]):
      raise ValueError(f"{where}: field 'source.{key}'={_short(source[key])} is invalid; expected {valid}")
  return meta


def read_meta(directory: str, *, need_tokenizer: bool = False) -> dict:
  """<directory>/packed.json, checked (check_meta). The file must be a regular file of at most META_MAX_BYTES of
  strict JSON (glm_jax/paths.py's read_json: opened without blocking, no NaN, no key twice); a missing one is
  FileNotFoundError, anything else wrong a ValueError, each naming the file."""
  path = os.path.join(os.path.abspath(directory), META_FILE)
  if not os.path.lexists(path):
    raise FileNotFoundError(f"{directory}: not a packed model (no {META_FILE}); launch/quantize.py writes one")
  meta = paths.read_json(path, META_MAX_BYTES)
  return check_meta(meta, path, need_tokenizer=need_tokenizer)
