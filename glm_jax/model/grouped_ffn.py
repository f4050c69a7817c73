"""The routed experts on one device, dropless: each (token, slot) pair through its expert's SwiGLU.

  y[n] = sum_k w[n, k] SwiGLU_{idx[n, k]}(x[n]),   SwiGLU_e(x) = (silu(x W_gate_e) * (x W_up_e)) W_down_e
The N*K pairs are sorted by expert (a stable argsort, so the order within an expert is the token order) and
each projection is one grouped matmul over the per-expert groups (grouped_matmul.py: ragged_dot's contract, only
the real rows' work on every backend): no capacity, no dropped tokens, no one-hot over experts. moe.py routes; moe_parallel.py runs the same computation with the experts split over a
mesh axis and calls `expert_swiglu` on the rows each device receives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm_jax.model.grouped_matmul import grouped_matmul


def expert_swiglu(xs: jax.Array, group_sizes: jax.Array, gate_EDI: jax.Array, up_EDI: jax.Array,
                  down_EID: jax.Array, dtype: jnp.dtype, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """Row m through the SwiGLU expert of its group (rows sorted by expert; rows past the last group give 0), one
  grouped matmul per projection, matmuls in `dtype` accumulated in fp32; the result in out_dtype (fp32 by default;
  `dtype` when the rows travel on in `dtype` anyway, which also keeps their gradient in `dtype`)."""

  def gmm(a, w, out=jnp.float32):
    return grouped_matmul(a, w.astype(dtype), group_sizes, preferred_element_type=out)

  h = (jax.nn.silu(gmm(xs, gate_EDI)) * gmm(xs, up_EDI)).astype(dtype)
  return gmm(h, down_EID, out_dtype)


def grouped_ffn_f32(x_ND: jax.Array, w_NX: jax.Array, idx_NX: jax.Array, gate_EDI: jax.Array,
                    up_EDI: jax.Array, down_EID: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """sum_k w[n, k] * SwiGLU_{idx[n, k]}(x[n]) in fp32, with tokens sorted by expert and ragged_dot per group."""
  n, k = idx_NX.shape
  flat_e = idx_NX.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  token_of = order // k
  group_sizes = jnp.bincount(flat_e, length=gate_EDI.shape[0]).astype(jnp.int32)
  ys = expert_swiglu(x_ND[token_of].astype(dtype), group_sizes, gate_EDI, up_EDI, down_EID, dtype)
  ys = ys * w_NX.reshape(-1)[order][:, None].astype(jnp.float32)
  return jnp.zeros((n, x_ND.shape[-1]), jnp.float32).at[token_of].add(ys)


def grouped_ffn(x_ND: jax.Array, w_NX: jax.Array, idx_NX: jax.Array, gate_EDI: jax.Array,
                up_EDI: jax.Array, down_EID: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """grouped_ffn_f32 in `dtype`: the dropless MoE on one device."""
  return grouped_ffn_f32(x_ND, w_NX, idx_NX, gate_EDI, up_EDI, down_EID, dtype).astype(dtype)
