"""Compiles MaxText's train step for a TPU topology on a CPU host and saves its HLO.

Runs MaxText's own ahead-of-time entry point (maxtext.trainers.pre_train.
train_compile.main), with one wrapper around its jit_and_compile so that the
compiled executable can be kept. From it we write:

  <out_dir>/<name>.hlo.txt   compiled.as_text(): the optimized HLO after SPMD
                             partitioning, i.e. one chip's program
  <out_dir>/<name>.json      memory analysis (bytes a chip), cost analysis, the
                             compile wall time, and the MaxText arguments

Run it with the MaxText venv's python (see setup_venv.sh), for example:

  .venv/bin/python compile_hlo.py --name=tiny --out_dir=out -- \
      <path to maxtext/configs/base.yml> model_name=deepseek3-tiny \
      compile_topology=v5p-8 compile_topology_num_slices=1 ...

Everything after `--` goes to MaxText unchanged (a base.yml path, then
key=value overrides).
"""

import json
import os
import time

from absl import app
from absl import flags

_NAME = flags.DEFINE_string("name", None, "Name of the outputs: <out_dir>/<name>.hlo.txt and .json.")
_OUT_DIR = flags.DEFINE_string("out_dir", "out", "Folder for the outputs.")

# Fields of jax's CompiledMemoryStats worth keeping (all in bytes, one chip).
_MEMORY_FIELDS = (
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "temp_size_in_bytes",
  "generated_code_size_in_bytes",
  "host_argument_size_in_bytes",
  "host_output_size_in_bytes",
  "host_alias_size_in_bytes",
  "host_temp_size_in_bytes",
  "peak_memory_in_bytes",
)


def _memory_analysis(compiled):
  """Returns the compiled program's memory use a chip as a dict of bytes and GiB."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  out = {f: getattr(stats, f) for f in _MEMORY_FIELDS if hasattr(stats, f)}
  # What XLA itself adds up for "does it fit in HBM": arguments + outputs + temps - aliased.
  out["total_hbm_bytes_args_plus_out_plus_temp_minus_alias"] = (
    out.get("argument_size_in_bytes", 0)
    + out.get("output_size_in_bytes", 0)
    + out.get("temp_size_in_bytes", 0)
    - out.get("alias_size_in_bytes", 0)
  )
  out["GiB"] = {k: round(v / 2**30, 3) for k, v in out.items() if isinstance(v, int)}
  return out


def _cost_analysis(compiled):
  """Returns XLA's own cost analysis (flops, bytes accessed) as plain floats."""
  try:
    cost = compiled.cost_analysis()
  except Exception as e:  # Not every backend implements it; keep going.
    return {"error": repr(e)}
  if isinstance(cost, list):  # Older jax returns one dict a module.
    cost = cost[0] if cost else {}
  # The per-operand "bytes accessed3{}" and "utilization7{}" entries are left out.
  keep = ("flops", "transcendentals", "bytes accessed", "optimal_seconds")
  return {k: float(v) for k, v in (cost or {}).items() if k in keep}


def _save(compiled, seconds, maxtext_argv):
  """Writes the HLO text and a JSON summary of the compiled train step."""
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  hlo_path = os.path.join(_OUT_DIR.value, f"{_NAME.value}.hlo.txt")
  text = compiled.as_text()
  with open(hlo_path, "w") as f:
    f.write(text)
  summary = {
    "name": _NAME.value,
    "lower_and_compile_seconds": round(seconds, 1),
    "hlo_path": hlo_path,
    "hlo_bytes": len(text),
    "memory_analysis_per_chip": _memory_analysis(compiled),
    "cost_analysis_per_chip": _cost_analysis(compiled),
    "maxtext_argv": maxtext_argv,
    "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
  }
  json_path = os.path.join(_OUT_DIR.value, f"{_NAME.value}.json")
  with open(json_path, "w") as f:
    json.dump(summary, f, indent=2)
  print(f"Saved {hlo_path} ({len(text) / 2**20:.1f} MiB) and {json_path}", flush=True)
  print(json.dumps(summary["memory_analysis_per_chip"], indent=2), flush=True)


def main(argv):
  if _NAME.value is None:
    raise app.UsageError("--name is required: it names the output files.")
  if len(argv) < 2:
    raise app.UsageError("Pass MaxText's base.yml path and key=value overrides after `--`.")
  # Imported here so that absl parses our flags before MaxText's modules load.
  from maxtext.trainers.pre_train import train_compile

  maxtext_argv = list(argv)  # [program, base.yml, key=value, ...], as MaxText expects
  original = train_compile.jit_and_compile

  def jit_and_compile_and_save(*args, **kwargs):
    start = time.time()
    compiled = original(*args, **kwargs)
    _save(compiled, time.time() - start, maxtext_argv[1:])
    return compiled

  train_compile.jit_and_compile = jit_and_compile_and_save
  train_compile.main(maxtext_argv)


if __name__ == "__main__":
  app.run(main)
