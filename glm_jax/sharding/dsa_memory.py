"""GLM-5's DSA attention, forward + backward, compiled for one TPU chip: the Pallas kernels against a dense mask.

What experiments/bench_kernels_sparse_attention.py and notebooks/dsa_kernels.ipynb measure (compile only, through
libtpu's topology descriptions; no TPU needed). `measure(approach, topology, devices, T, S, topk, dtype, batch)`
lowers one approach over abstract inputs for ONE chip and compiles it with XLA:TPU; a program that does not fit fails
with RESOURCE_EXHAUSTED, reported from the compiler's message (`parse_oom`). The approaches:
  kernels: pallas_kernels.lightning_indexer.lightning_indexer_topk (no gradient), then
    pallas_kernels.sparse_mla_attention.sparse_mla_attention, forward and backward (jax.vjp in q and kv).
  dense:   the indexer's [B, T, S] scores (lightning_indexer_reference), causal mask, lax.top_k, a [B, T, S] boolean
    mask scattered from the top-k indices, then dense absorbed-MQA attention under it, forward and backward.
Sizes are GLM-5's (below). FLOPs: XLA's cost analysis sees none inside a Pallas custom call, so `analytic_flops`
counts the matmuls each program executes (kernel_flops / dense_flops).
"""

import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from glm_jax.sharding import topology
from pallas_kernels import lightning_indexer_reference as indexer_reference
from pallas_kernels.lightning_indexer import IndexerBlockSizes, lightning_indexer_topk
from pallas_kernels.sparse_mla_attention import sparse_mla_attention

# GLM-5 (configs/glm5_744b.py; glm_jax/model/config.py: softmax_scale = qk_head_dim**-0.5)
HEADS = 64
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 192
DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576: the absorbed key (latent + shared rope key)
V_DIM = KV_LORA_RANK  # 512: the absorbed value
SM_SCALE = (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM) ** -0.5  # 1/16
INDEX_HEADS = 32
INDEX_DIM = 128

GiB = topology.GiB
DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32, "float32": jnp.float32}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# ----------------------------------------------------------------------------------------------------------------
# Analytic FLOPs (matmul multiply-adds x 2; elementwise softmax / relu / masking work not counted)
# ----------------------------------------------------------------------------------------------------------------


def causal_pairs(t_len: int, s_len: int) -> int:
  """(query, key) pairs with key <= query (queries are the last T of S keys)."""
  off = s_len - t_len
  return sum(min(s_len, t + off + 1) for t in range(t_len))


