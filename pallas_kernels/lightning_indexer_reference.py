"""Pure-jnp lightning indexer and its deterministic causal top-k (DSA, DeepSeek-V3.2 Eq. 1).

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])                                     (DS32 Eq. 1)
Key s is visible to query t when s <= t + q_offset (causal) and, when segment ids are given, when both
belong to the same packed document. The top-k keeps the `topk` highest visible scores per query; ties go
to the lower key index (lax.top_k's documented order), so two runs give identical indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_mask(t_len: int, s_len: int, *, causal: bool = True, q_offset: int = 0,
                 q_segment_ids: jax.Array | None = None,
                 kv_segment_ids: jax.Array | None = None) -> jax.Array:
  """[B or 1, T, S] bool: which keys each query may see."""
  t = jnp.arange(t_len)[:, None] + q_offset
  s = jnp.arange(s_len)[None, :]
  mask = (s <= t) if causal else jnp.ones((t_len, s_len), bool)
  mask = mask[None]
  if q_segment_ids is not None:
    if kv_segment_ids is None:
      raise ValueError("visible_mask: q_segment_ids given without kv_segment_ids")
    mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
  return mask


def lightning_indexer_scores(q_BTHD: jax.Array, k_BSD: jax.Array, w_BTH: jax.Array) -> jax.Array:
  """Index scores [B, T, S] in fp32, before masking."""
  qk_BTHS = jnp.einsum("bthd,bsd->bths", q_BTHD.astype(jnp.float32), k_BSD.astype(jnp.float32))
  scores_BTS = jnp.einsum("bths,bth->bts", jax.nn.relu(qk_BTHS), w_BTH.astype(jnp.float32))
  # A score whose every head term is zero can come out as -0.0 or +0.0 depending on how XLA orders the sum, and
  # lax.top_k ranks -0.0 below +0.0: make zero one value so the top-k among zero scores is by key index alone.
  return jnp.where(scores_BTS == 0, 0.0, scores_BTS)


def lightning_indexer_topk(q_BTHD: jax.Array, k_BSD: jax.Array, w_BTH: jax.Array, *, topk: int,
                           causal: bool = True, q_offset: int = 0,
                           q_segment_ids: jax.Array | None = None,
                           kv_segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Returns (indices [B, T, topk] int32, scores [B, T, topk] fp32); index -1 and score -inf where fewer
  than topk keys are visible. Indices come in descending score order."""
  if topk <= 0:
    raise ValueError(f"lightning_indexer_topk: topk={topk}; must be a positive integer")
  _, t_len, _, _ = q_BTHD.shape
  s_len = k_BSD.shape[1]
  scores_BTS = lightning_indexer_scores(q_BTHD, k_BSD, w_BTH)
  mask = visible_mask(t_len, s_len, causal=causal, q_offset=q_offset,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  scores_BTS = jnp.where(mask, scores_BTS, -jnp.inf)
  k_eff = min(topk, s_len)
  vals_BTK, idx_BTK = jax.lax.top_k(scores_BTS, k_eff)
  idx_BTK = jnp.where(jnp.isneginf(vals_BTK), -1, idx_BTK).astype(jnp.int32)
  if k_eff < topk:
    pad = [(0, 0), (0, 0), (0, topk - k_eff)]
    idx_BTK = jnp.pad(idx_BTK, pad, constant_values=-1)
    vals_BTK = jnp.pad(vals_BTK, pad, constant_values=-jnp.inf)
  return idx_BTK, vals_BTK
