"""Pure-jnp sparse MLA attention over indexer-selected keys, in MLA's absorbed (MQA) form.

q [B, T, H, D_qk] per head; kv [B, S, D_qk] shared by all heads (the kv latent and the shared rope key,
576 wide for GLM-5); the value is kv[..., :v_dim]. Each query attends only to its indices (-1, or any index outside
[0, S), = skip):
  o[t, h] = sum_{s in idx[t]} softmax_s(sm_scale * q[t, h] . kv[s]) kv[s, :v_dim]
A query with no valid index outputs zeros and lse = -inf. Softmax in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_kv(kv_BSD: jax.Array, idx_BTK: jax.Array) -> jax.Array:
  """kv rows selected per query: [B, T, K, D]; rows for an index outside [0, S) are row 0 (mask them)."""
  safe_BTK = jnp.where(idx_BTK < kv_BSD.shape[1], jnp.maximum(idx_BTK, 0), 0)
  return jax.vmap(lambda kv, idx: kv[idx])(kv_BSD, safe_BTK)


def _selected_scores(q_BTHD, kv_BTKD, idx_BTK, s_len: int, sm_scale: float) -> jax.Array:
  """sm_scale * q . kv over the gathered keys, fp32 [B, T, H, K]; -inf at skipped indices."""
  valid_BTK = (idx_BTK >= 0) & (idx_BTK < s_len)
  s_BTHK = jnp.einsum("bthd,btkd->bthk", q_BTHD, kv_BTKD, preferred_element_type=jnp.float32) * sm_scale
  return jnp.where(valid_BTK[:, :, None, :], s_BTHK, -jnp.inf)


def sparse_mla_attention(
  q_BTHD: jax.Array, kv_BSD: jax.Array, idx_BTK: jax.Array, *, sm_scale: float, v_dim: int
) -> tuple[jax.Array, jax.Array]:
  """Returns (out [B, T, H, v_dim] in q's dtype, lse [B, T, H] fp32)."""
  kv_BTKD = gather_kv(kv_BSD, idx_BTK)
  s_BTHK = _selected_scores(q_BTHD, kv_BTKD, idx_BTK, kv_BSD.shape[1], sm_scale)
  m_BTH = jnp.max(s_BTHK, axis=-1)
  m_safe = jnp.where(jnp.isneginf(m_BTH), 0.0, m_BTH)
  p_BTHK = jnp.exp(s_BTHK - m_safe[..., None])
  l_BTH = jnp.sum(p_BTHK, axis=-1)
  p_BTHK = p_BTHK / jnp.where(l_BTH == 0, 1.0, l_BTH)[..., None]
  out = jnp.einsum(
    "bthk,btkv->bthv", p_BTHK.astype(kv_BSD.dtype), kv_BTKD[..., :v_dim], preferred_element_type=jnp.float32
  )
  lse_BTH = jnp.where(l_BTH == 0, -jnp.inf, m_safe + jnp.log(jnp.where(l_BTH == 0, 1.0, l_BTH)))
  return out.astype(q_BTHD.dtype), lse_BTH


def sparse_attention_head_probs(
  q_BTHD: jax.Array, kv_BSD: jax.Array, idx_BTK: jax.Array, lse_BTH: jax.Array, *, sm_scale: float
) -> jax.Array:
  """The attention's probabilities of the selected keys summed over heads, sum_h exp(s[t, h, k] - lse[t, h]):
  [B, T, K] fp32, 0 where the index is skipped (the sparse-stage indexer loss's target)."""
  s_BTHK = _selected_scores(q_BTHD, gather_kv(kv_BSD, idx_BTK), idx_BTK, kv_BSD.shape[1], sm_scale)
  p_BTHK = jnp.exp(s_BTHK - jnp.where(jnp.isneginf(lse_BTH), 0.0, lse_BTH)[..., None])  # exp(-inf) = 0 if skipped
  return jnp.sum(p_BTHK, axis=2)
