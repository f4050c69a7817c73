"""Mixture of experts: fp32 sigmoid router with bias-corrected top-k, dropless grouped matmuls, a shared expert.

  s = sigmoid(u . e_i)                        fp32 affinities
  pick top-k of s + b                         b = e_score_correction_bias: selection only, no gradient
  g = s_sel / sum(s_sel) * routed_scaling_factor      (the normalization only when norm_topk_prob)
  y = sum_k g_k FFN_{e_k}(u) + FFN_shared(u)
Group-limited routing (n_group > 1): a group's score is the sum of its top-2 biased scores; only experts
in the topk_group best groups can be picked. Dispatch sorts the (token, slot) pairs by expert and runs
`jax.lax.ragged_dot` over the per-expert groups: no capacity, no dropped tokens, no one-hot over experts.
Under a mesh whose "expert" axis is larger than 1, experts are split over it and tokens travel by
all-to-all (moe_parallel.expert_parallel_ffn), computing the same thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.layers import MLP, dtype_of, param


class ExpertBias(nnx.Variable):
  """e_score_correction_bias: steers selection only; updated by the balance rule, never by gradient."""


def route(logits_NE: jax.Array, bias_E: jax.Array, cfg: ModelConfig
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (gate weights [N, K] fp32, expert ids [N, K] int32, affinities s [N, E] fp32)."""
  s_NE = jax.nn.sigmoid(logits_NE.astype(jnp.float32))
  choice_NE = s_NE + bias_E.astype(jnp.float32)
  if cfg.n_group > 1:
    n, e = choice_NE.shape
    grouped = choice_NE.reshape(n, cfg.n_group, e // cfg.n_group)
    group_score_NG = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, group_idx = jax.lax.top_k(group_score_NG, cfg.topk_group)
    group_keep_NG = jnp.zeros_like(group_score_NG, bool).at[jnp.arange(n)[:, None], group_idx].set(True)
    keep_NE = jnp.repeat(group_keep_NG, e // cfg.n_group, axis=-1)
    choice_NE = jnp.where(keep_NE, choice_NE, -jnp.inf)
  _, idx_NK = jax.lax.top_k(choice_NE, cfg.num_experts_per_tok)
  w_NK = jnp.take_along_axis(s_NE, idx_NK, axis=-1)
  if cfg.norm_topk_prob:
    w_NK = w_NK / (jnp.sum(w_NK, axis=-1, keepdims=True) + 1e-20)
  return w_NK * cfg.routed_scaling_factor, idx_NK.astype(jnp.int32), s_NE


def expert_swiglu(xs: jax.Array, group_sizes: jax.Array, gate_EDI: jax.Array, up_EDI: jax.Array,
                  down_EID: jax.Array, dtype: jnp.dtype, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """Row m through the SwiGLU expert of its group (rows sorted by expert; rows past the last group give 0), one
  ragged_dot per projection, matmuls in `dtype` accumulated in fp32; the result in out_dtype (fp32 by default;
  `dtype` when the rows travel on in `dtype` anyway, which also keeps their gradient in `dtype`)."""

  def gmm(a, w, out=jnp.float32):
    return jax.lax.ragged_dot(a, w.astype(dtype), group_sizes, preferred_element_type=out)

  h = (jax.nn.silu(gmm(xs, gate_EDI)) * gmm(xs, up_EDI)).astype(dtype)
  return gmm(h, down_EID, out_dtype)


def grouped_ffn_f32(x_ND: jax.Array, w_NK: jax.Array, idx_NK: jax.Array, gate_EDI: jax.Array,
                    up_EDI: jax.Array, down_EID: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """sum_k w[n, k] * SwiGLU_{idx[n, k]}(x[n]) in fp32, with tokens sorted by expert and ragged_dot per group."""
  n, k = idx_NK.shape
  flat_e = idx_NK.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  token_of = order // k
  group_sizes = jnp.bincount(flat_e, length=gate_EDI.shape[0]).astype(jnp.int32)
  ys = expert_swiglu(x_ND[token_of].astype(dtype), group_sizes, gate_EDI, up_EDI, down_EID, dtype)
  ys = ys * w_NK.reshape(-1)[order][:, None].astype(jnp.float32)
  return jnp.zeros((n, x_ND.shape[-1]), jnp.float32).at[token_of].add(ys)


def grouped_ffn(x_ND: jax.Array, w_NK: jax.Array, idx_NK: jax.Array, gate_EDI: jax.Array,
                up_EDI: jax.Array, down_EID: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """grouped_ffn_f32 in `dtype`: the dropless MoE on one device."""
  return grouped_ffn_f32(x_ND, w_NK, idx_NK, gate_EDI, up_EDI, down_EID, dtype).astype(dtype)


class MoE(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype_of(cfg.dtype)
    d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    self.router = param(rngs, (d, e), ("embed", "experts_router"), cfg)
    self.e_score_correction_bias = ExpertBias(jnp.zeros((e,), jnp.float32), out_sharding=("experts_router",),
                                              eager_sharding=False)
    self.gate_proj = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), cfg)
    self.up_proj = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), cfg)
    self.down_proj = param(rngs, (e, i, d), ("experts", "expert_mlp", "embed"), cfg)
    self.shared_experts = (MLP(cfg, i * cfg.n_shared_experts, rngs) if cfg.n_shared_experts else None)

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (y [B, T, D], router stats): expert_counts [B, E] (selections per sequence) and
    expert_probs [B, E] (the sequence mean of s_i / sum_j s_j, the P_i of the sequence balance loss)."""
    cfg = self.cfg
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    logits_NE = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), self.router[...].astype(jnp.float32))
    w_NK, idx_NK, s_NE = route(logits_NE, self.e_score_correction_bias[...], cfg)
    experts = (x_ND, w_NK, idx_NK, self.gate_proj[...], self.up_proj[...], self.down_proj[...], self.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get("expert", 1) > 1:  # expert parallelism: shard_map + all-to-all
      from glm_jax.model.moe_parallel import expert_parallel_ffn  # it builds on grouped_ffn, defined here
      y_ND = expert_parallel_ffn(*experts, mesh=mesh)
    else:
      y_ND = grouped_ffn(*experts)
    y_BTD = y_ND.reshape(b, t, d)
    if self.shared_experts is not None:
      y_BTD = y_BTD + self.shared_experts(x_BTD)
    e = cfg.n_routed_experts
    counts_BE = jax.vmap(lambda ids: jnp.bincount(ids, length=e))(idx_NK.reshape(b, t * cfg.num_experts_per_tok))
    probs_BE = jnp.mean((s_NE / jnp.sum(s_NE, axis=-1, keepdims=True)).reshape(b, t, e), axis=1)
    return y_BTD, {"expert_counts": counts_BE.astype(jnp.int32), "expert_probs": probs_BE}
