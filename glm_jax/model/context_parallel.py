"""Context parallelism: each sequence's tokens split over the mesh's `context` axis (config.mesh.context).

Everything in a layer but attention acts token by token, so under a mesh whose batches are [B, T] split
(batch axes, context) XLA keeps those ops on each device's tokens. Attention needs every key: each device
all-gathers the whole sequence's MLA key, the latent and rope key [c_kv ; k_rope] (576 numbers a token for
GLM-5), the indexer's key (128) and the segment ids, keeps its own queries, and runs the same kernels as one
device does (the indexer's top-k, sparse attention; the dense stage's blockwise attention) with its queries'
positions as q_offset. The backward of the all-gather is a reduce-scatter: each device gets the gradient of its
own keys, summed over every device's queries.

Load balance (zig-zag): causal attention's work grows with a query's position, so contiguous pieces would leave
the first device idle and the last one busy. The sequence is cut into 2c chunks (c = the context axis size) and
device i holds chunks i and 2c-1-i, so every device has one early and one late chunk. The model puts its inputs
in this order on entry (`to_zigzag`) and its outputs back (`from_zigzag`); inside, attention sees the true
positions (rope from the permuted position ids, q_offset per chunk, keys gathered back into natural order), so
the result is the one-device result, and nothing outside the model sees the order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm_jax.mesh_axes import BATCH_AXES, CONTEXT, TENSOR
from glm_jax.model import blockwise, dsa
from pallas_kernels.visibility import Visibility

# The reference path's largest array under context parallelism is the indexer's [T / c, T] scores (fp32) a
# sequence; past this many bytes `check` refuses it (the Pallas kernels hold nothing [T, S]).
REFERENCE_LIMIT_BYTES = 2**31


def context_size() -> int:
  """The size of the current mesh's context axis (1 without a mesh, or inside a shard_map over it)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT in mesh.manual_axes:
    return 1
  return mesh.shape.get(CONTEXT, 1)


def check(seq_len: int, c: int, cfg) -> None:
  """The sizes context parallelism over c devices needs for a model config (ModelConfig, or anything with its
  attention_chunk, attention_impl, use_dsa and index_topk), or a ValueError naming them: 2c chunks of the
  sequence, each a whole number of attention_chunk blocks; the reference path only where its [T / c, T] scores
  fit."""
  if c <= 1:
    return
  attention_chunk, attention_impl = cfg.attention_chunk, cfg.attention_impl
  if seq_len % (2 * c):
    raise ValueError(
      f"context parallelism: seq_len={seq_len} must divide into 2 x mesh.context = {2 * c} equal "
      "chunks (each device holds an early and a late chunk); use a multiple of it"
    )
  piece = seq_len // (2 * c)
  if attention_chunk and piece % attention_chunk:
    raise ValueError(
      f"context parallelism: model.attention_chunk={attention_chunk} must divide each device's "
      f"chunk of seq_len / (2 x mesh.context) = {seq_len} / {2 * c} = {piece} tokens"
    )
  scores = seq_len // c * seq_len * 4
  if attention_impl == "reference" and cfg.use_dsa and seq_len > cfg.index_topk and scores > REFERENCE_LIMIT_BYTES:
    raise ValueError(
      f"context parallelism: attention_impl='reference' builds the indexer's [T / c, T] fp32 scores, "
      f"{seq_len // c} x {seq_len} x 4 B = {scores / 2**30:.1f} GiB a sequence at seq_len={seq_len}, "
      f"mesh.context={c} (limit {REFERENCE_LIMIT_BYTES / 2**30:.0f} GiB); use attention_impl='pallas'"
    )


