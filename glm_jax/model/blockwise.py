"""Dense attention and the DSA warm-up's indexer KL a block of queries at a time (model.attention_chunk).

The warm-up stage trains the indexer towards the dense attention distribution: per query t, the head-summed
attention p[t, :] over every visible key, and the indexer's softmax over the same keys. Computed whole, that is
[B, H, T, S] scores (64 heads x 131,072^2 at 128K). Here a scan takes `chunk` query rows at a time: their
visibility (a Visibility's rows: segment ids, positions and GLM's prefix ends, not a [B, T, S] mask), their
scores against every key in MLA's absorbed form (the shared 576-wide latent key; the value is its latent part), the
softmax, the latent output, the index scores and the KL rows. Each step is rematerialized, so the forward and the
backward hold one block's [B, H, chunk, S] at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.lightning_indexer_reference import lightning_indexer_scores
from pallas_kernels.visibility import Visibility


def kl_rows(p_BTS: jax.Array, scores_BTS: jax.Array, valid_BTS: jax.Array) -> jax.Array:
  """[B, T]: KL(p[t] || softmax(scores[t])) over the valid keys, p L1-normalized there and held constant (the
  indexer's loss before the mean over queries; glm_jax/model/mla.py indexer_kl)."""
  p = jax.lax.stop_gradient(p_BTS.astype(jnp.float32))
  p = jnp.where(valid_BTS, p, 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  log_q = jax.nn.log_softmax(jnp.where(valid_BTS, scores_BTS, -jnp.inf), axis=-1)
  terms = jnp.where(valid_BTS & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
  return jnp.sum(terms, axis=-1)


def safe_softmax(s: jax.Array) -> jax.Array:
  """Softmax over the last axis in fp32; a row with nothing visible gives zeros, not NaN."""
  # The shift m cancels in p, so its gradient is zero: stopped (as jax.nn.softmax does) rather than autodiff
  # building the max's argmax-mask gradient, a second [.., T, S] pass that sums to zero.
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m)
  total = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(total == 0, 1.0, total)


def latent_attention_and_kl(
  q_BTHA: jax.Array,
  kv_BSA: jax.Array,
  indexer: tuple | None,
  *,
  sm_scale: float,
  v_dim: int,
  chunk: int,
  visibility: Visibility,
  out_dtype,
  piece_offsets=None,
  head_axis: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Dense attention of the absorbed queries q [B, T, H, A] against the shared keys kv [B, S, A], the keys each
  query sees given by `visibility` (pallas_kernels/visibility.py: q arrays [B, T], kv segment ids [B, S]), `chunk`
  query rows at a time. Returns (the latent output [B, T, H, v_dim] in out_dtype, and with indexer = (q_i
  [B, T, Hi, Di], k_i [B, S, Di], w_i [B, T, Hi]) each query's KL of the indexer to the head-summed attention
  [B, T] fp32 (kl_rows), else None).

  The queries sit at positions visibility.q_offset + 0, 1, ... among the S keys. Under context parallelism
  (glm_jax/model/context_parallel.py) q holds a device's queries: len(piece_offsets) equal consecutive pieces of
  T, piece j's rows at positions piece_offsets[j] + 0, 1, ... (ints or traced scalars), in place of q_offset; with
  the heads split over `head_axis` (a mesh axis, inside a shard_map) the KL's head sum is completed over it."""
  b, t_len, h, a = q_BTHA.shape
  s_len = kv_BSA.shape[1]
  piece_offsets = (visibility.offset,) if piece_offsets is None else piece_offsets
  pieces = len(piece_offsets)
  if t_len % (pieces * chunk):
    raise ValueError(
      f"model.attention_chunk={chunk} does not divide the {t_len // pieces} query rows of a "
      f"piece (sequence length {t_len} in {pieces} piece(s)); use a divisor of it (or 0: every "
      "query at once)"
    )
  n = t_len // chunk
  per_piece = n // pieces
  blocks = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)  # noqa: E731  [n, B, chunk, ...]
  offsets = jnp.concatenate([off + jnp.arange(per_piece, dtype=jnp.int32) * chunk for off in piece_offsets])
  xs = {"q": blocks(q_BTHA), "vis": visibility.query_blocks(n, offsets)}
  if indexer is not None:
    q_i, k_i, w_i = indexer
    xs["q_i"], xs["w_i"] = blocks(q_i), blocks(w_i)

  @jax.checkpoint
  def one(carry, x):
    mask_BCS = x["vis"].with_keys(visibility.kv_segment_ids).mask(chunk, s_len)
    s_BHCS = jnp.einsum("bchl,bsl->bhcs", x["q"], kv_BSA, preferred_element_type=jnp.float32)
    p_BHCS = safe_softmax(jnp.where(mask_BCS[:, None], s_BHCS * sm_scale, -jnp.inf))
    o_BCHR = jnp.einsum(
      "bhcs,bsr->bchr", p_BHCS.astype(kv_BSA.dtype), kv_BSA[..., :v_dim], preferred_element_type=jnp.float32
    ).astype(out_dtype)
    if indexer is None:
      return carry, (o_BCHR, None)
    p_BCS = jnp.sum(p_BHCS, axis=1)
    if head_axis is not None:
      p_BCS = jax.lax.psum(jax.lax.stop_gradient(p_BCS), head_axis)  # a constant of the KL (kl_rows)
    scores_BCS = jnp.where(mask_BCS, lightning_indexer_scores(x["q_i"], k_i, x["w_i"]), -jnp.inf)
    return carry, (o_BCHR, kl_rows(p_BCS, scores_BCS, mask_BCS))

  _, (o, kl) = jax.lax.scan(one, (), xs)
  o_BTHR = jnp.moveaxis(o, 0, 1).reshape(b, t_len, h, v_dim)
  return o_BTHR, (None if kl is None else jnp.moveaxis(kl, 0, 1).reshape(b, t_len))
