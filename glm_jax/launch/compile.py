r"""Compiles the real pretraining step for a TPU slice ahead of time, on any machine, and says whether it fits.

  pip install "glm-jax[tpu]"                # libtpu, the TPU compiler (CPU work does not need it)
  bash scripts/with_env.sh python launch/compile.py --config=configs/glm5_744b.py --topology=v5p:8x8x8
  bash scripts/with_env.sh python launch/compile.py --config=configs/glm5_744b.py --topology=v5p-1024 \
      --config.data.seq_len=8192 \
      --config.data.batch_size=256 --config.mesh.expert=16

--topology is a chip grid ("v5p:8x8x8", "v5e:16x16", "v6e:16x16", "v4:4x4x4") or a Cloud accelerator type
("v5p-1024", "v5litepod-256", "v6e-256"). The step is the one launch/train.py runs (the config's DSA stage,
optimizer, microbatches and config.mesh over the slice's chips), lowered over abstract arguments: nothing is
allocated and no TPU is needed. Prints one JSON line:
  per_chip_bytes      XLA's memory analysis of the compiled program for one chip: arguments (the sharded train
                      state and batch), outputs, temporaries, aliased (outputs written into donated arguments),
                      total = arguments + outputs + temporaries + generated code - aliased, and peak
  hbm_bytes           the chip's HBM as published; hbm_usable_bytes what XLA lets one program use
  fits                total and peak within hbm_usable_bytes (false, with the compiler's message in
                      "error", when XLA refuses to compile for lack of memory)
  compiled_flops_per_step       XLA's FLOP count of the compiled program per chip x chips, at full depth: XLA
                      counts a loop body (a scanned layer stack) once, so with --flops this comes from unrolled
                      compiles of shallow copies, extrapolated to full depth; xla_flops_per_device_loop_bodies_once
                      is the scanned program's own figure. A Pallas kernel counts as the cost it declares
                      (megablox: its whole static buffer), so "cost" below is the figure to read.
  analytic_flops_per_step       6 N P + attention (glm_jax/train/flops.py), Muon's Newton-Schulz apart in
                      analytic_optimizer_flops_per_step; compiled_over_analytic divides by their sum
  cost                with --flops (aot.cost_report, glm_jax/sharding/hlo_cost.py): the compiled TPU program op by
                      op (matmul FLOPs, HBM bytes, ICI bytes; the grouped-matmul kernels as their grids run; each
                      op's time from XLA:TPU's own estimate or its roofline at a measured efficiency; each
                      collective's time on the slice's torus from the links its replica groups span,
                      glm_jax/sharding/ici.py) for "balanced" and "hot" routing: per MoE and dense layer against the
                      analytic FLOPs, the ops that cost most per layer, the full step's serial time (everything one
                      after another) and scheduled time (the program's own order, collectives overlapped where it
                      overlaps them), MFU over the useful-work numerator (glm_jax/train/flops.py, useful_flops),
                      tokens a second a chip, the calibrated step (x hlo_cost.CALIBRATION's realism factor, when
                      one is set), and a linearity check of the depth extrapolation against one more compiled layer
  --hlo_dir           with --flops: keeps the shallow copies' HLO there (and reuses it: the cost model again
                      without the four compiles)
  lower_seconds, compile_seconds
Exit status 0 when it fits, 1 when it does not, 2 on bad input.

The serving engine (--serve): its decode step ([--max_running, 1] tokens) and chunked-prefill step ([--prefill_rows,
--prefill_chunk]) over a page pool of --pages pages of --page_size tokens, the rows and pages split over the batch
axes (glm_jax/serving/aot.py): per-chip bytes of the weights and the pool, each program's memory analysis, fits, and
each step's roofline ms; the defaults are a pool of 64 x 32K tokens for glm5_744b:
  bash scripts/with_env.sh python launch/compile.py --serve --config=configs/glm5_744b.py --topology=v5p:4x4x4 \
      --config.mesh.expert=64

Serving (--decode): the real decode step, and the prefill of --prefill_len tokens a row, for --batch_size rows
against a cache of --cache_len slots, with the weights in model.dtype laid out over config.mesh (the Sampler's
layout under a mesh: glm_jax/inference/aot.py):
  bash scripts/with_env.sh python launch/compile.py --decode --config=configs/glm5_744b.py --topology=v5p:4x4x4 \
      --batch_size=64 \
      --cache_len=32768 --config.mesh.fsdp=8 --config.mesh.expert=8
  weights_bytes_per_chip, cache_bytes_per_chip   the shards one chip holds
  decode_per_chip_bytes, prefill_per_chip_bytes  XLA's memory analysis of each program (as above); fits: both do
  max_cache_len_at_batch, max_batch_at_cache_len the cache the decode step's headroom still holds (its
                      temporaries taken as fixed)
  decode_step, roofline_ms_per_token, tokens_per_s   the compiled decode program op by op (hlo_cost): FLOPs, HBM
                      and ICI bytes, the scheduled time of a step (one token a row; serial_ms_per_token: every op
                      one after another; calibrated_ms_per_token: x hlo_cost.CALIBRATION's factor, which was
                      measured on a training step), tokens a second over the batch
  weights_and_cache_read_ms   the floor: one chip's weights and cache read once at the HBM's bandwidth
  speculative (--speculate=k)  a round's programs compiled too (the verification of k + 1 tokens a row, an MTP draft
                      step, the MTP rewrite of k slots): their roofline ms, a round's (verify + k drafts + rewrite),
                      and break_even_acceptance_length, a round over a decode step: speculation makes more tokens
                      a second than plain decoding when the acceptance length exceeds it
"""

