r"""How far below peak XLA:TPU's own cost model puts matmuls and memory-bound ops: the source of hlo_cost.EFFICIENCY.

XLA:TPU writes its estimate of each fusion's time into the compiled program (`"estimated_cycles"` in the backend
config). hlo_cost uses that estimate for every op that carries one; ops that carry none (Pallas kernels, fusions whose
estimate is the 2^63 - 1 "unknown" sentinel) get their roofline time divided by an efficiency. This script compiles,
for one chip of a topology, bf16 matmuls over a grid of shapes and f32 elementwise ops over a range of sizes, reads
XLA's estimate of each and prints estimate / roofline as an efficiency, with the means per class that hlo_cost's
table holds:

  bash scripts/with_env.sh python experiments/xla_op_efficiency.py --topology=v5p:2x2x1

Cycles become seconds at hlo_cost.CLOCK_HZ (derived from the published peak and the MXU count; see there).
"""

import re
import statistics

from absl import app, flags

_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "A TPU topology (one chip is used).")

MATMULS = [(m, k, n) for m in (2048, 4096, 8192, 16384) for k in (2048, 7168) for n in (2048, 6144)]
ELEMENTWISE = [1 << 22, 1 << 24, 1 << 26]


def _estimate(text: str) -> int | None:
  cycles = [int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', text) if int(c) < (1 << 62)]
  return sum(cycles) if cycles else None


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from glm_jax.sharding import hlo_cost
  from glm_jax.sharding.topology import parse_topology, tpu_topology_devices

  gen = parse_topology(_TOPOLOGY.value).generation.name
  chip = hlo_cost.PEAKS[gen]
  clock = hlo_cost.CLOCK_HZ[gen]
  s = SingleDeviceSharding(tpu_topology_devices(_TOPOLOGY.value)[0])
  rows = {"matmul": [], "hbm": []}
  for m, k, n in MATMULS:
    a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=s)
    b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=s)
    cycles = _estimate(jax.jit(lambda x, y: x @ y).lower(a, b).compile().as_text())
    roof = max(2 * m * k * n / chip.bf16_flops, 2 * (m * k + k * n + m * n) / chip.hbm_bytes_per_s)
    eff = roof / (cycles / clock)
    rows["matmul"].append(eff)
    print(
      f"matmul {m:>6} x {k:>5} x {n:>5}  XLA {cycles / clock * 1e6:9.1f} us  roofline {roof * 1e6:9.1f} us  "
      f"efficiency {eff:.3f}"
    )
  for size in ELEMENTWISE:
    a = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=s)
    cycles = _estimate(jax.jit(lambda x: jnp.tanh(x) * 2 + 1).lower(a).compile().as_text())
    roof = 8 * size / chip.hbm_bytes_per_s
    eff = roof / (cycles / clock)
    rows["hbm"].append(eff)
    print(
      f"elementwise f32[{size:>9}]      XLA {cycles / clock * 1e6:9.1f} us  roofline {roof * 1e6:9.1f} us  "
      f"efficiency {eff:.3f}"
    )
  print({k: round(statistics.mean(v), 3) for k, v in rows.items()})


if __name__ == "__main__":
  app.run(main)