def to_zigzag(x: jax.Array, c: int, axis: int = 1) -> jax.Array:
  """Natural order -> the layout whose i-th of c contiguous pieces is chunks (i, 2c-1-i) of 2c."""
  if c <= 1:
    return x
  x = jnp.moveaxis(x, axis, 0)
  t = x.shape[0]
  halves = x.reshape(2, c, t // (2 * c), *x.shape[1:])
  y = jnp.stack([halves[0], jnp.flip(halves[1], axis=0)], axis=1)  # [c, 2, L, ...]
  return jnp.moveaxis(y.reshape(x.shape), 0, axis)


def from_zigzag(x: jax.Array, c: int, axis: int = 1) -> jax.Array:
  """The inverse of to_zigzag."""
  if c <= 1:
    return x
  x = jnp.moveaxis(x, axis, 0)
  t = x.shape[0]
  pairs = x.reshape(c, 2, t // (2 * c), *x.shape[1:])
  y = jnp.concatenate([pairs[:, 0], jnp.flip(pairs[:, 1], axis=0)], axis=0)  # [2c, L, ...]
  return jnp.moveaxis(y.reshape(x.shape), 0, axis)


def attention(
  impl: str,
  q_BTHA: jax.Array,
  kv_BTA: jax.Array,
  indexer: tuple | None,
  *,
  visibility: Visibility,
  sparse: bool,
  indexer_loss: bool,
  sm_scale: float,
  v_dim: int,
  topk: int,
  chunk: int,
  out_dtype,
  share: dsa.IndexShare | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """MLA's attention in the absorbed form under the context axis. Every [B, T, ...] operand is in the zig-zag
  layout: q [B, T, H, A] (absorbed queries), kv [B, T, A] (the shared key; its first v_dim numbers are the value),
  indexer = (q_i [B, T, Hi, Di], k_i [B, T, Di], w_i [B, T, Hi]) or None; visibility: the sequence's self-attention
  (`Visibility.self_attention`: segment ids and prefix ends [B, T], q_offset 0).
  sparse: DSA (the indexer's top-`topk`, sparse attention); else dense causal attention, `chunk` query rows at a
  time (0: a device's chunk at once). Returns (latent output [B, T, H, v_dim], the selected keys [B, T, topk] as
  natural-order positions or None, each query's indexer KL [B, T] when indexer_loss or None), in the layout.
  share: dsa.IndexShare (sparse only): prev_topk [B, T, topk] in the layout, reused when
  share.shared is true instead of this layer's own selection."""
  mode = dsa.kernel_mode(impl)
  b, _, h, _ = q_BTHA.shape
  c = context_size()
  batch = dsa.split_axes(b, BATCH_AXES) or None
  heads = dsa.split_axes(h, (TENSOR,)) or None
  tok = P(batch, CONTEXT)

  def gather(x):  # this device's rows -> the whole sequence's, in natural order
    return from_zigzag(jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True), c)

  def local(q, kv, q_i, k_i, w_i, shared, prev, vis_arrays):
    i = jax.lax.axis_index(CONTEXT)
    piece = q.shape[1] // 2
    offsets = (i * piece, (2 * c - 1 - i) * piece)  # the positions of this device's two chunks
    kv_all = gather(kv)
    vis = visibility.with_arrays(vis_arrays, keys=gather)  # this device's queries against the whole sequence's keys
    k_i_all = None if k_i is None else gather(k_i)
    if not sparse:
      o, kl = blockwise.latent_attention_and_kl(
        q,
        kv_all,
        (q_i, k_i_all, w_i) if indexer_loss else None,
        sm_scale=sm_scale,
        v_dim=v_dim,
        chunk=chunk or piece,
        visibility=vis,
        out_dtype=out_dtype,
        piece_offsets=offsets,
        head_axis=heads,
      )
      return o, None, kl

    def rows(x, j):
      return x[:, j * piece : (j + 1) * piece]

    def select():
      picks = [
        dsa.select_topk(
          impl,
          rows(q_i, j),
          k_i_all,
          rows(w_i, j),
          topk=topk,
          visibility=vis.rows(j * piece, piece, q_offset=offsets[j]),
        )
        for j in (0, 1)
      ]
      idx = jnp.concatenate([p[0] for p in picks], axis=1)
      if mode == "reference":
        return idx, jnp.concatenate([p[1] for p in picks], axis=1)
      # the kernel's top-k scores carry no gradient
      return idx, dsa.selected_index_scores(q_i, k_i_all, w_i, idx) if indexer_loss else jnp.zeros(idx.shape)

    idx, vals = select() if share is None else dsa.IndexShare(shared, prev).select(select)
    o, lse = dsa.attend(impl, q, kv_all, idx, sm_scale=sm_scale, v_dim=v_dim)
    if not indexer_loss:
      return o, idx, None
    p_sel = dsa.head_probs(impl, q, kv_all, idx, lse, sm_scale=sm_scale)
    if heads:
      p_sel = jax.lax.psum(jax.lax.stop_gradient(p_sel), heads)  # a constant of the KL (kl_rows)
    return o, idx, blockwise.kl_rows(p_sel, vals, idx >= 0)

  q_i, k_i, w_i = indexer if indexer is not None else (None, None, None)
  shared, prev = (share.shared, share.prev_topk) if share is not None else (None, None)
  if not dataclasses.replace(visibility, q_prefix_end=None).is_static_causal:
    raise ValueError(
      f"context parallel attention: want a causal self-attention visibility (q_offset 0); got causal="
      f"{visibility.causal}, q_offset={visibility.q_offset!r}"
    )
  operands = [q_BTHA, kv_BTA, q_i, k_i, w_i, shared, prev]
  specs = [P(batch, CONTEXT, heads, None), tok, P(batch, CONTEXT, None, None), tok, tok, P(), tok]
  present = [x is not None for x in operands]
  vis_arrays = visibility.arrays()  # every one [B, T] in the layout, split like the tokens
  returned = (True, sparse, indexer_loss)  # which of (o, idx, kl) the body returns

  def body(*args):
    it = iter(args)
    outs = local(*(next(it) if p else None for p in present), dict(zip(vis_arrays, it)))
    return tuple(x for x, r in zip(outs, returned) if r)

  out_specs = (P(batch, CONTEXT, heads, None), tok, tok)
  outs = iter(
    jax.shard_map(
      body,
      in_specs=(*(s for s, p in zip(specs, present) if p), *[tok] * len(vis_arrays)),
      out_specs=tuple(s for s, r in zip(out_specs, returned) if r),
      check_vma=False,
    )(*(x for x in operands if x is not None), *vis_arrays.values())
  )
  o, idx, kl = (next(outs) if r else None for r in returned)
  return o, idx, kl