import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from glm_jax import cli, strict_json
from glm_jax.serving import EngineConfig, engine_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice: v5p:8x8x8, v5p-1024, v6e:16x16, v5e-256, ...")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined by DCN (multislice); the mesh spans all.")
_DECODE = flags.DEFINE_bool("decode", False, "Compile the decode step and prefill instead of the train step.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "--decode: rows decoded together.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 8192, "--decode: the cache's slots a row (prompt + response).")
_SPECULATE = flags.DEFINE_integer(
  "speculate",
  0,
  "--decode (and --serve): also compile a speculative round with k MTP drafts "
  "(the verification, a draft step, the MTP rewrite) and report its roofline.",
)
_SERVE = flags.DEFINE_bool("serve", False, "Compile the serving engine's decode and prefill steps instead.")
# --serve's engine (glm_jax/serving/engine_flags.py): 64 requests of up to 32K tokens, a 64 x 32K-token pool over the
# batch shards; a step a call of the decode program (on a pod the host round trip is small beside a step)
_ENGINE = engine_flags.define(
  EngineConfig(
    num_pages=32832, page_size=64, max_running=64, prefill_rows=64, prefill_chunk=256, max_seq_len=32768, decode_steps=1
  ),
  help_prefix="--serve: ",
)
_PREFILL_LEN = flags.DEFINE_integer(
  "prefill_len",
  None,
  "--decode: prompt tokens a row the prefill compiles for (default min(1024, --cache_len); 0: no prefill).",
)
_HLO_DIR = flags.DEFINE_string(
  "hlo_dir",
  None,
  "--flops: keep the shallow copies' compiled HLO and the step's memory "
  "report in this folder, and reuse them when it holds them (the cost model again, no "
  "compile).",
)
_FLOPS = flags.DEFINE_bool(
  "flops",
  False,
  "Also count the compiled step's cost at full depth: FLOPs, bytes, a "
  "roofline time and MFU (four more, shallow, unrolled compiles; aot.cost_report; minutes "
  "for glm5_744b).",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from glm_jax.sharding import topology
  from glm_jax.train import aot

  config = _CONFIG.value
  try:
    topo = topology.parse_topology(_TOPOLOGY.value)
    if _NUM_SLICES.value < 1:
      raise ValueError(f"--num_slices={_NUM_SLICES.value} is invalid; a positive integer")
    if not topology.libtpu_installed():
      raise ModuleNotFoundError(f"launch/compile.py needs libtpu to compile for {topo.name}: {topology.install_hint()}")
    if _DECODE.value and _SERVE.value:
      raise ValueError("--decode and --serve: give one of them")
    if _DECODE.value:
      decode(config, topo)
      return
    if _SERVE.value:
      serve(config, topo)
      return
    aot.check_sections(config)
    t0 = time.perf_counter()
    devices = topology.tpu_topology_devices(topo.name, num_slices=_NUM_SLICES.value)
    topology_seconds = time.perf_counter() - t0
    saved = os.path.join(_HLO_DIR.value, "step_report.json") if _HLO_DIR.value else None
    if _FLOPS.value and saved and os.path.exists(saved):  # compiled before: the cost model again, no compile
      with open(saved) as f:
        report = json.load(f)
      report["cost"] = aot.cost_report(config, devices, aot.load_depths(_HLO_DIR.value))
      print(strict_json.dumps(report), flush=True)
      sys.exit(0 if report["fits"] else 1)
    result = aot.compile_train_step(config, devices)
    depths = flops = None
    if _FLOPS.value and result.compiled is not None:
      if _HLO_DIR.value and os.path.exists(os.path.join(_HLO_DIR.value, "index.json")):
        depths = aot.load_depths(_HLO_DIR.value)
      else:
        depths = aot.compile_depths(config, devices, linearity=True)
        if _HLO_DIR.value:
          aot.save_depths(depths, _HLO_DIR.value)
      flops = aot.extrapolated_flops(config, devices, depths)
    report = step_memory_report(config, topo, devices, result, flops, topology_seconds)
    if depths is not None:
      if saved:
        with open(saved, "w") as f:
          f.write(strict_json.dumps(report))
      report["cost"] = aot.cost_report(config, devices, depths)
  except (ValueError, ModuleNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(strict_json.dumps(report), flush=True)
  sys.exit(0 if report["fits"] else 1)


def step_memory_report(config, topo, devices, result, flops, topology_seconds) -> dict:
  """The JSON line's sizes, FLOPs and per-chip memory (all but "cost")."""
  from glm_jax.sharding import topology
  from glm_jax.train import aot

  gen = topo.generation.name
  report = {
    "topology": topo.name,
    "num_slices": _NUM_SLICES.value,
    "chips": len(devices),
    "device_kind": devices[0].device_kind,
  }
  report.update(aot.step_report(config, result, flops))
  report["topology_seconds"] = round(topology_seconds, 1)
  usable = topology.HBM_USABLE_BYTES[gen]
  report["hbm_bytes"] = topology.HBM_BYTES[gen]
  report["hbm_usable_bytes"] = usable
  if result.compiled is not None:
    mem = topology.compiled_memory(result.compiled)
    report["per_chip_bytes"] = {
      k: mem[k] for k in ("arguments", "outputs", "temporaries", "generated_code", "aliased", "total", "peak")
    }
    report["per_chip_gib"] = {k: round(v / topology.GiB, 2) for k, v in report["per_chip_bytes"].items()}
    report["fits"] = mem["total"] <= usable and mem["peak"] <= usable
    report["hbm_headroom_gib"] = round((usable - max(mem["total"], mem["peak"])) / topology.GiB, 2)
  else:
    report["fits"] = False
    report["error"] = result.error.strip().splitlines()[0][:2000] if result.error else "compile failed"
  return report


def decode(config, topo):
  """--decode: compile serving for the slice and print its report (glm_jax/inference/aot.py)."""
  from glm_jax.inference import aot as serving
  from glm_jax.sharding import topology
  from glm_jax.train.config import require_sections

  require_sections(config, ("model", "mesh"), "compiling the decode step", "configs/glm5_tiny.py")
  devices = topology.tpu_topology_devices(topo.name, num_slices=_NUM_SLICES.value)
  result = serving.compile_decode(
    config,
    devices,
    batch_size=_BATCH.value,
    cache_len=_CACHE_LEN.value,
    prefill_len=(min(1024, _CACHE_LEN.value) if _PREFILL_LEN.value is None else _PREFILL_LEN.value),
    speculate=_SPECULATE.value,
  )
  report = {
    "topology": topo.name,
    "num_slices": _NUM_SLICES.value,
    "chips": len(devices),
    "device_kind": devices[0].device_kind,
    "config": config.get("name", "?"),
  }
  usable = topology.HBM_USABLE_BYTES[topo.generation.name]
  report.update(serving.decode_report(result, usable))
  report["hbm_usable_bytes"] = usable
  print(strict_json.dumps(report), flush=True)
  sys.exit(0 if report["fits"] else 1)


def serve(config, topo):
  """--serve: compile the serving engine's steps for the slice and print its report (glm_jax/serving/aot.py)."""
  from glm_jax.serving import aot as engine_aot
  from glm_jax.sharding import topology
  from glm_jax.train.config import require_sections

  require_sections(config, ("model", "mesh"), "compiling the serving engine", "configs/glm5_tiny.py")
  engine = _ENGINE()
  devices = topology.tpu_topology_devices(topo.name, num_slices=_NUM_SLICES.value)
  result = engine_aot.compile_engine(config, devices, engine)
  usable = topology.HBM_USABLE_BYTES[topo.generation.name]
  report = {"topology": topo.name, "chips": len(devices), "config": config.get("name", "?")}
  report.update(engine_aot.engine_report(result, usable))
  report["hbm_usable_bytes"] = usable
  print(strict_json.dumps(report), flush=True)
  sys.exit(0 if report["fits"] else 1)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "topology"])
  cli.run(main)
