"""The GLM-5 decoder: embedding, dense layers, MoE layers (two scanned stacks), final norm, head, MTP.

  h_0 = Emb(x);  h_{l+1} = h_l' + FFN_l(RMSNorm(h_l')),  h_l' = h_l + MLA_l(RMSNorm(h_l))
  logits = RMSNorm(h_L) W_head
With model.norm_style "deepnorm" (GLM-130B) a layer is Post-LN instead, glm_jax/model/deepnorm.py:
  x' = RMSNorm(x);  h = RMSNorm(alpha x' + MLA(x'));  out = alpha h + FFN(h)
The first `first_k_dense_replace` layers use a dense SwiGLU MLP, the rest the MoE block; each group is one
stack of layers (a leading layer axis on every parameter) applied with `jax.lax.scan`, so compile time
does not grow with depth. Packed documents: `segment_ids` keep attention inside a document and
`positions` restart its rope at 0. GLM's blank infilling (glm_jax/data/blank_infilling.py): `prefix_end` makes
attention bidirectional over each document's prefix (key s is visible to query t when s <= max(t,
prefix_end[t] - 1)), and with model.rope_2d `block_positions` is GLM's second position id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm_jax.model.config import ModelConfig
from glm_jax.model.kv_cache import KVCache, LayerCache
from glm_jax.model import context_parallel, deepnorm
from glm_jax.model.dsa import IndexShare
from glm_jax.model.layers import (
  MLP,
  Embed,
  RMSNorm,
  check_token_ids,
  dense,
  dense_fp32,
  dtype_of,
  param,
  rope_angles,
  rope_angles_2d,
)
from glm_jax.model.mla import MLA, AttentionInputs
from glm_jax.model.moe import MoE
from pallas_kernels.visibility import Visibility

# What jax.checkpoint saves under each of config.REMAT_POLICIES but "none" (which does not wrap the layer).
CHECKPOINT_POLICIES: dict[str, Callable | None] = {
  "full": None,  # save nothing: recompute the whole layer in the backward pass
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
  # recompute the layer, and keep its input (the layer-boundary residual, [B, T, D] a layer) in host memory
  "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["layer_input"],
    offload_src="device",
    offload_dst="pinned_host",
  ),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
  """logits [B, T, V] fp32 (position t predicts token t+1); mtp_logits [n_mtp, B, T, V] (depth k at t
  predicts token t+1+k; the last k positions have no target) or None; aux: per-layer statistics stacked on a
  leading layer axis: "expert_counts", "expert_probs" [L_moe, B, E] (MoE layers), "expert_dropped" [L_moe]
  (with model.moe_capacity_factor), "topk_indices" [L, B, T, K] when DSA is active (an IndexShare layer's: the
  selection it reused), "index_scores" [L, B, T, T] when asked for, "indexer_kl" [L_full + n_mtp] when asked for:
  the layers that run their own indexer (all of them unless model.indexer_types has "shared" ones), the MTP layers
  last; "mtp{k}_expert_*" [B, E] for MoE MTP layers. With return_hidden, logits and mtp_logits are None and
  hidden [B, T, D] / mtp_hidden [n_mtp, B, T, D] are the normed states the head reads (GlmMoeDsa.head maps them
  to logits: a loss can then take them a chunk at a time)."""

  logits: jax.Array | None
  mtp_logits: jax.Array | None
  aux: dict[str, jax.Array]
  hidden: jax.Array | None = None
  mtp_hidden: jax.Array | None = None


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, moe: bool, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
    self.self_attn = MLA(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs)
    self.alpha = deepnorm.alpha(cfg) if cfg.norm_style == "deepnorm" else None  # None: Pre-LN

  def __call__(
    self,
    x_BTD: jax.Array,
    inp: AttentionInputs,
    *,
    form: str = "mha",
    return_index_scores: bool = False,
    indexer_loss: bool = False,
    return_cache: bool = False,
    share: IndexShare | None = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    return self._residuals(
      x_BTD,
      lambda xn: self.self_attn(
        xn,
        inp,
        form=form,
        return_index_scores=return_index_scores,
        indexer_loss=indexer_loss,
        return_cache=return_cache,
        share=share,
      ),
    )

  def _residuals(self, x, attention) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The two sublayers around `attention` (normed input -> (out, aux)): Pre-LN, or DeepNorm's Post-LN."""
    if self.alpha is None:
      a, aux = attention(self.input_layernorm(x))
      x = x + a
      m, router_aux = self._ffn(self.post_attention_layernorm(x))
      return x + m, {**aux, **router_aux}
    xn = self.input_layernorm(x)
    a, aux = attention(xn)
    h = self.post_attention_layernorm(self.alpha * xn + a)
    m, router_aux = self._ffn(h)
    return self.alpha * h + m, {**aux, **router_aux}

  def _ffn(self, xn_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    m = self.mlp(xn_BTD)
    return m if isinstance(m, tuple) else (m, {})

  def decode(
    self,
    x_BTD: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    pos_B: jax.Array,
    cache: LayerCache,
    share: IndexShare | None = None,
  ) -> tuple[jax.Array, LayerCache, jax.Array | None]:
    """T tokens a row at slots pos[b].. against this layer's cache (MLA.decode): (x, the cache, the selected slots
    or None)."""

    def attention(xn):
      a, new_cache, idx = self.self_attn.decode(xn, cos, sin, pos_B, cache, share)
      return a, {"cache": new_cache, "topk": idx}

    x_BTD, aux = self._residuals(x_BTD, attention)
    return x_BTD, aux["cache"], aux["topk"]


def stacked_layers(cfg: ModelConfig, moe: bool, n: int, rngs: nnx.Rngs) -> DecoderLayer | None:
  """n DecoderLayers as one module whose parameters have a leading "layers" axis."""
  if n == 0:
    return None

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(r: nnx.Rngs) -> DecoderLayer:
    return DecoderLayer(cfg, moe, r)

  return make(rngs)


def scan_layers(
  stack: DecoderLayer | None,
  x_BTD: jax.Array,
  inp: AttentionInputs,
  remat_policy: str,
  unroll: bool = False,
  shared: jax.Array | None = None,
  topk: jax.Array | None = None,
  **kwargs,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
  """Applies a stack layer by layer with jax.lax.scan; per-layer aux comes back stacked [L, ...]. IndexShare
  (model.indexer_types, DSA selecting): shared [L] bool says which layers reuse the selection before them, topk
  [B, T, K] is the last selection before the stack; each layer's goes on to the next. Returns (x, aux, the
  stack's last selection or None)."""
  if stack is None:
    return x_BTD, {}, topk
  graphdef, state = nnx.split(stack)

  def body(carry, layer):
    x, prev = carry
    layer_state, is_shared = layer
    x = checkpoint_name(x, "layer_input")  # what remat_policy "offload_layer_inputs" moves to the host
    share = None if is_shared is None else IndexShare(is_shared, prev)
    x, aux = nnx.merge(graphdef, layer_state)(x, inp, share=share, **kwargs)
    return (x, None if prev is None else aux["topk_indices"]), aux

  if remat_policy != "none":
    body = jax.checkpoint(body, policy=CHECKPOINT_POLICIES[remat_policy], prevent_cse=False)
  (x, topk), aux = jax.lax.scan(body, (x_BTD, topk), (state, shared), unroll=unroll)
  return x, aux, topk


def scan_decode(
  stack: DecoderLayer | None,
  x_BTD: jax.Array,
  cos: jax.Array,
  sin: jax.Array,
  pos_B: jax.Array,
  cache: LayerCache | None,
  shared: jax.Array | None = None,
  topk: jax.Array | None = None,
) -> tuple[jax.Array, LayerCache | None, jax.Array | None]:
  """DecoderLayer.decode through a stack, each layer with its slice of the stacked cache; IndexShare's shared and
  topk [B, T, K] as in scan_layers. Returns (x, the cache, the stack's last selection or None)."""
  if stack is None:
    return x_BTD, cache, topk
  graphdef, state = nnx.split(stack)

  def body(carry, layer):
    x, prev = carry
    layer_state, layer_cache, is_shared = layer
    share = None if is_shared is None else IndexShare(is_shared, prev)
    x, layer_cache, idx = nnx.merge(graphdef, layer_state).decode(x, cos, sin, pos_B, layer_cache, share)
    return (x, None if prev is None else idx), layer_cache

  (x, topk), cache = jax.lax.scan(body, (x_BTD, topk), (state, cache, shared))
  return x, cache, topk


def check_draft(cfg: ModelConfig) -> None:
  """Speculative decoding drafts with the first MTP layer: a model without one is refused by name."""
  if cfg.num_nextn_predict_layers < 1:
    raise ValueError(
      "speculative decoding drafts with the MTP layer, but model.num_nextn_predict_layers="
      f"{cfg.num_nextn_predict_layers}: use a model with an MTP layer (GLM-5 has 1), or decode without "
      "speculation"
    )


class MTPLayer(nnx.Module):
  """One multi-token-prediction module: h' = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h_i)]), a decoder layer,
  then the shared head after its own norm (DeepSeek-V3 MTP; GLM-5 ships one, as layer index 78)."""

  def __init__(self, cfg: ModelConfig, layer_index: int, rngs: nnx.Rngs):
    self.dtype = dtype_of(cfg.dtype)
    d = cfg.hidden_size
    self.enorm = RMSNorm(d, cfg.rms_norm_eps, cfg, rngs)
    self.hnorm = RMSNorm(d, cfg.rms_norm_eps, cfg, rngs)
    self.eh_proj = param(rngs, (2 * d, d), ("mtp_in", "embed"), cfg)
    self.layer = DecoderLayer(cfg, layer_index >= cfg.first_k_dense_replace, rngs)
    self.shared_head_norm = RMSNorm(d, cfg.rms_norm_eps, cfg, rngs)

  def __call__(
    self,
    h_BTD: jax.Array,
    emb_next_BTD: jax.Array,
    inp: AttentionInputs,
    *,
    form: str = "mha",
    indexer_loss: bool = False,
    return_cache: bool = False,
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Returns (the new hidden state h^k, its normed output for the head, aux); return_cache as in MLA.__call__."""
    h, aux = self.layer(
      self._input(h_BTD, emb_next_BTD), inp, form=form, indexer_loss=indexer_loss, return_cache=return_cache
    )
    return h, self.shared_head_norm(h), aux

  def decode(
    self, h_BTD: jax.Array, emb_next_BTD: jax.Array, cos: jax.Array, sin: jax.Array, pos_B: jax.Array, cache: LayerCache
  ) -> tuple[jax.Array, jax.Array, LayerCache]:
    """__call__ for T positions a row at slots pos[b].. against the layer's cache (DecoderLayer.decode):
    (the new hidden state, its normed output for the head, the cache)."""
    h, cache, _ = self.layer.decode(self._input(h_BTD, emb_next_BTD), cos, sin, pos_B, cache)
    return h, self.shared_head_norm(h), cache

  def _input(self, h_BTD: jax.Array, emb_next_BTD: jax.Array) -> jax.Array:
    x = jnp.concatenate([self.enorm(emb_next_BTD), self.hnorm(h_BTD)], axis=-1)
    return dense(x, self.eh_proj, self.dtype)


class GlmMoeDsa(nnx.Module):
  """GLM-5 as a causal LM. `model(input_ids)` -> ModelOutput with `.logits` [B, T, V]."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype_of(cfg.dtype)
    self.embed_tokens = Embed(cfg, rngs)
    self.dense_layers = stacked_layers(cfg, False, cfg.num_dense_layers, rngs)
    self.moe_layers = stacked_layers(cfg, True, cfg.num_moe_layers, rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
    self.lm_head = (
      None if cfg.tie_word_embeddings else param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg)
    )
    self.mtp = nnx.List([MTPLayer(cfg, cfg.num_hidden_layers + k, rngs) for k in range(cfg.num_nextn_predict_layers)])
    if cfg.norm_style == "deepnorm":
      deepnorm.init_weights(self, rngs)

  def head(self, x_BTD: jax.Array) -> jax.Array:
    """fp32 logits from normed hidden states."""
    if self.lm_head is None:
      w = self.embed_tokens.embedding[...].astype(self.dtype)
      return jnp.einsum("btd,vd->btv", x_BTD, w, preferred_element_type=jnp.float32)
    return dense_fp32(x_BTD, self.lm_head, self.dtype)

  def __call__(
    self,
    input_ids: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    block_positions: jax.Array | None = None,
    prefix_end: jax.Array | None = None,
    form: str = "mha",
    return_index_scores: bool = False,
    indexer_loss: bool = False,
    compute_mtp: bool = True,
    embedding_grad_shrink: float = 1.0,
    return_hidden: bool = False,
  ) -> ModelOutput:
    """input_ids [B, T] int; positions [B, T] (default 0..T-1); segment_ids [B, T] (default one segment);
    block_positions [B, T] (GLM's second position id; model.rope_2d only; default 0); prefix_end [B, T] int
    (default None: causal): the end of the bidirectional prefix each token's document has.
    form: "mha" or "absorbed" for the dense attention path (DSA always attends in the absorbed form).
    indexer_loss: each layer reports aux["indexer_kl"] [L] (see MLA.__call__).
    embedding_grad_shrink: GLM-130B's EGS, a in emb = a emb + (1 - a) stop_gradient(emb): the forward is
    unchanged, the gradient reaching the embedding table is a times the plain one (1.0: off).
    return_hidden: return the normed hidden states instead of the logits (ModelOutput)."""
    emb_BTD, inp, h, dense_aux, moe_aux = self._decoder(
      input_ids,
      positions,
      segment_ids,
      block_positions,
      prefix_end,
      embedding_grad_shrink,
      form=form,
      return_index_scores=return_index_scores,
      indexer_loss=indexer_loss,
    )
    # Under context parallelism the tokens are in the zig-zag layout inside the model (context_parallel.py); every
    # per-token output goes back to natural order here. (c = 1: both maps are the identity.)
    c = context_parallel.context_size()
    aux = {k: v for k, v in moe_aux.items() if k.startswith("expert_")}
    for key in ("topk_indices", "index_scores", "indexer_kl"):
      parts = [a[key] for a in (dense_aux, moe_aux) if key in a]
      if parts:
        aux[key] = jnp.concatenate(parts, axis=0)
    if "indexer_kl" in aux and self.cfg.index_share:  # a shared layer's indexer selects nothing: no loss
      aux["indexer_kl"] = aux["indexer_kl"][np.flatnonzero(~np.asarray(self.cfg.shared_indexer_layers))]
    if "topk_indices" in aux:
      aux["topk_indices"] = context_parallel.from_zigzag(aux["topk_indices"], c, axis=2)
    head = (lambda x: x) if return_hidden else self.head  # noqa: E731
    logits = context_parallel.from_zigzag(head(self.norm(h)), c)

    mtp_logits = None
    if compute_mtp and len(self.mtp):
      outs = []
      emb_natural = context_parallel.from_zigzag(emb_BTD, c)
      for k, layer in enumerate(self.mtp):
        # Depth k+1 at position i reads the embedding of token i+k+1; positions past the end get a zero
        # embedding (their targets do not exist, the loss masks them).
        emb_next = jnp.concatenate([emb_natural[:, k + 1 :], jnp.zeros_like(emb_natural[:, : k + 1])], axis=1)
        h, normed, mtp_aux = layer(
          h, context_parallel.to_zigzag(emb_next, c), inp, form=form, indexer_loss=indexer_loss
        )
        outs.append(context_parallel.from_zigzag(head(normed), c))
        aux.update({f"mtp{k}_{name}": v for name, v in mtp_aux.items() if name.startswith("expert_")})
        if indexer_loss:  # the MTP layer's own indexer learns the same KL
          aux["indexer_kl"] = jnp.concatenate([aux["indexer_kl"], mtp_aux["indexer_kl"][None]])
      mtp_logits = jnp.stack(outs)
    if return_hidden:
      return ModelOutput(logits=None, mtp_logits=None, aux=aux, hidden=logits, mtp_hidden=mtp_logits)
    return ModelOutput(logits=logits, mtp_logits=mtp_logits, aux=aux)

  def rope(self, positions_BT: jax.Array, block_positions_BT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """cos, sin for the MLA and indexer rope: 1-D, or GLM-130B's 2-D with model.rope_2d."""
    cfg = self.cfg
    if not cfg.rope_2d:
      if block_positions_BT is not None:
        raise ValueError(
          "block_positions given, but model.rope_2d is False: a 1-D rope has no block position "
          "(set model.rope_2d=True for GLM's 2-D positions)"
        )
      return rope_angles(positions_BT, cfg.qk_rope_head_dim, cfg.rope_theta)
    if block_positions_BT is None:
      block_positions_BT = jnp.zeros_like(positions_BT)
    return rope_angles_2d(positions_BT, block_positions_BT, cfg.qk_rope_head_dim, cfg.rope_theta)

  def _decoder(
    self, input_ids, positions, segment_ids, block_positions=None, prefix_end=None, embedding_grad_shrink=1.0, **kw
  ):
    """Embedding and the two stacks: (emb [B, T, D], attention inputs, h [B, T, D], dense aux, MoE aux)."""
    cfg = self.cfg
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids: shape {input_ids.shape}; expected [batch, seq_len]")
    check_token_ids(input_ids, cfg.vocab_size)
    b, t = input_ids.shape
    for name, arr in (
      ("positions", positions),
      ("segment_ids", segment_ids),
      ("block_positions", block_positions),
      ("prefix_end", prefix_end),
    ):
      if arr is not None and arr.shape != (b, t):
        raise ValueError(f"{name}: shape {arr.shape}; expected input_ids' shape {(b, t)}")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.zeros((b, t), jnp.int32)
    c = context_parallel.context_size()
    if c > 1:  # context parallelism: the tokens in the zig-zag layout, attention without a [T, T] mask
      context_parallel.check(t, c, cfg)
      input_ids, positions, segment_ids, block_positions, prefix_end = (
        None if x is None else context_parallel.to_zigzag(x, c)
        for x in (input_ids, positions, segment_ids, block_positions, prefix_end)
      )
    visibility = Visibility.self_attention(segment_ids, prefix_end)
    cos, sin = self.rope(positions, block_positions)
    inp = AttentionInputs(cos=cos, sin=sin, visibility=visibility, mask=None if c > 1 else visibility.mask(t, t))
    emb_BTD = self.embed_tokens(input_ids)
    if not isinstance(embedding_grad_shrink, (int, float)) or embedding_grad_shrink != 1.0:  # GLM-130B's EGS:
      # the same values, a times the gradient (a may be traced)
      a = embedding_grad_shrink
      emb_BTD = a * emb_BTD + (1.0 - a) * jax.lax.stop_gradient(emb_BTD)
    shared_dense, shared_moe, topk = self._index_share(b, t, t)
    h, dense_aux, topk = scan_layers(
      self.dense_layers, emb_BTD, inp, cfg.remat_policy, cfg.scan_unroll, shared=shared_dense, topk=topk, **kw
    )
    h, moe_aux, _ = scan_layers(
      self.moe_layers, h, inp, cfg.remat_policy, cfg.scan_unroll, shared=shared_moe, topk=topk, **kw
    )
    return emb_BTD, inp, h, dense_aux, moe_aux

  def _index_share(self, batch: int, rows: int, seq_len: int):
    """IndexShare's operands of the two stacks: (dense layers' shared flags, MoE layers', the selection carried
    into the first layer [batch, rows, index_topk], never read: layer 0 is full); Nones when no layer shares or
    DSA does not select at seq_len keys."""
    cfg = self.cfg
    if not (cfg.index_share and cfg.dsa_selects(seq_len)):
      return None, None, None
    flags = jnp.asarray(cfg.shared_indexer_layers)
    n = cfg.num_dense_layers
    return flags[:n], flags[n:], jnp.zeros((batch, rows, cfg.index_topk), jnp.int32)

  def prefill(
    self,
    input_ids: jax.Array,
    cache_len: int,
    *,
    positions: jax.Array | None = None,
    block_positions: jax.Array | None = None,
    prefix_end: jax.Array | None = None,
    draft: bool = False,
  ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """The forward pass over prompts [B, T] (one document a row, slot s holding token s; rope positions 0..T-1
    unless given; a row's padding after its prompt changes nothing before it), returning (logits [B, T, V] fp32,
    a cache of cache_len slots holding slots 0..T-1). The logits are the full forward's: this is __call__ without
    MTP. GLM's blank infilling: prefix_end [B, T] (each row's context length on every slot) prefills the context
    bidirectionally; block_positions with model.rope_2d.
    draft (speculative decoding, glm_jax/inference/speculative.py): also fill cache.mtp, the first MTP layer's
    entries for slots 0..T-2 (slot s: the hidden state at s and token s + 1; a row's last prompt slot is written
    by its first draft, once the next token is known), and return the last layer's hidden states h [B, T, D]
    (before the final norm: the MTP layer's input) as a third output."""
    t = input_ids.shape[-1]
    if cache_len < t:
      raise ValueError(f"cache_len={cache_len} is shorter than the prompts ({t} tokens)")
    if draft:
      check_draft(self.cfg)
    emb_BTD, inp, h, dense_aux, moe_aux = self._decoder(
      input_ids, positions, None, block_positions, prefix_end, return_cache=True
    )

    def layer_cache(aux):
      if "cache_kv" not in aux:
        return None

      def pad(x):  # [..., B, T, W] -> [..., B, S, W]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, cache_len - t), (0, 0)])

      index_k = aux.get("cache_index_k")
      return LayerCache(kv=pad(aux["cache_kv"]), index_k=None if index_k is None else pad(index_k))

    cache = KVCache(dense=layer_cache(dense_aux), moe=layer_cache(moe_aux))
    logits = self.head(self.norm(h))
    if not draft:
      return logits, cache
    # Slot s reads token s + 1's embedding, as in training (__call__); the last slot's zero is overwritten.
    emb_next = jnp.concatenate([emb_BTD[:, 1:], jnp.zeros_like(emb_BTD[:, :1])], axis=1)
    _, _, mtp_aux = self.mtp[0](h, emb_next, inp, return_cache=True)
    return logits, dataclasses.replace(cache, mtp=layer_cache(mtp_aux)), h

  def decode(
    self,
    token_B: jax.Array,
    pos_B: jax.Array,
    cache: KVCache,
    *,
    rope_pos_B: jax.Array | None = None,
    block_pos_B: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Feeds token[b] at slot pos[b] of the cache: (next-token logits [B, V] fp32, the cache with the token's
    entries written); it attends to slots 0..pos[b]. Slots may differ between rows (ragged prompts). The rope
    position is the slot unless rope_pos_B is given (GLM's blank infilling: the blank's mask position), with the
    block position block_pos_B under model.rope_2d."""
    logits, _, cache = self.decode_tokens(
      token_B[:, None],
      pos_B,
      cache,
      rope_pos_BT=None if rope_pos_B is None else rope_pos_B[:, None],
      block_pos_BT=None if block_pos_B is None else block_pos_B[:, None],
    )
    return logits[:, 0], cache

  def decode_tokens(
    self,
    tokens_BT: jax.Array,
    pos_B: jax.Array,
    cache: KVCache,
    *,
    rope_pos_BT: jax.Array | None = None,
    block_pos_BT: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array, KVCache]:
    """Feeds T tokens a row, tokens[b, t] at slot pos[b] + t, in one forward (a speculative round's
    verification; T = 1 is `decode`): token t attends to slots 0..pos[b] + t, the full forward's causal view.
    Returns (logits [B, T, V] fp32, the last layer's hidden states [B, T, D] before the final norm, the cache with
    the tokens' entries written). rope_pos_BT / block_pos_BT as in `decode`."""
    b, t = tokens_BT.shape
    if rope_pos_BT is None:
      rope_pos_BT = pos_B[:, None] + jnp.arange(t)
    cos, sin = self.rope(rope_pos_BT, block_pos_BT)
    h = self.embed_tokens(tokens_BT)
    shared_dense, shared_moe, topk = self._index_share(b, t, cache.length)
    h, dense_cache, topk = scan_decode(self.dense_layers, h, cos, sin, pos_B, cache.dense, shared_dense, topk)
    h, moe_cache, _ = scan_decode(self.moe_layers, h, cos, sin, pos_B, cache.moe, shared_moe, topk)
    return self.head(self.norm(h)), h, dataclasses.replace(cache, dense=dense_cache, moe=moe_cache)

  def draft(
    self, h_BTD: jax.Array, next_tokens_BT: jax.Array, pos_B: jax.Array, cache: KVCache
  ) -> tuple[jax.Array, jax.Array, KVCache]:
    """The first MTP layer at slots pos[b] + t against cache.mtp: position t takes the hidden state h[b, t] (the
    main model's at that slot, or, drafting several tokens ahead, the MTP layer's own previous output) and
    the embedding of the token at the next slot, next_tokens[b, t]. Returns (logits [B, T, V] fp32 for the token
    two slots on, the MTP layer's hidden states [B, T, D], the cache with cache.mtp written)."""
    b, t = next_tokens_BT.shape
    cos, sin = self.rope(pos_B[:, None] + jnp.arange(t), None)
    g, normed, mtp_cache = self.mtp[0].decode(h_BTD, self.embed_tokens(next_tokens_BT), cos, sin, pos_B, cache.mtp)
    return self.head(normed), g, dataclasses.replace(cache, mtp=mtp_cache)
