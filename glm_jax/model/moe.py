"""Mixture of experts: fp32 sigmoid router with bias-corrected top-k, dropless grouped matmuls, a shared expert.

  s = sigmoid(u . e_i)                        fp32 affinities
  pick top-k of s + b                         b = e_score_correction_bias: selection only, no gradient
  g = s_sel / sum(s_sel) * routed_scaling_factor      (the normalization only when norm_topk_prob)
  y = sum_k g_k FFN_{e_k}(u) + FFN_shared(u)
Group-limited routing (n_group > 1): a group's score is the sum of its top-2 biased scores; only experts
in the topk_group best groups can be picked. The routed experts run dropless (grouped_ffn.py: the (token,
slot) pairs sorted by expert, grouped matmuls over the per-expert groups: no capacity, no dropped tokens, no
one-hot over experts; model.moe_capacity_factor > 0 bounds each expert's rows instead and counts the drops).
Under a mesh the routed experts run in moe_parallel.expert_parallel_ffn's shard_map: with an "expert" axis larger
than 1 the experts are split over it and tokens travel by ragged all-to-all, computing the same thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.mesh_axes import TOKEN_AXES
from glm_jax.model.config import ModelConfig
from glm_jax.model.grouped_ffn import grouped_ffn
from glm_jax.model.layers import MLP, dtype_of, param
from glm_jax.model.moe_parallel import expert_parallel_ffn, token_shards
from glm_jax.quant.packed import PackedWeight, dequantize_weight


class ExpertBias(nnx.Variable):
  """e_score_correction_bias: steers selection only; updated by the balance rule, never by gradient."""


def route(logits_NE: jax.Array, bias_E: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (gate weights [N, X] fp32, expert ids [N, X] int32, affinities s [N, E] fp32)."""
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
  _, idx_NX = jax.lax.top_k(choice_NE, cfg.num_experts_per_tok)
  w_NX = jnp.take_along_axis(s_NE, idx_NX, axis=-1)
  if cfg.norm_topk_prob:
    w_NX = w_NX / (jnp.sum(w_NX, axis=-1, keepdims=True) + 1e-20)
  return w_NX * cfg.routed_scaling_factor, idx_NX.astype(jnp.int32), s_NE


def _unpacked_for_mesh(w):
  """Packed expert weights under a mesh: weight-only ones dequantized (the same values); integer-dot ones refused."""
  if not isinstance(w, PackedWeight):
    return w
  if w.act_bits is not None:
    raise ValueError(
      f"routed experts packed with {w.bits}-bit weights and {w.act_bits}-bit activations run on one "
      "device (the sampler's path); under a mesh use a weight-only scheme"
    )
  return dequantize_weight(w)


class MoE(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype_of(cfg.dtype)
    d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    self.router = param(rngs, (d, e), ("embed", "experts_router"), cfg)
    self.e_score_correction_bias = ExpertBias(
      jnp.zeros((e,), jnp.float32), out_sharding=("experts_router",), eager_sharding=False
    )
    self.gate_proj = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), cfg)
    self.up_proj = param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), cfg)
    self.down_proj = param(rngs, (e, i, d), ("experts", "expert_mlp", "embed"), cfg)
    self.shared_experts = MLP(cfg, i * cfg.n_shared_experts, rngs) if cfg.n_shared_experts else None

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (y [B, T, D], router stats): expert_counts [B, E] (selections per sequence, before any capacity
    drop), expert_probs [B, E] (the sequence mean of s_i / sum_j s_j, the P_i of the sequence balance loss) and,
    with a capacity factor, expert_dropped (the (token, slot) pairs dropped, int32 scalar)."""
    cfg = self.cfg
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    logits_NE = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), self.router[...].astype(jnp.float32))
    w_NX, idx_NX, s_NE = route(logits_NE, self.e_score_correction_bias[...], cfg)
    experts = (x_ND, w_NX, idx_NX, self.gate_proj[...], self.up_proj[...], self.down_proj[...], self.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    # B * T flattened: B split over the batch axes, T over context (context parallelism), in that order.
    if not mesh.empty and mesh.size > 1 and (b * t) % token_shards(mesh, token_axes=TOKEN_AXES) == 0:
      experts = experts[:3] + tuple(_unpacked_for_mesh(w) for w in experts[3:6]) + experts[6:]
      # Under a mesh the experts run in a shard_map: by ragged all-to-all over an expert axis, else each device on
      # its own tokens. (A Mosaic kernel, TPU's grouped matmul, cannot be partitioned by XLA.)
      y_ND, dropped = expert_parallel_ffn(
        *experts,
        mesh=mesh,
        capacity_factor=cfg.moe_capacity_factor,
        buffer_factor=cfg.moe_buffer_factor,
        token_axes=TOKEN_AXES,
      )
    else:
      y_ND, dropped = grouped_ffn(*experts, capacity_factor=cfg.moe_capacity_factor)
    y_BTD = y_ND.reshape(b, t, d)
    if self.shared_experts is not None:
      y_BTD = y_BTD + self.shared_experts(x_BTD)
    e = cfg.n_routed_experts
    counts_BE = jax.vmap(lambda ids: jnp.bincount(ids, length=e))(idx_NX.reshape(b, t * cfg.num_experts_per_tok))
    probs_BE = jnp.mean((s_NE / jnp.sum(s_NE, axis=-1, keepdims=True)).reshape(b, t, e), axis=1)
    stats = {"expert_counts": counts_BE.astype(jnp.int32), "expert_probs": probs_BE}
    if cfg.moe_capacity_factor:
      stats["expert_dropped"] = dropped
    return y_BTD, stats
