"""The routed experts on one device: each (token, slot) pair through its expert's SwiGLU, dropless by default.

  y[n] = sum_k w[n, k] SwiGLU_{idx[n, k]}(x[n]),   SwiGLU_e(x) = (silu(x W_gate_e) * (x W_up_e)) W_down_e
The N*K pairs are sorted by expert (a stable argsort, so the order within an expert is the token order) and
each projection is one grouped matmul over the per-expert groups (grouped_matmul.py: ragged_dot's contract, only
the real rows' work on every backend; on the CPU the three projections run fused, tile by tile: tiled_swiglu.py):
by default no capacity, no dropped tokens, no one-hot over experts. An optional capacity factor c bounds each
expert's rows at ceil(c * G * K / E) for a dispatch group of G tokens (the pairs past it dropped, in token order,
and counted). moe.py routes; moe_parallel.py runs the same computation
with the experts split over a mesh axis and calls `expert_swiglu` on the rows each device receives.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from glm_jax.model.grouped_matmul import cpu_tile, grouped_matmul
from glm_jax.model.platform import current_platform
from glm_jax.model.tiled_swiglu import tiled_swiglu
from glm_jax.quant.packed import PackedWeight, dequantize_weight, int_grouped_matmul


def expert_swiglu(
  xs: jax.Array,
  group_sizes: jax.Array,
  gate_EDI: jax.Array,
  up_EDI: jax.Array,
  down_EID: jax.Array,
  dtype: jnp.dtype,
  out_dtype: jnp.dtype = jnp.float32,
  *,
  zero_past: bool = True,
) -> jax.Array:
  """Row m through the SwiGLU expert of its group (rows sorted by expert; rows past the last group give 0), one
  grouped matmul per projection, matmuls in `dtype` accumulated in fp32; the result in out_dtype (fp32 by default;
  `dtype` when the rows travel on in `dtype` anyway, which also keeps their gradient in `dtype`). When traced for
  the CPU the three projections run tile by tile in one loop (tiled_swiglu.py), the same products, in tiles sized
  by the rows (grouped_matmul.cpu_tile).
  zero_past=False: rows past the last group, of the result and of xs's gradient, may be undefined (on TPU no pass
  zeroes them), for a caller that never reads them; rows of xs past the last group may then hold anything, NaN
  included, without reaching the other rows or the weight gradients."""
  if isinstance(gate_EDI, PackedWeight):
    if gate_EDI.act_bits is not None:
      return _int_expert_swiglu(xs, group_sizes, gate_EDI, up_EDI, down_EID, dtype, out_dtype)
    # weight-only: the fake-quantized weights of training, then the same grouped matmuls
    gate_EDI, up_EDI, down_EID = (dequantize_weight(w) for w in (gate_EDI, up_EDI, down_EID))
  if current_platform() == "cpu":
    tile = cpu_tile(xs.shape[0], gate_EDI.shape[0])  # by the rows: decoding's few, training's many
    return tiled_swiglu(xs, group_sizes, gate_EDI, up_EDI, down_EID, jnp.dtype(dtype), jnp.dtype(out_dtype), tile)

  def gmm(a, w, out=jnp.float32):
    return grouped_matmul(a, w.astype(dtype), group_sizes, preferred_element_type=out, zero_past=zero_past)

  h = (jax.nn.silu(gmm(xs, gate_EDI)) * gmm(xs, up_EDI)).astype(dtype)
  return gmm(h, down_EID, out_dtype)


def _int_expert_swiglu(
  xs, group_sizes, gate: PackedWeight, up: PackedWeight, down: PackedWeight, dtype, out_dtype
) -> jax.Array:
  """W8A8 / W4A8 experts: each projection's input quantized per row (int8), integer grouped matmuls."""
  platform = current_platform()
  h = jax.nn.silu(int_grouped_matmul(xs, gate, group_sizes, platform)) * int_grouped_matmul(
    xs, up, group_sizes, platform
  )
  return int_grouped_matmul(h.astype(dtype), down, group_sizes, platform).astype(out_dtype)


def expert_capacity(capacity_factor: float, group_tokens: int, k: int, n_experts: int) -> int | None:
  """The (token, slot) pairs one expert takes from a dispatch group of `group_tokens` tokens, ceil(c * G * K / E);
  None when capacity_factor is 0 (dropless)."""
  if not capacity_factor:
    return None
  return max(1, math.ceil(capacity_factor * group_tokens * k / n_experts))


def capacity_ranks(flat_e: jax.Array, order: jax.Array, n_experts: int) -> jax.Array:
  """For pairs sorted by expert (`order`, a stable argsort of their expert ids `flat_e`), each sorted pair's rank
  among its expert's pairs: the first pair routed to an expert (in token order) has rank 0."""
  counts = jnp.bincount(flat_e, length=n_experts)
  starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
  return jnp.arange(flat_e.shape[0], dtype=jnp.int32) - starts[flat_e[order]]


def grouped_ffn_f32(
  x_ND: jax.Array,
  w_NX: jax.Array,
  idx_NX: jax.Array,
  gate_EDI: jax.Array,
  up_EDI: jax.Array,
  down_EID: jax.Array,
  dtype: jnp.dtype,
  capacity_factor: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """(sum_k w[n, k] * SwiGLU_{idx[n, k]}(x[n]) in fp32 [N, D], dropped pairs: int32 scalar).

  The pairs are sorted by expert and each projection is one grouped matmul over the per-expert groups. With a
  capacity factor the N tokens are one dispatch group: an expert keeps its first `expert_capacity(...)` pairs in
  token order; the others are sorted past the last group, where the grouped matmul gives 0 (dropped)."""
  n, k = idx_NX.shape
  n_experts = gate_EDI.shape[0]
  flat_e = idx_NX.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat_e, stable=True)
  group_sizes = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)
  dropped = jnp.zeros((), jnp.int32)
  cap = expert_capacity(capacity_factor, n, k, n_experts)
  if cap is not None:
    drop_sorted = capacity_ranks(flat_e, order, n_experts) >= cap
    drop = jnp.zeros_like(drop_sorted).at[order].set(drop_sorted)
    order = jnp.argsort(flat_e + n_experts * drop.astype(jnp.int32), stable=True)  # kept by expert, then dropped
    dropped = jnp.sum(group_sizes - jnp.minimum(group_sizes, cap)).astype(jnp.int32)
    group_sizes = jnp.minimum(group_sizes, cap)
  token_of = order // k
  ys = expert_swiglu(x_ND[token_of].astype(dtype), group_sizes, gate_EDI, up_EDI, down_EID, dtype)
  ys = ys * w_NX.reshape(-1)[order][:, None].astype(jnp.float32)
  return jnp.zeros((n, x_ND.shape[-1]), jnp.float32).at[token_of].add(ys), dropped


def grouped_ffn(
  x_ND: jax.Array,
  w_NX: jax.Array,
  idx_NX: jax.Array,
  gate_EDI: jax.Array,
  up_EDI: jax.Array,
  down_EID: jax.Array,
  dtype: jnp.dtype,
  capacity_factor: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """grouped_ffn_f32 with y in `dtype`: the MoE's routed experts on one device."""
  y, dropped = grouped_ffn_f32(x_ND, w_NX, idx_NX, gate_EDI, up_EDI, down_EID, dtype, capacity_factor)
  return y.astype(dtype), dropped
