"""Dense-stage causal attention through jax's splash attention (jax.experimental.pallas.ops.tpu.splash_attention):
a block-sparse flash attention for TPU that skips the blocks its mask rules out entirely (above the causal
diagonal: about half the T x T work), forward and backward (a fused dq/dkv kernel), never a [T, S] array in HBM.

MLA in its MHA form is ordinary multi-head attention with a query/key head dim P = qk_nope + qk_rope and a value
head dim O (256 and 256 for GLM-5): q [H, T, P], k [H, S, P] (the rope key broadcast to every head), v [H, S, O].
The mask is a Visibility's (pallas_kernels/visibility.py) that a static mask expresses: causal and, for packed
documents, the same segment (splash's CausalMask with SegmentIds). The softmax scale is applied to q.

`causal_attention` takes the batch-major layout of glm_jax/model/mla.py and runs one splash kernel per sequence
(jax.vmap). glm_jax/model/dsa.py routes to it by attention_impl and backend, and splits batch and heads over a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from pallas_kernels.visibility import Visibility

BLOCKS = (512, 256, 128)  # block sizes tried, largest first: one must divide the sequence length


def fits(seq_len: int) -> bool:
  """Whether one of BLOCKS divides seq_len (the kernel tiles the sequence exactly)."""
  return any(seq_len % b == 0 for b in BLOCKS)


def block_size(seq_len: int) -> int:
  """The largest of BLOCKS that divides seq_len; a ValueError naming the sizes when none does."""
  for b in BLOCKS:
    if seq_len % b == 0:
      return b
  raise ValueError(
    f"splash attention: seq_len={seq_len} must be a multiple of one of the block sizes {BLOCKS} "
    "(pad the sequence, or use attention_impl='reference')"
  )


def _kernel(heads: int, seq_len: int, interpret: bool):
  """A splash kernel for this trace (splash itself caches the host-side block map of a mask, slow to build only the
  first time: docs/kernels.md, "Splash attention for the dense stage")."""
  b = block_size(seq_len)
  sizes = splash.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    use_fused_bwd_kernel=True,
  )
  mask = masks.MultiHeadMask([masks.CausalMask((seq_len, seq_len)) for _ in range(heads)])
  return splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def causal_attention(
  q_BTHP: jax.Array,
  k_BTHP: jax.Array,
  v_BTHO: jax.Array,
  visibility: Visibility,
  *,
  sm_scale: float,
  interpret: bool = False,
) -> jax.Array:
  """softmax(q k^T * sm_scale over the visible keys) v: o [B, T, H, O] in v's dtype (fp32 softmax and accumulation
  inside the kernel). visibility: static causal (`Visibility.is_static_causal`), with segment ids [B, T] or none
  (one document a row)."""
  b, t, h, p = q_BTHP.shape
  if k_BTHP.shape != (b, t, h, p) or v_BTHO.shape[:3] != (b, t, h):
    raise ValueError(
      f"splash causal_attention: q {q_BTHP.shape}, k {k_BTHP.shape}, v {v_BTHO.shape}; want "
      "q, k [B, T, H, P] and v [B, T, H, O]"
    )
  if not visibility.is_static_causal:
    raise ValueError(
      f"splash causal_attention: its mask is static causal; this visibility has causal={visibility.causal}, "
      f"q_offset={visibility.q_offset!r}, a prefix: {visibility.q_prefix_end is not None}"
    )
  vis = visibility.check("splash causal_attention", b, t, t)
  kernel = _kernel(h, t, interpret)
  zeros = jnp.zeros((b, t), jnp.int32)
  q_seg = zeros if vis.q_segment_ids is None else vis.q_segment_ids.astype(jnp.int32)
  kv_seg = zeros if vis.kv_segment_ids is None else vis.kv_segment_ids.astype(jnp.int32)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, .] -> [B, H, T, .]

  def one(q, k, v, qs, ks):
    return kernel(q, k, v, segment_ids=splash.SegmentIds(q=qs, kv=ks))

  q = (q_BTHP.astype(jnp.float32) * sm_scale).astype(q_BTHP.dtype)
  o = jax.vmap(one)(heads_first(q), heads_first(k_BTHP), heads_first(v_BTHO), q_seg, kv_seg)
  return heads_first(o).astype(v_BTHO.dtype)


def grid_cost(
  kernel: str, batch_heads: int, seq_len: int, p: int, o: int, itemsize: int, *, block: int | None = None
) -> tuple[float, float]:
  """(matmul FLOPs, HBM bytes) of one splash call as its grid runs the causal mask (a host-side count for cost
  reports; jax's splash declares no cost_estimate). Of the n x n blocks (n = seq_len / block; block: ours,
  block_size, unless given) it visits the n (n + 1) / 2 on or below the diagonal, each a full block x block
  product; segment masks are applied inside a block, so they skip nothing. kernel "fwd": scores (P) and p v (O);
  "dkv", the fused backward: scores again (P), dp (O), dq, dk (P each) and dv (O); with the backward split in two
  kernels (splash's use_fused_bwd_kernel=False, as MaxText runs it), "dkv_no_dq": scores, dp, dk, dv, and "dq":
  scores, dp, dq. Bytes, approximately: fwd reads q once, k and v once a visited block, writes o; the backward
  kernels read q and do once a visited block, k and v once, and write their gradients."""
  block = block or block_size(seq_len)
  active = batch_heads * (seq_len // block) * (seq_len // block + 1) // 2
  products = {"fwd": p + o, "dkv": 3 * p + 2 * o, "dkv_no_dq": 2 * p + 2 * o, "dq": 2 * p + o}
  if kernel not in products:
    raise ValueError(f"splash grid_cost: kernel={kernel!r}; one of {sorted(products)}")
  flops = active * 2.0 * block * block * products[kernel]
  if kernel == "fwd":
    moved = batch_heads * seq_len * (p + o) + active * block * (p + o)
  else:
    moved = active * block * (p + o) + batch_heads * seq_len * products[kernel]
  return flops, float(moved * itemsize)
