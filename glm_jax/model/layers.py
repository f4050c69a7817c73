"""Building blocks: parameters with logical axes, RMSNorm, LayerNorm, RoPE, the SwiGLU MLP, the embedding.

Kernels are stored input-first ([in, out], heads split out where a head exists), so `x @ w` is the layer.
Every parameter carries logical axis names in its `out_sharding` metadata (eager sharding off): the mesh
rules that map them onto devices live with the sharding code, not here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.platform import current_platform
from glm_jax.quant.packed import PackedWeight, dequantize_weight, int_matmul


def dtype_of(name: str) -> jnp.dtype:
  return jnp.dtype(name)


def param(
  rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], cfg: ModelConfig, init: str = "normal"
) -> nnx.Param:
  """A parameter initialized like HF (normal(0, initializer_range), ones for norm scales, zeros for biases)."""
  dtype = dtype_of(cfg.param_dtype)
  if init == "normal":
    value = cfg.initializer_range * jax.random.normal(rngs.params(), shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    raise ValueError(f"init={init!r}; one of 'normal', 'ones', 'zeros'")
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def _contracted(spec: str) -> int | None:
  """For a spec whose contracted axes are x's trailing and w's leading ones, in order, with the output x's free
  axes then w's (every `dense` spec): how many axes are contracted; else None."""
  ins, out = spec.replace("...", "").split("->")
  xs, ws = ins.split(",")
  k = len([c for c in xs if c not in out])
  if k == 0 or xs[len(xs) - k :] != ws[:k] or out != xs[: len(xs) - k] + ws[k:]:
    return None
  return k


def dense(x: jax.Array, w: nnx.Param, dtype: jnp.dtype, spec: str = "...d,df->...f") -> jax.Array:
  """x @ w in the compute dtype with fp32 accumulation (the result in `dtype`)."""
  return dense_fp32(x, w, dtype, spec).astype(dtype)


def dense_fp32(x: jax.Array, w: nnx.Param, dtype: jnp.dtype, spec: str = "...d,df->...f") -> jax.Array:
  """x @ w with operands in `dtype`, the result in fp32. Traced for the CPU, computed as one 2D matmul
  [rows, in] @ [in, out] (free reshapes): the same products and sums as the einsum, but XLA:CPU then needs no
  transposed copies in the backward (a dot contracting two or more axes, as the weight gradient of a 3D einsum
  does, gets a physical transpose of its operands: 29% of a glm5-shaped step's time). Elsewhere the einsum, whose
  sharded axes XLA's partitioner sees as they are."""
  w = w[...]
  if isinstance(w, PackedWeight):
    if w.act_bits is not None:
      return _int_dense(x, w, spec)
    w = dequantize_weight(w)  # weight-only: the fake-quantized weight of training, then the same matmul
  w = w.astype(dtype)
  x = x.astype(dtype)
  k = _contracted(spec) if current_platform() == "cpu" else None
  if k is None:
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
  lead, free = x.shape[: x.ndim - k], w.shape[k:]
  y = jnp.dot(x.reshape(math.prod(lead), -1), w.reshape(-1, math.prod(free)), preferred_element_type=jnp.float32)
  return y.reshape(lead + free)


def _int_dense(x: jax.Array, w: PackedWeight, spec: str) -> jax.Array:
  """W8A8 / W4A8 (glm_jax/quant/packed.py): per-token int8 activations, an integer dot, fp32 out."""
  k = _contracted(spec)
  if k != w.contracted_axes:
    raise ValueError(f"spec {spec!r} contracts {k} axes of a packed weight quantized over {w.contracted_axes}")
  lead = x.shape[: x.ndim - k]
  y = int_matmul(x.reshape(math.prod(lead), -1), w, current_platform())
  return y.reshape(lead + w.shape[k:])


