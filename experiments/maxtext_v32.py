r"""MaxText's DeepSeek-V3.2 step beside glm5_744b's sparse stage, on one instrument: our cost model on each compiled
program.

DeepSeek-V3.2 (MaxText 0.2.5's `deepseek3.2-671b`: DSA's lightning indexer picks 2048 keys a query, applied to
attention as a dense [batch, query, key] mask over splash attention) is compiled by
`experiments/maxtext/compile.sh v32` for v5p-1024 with the DeepSeek-V3 recipe's flags; with
`per_device_batch_size=1` a chip holds one 4096-token sequence, as glm5_744b's 4K step does. For each MaxText
program given (its HLO text and the JSON compile_hlo.py writes beside it) this prints a chip's bytes (XLA's memory
analysis: arguments + outputs + temporaries - aliased), the scheduled and serial step under our cost model
(maxtext_cost.cost_maxtext_program: the same reading of MaxText's programs that gives the realism factor), the
calibrated step (x hlo_cost.CALIBRATION) and tokens a second a chip; then glm5_744b's sparse rows with the same
context from experiments/results/pod_costs.jsonl.

  experiments/maxtext/setup_venv.sh
  NAME=v32_pdbs1 experiments/maxtext/compile.sh v32 per_device_batch_size=1
  NAME=v32_pdbs1_32k experiments/maxtext/compile.sh v32 per_device_batch_size=1 max_target_length=32768
  bash scripts/with_env.sh python experiments/maxtext_v32.py \
      --programs=experiments/maxtext/out/v32_pdbs1.hlo.txt:1:4096,experiments/maxtext/out/v32_pdbs1_32k.hlo.txt:1:32768
(64K does not fit: experiments/maxtext/RESULTS.md.)
"""

import json
import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.maxtext_cost import cost_maxtext_program, read_hlo  # noqa: E402

_PROGRAMS = flags.DEFINE_list(
  "programs",
  [],
  "MaxText programs as HLO_PATH:BATCH_A_CHIP:SEQ_LEN; each HLO_PATH's "
  "compile JSON is HLO_PATH with .hlo.txt replaced by .json.",
)
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:8x8x8", "The slice they were compiled for.")
_SPLASH_BLOCK = flags.DEFINE_integer("splash_block", 2048, "The recipe's sa_block_* sizes.")
_OURS = flags.DEFINE_string(
  "ours", os.path.join(ROOT, "experiments/results/pod_costs.jsonl"), "glm5_744b's pod rows (experiments/bench_pod.py)."
)
_OUT = flags.DEFINE_string("out", os.path.join(ROOT, "experiments/results/maxtext_v32.jsonl"), "JSON lines.")

GIB = 2**30


def maxtext_row(spec: str) -> dict:
  from glm_jax.sharding import hlo_cost

  path, batch, seq = spec.rsplit(":", 2)
  batch, seq = int(batch), int(seq)
  memory_path = path.replace(".hlo.txt", ".json")
  with open(memory_path) as f:
    compiled = json.load(f)
  _, totals, timed = cost_maxtext_program(read_hlo(path), _TOPOLOGY.value, batch * seq, 8, _SPLASH_BLOCK.value)
  factor = hlo_cost.CALIBRATION["realism_factor"]
  calibrated = timed["seconds"] * factor
  memory = compiled.get("memory_analysis_per_chip") or {}
  total = memory.get("total_hbm_bytes_args_plus_out_plus_temp_minus_alias")
  return {
    "program": "MaxText deepseek3.2-671b",
    "hlo": os.path.relpath(path, ROOT),
    "seq_len": seq,
    "tokens_per_chip": batch * seq,
    "per_chip_gib": round(total / GIB, 2) if total else None,
    "scheduled_seconds": round(timed["seconds"], 3),
    "serial_seconds": round(timed["serial_seconds"], 3),
    "collective_seconds": round(totals["collective_seconds"], 3),
    "calibrated_seconds": round(calibrated, 3),
    "calibrated_tokens_per_s_per_chip": round(batch * seq / calibrated, 1),
  }


def ours(seq: int) -> list[dict]:
  rows = []
  with open(_OURS.value) as f:
    for line in f:
      r = json.loads(line)
      bal = r.get("cost", {}).get("routings", {}).get("balanced", {})
      if r["seq_len"] == seq and r["dsa_stage"] == "sparse" and r.get("num_slices", 1) == 1 and bal:
        rows.append(
          {
            "program": f"glm5_744b {r['row_name']}",
            "seq_len": seq,
            "tokens_per_chip": r["tokens_per_step"] // r["chips"],
            "per_chip_gib": r["per_chip_gib"]["total"],
            "scheduled_seconds": bal["estimated_step_seconds"],
            "serial_seconds": bal["serial_step_seconds"],
            "calibrated_seconds": bal["calibrated_step_seconds"],
            "calibrated_tokens_per_s_per_chip": bal["calibrated_tokens_per_s_per_chip"],
          }
        )
  return rows


def main(argv):
  del argv
  out = []
  for spec in _PROGRAMS.value:
    row = maxtext_row(spec)
    out += [row] + ours(row["seq_len"])
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in out)
  print("| program | context | tokens a chip | per chip | scheduled | serial | calibrated | tokens/s a chip |")
  print("|---|---|---|---|---|---|---|---|")
  for r in out:
    gib = f"{r['per_chip_gib']:.2f} GiB" if r.get("per_chip_gib") is not None else "n/a"
    print(
      f"| {r['program']} | {r['seq_len']} | {r['tokens_per_chip']} | {gib} | {r['scheduled_seconds']} s | "
      f"{r['serial_seconds']} s | {r['calibrated_seconds']} s | {r['calibrated_tokens_per_s_per_chip']} |"
    )


if __name__ == "__main__":
  app.run(main)
