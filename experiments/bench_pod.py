r"""The pod table: glm5_744b's training steps compiled for a v5p slice and costed by the cost model, one row each.

Runs `launch/compile.py --flops` for every row (a process each; the shallow copies' HLO is kept under --hlo_dir so
the cost model can be run again without compiling) and writes the JSON lines to --out, then prints the table the
docs/pods.md shows: per-chip memory, compiled / useful FLOPs, the serial and the scheduled step, the calibrated step
(hlo_cost.CALIBRATION), MFU over the useful-work numerator (glm_jax/train/flops.py, useful_flops), tokens a second
a chip; balanced routing, hot routing's step beside it. A second table bounds each program: its MFU if every
collective were hidden, and if besides the recompute were gone (glm_jax/train/aot.py's step_bounds).

  bash scripts/with_env.sh python experiments/bench_pod.py                      # every row (an hour or more here)
  bash scripts/with_env.sh python experiments/bench_pod.py --rows=4k_dense      # one row
  bash scripts/with_env.sh python experiments/bench_pod.py --table_only         # the table from --out's rows
  bash scripts/with_env.sh python experiments/bench_pod.py --recalibrate        # after hlo_cost.CALIBRATION changed
  bash scripts/with_env.sh python experiments/bench_pod.py --out=experiments/results/pod_levers.jsonl \
      --rows=4k_dense_unfilled_only,4k_dense_no_fast_path,4k_dense_no_xla_flags,4k_dense  # the levers
"""

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from glm_jax.configs import glm5_744b

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (config, overrides)
ROWS = {
  "4k_dense": ("configs/glm5_744b.py", ["--config.optimizer.name=adamw"]),
  "4k_sparse": ("configs/glm5_744b.py", ["--config.train.dsa_stage=sparse"]),
  "128k_sparse": ("configs/glm5_744b_128k.py", []),
  "128k_warmup": ("configs/glm5_744b_128k.py:warmup", []),
  "200k_sparse": ("configs/glm5_744b_200k.py", []),
  "200k_warmup": ("configs/glm5_744b_200k.py:warmup", []),
  # 4 slices joined by DCN: the data axis across them, each slice the 4k_dense layout with its own 1024 sequences
  "4k_dense_4slices": (
    "configs/glm5_744b.py",
    ["--config.optimizer.name=adamw", "--num_slices=4", "--config.data.batch_size=4096"],
  ),
}

# The levers of the 4K dense step, each turned off in turn (experiments/results/pod_levers.jsonl; not run by default),
# at one sequence a chip, as docs/pods.md's table of levers has them
LEVER_ROWS = {
  "4k_dense_unfilled_only": (
    "configs/glm5_744b.py",
    [
      "--config.optimizer.name=adamw",
      "--config.data.batch_size=512",
      "--config.model.moe_buffer_factor=0",
      "--config.train.xla_flags=",
    ],
  ),
  "4k_dense_no_fast_path": (
    "configs/glm5_744b.py",
    ["--config.optimizer.name=adamw", "--config.data.batch_size=512", "--config.model.moe_buffer_factor=0"],
  ),
  "4k_dense_no_xla_flags": (
    "configs/glm5_744b.py",
    ["--config.optimizer.name=adamw", "--config.data.batch_size=512", "--config.train.xla_flags="],
  ),
  # XLA:TPU's async ragged all-to-all on top of the shipped flags (faster, but over HBM at two sequences a chip)
  "4k_dense_async_ragged": (
    "configs/glm5_744b.py",
    [
      "--config.optimizer.name=adamw",
      "--config.train.xla_flags="
      + glm5_744b.get_config().train.xla_flags
      + " --xla_tpu_enable_async_ragged_all_to_all=true",
    ],
  ),
  # Tokens a chip (MaxText's measured recipe runs 40,960): one sequence a chip, and four
  "4k_dense_1_a_chip": ("configs/glm5_744b.py", ["--config.optimizer.name=adamw", "--config.data.batch_size=512"]),
  "4k_dense_4_a_chip": ("configs/glm5_744b.py", ["--config.optimizer.name=adamw", "--config.data.batch_size=2048"]),
}
ORDER = list(ROWS) + list(LEVER_ROWS)

_ROWS = flags.DEFINE_list("rows", list(ROWS), f"Rows to compile, of {list(ROWS)} (and the levers' {list(LEVER_ROWS)}).")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:8x8x8", "The slice.")
_OUT = flags.DEFINE_string("out", os.path.join(ROOT, "experiments/results/pod_costs.jsonl"), "JSON lines, one a row.")
_HLO_DIR = flags.DEFINE_string(
  "hlo_dir",
  os.path.join(ROOT, "experiments/results/hlo"),
  "Where each row's shallow compiled programs are kept (not committed: tens of MB).",
)
_TABLE_ONLY = flags.DEFINE_bool("table_only", False, "Print the table from --out without compiling.")
_EXTRA = flags.DEFINE_multi_string("extra", [], "More --config.* overrides for every row.")
_RECALIBRATE = flags.DEFINE_bool(
  "recalibrate",
  False,
  "Redo --out's calibrated figures with hlo_cost.CALIBRATION "
  "as it is now (the scheduled steps as they are), rewrite it, print the table.",
)


