"""Per-chip HBM and FLOPs of GLM-5's DSA attention, forward + backward: the Pallas kernels against a dense mask.

  python experiments/bench_kernels_sparse_attention.py                          # v5p:2x2x1, T = S = 32768 and 4096
  python experiments/bench_kernels_sparse_attention.py --topology=v6e:2x2
  python experiments/bench_kernels_sparse_attention.py --seq_len=65536 --small_seq_len=0 --approach=kernels

Compile only (needs libtpu, no TPU): each approach is lowered over abstract bf16 inputs for ONE chip of the
topology (batch 1, nothing sharded) and compiled by XLA:TPU; a program that does not fit fails to compile with
RESOURCE_EXHAUSTED, reported as "does not fit: needs X GiB" from the compiler's message. The approaches:
  kernels: pallas_kernels.lightning_indexer.lightning_indexer_topk (no gradient), then
    pallas_kernels.sparse_mla_attention.sparse_mla_attention, forward and backward (jax.vjp in q and kv).
  dense:   what public JAX trainers do today: the indexer's [B, T, S] scores (lightning_indexer_reference), causal
    mask, lax.top_k, a [B, T, S] boolean mask scattered from the top-k indices, then dense absorbed-MQA attention
    under it (fp32 scores [B, H, T, S], masked softmax, probs @ kv[..., :v]), forward and backward by autodiff.
Sizes are GLM-5's: H = 64 heads, D = kv_lora_rank + rope = 576, v = 512, sm_scale = (192 + 64)**-0.5 (the model's
qk_head_dim**-0.5), indexer H_I = 32, D_I = 128, topk = 2048. Each size (--seq_len, --small_seq_len) is compiled
for both approaches; prints a table, then one JSON line per configuration.

FLOPs: XLA's cost analysis sees no FLOPs inside a Pallas custom call, so xla_flops of the kernels is only the glue
around them; analytic_flops counts the matmuls each program executes (see kernel_flops / dense_flops).
"""

import argparse
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from glm_jax import strict_json
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
_DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32, "float32": jnp.float32}
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


def _gib(x) -> str:
  return "-" if x is None else f"{x / GiB:9.2f}"


def _tflop(x) -> str:
  return "-" if x is None else f"{x / 1e12:10.2f}"


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


def print_table(reports: list) -> None:
  head = (
    f"{'approach':<8} {'T=S':>6} {'args':>9} {'outputs':>9} {'temps':>9} {'total':>9} {'peak':>9} "
    f"{'XLA TFLOP':>10} {'analytic':>10} {'compile':>8}  status"
  )
  print(head + "\n" + " " * 16 + "(per-chip GiB)" + " " * 30 + "(TFLOP)    (s)")
  print("-" * len(head))
  for r in reports:
    m = r["per_chip_bytes"] or {}
    cs = "-" if r["compile_seconds"] is None else f"{r['compile_seconds']:8.1f}"
    print(
      f"{r['approach']:<8} {r['T']:>6} {_gib(m.get('arguments')):>9} {_gib(m.get('outputs')):>9} "
      f"{_gib(m.get('temporaries')):>9} {_gib(m.get('total')):>9} {_gib(m.get('peak')):>9} "
      f"{_tflop(r['xla_flops']):>10} {_tflop(r['analytic_flops']['total']):>10} {cs:>8}  {status(r)}"
    )


def print_flops(reports: list) -> None:
  print(
    "\nanalytic FLOPs (TFLOP) as executed; the kernels' 'useful' counts only causal indexer pairs and valid "
    "(non-padding) selected keys:"
  )
  for r in reports:
    a = r["analytic_flops"]
    extra = (
      (f"  [indexer causal-visible {a['indexer_visible'] / 1e12:.2f}, useful total {a['total_useful'] / 1e12:.2f}]")
      if "indexer_visible" in a
      else ""
    )
    print(
      f"  {r['approach']:<8} T=S={r['T']:<6} indexer {a['indexer'] / 1e12:9.2f}  attention fwd "
      f"{a['attention_fwd'] / 1e12:9.2f}  bwd {a['attention_bwd'] / 1e12:9.2f}  total {a['total'] / 1e12:9.2f}" + extra
    )
  by_t = {}
  for r in reports:
    by_t.setdefault(r["T"], {})[r["approach"]] = r
  for t_len, pair in by_t.items():
    if len(pair) == 2:
      k, d = pair["kernels"]["analytic_flops"]["total"], pair["dense"]["analytic_flops"]["total"]
      print(f"  T=S={t_len}: dense / kernels analytic FLOPs = {d / k:.1f}x")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--topology", default="v5p:2x2x1", help="TPU to compile for (one chip of it is used)")
  parser.add_argument("--seq_len", type=int, default=32768, help="T = S, the GLM-5 size")
  parser.add_argument("--small_seq_len", type=int, default=4096, help="a size where the dense approach fits; 0: skip")
  parser.add_argument("--topk", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
  parser.add_argument("--approach", default="both", choices=["both", "kernels", "dense"])
  args = parser.parse_args()

  dtype = _DTYPES[args.dtype]
  names = ["kernels", "dense"] if args.approach == "both" else [args.approach]
  sizes = [n for n in (args.seq_len, args.small_seq_len) if n]
  devices = topology.tpu_topology_devices(args.topology)
  gen = topology.generation_of(devices[0])
  print(
    f"{args.topology} ({devices[0].device_kind}), one chip: usable HBM "
    f"{topology.HBM_USABLE_BYTES[gen] / GiB:.2f} GiB; B={args.batch} topk={args.topk} {jnp.dtype(dtype).name}; "
    f"H={HEADS} D={DIM} v={V_DIM} sm_scale={SM_SCALE:.6g} H_I={INDEX_HEADS} D_I={INDEX_DIM}"
  )
  reports = []
  for t_len in sizes:
    for name in names:
      r = measure(name, args.topology, devices, t_len, t_len, args.topk, dtype, args.batch)
      print(
        f"  compiled {name} T=S={t_len}: {status(r)} (lower {r['lower_seconds']} s, compile {r['compile_seconds']} s)",
        flush=True,
      )
      reports.append(r)
  print()
  print_table(reports)
  print_flops(reports)
  failed = [r for r in reports if r["error"] is not None and "oom" not in r]
  for r in failed:
    print(f"\n{r['approach']} T=S={r['T']} failed:\n{r['error'][:4000]}")
  print(
    "\nXLA TFLOP: cost analysis of the compiled program; Pallas custom calls count 0 there, so for the kernels "
    "it is only the glue around them."
  )
  print()
  for r in reports:
    r = dict(r, error=None if r["error"] is None else r["error"].splitlines()[0][:2000])
    print(strict_json.dumps(r), flush=True)


if __name__ == "__main__":
  main()