def indexer_tile_pairs(t_len: int, s_len: int) -> int:
  """(query, key) pairs the indexer kernel scores: whole [block_q, block_k] tiles, skipping only the tiles the causal
  mask hides from every query of the block (lightning_indexer.py; default IndexerBlockSizes, as the script runs it)."""
  bs = IndexerBlockSizes()
  block_q = -(-t_len // 8) * 8 if t_len <= bs.block_q else bs.block_q
  block_k = min(bs.block_k, max(8, 1 << (s_len - 1).bit_length()))
  n_q, n_k, off = -(-t_len // block_q), -(-s_len // block_k), s_len - t_len
  return sum(min((i + 1) * block_q - 1 + off, n_k * block_k - 1) // block_k + 1 for i in range(n_q)) * block_q * block_k


def kernel_flops(b: int, t_len: int, s_len: int, topk: int) -> dict:
  """FLOPs the two kernels execute.

  indexer, per scored (query, key) pair: 2*H_I*D_I on the MXU (q . k per head) + 2*H_I on the VPU (w * relu, sum
    over heads); the kernel scores whole tiles (indexer_tile_pairs); indexer_visible counts causal pairs only.
  attention, per query and selected key (all K slots run, padded ones masked; a query t < K has only t + 1 valid):
    forward  s = q . kv^T (2*H*D), o += p . kv[:, :v] (2*H*v)                                   2*H*(D + v)
    backward s recomputed (2*H*D), dp = do . v^T (2*H*v), dq += ds . kv (2*H*D), dkv key part ds^T . q (2*H*D),
             dkv value part p^T . do (2*H*v)                                                   2*H*(3D + 2v)
  """
  per_pair = 2 * INDEX_HEADS * INDEX_DIM + 2 * INDEX_HEADS
  slots = b * t_len * topk
  valid = b * sum(min(topk, min(s_len, t + s_len - t_len + 1)) for t in range(t_len))
  out = {
    "indexer": per_pair * b * indexer_tile_pairs(t_len, s_len),
    "attention_fwd": 2 * HEADS * (DIM + V_DIM) * slots,
    "attention_bwd": 2 * HEADS * (3 * DIM + 2 * V_DIM) * slots,
  }
  out["total"] = sum(out.values())
  out["indexer_visible"] = per_pair * b * causal_pairs(t_len, s_len)
  out["total_useful"] = out["indexer_visible"] + 2 * HEADS * (4 * DIM + 3 * V_DIM) * valid
  return out


def dense_flops(b: int, t_len: int, s_len: int) -> dict:
  """FLOPs the dense program executes: every (query, key) pair, masked or not.

  indexer: 2*H_I*D_I (q . k) + 2*H_I (the w-weighted head sum, an einsum) per pair.
  attention forward: s = q . kv^T (2*H*D), o = p . kv[:, :v] (2*H*v) per pair;
  backward (autodiff, p saved, nothing recomputed): dp = do . v^T (2*H*v), d(kv value) = p^T . do (2*H*v),
    dq = ds . kv (2*H*D), d(kv key) = ds^T . q (2*H*D) per pair: 2*H*(2D + 2v).
  """
  pairs = b * t_len * s_len
  out = {
    "indexer": (2 * INDEX_HEADS * INDEX_DIM + 2 * INDEX_HEADS) * pairs,
    "attention_fwd": 2 * HEADS * (DIM + V_DIM) * pairs,
    "attention_bwd": 2 * HEADS * (2 * DIM + 2 * V_DIM) * pairs,
  }
  out["total"] = sum(out.values())
  return out


# ----------------------------------------------------------------------------------------------------------------
# The two programs
# ----------------------------------------------------------------------------------------------------------------


def kernels_step(qi_BTHD, ki_BSD, w_BTH, q_BTHD, kv_BSD, do_BTHV, *, topk: int):
  """Indexer kernel top-k, then the sparse attention kernel forward and backward: (o, dq, dkv)."""
  idx_BTK, _ = lightning_indexer_topk(qi_BTHD, ki_BSD, w_BTH, topk=topk, interpret=False)

  def attend(q_BTHD, kv_BSD):
    return sparse_mla_attention(q_BTHD, kv_BSD, idx_BTK, sm_scale=SM_SCALE, v_dim=V_DIM, interpret=False)[0]

  o_BTHV, vjp = jax.vjp(attend, q_BTHD, kv_BSD)
  dq_BTHD, dkv_BSD = vjp(do_BTHV)
  return o_BTHV, dq_BTHD, dkv_BSD


def topk_mask(idx_BTK: jax.Array, s_len: int) -> jax.Array:
  """[B, T, S] bool, True at each query's top-k indices (scatter; index -1 dropped)."""
  b, t_len, _ = idx_BTK.shape
  cols = jnp.where(idx_BTK < 0, s_len, idx_BTK)  # out of range: dropped
  rows_b = jnp.arange(b)[:, None, None]
  rows_t = jnp.arange(t_len)[None, :, None]
  return jnp.zeros((b, t_len, s_len), bool).at[rows_b, rows_t, cols].set(True, mode="drop")


def dense_step(qi_BTHD, ki_BSD, w_BTH, q_BTHD, kv_BSD, do_BTHV, *, topk: int):
  """Reference indexer ([T, S] scores, lax.top_k), a [B, T, S] mask, dense masked attention fwd + bwd."""
  idx_BTK, _ = indexer_reference.lightning_indexer_topk(qi_BTHD, ki_BSD, w_BTH, topk=topk)
  mask_BTS = topk_mask(jax.lax.stop_gradient(idx_BTK), kv_BSD.shape[1])

  def attend(q_BTHD, kv_BSD):
    s_BHTS = jnp.einsum("bthd,bsd->bhts", q_BTHD, kv_BSD, preferred_element_type=jnp.float32) * SM_SCALE
    s_BHTS = jnp.where(mask_BTS[:, None], s_BHTS, -jnp.inf)
    p_BHTS = jax.nn.softmax(s_BHTS, axis=-1)  # every query has >= 1 selected key (key 0 is always visible)
    o_BTHV = jnp.einsum(
      "bhts,bsv->bthv", p_BHTS.astype(kv_BSD.dtype), kv_BSD[..., :V_DIM], preferred_element_type=jnp.float32
    )
    return o_BTHV.astype(q_BTHD.dtype)

  o_BTHV, vjp = jax.vjp(attend, q_BTHD, kv_BSD)
  dq_BTHD, dkv_BSD = vjp(do_BTHV)
  return o_BTHV, dq_BTHD, dkv_BSD


APPROACHES = {"kernels": kernels_step, "dense": dense_step}


# ----------------------------------------------------------------------------------------------------------------
# Compile and measure
# ----------------------------------------------------------------------------------------------------------------


def _bytes(num: str, unit: str) -> int:
  return int(float(num) * _UNITS[unit.upper()[:1] if unit else ""])


def parse_oom(message: str) -> dict:
  """The bytes XLA:TPU says a program needs and has, from its RESOURCE_EXHAUSTED message (empty when unknown).

  Seen (libtpu 0.0.42.1): "Ran out of memory on HBM, the total memory required for HLO temporaries (32.00G)
  exceeds available HBM (31.25G)." XLA's "G" is GiB.
  """
  m = re.search(r"required for ([^(]+?) \(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM \(([\d.]+)([KMGT]?)", message)
  if m:
    return {"needs_bytes": _bytes(m[2], m[3]), "needs_what": m[1].strip(), "available_bytes": _bytes(m[4], m[5])}
  m = re.search(r"Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B? hbm", message)
  if m:
    return {"needs_bytes": _bytes(m[1], m[2]), "needs_what": "program", "available_bytes": _bytes(m[3], m[4])}
  return {}


def measure(name: str, topo: str, devices, t_len: int, s_len: int, topk: int, dtype, batch: int) -> dict:
  """Lowers and compiles one approach for one chip; its memory, FLOPs and compile time, or why it failed."""
  sharding = SingleDeviceSharding(devices[0])
  shapes = [
    ((batch, t_len, INDEX_HEADS, INDEX_DIM), dtype),
    ((batch, s_len, INDEX_DIM), dtype),
    ((batch, t_len, INDEX_HEADS), jnp.float32),
    ((batch, t_len, HEADS, DIM), dtype),
    ((batch, s_len, DIM), dtype),
    ((batch, t_len, HEADS, V_DIM), dtype),
  ]
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
  fn = jax.jit(lambda *a: APPROACHES[name](*a, topk=topk))
  analytic = kernel_flops(batch, t_len, s_len, topk) if name == "kernels" else dense_flops(batch, t_len, s_len)
  report = {
    "approach": name,
    "topology": topo,
    "device_kind": devices[0].device_kind,
    "B": batch,
    "T": t_len,
    "S": s_len,
    "topk": topk,
    "dtype": jnp.dtype(dtype).name,
    "fits": False,
    "per_chip_bytes": None,
    "per_chip_gib": None,
    "xla_flops": None,
    "analytic_flops": analytic,
    "compile_seconds": None,
    "error": None,
  }
  start = time.perf_counter()
  try:
    lowered = fn.lower(*args)
  except Exception as e:  # a kernel that does not lower (Mosaic / Pallas errors surface here)
    report["error"] = f"lowering failed: {type(e).__name__}: {e}"
    report["lower_seconds"] = round(time.perf_counter() - start, 2)
    return report
  report["lower_seconds"] = round(time.perf_counter() - start, 2)
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:
    report["compile_seconds"] = round(time.perf_counter() - start, 2)
    message = str(e)
    report["error"] = message.strip()
    oom = parse_oom(message) if "RESOURCE_EXHAUSTED" in message else {}
    if oom:
      report["oom"] = oom
    return report
  report["compile_seconds"] = round(time.perf_counter() - start, 2)
  mem = topology.compiled_memory(compiled)
  keys = ("arguments", "outputs", "temporaries", "generated_code", "aliased", "total", "peak")
  report["per_chip_bytes"] = {k: mem[k] for k in keys}
  report["per_chip_gib"] = {k: round(mem[k] / GiB, 3) for k in keys}
  usable = topology.HBM_USABLE_BYTES[topology.generation_of(devices[0])]
  report["fits"] = mem["total"] <= usable and mem["peak"] <= usable
  try:
    report["xla_flops"] = topology.compiled_flops(compiled)
  except ValueError:
    pass
  return report


def status(r: dict) -> str:
  if r["error"] is None:
    return "fits" if r["fits"] else "does not fit (compiled, over HBM)"
  if "oom" in r:
    o = r["oom"]
    return (
      f"does not fit: needs {o['needs_bytes'] / GiB:.2f} GiB ({o['needs_what']}) of "
      f"{o['available_bytes'] / GiB:.2f} GiB"
    )
  return "FAILED: " + r["error"].splitlines()[0][:200]