def float_weight(w: nnx.Param | jax.Array | PackedWeight) -> jax.Array:
  """A weight's values as a float array: a packed weight dequantized (for uses other than `dense`'s matmul)."""
  w = w[...] if isinstance(w, nnx.Variable) else w
  return dequantize_weight(w) if isinstance(w, PackedWeight) else w


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * g, computed in fp32."""

  def __init__(self, dim: int, eps: float, cfg: ModelConfig, rngs: nnx.Rngs, axis_name: str = "norm"):
    self.eps = eps
    self.weight = param(rngs, (dim,), (axis_name,), cfg, init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y.astype(x.dtype) * self.weight[...].astype(x.dtype)


class LayerNorm(nnx.Module):
  """y = (x - mean) / sqrt(var + eps) * g + b, computed in fp32 (the indexer's key norm)."""

  def __init__(self, dim: int, eps: float, cfg: ModelConfig, rngs: nnx.Rngs, axis_name: str = "norm"):
    self.eps = eps
    self.weight = param(rngs, (dim,), (axis_name,), cfg, init="ones")
    self.bias = param(rngs, (dim,), (axis_name,), cfg, init="zeros")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.weight[...] + self.bias[...]).astype(x.dtype)


def rope_angles(positions_BT: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, dim/2] for inv_freq_i = theta^(-2i/dim)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def rope_angles_2d(
  positions_BT: jax.Array, block_positions_BT: jax.Array, dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
  """GLM-130B's 2-D rotary: cos, sin [B, T, dim/2] whose first dim/4 pairs rotate by the position and whose last
  dim/4 pairs by the block position, each set a rotary of width dim/2 (inv_freq_i = theta^(-4i/dim)). With
  interleaved pairs (GLM-5's layout) that is the first and the second half of the rotated dims, as GLM-130B splits
  them; a block position of 0 leaves the second half unrotated."""
  c1, s1 = rope_angles(positions_BT, dim // 2, theta)
  c2, s2 = rope_angles(block_positions_BT, dim // 2, theta)
  return jnp.concatenate([c1, c2], axis=-1), jnp.concatenate([s1, s2], axis=-1)


def apply_rope(x: jax.Array, cos_BTF: jax.Array, sin_BTF: jax.Array, interleave: bool) -> jax.Array:
  """Rotates x [B, T, ..., dim] by position. interleave: pairs (x0, x1), (x2, x3), ... (GLM-5 / DeepSeek);
  otherwise the half split (x_i, x_{i + dim/2}). Computed in fp32, returned in x's dtype."""
  extra = x.ndim - cos_BTF.ndim
  cos = cos_BTF.reshape(cos_BTF.shape[:2] + (1,) * extra + cos_BTF.shape[2:])
  sin = sin_BTF.reshape(cos.shape)
  x32 = x.astype(jnp.float32)
  if interleave:
    pairs = x32.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
  else:
    a, b = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  return out.astype(x.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs):
    self.dtype = dtype_of(cfg.dtype)
    d = cfg.hidden_size
    self.gate_proj = param(rngs, (d, width), ("embed", "mlp"), cfg)
    self.up_proj = param(rngs, (d, width), ("embed", "mlp"), cfg)
    self.down_proj = param(rngs, (width, d), ("mlp", "embed"), cfg)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(dense(x, self.gate_proj, self.dtype)) * dense(x, self.up_proj, self.dtype)
    return dense(h, self.down_proj, self.dtype)


class Embed(nnx.Module):
  """Token embedding [V, D]. Ids outside [0, V) give NaN rows (never a silent clamp); `check_token_ids`
  raises a readable error on concrete inputs before that."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.dtype = dtype_of(cfg.dtype)
    self.embedding = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)

  def __call__(self, ids_BT: jax.Array) -> jax.Array:
    table = self.embedding[...].astype(self.dtype)
    ids_BT = jnp.where(ids_BT < 0, table.shape[0], ids_BT)  # take() would wrap negative ids numpy-style
    return jnp.take(table, ids_BT, axis=0, mode="fill", fill_value=jnp.nan)


def check_token_ids(ids: jax.Array, vocab_size: int, name: str = "input_ids") -> None:
  """Raises ValueError naming the bad id when `ids` is concrete; a no-op while tracing."""
  if isinstance(ids, jax.core.Tracer):
    return
  ids = np.asarray(ids)  # numpy, so this also works on concrete ids closed over by a jit trace
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name}: dtype {ids.dtype} is not an integer type")
  if ids.size == 0:
    return
  lo, hi = int(ids.min()), int(ids.max())
  if lo < 0 or hi >= vocab_size:
    bad = lo if lo < 0 else hi
    raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
