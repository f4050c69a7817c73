"""MLA, multi-head latent attention, with DSA's top-k selection.

  c_q = RMSNorm(h W_DQ);  [q_nope_h ; q_rope_h] = c_q W_UQ_h;  q_rope = RoPE(q_rope)
  [c_kv ; k_rope] = h W_DKV;  c_kv = RMSNorm(c_kv);  k_rope = RoPE(k_rope), one rope key for all heads
  [k_nope_h ; v_h] = c_kv W_UKV_h
MHA form (training, dense): k_h = [k_nope_h ; k_rope], softmax(q_h . k_h * scale) v_h.
Absorbed (MQA) form: q~_h = [q_nope_h W_UK_h^T ; q_rope_h] against the single 576-wide key [c_kv ; k_rope];
o_h = (sum_s p_s c_kv_s) W_UV_h. DSA attends in this form over the indexer's top-k keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.model import blockwise, context_parallel, dsa, splash
from glm_jax.model.config import ModelConfig
from glm_jax.model.indexer import Indexer
from glm_jax.model.kv_cache import LayerCache
from glm_jax.model.layers import RMSNorm, apply_rope, dense, dtype_of, float_weight, param
from pallas_kernels.lightning_indexer_reference import lightning_indexer_scores
from pallas_kernels.visibility import Visibility


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionInputs:
  """Per-sequence tensors every layer shares: rope angles and which keys each query sees."""

  cos: jax.Array  # [B, T, qk_rope_head_dim / 2]
  sin: jax.Array
  visibility: Visibility  # the sequence's self-attention (pallas_kernels/visibility.py): segments, GLM's prefixes
  mask: jax.Array | None  # [B, T, T] bool, visibility.mask(T, T) built once for every layer; None under context
  # parallelism (glm_jax/model/context_parallel.py), whose attention builds no [T, T] mask


class MLA(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype_of(cfg.dtype)
    d, h = cfg.hidden_size, cfg.num_attention_heads
    self.q_a_proj = param(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), cfg)
    self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps, cfg, rngs)
    self.q_b_proj = param(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim), ("q_lora", "heads", "qk_head_dim"), cfg)
    self.kv_a_proj_with_mqa = param(rngs, (d, cfg.kv_latent_dim), ("embed", "kv_lora"), cfg)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_norm_eps, cfg, rngs)
    self.kv_b_proj = param(
      rngs, (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "heads", "kv_head_dim"), cfg
    )
    self.o_proj = param(rngs, (h, cfg.v_head_dim, d), ("heads", "v_head_dim", "embed"), cfg)
    self.indexer = Indexer(cfg, rngs)

  def dsa_active(self, seq_len: int) -> bool:
    return self.cfg.dsa_selects(seq_len)

  def project(self, x_BTD: jax.Array, inp: AttentionInputs):
    """The low-rank paths: (c_q, q_nope, q_rope, c_kv, k_rope)."""
    cfg = self.cfg
    cq_BTQ = self.q_a_layernorm(dense(x_BTD, self.q_a_proj, self.dtype))
    q_BTHP = dense(cq_BTQ, self.q_b_proj, self.dtype, "btr,rhk->bthk")
    q_nope, q_rope = q_BTHP[..., : cfg.qk_nope_head_dim], q_BTHP[..., cfg.qk_nope_head_dim :]
    q_rope = apply_rope(q_rope, inp.cos, inp.sin, cfg.rope_interleave)
    kv_BTA = dense(x_BTD, self.kv_a_proj_with_mqa, self.dtype)
    ckv_BTC = self.kv_a_layernorm(kv_BTA[..., : cfg.kv_lora_rank])
    k_rope_BTR = apply_rope(kv_BTA[..., cfg.kv_lora_rank :], inp.cos, inp.sin, cfg.rope_interleave)
    return cq_BTQ, q_nope, q_rope, ckv_BTC, k_rope_BTR

  def mha_qkv(self, q_nope, q_rope, ckv_BSC, k_rope_BSR) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MHA form's per-head operands: q [B, T, H, P] = [q_nope ; q_rope], k [B, S, H, P] = [k_nope ; k_rope] (the
    shared rope key broadcast to every head) and v [B, S, H, O], k_nope and v expanded from the latent."""
    kv_up = dense(ckv_BSC, self.kv_b_proj, self.dtype, "bsr,rhk->bshk")
    k_nope, v_BSHO = kv_up[..., : self.cfg.qk_nope_head_dim], kv_up[..., self.cfg.qk_nope_head_dim :]
    k_rope = jnp.broadcast_to(k_rope_BSR[:, :, None], k_nope.shape[:3] + k_rope_BSR.shape[-1:]).astype(k_nope.dtype)
    return (jnp.concatenate([q_nope, q_rope], axis=-1), jnp.concatenate([k_nope, k_rope], axis=-1), v_BSHO)

  def mha_probs(self, q_nope, q_rope, ckv_BSC, k_rope_BSR, mask_BTS) -> tuple[jax.Array, jax.Array]:
    """MHA form up to the softmax: (p [B, H, T, S] fp32, v [B, S, H, v_head_dim])."""
    cfg = self.cfg
    q_BTHP, k_BSHP, v_BSHO = self.mha_qkv(q_nope, q_rope, ckv_BSC, k_rope_BSR)
    # One score einsum over [nope ; rope] with the rope key broadcast to every head: the same products as
    # q_nope.k_nope + q_rope.k_rope, one [B, H, T, S] pass, and no dot contracting (h, t) in the backward (the
    # shared rope key's gradient), which XLA:CPU computes through transposed copies of [B, H, T, S] arrays.
    s_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHP, k_BSHP, preferred_element_type=jnp.float32)
    s_BHTS = jnp.where(mask_BTS[:, None], s_BHTS * cfg.softmax_scale, -jnp.inf)
    return blockwise.safe_softmax(s_BHTS), v_BSHO

  def mha(self, q_nope, q_rope, ckv_BSC, k_rope_BSR, mask_BTS) -> jax.Array:
    """MHA form: per-head keys and values expanded from the latent. Returns o [B, T, H, O]."""
    p_BHTS, v_BSHO = self.mha_probs(q_nope, q_rope, ckv_BSC, k_rope_BSR, mask_BTS)
    return self._mha_out(p_BHTS, v_BSHO)

  def _mha_out(self, p_BHTS, v_BSHO) -> jax.Array:
    return jnp.einsum("bhts,bshv->bthv", p_BHTS.astype(self.dtype), v_BSHO, preferred_element_type=jnp.float32).astype(
      self.dtype
    )

  def absorbed_q_kv(self, q_nope, q_rope, ckv_BSC, k_rope_BSR) -> tuple[jax.Array, jax.Array]:
    """The absorbed query [B, T, H, A] and the shared key [B, S, A] (A = kv_lora_rank + rope)."""
    w_uk = float_weight(self.kv_b_proj)[..., : self.cfg.qk_nope_head_dim]  # [R, H, dn]
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk.astype(self.dtype), preferred_element_type=jnp.float32).astype(
      self.dtype
    )
    return (jnp.concatenate([q_lat, q_rope], axis=-1), jnp.concatenate([ckv_BSC, k_rope_BSR], axis=-1))

  def absorbed_out(self, o_lat_BTHC: jax.Array) -> jax.Array:
    """o_h = o_lat_h W_UV_h: [B, T, H, O]."""
    w_uv = float_weight(self.kv_b_proj)[..., self.cfg.qk_nope_head_dim :]  # [R, H, dv]
    return jnp.einsum("bthr,rhv->bthv", o_lat_BTHC, w_uv.astype(self.dtype), preferred_element_type=jnp.float32).astype(
      self.dtype
    )

  def absorbed_dense(self, q_nope, q_rope, ckv_BSC, k_rope_BSR, mask_BTS) -> jax.Array:
    """Dense attention computed in the absorbed form (equal to `mha`; the decode path's shape)."""
    q_BTHA, kv_BSA = self.absorbed_q_kv(q_nope, q_rope, ckv_BSC, k_rope_BSR)
    return self.absorbed_out(self._latent_attention(q_BTHA, kv_BSA, mask_BTS))

  def _latent_attention(self, q_BTHA, kv_BSA, mask_BTS) -> jax.Array:
    """Dense attention against the shared 576-wide key; the value is the key's latent part: [B, T, H, R]."""
    s_BHTS = jnp.einsum("bthl,bsl->bhts", q_BTHA, kv_BSA, preferred_element_type=jnp.float32)
    s_BHTS = jnp.where(mask_BTS[:, None], s_BHTS * self.cfg.softmax_scale, -jnp.inf)
    p_BHTS = blockwise.safe_softmax(s_BHTS)
    return jnp.einsum(
      "bhts,bsr->bthr",
      p_BHTS.astype(self.dtype),
      kv_BSA[..., : self.cfg.kv_lora_rank],
      preferred_element_type=jnp.float32,
    ).astype(self.dtype)

  def __call__(
    self,
    x_BTD: jax.Array,
    inp: AttentionInputs,
    *,
    form: str = "mha",
    return_index_scores: bool = False,
    indexer_loss: bool = False,
    return_cache: bool = False,
    share: dsa.IndexShare | None = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (out [B, T, D], aux). With DSA active, aux["topk_indices"] [B, T, index_topk]; with
    return_index_scores, aux["index_scores"] [B, T, T] (fp32, -inf where not visible); with indexer_loss,
    aux["indexer_kl"]: the indexer's KL to the main attention, over the visible keys when attention is
    dense (DSA warm-up) and over the selected keys when it is sparse. The indexer reads a detached copy
    of its inputs, so its only gradient is this KL and the KL trains nothing else. With return_cache (a
    prefill), aux["cache_kv"] [B, T, A] and, with DSA, aux["cache_index_k"] [B, T, Z]:
    the entries of the decode cache (glm_jax/model/kv_cache.py). share (IndexShare, model.indexer_types): when
    share.shared is true and DSA selects, the layer attends over share.prev_topk (the previous full layer's
    selection) and its own indexer does not score; aux["indexer_kl"] of such a layer is computed on zero scores
    and means nothing (GlmMoeDsa drops it)."""
    seq_len = x_BTD.shape[1]
    sparse = self.dsa_active(seq_len)
    cq_BTQ, *qkv = self.project(x_BTD, inp)  # qkv: (q_nope, q_rope, c_kv, k_rope)
    memo = []

    def indexer():  # the indexer's (q_i, k_i, w_i) on a detached copy of its inputs, projected once
      if not memo:
        memo.append(self.indexer(jax.lax.stop_gradient(x_BTD), jax.lax.stop_gradient(cq_BTQ), inp.cos, inp.sin))
      return memo[0]

    if context_parallel.context_size() > 1:
      unsupported = dict(return_index_scores=return_index_scores, return_cache=return_cache)
      return self._context_parallel(
        qkv, inp, indexer, sparse=sparse, indexer_loss=indexer_loss, share=share, **unsupported
      )
    aux: dict[str, jax.Array] = {}
    if return_cache:
      aux["cache_kv"] = jnp.concatenate(qkv[2:], axis=-1)
      if self.cfg.use_dsa:
        aux["cache_index_k"] = indexer()[1]
    if return_index_scores:
      aux["index_scores"] = self._index_scores(indexer(), inp)
    path = "sparse" if sparse else self.dense_path(seq_len, form=form, indexer_loss=indexer_loss, inp=inp)
    o_BTHO, path_aux = getattr(self, f"_attend_{path}")(qkv, inp, indexer, indexer_loss=indexer_loss, share=share)
    return dense(o_BTHO, self.o_proj, self.dtype, "bthv,hvd->btd"), aux | path_aux

  def dense_path(self, seq_len: int, *, form: str, indexer_loss: bool, inp: AttentionInputs) -> str:
    """Which dense attention runs (DSA does not select): "splash" (the kernel, where it applies: TPU, or CPU in
    interpret mode; a static causal mask, so no GLM prefix; a block size dividing the sequence; no KL to compute),
    "blockwise" (sequences longer than model.attention_chunk: a block of queries at a time, never [B, H, T, S]),
    "mha" (the reference, with the warm-up's KL) or "absorbed" (form='absorbed': the decode path's shape). Each
    name is a method `_attend_<name>`: a new attention option is one method and one line here."""
    cfg = self.cfg
    if form not in ("mha", "absorbed"):
      raise ValueError(f"MLA form={form!r}; one of 'mha', 'absorbed'")
    if form == "absorbed":
      if indexer_loss:
        raise ValueError("indexer_loss with dense attention needs form='mha'")
      return "absorbed"
    kernels = dsa.kernel_mode(cfg.attention_impl) != "reference"
    if kernels and not indexer_loss and splash.fits(seq_len) and inp.visibility.is_static_causal:
      return "splash"
    if cfg.attention_chunk and seq_len > cfg.attention_chunk:
      return "blockwise"
    return "mha"

  def _index_scores(self, indexer_out, inp: AttentionInputs) -> jax.Array:
    """The indexer's scores of every key [B, T, S] fp32, -inf where not visible."""
    return jnp.where(inp.mask, lightning_indexer_scores(*indexer_out), -jnp.inf)

  # The attention paths: (qkv, inputs, the indexer's memoized projection) -> (o [B, T, H, O], aux).

  def _attend_sparse(self, qkv, inp, indexer, *, indexer_loss, share):
    """DSA: the indexer's top-k keys (or, on an IndexShare layer, the previous full layer's), absorbed-form sparse
    attention over them, and the sparse stage's KL over the selected keys."""
    cfg, impl = self.cfg, self.cfg.attention_impl

    def select():
      q_i, k_i, w_i = indexer()
      idx, vals = dsa.select_topk(impl, q_i, k_i, w_i, topk=cfg.index_topk, visibility=inp.visibility)
      if indexer_loss and dsa.kernel_mode(impl) != "reference":  # the kernel's top-k scores carry no gradient
        vals = dsa.selected_index_scores(q_i, k_i, w_i, idx)
      return idx, vals

    idx_BTK, vals_BTK = select() if share is None else share.select(select)
    aux = {"topk_indices": idx_BTK}
    q_BTHA, kv_BSA = self.absorbed_q_kv(*qkv)
    o_lat, lse_BTH = dsa.attend(impl, q_BTHA, kv_BSA, idx_BTK, sm_scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank)
    if indexer_loss:
      p_BTK = dsa.head_probs(impl, q_BTHA, kv_BSA, idx_BTK, lse_BTH, sm_scale=cfg.softmax_scale)
      aux["indexer_kl"] = indexer_kl(p_BTK, vals_BTK, idx_BTK >= 0)
    return self.absorbed_out(o_lat), aux

  def _attend_splash(self, qkv, inp, indexer, *, indexer_loss, share):
    """The dense stage on TPU (CPU: interpret mode): splash attention skips the blocks above the diagonal."""
    mode = dsa.kernel_mode(self.cfg.attention_impl)
    o_BTHO = dsa.dense_causal_attend(
      *self.mha_qkv(*qkv), inp.visibility, sm_scale=self.cfg.softmax_scale, interpret=mode == "interpret"
    )
    return o_BTHO, {}

  def _attend_blockwise(self, qkv, inp, indexer, *, indexer_loss, share):
    """Dense attention (and the warm-up's KL) a block of queries at a time, in the absorbed form
    (glm_jax/model/blockwise.py)."""
    cfg = self.cfg
    q_BTHA, kv_BSA = self.absorbed_q_kv(*qkv)
    o_lat, kl = blockwise.latent_attention_and_kl(
      q_BTHA,
      kv_BSA,
      indexer() if indexer_loss else None,
      sm_scale=cfg.softmax_scale,
      v_dim=cfg.kv_lora_rank,
      chunk=cfg.attention_chunk,
      visibility=inp.visibility,
      out_dtype=self.dtype,
    )
    return self.absorbed_out(o_lat), ({"indexer_kl": jnp.mean(kl)} if indexer_loss else {})

  def _attend_mha(self, qkv, inp, indexer, *, indexer_loss, share):
    """The reference: MHA form over the [B, T, T] mask; the warm-up's KL over every visible key."""
    p_BHTS, v_BSHO = self.mha_probs(*qkv, inp.mask)
    aux = {}
    if indexer_loss:
      aux["indexer_kl"] = indexer_kl(jnp.sum(p_BHTS, axis=1), self._index_scores(indexer(), inp), inp.mask)
    return self._mha_out(p_BHTS, v_BSHO), aux

  def _attend_absorbed(self, qkv, inp, indexer, *, indexer_loss, share):
    return self.absorbed_dense(*qkv, inp.mask), {}

  def _context_parallel(
    self,
    qkv,
    inp: AttentionInputs,
    indexer,
    *,
    sparse: bool,
    indexer_loss: bool,
    share: dsa.IndexShare | None,
    **unsupported: bool,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """__call__ under a mesh with a context axis (glm_jax/model/context_parallel.py): every [B, T] operand in the
    zig-zag layout, attention in the absorbed form (dense: blockwise; DSA: the indexer's top-k and sparse
    attention), each device's queries against the whole sequence's gathered keys."""
    cfg = self.cfg
    for name, asked in unsupported.items():
      if asked:
        raise ValueError(
          f"MLA: {name}=True under context parallelism (mesh.context > 1): it needs whole-sequence "
          "[T, S] scores or a whole-sequence cache on one device; run it with mesh.context=1"
        )
    q_BTHA, kv_BTA = self.absorbed_q_kv(*qkv)
    o_lat, idx_BTK, kl_BT = context_parallel.attention(
      cfg.attention_impl,
      q_BTHA,
      kv_BTA,
      indexer() if sparse or indexer_loss else None,
      visibility=inp.visibility,
      sparse=sparse,
      indexer_loss=indexer_loss,
      sm_scale=cfg.softmax_scale,
      v_dim=cfg.kv_lora_rank,
      topk=cfg.index_topk,
      chunk=cfg.attention_chunk,
      out_dtype=self.dtype,
      share=share if sparse else None,
    )
    aux = {}
    if sparse:
      aux["topk_indices"] = idx_BTK
    if indexer_loss:
      aux["indexer_kl"] = jnp.mean(kl_BT)
    return dense(self.absorbed_out(o_lat), self.o_proj, self.dtype, "bthv,hvd->btd"), aux

  def decode(
    self,
    x_BTD: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    pos_B: jax.Array,
    cache: LayerCache,
    share: dsa.IndexShare | None = None,
  ) -> tuple[jax.Array, LayerCache, jax.Array | None]:
    """T new tokens a row against the cache, in the absorbed MQA form (T = 1: a decode step; T > 1: a speculative
    round's verification): writes token t's entries at slot pos[b] + t, then token t attends to slots
    0..pos[b] + t; with DSA, to the indexer's top index_topk of them when the cache is longer than index_topk
    (the same keys the full forward's causal top-k picks: stale slots past pos[b] + t are out of its reach), or
    to share.prev_topk on an IndexShare layer whose share.shared is true.
    Returns (out [B, T, D], the updated cache, the selected slots [B, T, K] or None when DSA does not select)."""
    cfg = self.cfg
    t, s_len = x_BTD.shape[1], cache.length
    visibility = Visibility.up_to(pos_B[:, None] + jnp.arange(t))  # the last slot each query sees: its own
    inp = AttentionInputs(cos=cos, sin=sin, visibility=visibility, mask=None)
    cq_BTQ, q_nope, q_rope, ckv_BTC, k_rope_BTR = self.project(x_BTD, inp)
    k_i = q_i = w_i = None
    if cfg.use_dsa:
      q_i, k_i, w_i = self.indexer(x_BTD, cq_BTQ, cos, sin)
    cache = cache.write(pos_B, jnp.concatenate([ckv_BTC, k_rope_BTR], axis=-1), k_i)
    q_BTHA = self.absorbed_q_kv(q_nope, q_rope, ckv_BTC, k_rope_BTR)[0]
    kv_BSA = cache.kv.astype(self.dtype)
    idx_BTK = None
    if self.dsa_active(s_len):

      def select():
        return dsa.select_topk(cfg.attention_impl, q_i, cache.index_k, w_i, topk=cfg.index_topk, visibility=visibility)

      idx_BTK, _ = select() if share is None else share.select(select)
      o_lat, _ = dsa.attend(
        cfg.attention_impl, q_BTHA, kv_BSA, idx_BTK, sm_scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank
      )
    else:
      o_lat = self._latent_attention(q_BTHA, kv_BSA, visibility.mask(t, s_len))
    o_BTHO = self.absorbed_out(o_lat)
    return dense(o_BTHO, self.o_proj, self.dtype, "bthv,hvd->btd"), cache, idx_BTK


def indexer_kl(p_target_BTS: jax.Array, scores_BTS: jax.Array, valid_BTS: jax.Array) -> jax.Array:
  """mean_t KL(p[t] || softmax(I[t])) over the valid keys, p = the head-summed attention, L1-normalized
  and treated as a constant (DS32's indexer loss, averaged over query tokens instead of summed)."""
  return jnp.mean(blockwise.kl_rows(p_target_BTS, scores_BTS, valid_BTS))