def run_row(name: str) -> dict:
  config, overrides = {**ROWS, **LEVER_ROWS}[name]
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch/compile.py"),
    f"--config={config}",
    f"--topology={_TOPOLOGY.value}",
    "--flops",
    f"--hlo_dir={os.path.join(_HLO_DIR.value, name)}",
    *overrides,
    *_EXTRA.value,
  ]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if not lines:
    raise RuntimeError(f"{name}: launch/compile.py exited {proc.returncode} with no report:\n{proc.stderr[-3000:]}")
  row = json.loads(lines[-1])
  row.update(row_name=name, command=" ".join(cmd[1:]), wall_seconds=round(time.perf_counter() - t0, 1))
  return row


def table(rows: list[dict]) -> str:
  head = (
    "| row | per chip | compiled / useful | serial step | scheduled step | calibrated step | MFU (useful) | "
    "tokens/s a chip | hot routing step |"
  )
  out = [head, "|---" * (head.count("|") - 1) + "|"]
  for r in rows:
    if "per_chip_gib" not in r:  # XLA refused it: out of HBM
      out.append(f"| {r['row_name']} | does not fit: {r.get('error', '?')[:120]} |" + " |" * 7)
      continue
    cost = r.get("cost", {}).get("routings", {})
    bal, hot = cost.get("balanced", {}), cost.get("hot", {})
    cal = bal.get("calibrated_step_seconds")
    gib = f"{r['per_chip_gib']['total']:.2f} GiB" + ("" if r.get("fits", True) else " (over HBM)")
    out.append(
      f"| {r['row_name']} | {gib} | {bal.get('compiled_over_useful_step')} | "
      f"{bal.get('serial_step_seconds')} s | {bal.get('estimated_step_seconds')} s | "
      f"{f'{cal} s' if cal is not None else 'n/a'} | "
      f"{100 * (bal.get('calibrated_mfu') or bal.get('estimated_mfu') or 0):.1f}% | "
      f"{bal.get('calibrated_tokens_per_s_per_chip') or bal.get('tokens_per_s_per_chip')} | "
      f"{hot.get('estimated_step_seconds')} s |"
    )
  return "\n".join(out)


def bounds_table(rows: list[dict]) -> str:
  head = (
    "| row | compute | exposed collectives | MFU, every collective hidden | and no recompute | "
    "tokens/s a chip, hidden | and no recompute |"
  )
  out = [head, "|---" * (head.count("|") - 1) + "|"]
  from glm_jax.train.aot import step_bounds

  for r in rows:
    if not r.get("cost", {}).get("routings", {}).get("balanced"):
      continue
    b = step_bounds(r["cost"], r["chips"], r["tokens_per_step"])
    out.append(
      f"| {r['row_name']} | {b['compute_seconds']} s | {b['exposed_collective_seconds']} s | "
      f"{100 * b['hidden_mfu']:.1f}% | {100 * b['no_recompute_mfu']:.1f}% | {b['hidden_tokens_per_s_per_chip']} | "
      f"{b['no_recompute_tokens_per_s_per_chip']} |"
    )
  return "\n".join(out)


def recalibrated(row: dict) -> dict:
  """The row with its calibrated step, MFU and tokens a second a chip from the current realism factor."""
  from glm_jax.sharding import hlo_cost
  from glm_jax.train.aot import step_figures

  cost = row.get("cost")
  if not cost:
    return row
  cost["calibration"] = hlo_cost.CALIBRATION
  for entry in cost["routings"].values():
    entry.update(
      step_figures(
        entry["estimated_step_seconds"],
        hlo_cost.CALIBRATION,
        cost["useful_flops_per_step"],
        row["chips"],
        row["tokens_per_step"],
        cost["peaks"]["bf16_flops"],
      )
    )
  return row


def _order(row: dict) -> int:  # ORDER's order; a row from elsewhere (an earlier commit's) first
  return ORDER.index(row["row_name"]) if row["row_name"] in ORDER else -1


def main(argv):
  del argv
  rows = []
  if os.path.exists(_OUT.value):
    with open(_OUT.value) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  if _RECALIBRATE.value:
    rows = [recalibrated(r) for r in rows]
    with open(_OUT.value, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  elif not _TABLE_ONLY.value:
    for name in _ROWS.value:
      if name not in ORDER:
        raise app.UsageError(f"--rows: {name!r} is not a row; rows: {ORDER}")
      print(f"[bench_pod] {name} ...", file=sys.stderr, flush=True)
      row = run_row(name)
      rows = [r for r in rows if r.get("row_name") != name] + [row]
      with open(_OUT.value, "w") as f:
        for r in sorted(rows, key=_order):
          f.write(json.dumps(r) + "\n")
      print(f"[bench_pod] {name}: {row['wall_seconds']} s", file=sys.stderr, flush=True)
  rows.sort(key=_order)
  print(table(rows))
  print("\nWhat the model allows each program at best (calibrated; compute time from its per-op efficiency table):")
  print(bounds_table(rows))


if __name__ == "__main__":
  app.run(main)
