"""Prints the lightning-indexer top-k's speed: the Pallas kernel against the pure-jnp reference (einsum + lax.top_k).

  bash scripts/with_env.sh python experiments/bench_kernels_indexer.py                      # this machine's backend
  bash scripts/with_env.sh python experiments/bench_kernels_indexer.py --seq_len=16384 --block_k=1024
  bash scripts/with_env.sh python experiments/bench_kernels_indexer.py \
      --topology=v5p:2x2x1  # compile for a TPU only (needs libtpu)

On a TPU the kernel runs compiled; elsewhere in Pallas interpret mode, whose times say nothing about a TPU (the
default sizes then shrink to a CPU-sized problem). With --topology nothing runs: it prints the compile time and
the per-chip HBM of the compiled program. It also prints the work the kernel's algorithm implies: MXU flops and
sorting-network compare-exchanges (see pallas_kernels/lightning_indexer.py).
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.visibility import Visibility
from pallas_kernels import lightning_indexer_reference as reference
from pallas_kernels.lightning_indexer import IndexerBlockSizes, lightning_indexer_topk


def network_compare_exchanges(s_len: int, topk: int, block_k: int) -> int:
  """Per query, with no tile skipped: sort each key tile, better-of, merges (the kernel docstring's formula)."""
  kp = max(8, 1 << (topk - 1).bit_length())
  sb = min(block_k, max(8, 1 << (s_len - 1).bit_length()))
  m, lg = min(sb, kp), math.log2
  per_tile = sb * lg(sb) * (lg(sb) + 1) / 4 + m + (m * lg(m) / 2 if m < kp else 0) + kp * lg(kp) / 2
  return int(math.ceil(s_len / sb) * per_tile)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq_len", type=int, default=None, help="queries T (default 8192 on TPU, 512 elsewhere)")
  parser.add_argument("--kv_len", type=int, default=None, help="keys S (default T; queries are the last T)")
  parser.add_argument("--heads", type=int, default=None, help="H_I (default 32 on TPU, 4 elsewhere)")
  parser.add_argument("--dim", type=int, default=None, help="D_I (default 128 on TPU, 32 elsewhere)")
  parser.add_argument("--topk", type=int, default=None, help="default 2048 on TPU, 128 elsewhere")
  parser.add_argument("--block_q", type=int, default=128)
  parser.add_argument("--block_k", type=int, default=2048)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--topology", default=None, help="e.g. v5p:2x2x1: compile for that TPU only")
  args = parser.parse_args()

  big = args.topology is not None or jax.default_backend() == "tpu"
  t_len = args.seq_len or (8192 if big else 512)
  s_len = args.kv_len or t_len
  heads, dim, topk = (
    args.heads or (32 if big else 4),
    args.dim or (128 if big else 32),
    args.topk or (2048 if big else 128),
  )
  dtype, b = jnp.dtype(args.dtype), args.batch
  blocks = IndexerBlockSizes(args.block_q, args.block_k)
  q_offset = s_len - t_len
  visible_pairs = sum(min(s_len, t + q_offset + 1) for t in range(t_len)) * b
  print(f"B={b} T={t_len} S={s_len} H_I={heads} D_I={dim} topk={topk} {dtype.name} blocks={blocks}")
  print(
    f"work: {2 * heads * dim * visible_pairs / 1e12:.3f} TFLOP on the MXU for the visible scores; "
    f"sorting network <= {network_compare_exchanges(s_len, topk, args.block_k) * t_len * b / 1e9:.2f} G "
    f"compare-exchanges (every tile merged; the causal mask skips about half of them)"
  )

  vis = Visibility(q_offset=q_offset)

  def kernel(q, k, w):
    interpret = None if args.topology is None else False
    return lightning_indexer_topk(q, k, w, topk=topk, visibility=vis, block_sizes=blocks, interpret=interpret)

  if args.topology is not None:
    from jax.sharding import SingleDeviceSharding

    from glm_jax.sharding.topology import compiled_memory, tpu_topology_devices

    sharding = SingleDeviceSharding(tpu_topology_devices(args.topology)[0])
    shapes = [((b, t_len, heads, dim), dtype), ((b, s_len, dim), dtype), ((b, t_len, heads), jnp.float32)]
    start = time.perf_counter()
    compiled = jax.jit(kernel).lower(*[jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]).compile()
    mem = compiled_memory(compiled)
    print(
      f"{args.topology}: compiled in {time.perf_counter() - start:.2f} s; HBM per chip: arguments "
      f"{mem['arguments'] / 2**20:.1f} MiB, outputs {mem['outputs'] / 2**20:.1f} MiB, temporaries "
      f"{mem['temporaries'] / 2**20:.1f} MiB (a [T, S] fp32 score array would be {t_len * s_len * 4 / 2**20:.0f} "
      f"MiB)"
    )
    return

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t_len, heads, dim)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s_len, dim)), dtype)
  w = jnp.asarray(rng.standard_normal((b, t_len, heads)) / math.sqrt(heads * dim), jnp.float32)
  ref = jax.jit(lambda q, k, w: reference.lightning_indexer_topk(q, k, w, topk=topk, visibility=vis))
  results = {}
  for name, fn in [
    ("pallas kernel" + ("" if jax.default_backend() == "tpu" else " (interpret)"), kernel),
    ("reference (XLA)", ref),
  ]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(q, k, w))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.iters):
      out = jax.block_until_ready(fn(q, k, w))
    per_call = (time.perf_counter() - start) / args.iters
    results[name] = out
    print(f"{name:<28s} first call {first:8.3f} s   then {per_call * 1e3:10.2f} ms per call")
  (idx, _), (idx_ref, _) = results.values()
  print(f"indices equal to the reference's: {float(jnp.mean(idx == idx_ref)) * 100:.4f} %")


if __name__ == "__main__":
  main()
