"""Pure-jnp lightning indexer and its deterministic causal top-k (DSA, DeepSeek-V3.2 Eq. 1).

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])                                     (DS32 Eq. 1)
Key s is visible to query t when s <= t + q_offset (causal) and, when segment ids are given, when both
belong to the same packed document. The top-k keeps the `topk` highest visible scores per query; ties go
to the lower key index (lax.top_k's documented order), so two runs give identical indices.

Prefix-bidirectional visibility (GLM's blank infilling: part A of a document attends both ways, part B causally
after it): with q_prefix_end [B, T] (integers), key s is visible to query t when
s <= max(t + q_offset, q_prefix_end[t] - 1), i.e. causally or inside the query's prefix [0, q_prefix_end[t]),
and still only within its segment. A query whose prefix ends at or before its own position + 1 (all zeros, say)
sees exactly the causal set, so all zeros equal q_prefix_end=None. Only with causal=True: a non-causal mask
already shows every key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_prefix_end(fn: str, q_prefix_end, b: int | None, t_len: int, causal: bool) -> jax.Array:
  """q_prefix_end as an array, or a ValueError naming it: [b, t_len] (any B when b is None), integer, causal."""
  q_prefix_end = jnp.asarray(q_prefix_end)
  if not causal:
    raise ValueError(
      f"{fn}: q_prefix_end given with causal=False; a prefix widens the causal mask only "
      "(a non-causal mask already shows every key): pass causal=True or q_prefix_end=None"
    )
  if q_prefix_end.ndim != 2 or q_prefix_end.shape[1] != t_len or (b is not None and q_prefix_end.shape[0] != b):
    raise ValueError(
      f"{fn}: q_prefix_end shape {q_prefix_end.shape}; want [B, T] = [{'B' if b is None else b}, "
      f"{t_len}] (each query's prefix end)"
    )
  if not jnp.issubdtype(q_prefix_end.dtype, jnp.integer):
    raise ValueError(f"{fn}: q_prefix_end dtype {q_prefix_end.dtype}; want an integer dtype (a key position)")
  return q_prefix_end


def visible_mask(
  t_len: int,
  s_len: int,
  *,
  causal: bool = True,
  q_offset: int = 0,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  q_prefix_end: jax.Array | None = None,
) -> jax.Array:
  """[B or 1, T, S] bool: which keys each query may see (the rule in the module docstring); [B, T, S] with segment
  ids or q_prefix_end [B, T]."""
  t = jnp.arange(t_len)[:, None] + q_offset
  s = jnp.arange(s_len)[None, :]
  mask = (s <= t) if causal else jnp.ones((t_len, s_len), bool)
  mask = mask[None]
  if q_prefix_end is not None:
    q_prefix_end = _check_prefix_end("visible_mask", q_prefix_end, None, t_len, causal)
    mask = mask | (s[None] < q_prefix_end[:, :, None])  # s < end, not s <= end - 1: no wrap at the int minimum
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


def lightning_indexer_topk(
  q_BTHD: jax.Array,
  k_BSD: jax.Array,
  w_BTH: jax.Array,
  *,
  topk: int,
  causal: bool = True,
  q_offset: int = 0,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  q_prefix_end: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Returns (indices [B, T, topk] int32, scores [B, T, topk] fp32); index -1 and score -inf where fewer
  than topk keys are visible. Indices come in descending score order. q_prefix_end [B, T]: each query's
  bidirectional prefix (module docstring; causal only)."""
  if topk <= 0:
    raise ValueError(f"lightning_indexer_topk: topk={topk}; must be a positive integer")
  b, t_len, _, _ = q_BTHD.shape
  s_len = k_BSD.shape[1]
  if q_prefix_end is not None:
    q_prefix_end = _check_prefix_end("lightning_indexer_topk", q_prefix_end, b, t_len, causal)
  scores_BTS = lightning_indexer_scores(q_BTHD, k_BSD, w_BTH)
  mask = visible_mask(
    t_len,
    s_len,
    causal=causal,
    q_offset=q_offset,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    q_prefix_end=q_prefix_end,
  )
  scores_BTS = jnp.where(mask, scores_BTS, -jnp.inf)
  k_eff = min(topk, s_len)
  vals_BTK, idx_BTK = jax.lax.top_k(scores_BTS, k_eff)
  idx_BTK = jnp.where(jnp.isneginf(vals_BTK), -1, idx_BTK).astype(jnp.int32)
  if k_eff < topk:
    pad = [(0, 0), (0, 0), (0, topk - k_eff)]
    idx_BTK = jnp.pad(idx_BTK, pad, constant_values=-1)
    vals_BTK = jnp.pad(vals_BTK, pad, constant_values=-jnp.inf)
  return idx_BTK, vals_BTK
