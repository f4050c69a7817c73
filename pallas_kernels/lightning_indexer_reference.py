"""Pure-jnp lightning indexer and its deterministic causal top-k (DSA, DeepSeek-V3.2 Eq. 1).

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])                                     (DS32 Eq. 1)
Which keys each query sees is a Visibility (pallas_kernels/visibility.py: causal from q_offset, packed documents
segments, GLM's bidirectional prefixes). The top-k keeps the `topk` highest visible scores per query; ties go
to the lower key index (lax.top_k's documented order), so two runs give identical indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.visibility import Visibility


def lightning_indexer_scores(q_BTHD: jax.Array, k_BSD: jax.Array, w_BTH: jax.Array) -> jax.Array:
  """Index scores [B, T, S] in fp32, before masking."""
  qk_BTHS = jnp.einsum("bthd,bsd->bths", q_BTHD.astype(jnp.float32), k_BSD.astype(jnp.float32))
  scores_BTS = jnp.einsum("bths,bth->bts", jax.nn.relu(qk_BTHS), w_BTH.astype(jnp.float32))
  # A score whose every head term is zero can come out as -0.0 or +0.0 depending on how XLA orders the sum, and
  # lax.top_k ranks -0.0 below +0.0: make zero one value so the top-k among zero scores is by key index alone.
  return jnp.where(scores_BTS == 0, 0.0, scores_BTS)


def lightning_indexer_topk(
  q_BTHD: jax.Array,
  k_BSD: jax.Array,
  w_BTH: jax.Array,
  *,
  topk: int,
  visibility: Visibility | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Returns (indices [B, T, topk] int32, scores [B, T, topk] fp32); index -1 and score -inf where fewer
  than topk keys are visible. Indices come in descending score order. visibility: which keys each query sees
  (None: causal, q_offset 0, no segments)."""
  if topk <= 0:
    raise ValueError(f"lightning_indexer_topk: topk={topk}; must be a positive integer")
  b, t_len, _, _ = q_BTHD.shape
  s_len = k_BSD.shape[1]
  vis = (visibility or Visibility()).check("lightning_indexer_topk", b, t_len, s_len)
  scores_BTS = lightning_indexer_scores(q_BTHD, k_BSD, w_BTH)
  mask = vis.mask(t_len, s_len)
  scores_BTS = jnp.where(mask, scores_BTS, -jnp.inf)
  k_eff = min(topk, s_len)
  vals_BTK, idx_BTK = jax.lax.top_k(scores_BTS, k_eff)
  idx_BTK = jnp.where(jnp.isneginf(vals_BTK), -1, idx_BTK).astype(jnp.int32)
  if k_eff < topk:
    pad = [(0, 0), (0, 0), (0, topk - k_eff)]
    idx_BTK = jnp.pad(idx_BTK, pad, constant_values=-1)
    vals_BTK = jnp.pad(vals_BTK, pad, constant_values=-jnp.inf)
  return idx_BTK, vals_BTK
