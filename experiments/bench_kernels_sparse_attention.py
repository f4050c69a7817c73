"""Per-chip HBM and FLOPs of GLM-5's DSA attention, forward + backward: the Pallas kernels against a dense mask.

  bash scripts/with_env.sh python experiments/bench_kernels_sparse_attention.py      # v5p:2x2x1, T = S = 32768 and 4096
  bash scripts/with_env.sh python experiments/bench_kernels_sparse_attention.py --topology=v6e:2x2
  bash scripts/with_env.sh python experiments/bench_kernels_sparse_attention.py --seq_len=65536 --small_seq_len=0 \
      --approach=kernels

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
The programs and their measurement are glm_jax/sharding/dsa_memory.py (notebooks/dsa_kernels.ipynb uses it too).
"""

import argparse

import jax.numpy as jnp

from glm_jax import strict_json
from glm_jax.sharding import topology
from glm_jax.sharding.dsa_memory import (
  DTYPES,
  DIM,
  GiB,
  HEADS,
  INDEX_DIM,
  INDEX_HEADS,
  SM_SCALE,
  V_DIM,
  measure,
  status,
)


def _gib(x) -> str:
  return "-" if x is None else f"{x / GiB:9.2f}"


def _tflop(x) -> str:
  return "-" if x is None else f"{x / 1e12:10.2f}"


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
  parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  parser.add_argument("--approach", default="both", choices=["both", "kernels", "dense"])
  args = parser.parse_args()

  dtype = DTYPES[args.dtype]
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
