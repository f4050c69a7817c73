r"""The cost model's realism factor: its estimate of a training step that was measured on real TPUs, over the
measured time.

The measured run is MaxText's DeepSeek-V3 671B recipe on v5p-1024 (AI-Hypercomputer/tpu-recipes,
training/v5p/DeepSeek3-671B-MaxText, 6 sequences of 8192 tokens a chip). experiments/maxtext/compile.sh compiles that
recipe with MaxText's own train_compile for v5p:8x8x8 on this machine and saves the optimized HLO; where the recipe's
batch does not fit at compile time, it is compiled at 5 sequences a chip and the measured time is scaled to it by
tokens (a step's work is linear in the batch; the weights' collectives are not, so the factor errs towards a larger
calibrated time). This script runs our cost model (glm_jax/sharding/hlo_cost.py) on that HLO as on ours: XLA's per-op
estimates, the megablox kernels by their grids with balanced routing (MaxText's recipe is pure FSDP), splash's
kernels by their causal grids (MaxText's 2048-blocks, its split backward), each collective on the v5p:8x8x8 torus
(every group spans all 512 chips, so the partitions' order does not matter), the program's schedule. It prints one
JSON line and writes it to --out:

  bash scripts/with_env.sh python experiments/calibrate_maxtext.py      # the checked-in copy of that HLO

realism_factor = measured seconds / the model's scheduled seconds: a pod figure of ours times it is its calibrated
step (hlo_cost.CALIBRATION holds the factor this script printed). The run's figures and the factor: docs/pods.md,
"How the pod figures are counted"; the compile: experiments/maxtext/RESULTS.md.
"""

import json
import os
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.maxtext_cost import cost_maxtext_program, read_hlo  # noqa: E402

_HLO = flags.DEFINE_string(
  "hlo",
  os.path.join(ROOT, "tests/sharding/maxtext_deepseek3_671b_v5p1024_b5.hlo.txt.xz"),
  "MaxText's compiled train step (compiled.as_text(); .xz or .gz read as such). The default is "
  "experiments/maxtext/out/671b_pdbs5.hlo.txt as compile.sh wrote it, compressed.",
)
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:8x8x8", "The slice it was compiled for.")
_MEASURED = flags.DEFINE_float("measured_seconds", 90.7, "The measured step time, at --measured_batch.")
_MEASURED_BATCH = flags.DEFINE_integer("measured_batch", 6, "Sequences a chip of the measured run.")
_BATCH = flags.DEFINE_integer("batch", 5, "Sequences a chip of the compiled program.")
_SEQ = flags.DEFINE_integer("seq_len", 8192, "Tokens a sequence.")
_TOPK = flags.DEFINE_integer("experts_per_token", 8, "Routed experts a token (DeepSeek-V3: 8).")
_MEASURED_TFLOPS = flags.DEFINE_float("measured_tflops_per_chip", 152.4, "MaxText's model TFLOP/s a chip, measured.")
_SPLASH_BLOCK = flags.DEFINE_integer("splash_block", 2048, "The recipe's sa_block_* sizes.")
_OUT = flags.DEFINE_string("out", os.path.join(ROOT, "experiments/results/calibration_maxtext.json"), "Output JSON.")


def main(argv):
  del argv
  from glm_jax.sharding.topology import parse_topology

  t0 = time.perf_counter()
  text = read_hlo(_HLO.value)
  topo = parse_topology(_TOPOLOGY.value)
  tokens = _BATCH.value * _SEQ.value
  ops, totals, timed = cost_maxtext_program(text, _TOPOLOGY.value, tokens, _TOPK.value, _SPLASH_BLOCK.value)
  measured = _MEASURED.value * _BATCH.value / _MEASURED_BATCH.value
  # MaxText's own model FLOPs a chip-step, from its measured rate: the numerator its 33.2% MFU uses.
  model_flops = _MEASURED_TFLOPS.value * 1e12 * _MEASURED.value * _BATCH.value / _MEASURED_BATCH.value
  by_kind: dict[str, float] = {}
  for o in ops:
    by_kind[o.kind] = by_kind.get(o.kind, 0.0) + o.compute_seconds + o.wire_seconds
  top = sorted(by_kind.items(), key=lambda kv: -kv[1])[:12]
  report = {
    "hlo": os.path.relpath(_HLO.value, ROOT),
    "topology": topo.name,
    "chips": topo.num_chips,
    "tokens_per_chip": tokens,
    "measured_seconds_at_measured_batch": _MEASURED.value,
    "measured_seconds_scaled": round(measured, 3),
    "model_serial_seconds": round(timed["serial_seconds"], 3),
    "model_scheduled_seconds": round(timed["seconds"], 3),
    "model_compute_seconds": round(totals["compute_seconds"], 3),
    "model_collective_seconds": round(totals["collective_seconds"], 3),
    "model_exposed_collective_seconds": round(timed["exposed_collective_seconds"], 3),
    "realism_factor": round(measured / timed["seconds"], 4),
    "realism_factor_serial": round(measured / timed["serial_seconds"], 4),
    "program_matmul_flops_per_chip": totals["flops"],
    "maxtext_model_flops_per_chip": model_flops,
    "wire_bytes_per_chip": totals["wire_bytes"],
    "hbm_bytes_per_chip": totals["hbm_bytes"],
    "seconds_by_kind": {k: round(v, 3) for k, v in top},
    "timing_sources": {t: sum(1 for o in ops if o.timing == t) for t in {o.timing for o in ops}},
    "analysis_seconds": round(time.perf_counter() - t0, 1),
  }
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(report, f, indent=1)
  print(json.dumps(report), flush=True)


if __name__ == "__main__":
  app.run(main)
