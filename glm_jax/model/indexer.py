"""DSA's lightning indexer: a cheap scorer that picks the index_topk keys each query attends to.

  q_I = wq_b(c_q)                [T, J, Z]  from MLA's normalized q latent (J = H_I heads of width Z = d_I)
  k_I = LayerNorm(wk(h))         [S, Z]     one key per token, shared by the indexer heads
  rope on the first qk_rope_head_dim dims of q_I and k_I (interleaved for GLM-5)
  w   = weights_proj(h) * H_I^-1/2 * d_I^-1/2    [T, J]
  I[t, s] = sum_j w[t, j] * relu(q_I[t, j] . k_I[s])                                     (DS32 Eq. 1)
then a causal, deterministic top-k (pallas_kernels.lightning_indexer_reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.layers import LayerNorm, apply_rope, dense, dtype_of, param


class Indexer(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype_of(cfg.dtype)
    h, d = cfg.index_n_heads, cfg.index_head_dim
    self.wq_b = param(rngs, (cfg.q_lora_rank, h, d), ("q_lora", "index_heads", "index_head_dim"), cfg)
    self.wk = param(rngs, (cfg.hidden_size, d), ("embed", "index_head_dim"), cfg)
    self.k_norm = LayerNorm(d, cfg.index_norm_eps, cfg, rngs)
    self.weights_proj = param(rngs, (cfg.hidden_size, h), ("embed", "index_heads"), cfg)

  def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    r = self.cfg.qk_rope_head_dim
    x_rot = apply_rope(x[..., :r], cos, sin, self.cfg.indexer_rope_interleave)
    return jnp.concatenate([x_rot, x[..., r:]], axis=-1)

  def __call__(
    self, x_BTD: jax.Array, cq_BTQ: jax.Array, cos: jax.Array, sin: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (q [B, T, J, Z], k [B, T, Z], w [B, T, J] fp32), ready for the scorer."""
    cfg = self.cfg
    q_BTJZ = dense(cq_BTQ, self.wq_b, self.dtype, "btr,rhd->bthd")
    q_BTJZ = self._rope(q_BTJZ, cos, sin)
    k_BTZ = self.k_norm(dense(x_BTD, self.wk, self.dtype))
    k_BTZ = self._rope(k_BTZ, cos, sin)
    w_BTJ = jnp.einsum("btd,dh->bth", x_BTD.astype(jnp.float32), self.weights_proj[...].astype(jnp.float32))
    w_BTJ = w_BTJ * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
    return q_BTJZ, k_BTZ, w_BTJ
