"""Ahead-of-time compilation of the real pretraining step for any device list, compile-only TPU devices included.

`compile_train_step(config, devices)` builds exactly what train_and_evaluate runs (the stage's model config, the
optimizer, make_train_step with the state and batch shardings of config.mesh) over abstract arguments, so
nothing is allocated, lowers it under the mesh and compiles it. With devices from
glm_jax.sharding.topology.tpu_topology_devices this is XLA:TPU's own compile for a pod on a machine without a
TPU: its memory analysis is the per-chip HBM the step needs, and a step that does not fit fails to compile.
launch/compile.py prints the report as one JSON line.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from glm_jax.mesh_axes import CONTEXT
from glm_jax.model import context_parallel, param_counts, splash
from glm_jax.model.grouped_matmul import megablox_grid_cost
from glm_jax.model.moe_parallel import FAST_PATH
from glm_jax.model.platform import target_platform
from glm_jax.sharding import hlo_cost
from glm_jax.sharding.mesh import MESH_AXES, batch_sharding, entry_axes, make_mesh
from glm_jax.sharding.state import abstract_sharded
from glm_jax.sharding.topology import GENERATIONS, compiled_flops, torus_of
from glm_jax.train import step as step_lib, trainer
from glm_jax.train.config import model_config_for_stage, require_sections, validate_train_config
from glm_jax.train.flops import analytic_flops, muon_ns_flops, useful_flops


SECTIONS = ("model", "data", "train", "optimizer", "mesh")  # what compiling the train step reads


@dataclasses.dataclass
class CompiledStep:
  lowered: Any  # jax.stages.Lowered
  compiled: Any  # jax.stages.Compiled, None when compilation failed (see error)
  error: str | None
  mesh: jax.sharding.Mesh
  lower_seconds: float
  compile_seconds: float
  abstract_params: Any  # the state's parameters as ShapeDtypeStructs (for FLOP and byte counts)


def check_sections(config: ml_collections.ConfigDict) -> None:
  require_sections(config, SECTIONS, "compiling the train step", "configs/glm5_tiny.py")


def compile_train_step(
  config: ml_collections.ConfigDict, devices: Sequence[Any], *, unrolled: bool = False
) -> CompiledStep:
  """Lowers and compiles train_and_evaluate's step for config.mesh over `devices`, with abstract arguments.

  unrolled: the layer scans and the microbatch loop unrolled (for XLA's cost analysis; compile time grows with
  depth). Config errors (mesh sizes, divisibility of heads / experts / the batch) are raised before compiling.
  A compile that fails (e.g. RESOURCE_EXHAUSTED: the step does not fit the chip's HBM) is returned with
  compiled=None and the compiler's message in `error`.
  """
  check_sections(config)
  validate_train_config(config.train)
  model_cfg = model_config_for_stage(config)
  if unrolled:
    model_cfg = model_cfg.replace(scan_unroll=True)
  mesh = make_mesh(config.mesh, devices)
  context_parallel.check(config.data.seq_len, mesh.shape[CONTEXT], model_cfg)
  data_sharding = batch_sharding(mesh)
  b, t = config.data.batch_size, config.data.seq_len
  batch_shards = math.prod(mesh.shape[a] for a in data_sharding.spec[0])
  if b % (batch_shards * config.train.microbatches):
    raise ValueError(
      f"data.batch_size={b} must be divisible by train.microbatches={config.train.microbatches} "
      f"x the {batch_shards} batch shards of mesh {dict(mesh.shape)} (axes {data_sharding.spec[0]})"
    )

  make_state, built = trainer.train_state_factory(config, model_cfg)
  abstract_state, shardings = abstract_sharded(make_state, lambda s: s.params, mesh)
  train_step = step_lib.make_train_step(
    built["graphdef"],
    built["optimizer"],
    built["schedule"],
    config.train,
    state_shardings=shardings,
    batch_sharding=data_sharding,
    unroll_microbatches=unrolled,
    quant_plan=trainer.training_quant_plan(config, abstract_state.params),
  )
  keys = trainer.BATCH_KEYS if config.data.objective == "glm" else trainer.BATCH_KEYS[:4]
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=data_sharding) for k in keys}  # the pipeline's batch
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), target_platform(devices[0].platform):  # the DSA kernels compiled, not interpreted
    lowered = train_step.lower(abstract_state, batch)
  lower_seconds = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled, error = None, None
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    error = str(e)
  return CompiledStep(lowered, compiled, error, mesh, lower_seconds, time.perf_counter() - t0, abstract_state.params)


def _shallow(config: ml_collections.ConfigDict, n_dense: int, n_moe: int) -> ml_collections.ConfigDict:
  shallow = config.copy_and_resolve_references()
  shallow.model.num_hidden_layers = n_dense + n_moe
  shallow.model.first_k_dense_replace = n_dense
  return shallow


def depth_variants(config: ml_collections.ConfigDict, *, linearity: bool = False) -> list[tuple[int, int]]:
  """The (dense, MoE) layer counts of the shallow copies: (1, 1), (2, 1), (1, 2) (one stack at a time when the
  model has only one kind); with linearity, one more MoE layer (or dense, for an all-dense model) to check that
  the cost really is linear in depth."""
  model_cfg = model_config_for_stage(config)
  base = (min(model_cfg.num_dense_layers, 1), min(model_cfg.num_moe_layers, 1))
  variants = [base] + [tuple(b + (i == j) for j, b in enumerate(base)) for i in range(2) if base[i]]
  if linearity:
    i = 1 if base[1] else 0
    variants.append(tuple(b + 2 * (i == j) for j, b in enumerate(base)))
  return variants


def compile_depths(
  config: ml_collections.ConfigDict, devices: Sequence[Any], *, linearity: bool = False
) -> dict[str, Any]:
  """Fully unrolled compiles of the shallow copies of depth_variants: {"programs": {(dense, MoE): (XLA's FLOPs a
  device, the optimized HLO text)}, "seconds": ...}. XLA's cost analysis counts a while body once, so the scanned
  step's own figures miss all but one layer of each stack; unrolling glm5_744b's 78 layers would make the compile
  very long. For the same widths, mesh and batch a cost is c + n_dense * a + n_moe * b, so the shallow copies give
  the full depth's (extrapolated_flops, cost_report)."""
  t0 = time.perf_counter()
  programs = {}
  for nd, nm in depth_variants(config, linearity=linearity):
    result = compile_train_step(_shallow(config, nd, nm), devices, unrolled=True)
    if result.compiled is None:
      raise RuntimeError(f"the unrolled {nd}+{nm}-layer copy did not compile: {result.error}")
    programs[(nd, nm)] = (compiled_flops(result.compiled), result.compiled.as_text())
  return {"programs": programs, "seconds": time.perf_counter() - t0}


def save_depths(depths: dict[str, Any], folder: str) -> None:
  """Writes compile_depths' programs to folder (one gzipped HLO text a variant, and index.json with XLA's FLOPs and
  the compile seconds), so a cost report can be made again without compiling (load_depths)."""
  os.makedirs(folder, exist_ok=True)
  index = {"seconds": depths["seconds"], "programs": {}}
  for (nd, nm), (flops, text) in depths["programs"].items():
    name = f"{nd}+{nm}.hlo.txt.gz"
    with gzip.open(os.path.join(folder, name), "wt") as f:
      f.write(text)
    index["programs"][f"{nd}+{nm}"] = {"xla_flops": flops, "file": name}
  with open(os.path.join(folder, "index.json"), "w") as f:
    json.dump(index, f, indent=1)


def load_depths(folder: str) -> dict[str, Any]:
  """compile_depths' result as save_depths wrote it; FileNotFoundError naming the folder when it holds none."""
  path = os.path.join(folder, "index.json")
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"{folder} holds no compiled depth variants (no index.json; launch/compile.py --flops "
      f"--hlo_dir={folder} writes them)"
    )
  with open(path) as f:
    index = json.load(f)
  programs = {}
  for key, entry in index["programs"].items():
    with gzip.open(os.path.join(folder, entry["file"]), "rt") as f:
      programs[tuple(int(x) for x in key.split("+"))] = (entry["xla_flops"], f.read())
  return {"programs": programs, "seconds": index["seconds"]}


def _per_layer(values: dict[tuple[int, int], Any], config: ml_collections.ConfigDict, sub=lambda a, b: a - b):
  """(outside the layers, per dense layer, per MoE layer) of a cost linear in depth, from the base variants."""
  base = depth_variants(config)[0]
  f0 = values[base]
  zero = sub(f0, f0)
  per_dense = sub(values[(2, base[1])], f0) if base[0] else zero
  per_moe = sub(values[(base[0], 2)], f0) if base[1] else zero
  return f0, per_dense, per_moe, base


def extrapolated_flops(
  config: ml_collections.ConfigDict, devices: Sequence[Any], depths: dict | None = None
) -> dict[str, Any]:
  """XLA's FLOPs per device of the full-depth step, from compile_depths (given, or compiled here).

  Exact up to work that is not linear in depth: the optimizer's padding of the Muon matrix stacks to the device
  count (see glm_jax/train/muon.py: orthogonalize), and the few elementwise ops XLA fuses or folds differently at
  another depth (2.7e-4 of the count for a 4-layer tiny model with AdamW, tests/sharding/test_hlo_cost.py). A Pallas
  kernel counts as the cost_estimate it declares (megablox's grouped matmul: its whole static buffer)."""
  depths = depths or compile_depths(config, devices)
  model_cfg = model_config_for_stage(config)
  flops = {k: v[0] for k, v in depths["programs"].items()}
  f0, per_dense, per_moe, base = _per_layer(flops, config)
  rest = f0 - base[0] * per_dense - base[1] * per_moe
  return {
    "per_device": rest + model_cfg.num_dense_layers * per_dense + model_cfg.num_moe_layers * per_moe,
    "per_dense_layer": per_dense,
    "per_moe_layer": per_moe,
    "outside_layers": rest,
    "seconds": depths["seconds"],
  }


ROUTINGS = ("balanced", "hot")


def moe_real_rows(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, routing: str) -> int:
  """The (token, slot) rows one device's experts get in an MoE layer: "balanced", every expert the same share,
  n*K for the n tokens a device holds; "hot", every pair of an expert group's P devices sent to one shard,
  P*n*K on that device (the dropless worst case; the step waits for it)."""
  model_cfg = model_config_for_stage(config)
  spec = batch_sharding(mesh).spec  # rows over the batch axes, the sequence over context: both split the tokens
  shards = math.prod(mesh.shape[a] for entry in spec for a in entry_axes(entry))
  n = config.data.batch_size * config.data.seq_len // (shards * config.train.microbatches)
  rows = n * model_cfg.num_experts_per_tok
  if routing == "balanced":
    return rows
  if routing == "hot":
    return rows * mesh.shape.get("expert", 1)
  raise ValueError(f"routing={routing!r}; one of {ROUTINGS}")


def kernel_model(real_rows: int, routing: str, *, splash_block: int | None = None, split_backward: bool = False):
  """hlo_cost's kernel model: megablox's calls as their grid runs with `real_rows` rows (at most the buffer)
  spread evenly over the groups; splash's (which declare no cost) as their causal grid runs, in blocks of
  splash_block (ours, splash.block_size, when None); split_backward: the backward is splash's two kernels (dkv
  without dq, and dq), as MaxText runs it, rather than our fused one."""

  def model(source, ins, by_name):
    splash_kernel = re.search(r"splash_mha_(fwd|dkv|dq)_", ins.name) or re.search(r"/splash_mha_(fwd|dkv|dq)_", source)
    if splash_kernel:  # q, k [(b,) H, T, P] and v [(b,) H, T, O] are its first float operands (b: under vmap)
      qkv = [
        s
        for s in (by_name[o].shapes[0] for o in ins.operands if o in by_name and by_name[o].shapes)
        if s[0] in ("bf16", "f32") and len(s[1]) in (3, 4)
      ][:3]
      if len(qkv) < 3:
        return None  # not the layout this model knows: the kernel's declared cost (none) stands
      (dtype, q), v = qkv[0], qkv[2][1]
      kind = splash_kernel.group(1)
      kind = "dkv_no_dq" if kind == "dkv" and split_backward else kind
      flops, moved = splash.grid_cost(
        kind, math.prod(q[:-2]), q[-2], q[-1], v[-1], int(hlo_cost.nbytes([(dtype, ())])), block=splash_block
      )
      return flops, moved, "causal blocks"
    # megablox's kernels by jax's op name, or by the instruction's name where a program has no op names (MaxText's)
    kernel = re.search(r"jit\((t?gmm)\)/pallas_call", source) or re.fullmatch(r"(t?gmm)(?:\.\d+)?", ins.name)
    if not kernel:
      return None
    operands = [by_name[o].shapes[0] for o in ins.operands if o in by_name and by_name[o].shapes]
    ((out_dtype, out),) = ins.shapes[:1]
    mats = [(dt, dims) for dt, dims in operands if len(dims) in (2, 3)]
    lhs_dtype, lhs = next((dt, dims) for dt, dims in mats if len(dims) == 2)
    if kernel.group(1) == "gmm":  # lhs [m, k] x rhs [G, k, n] (or [G, n, k]) -> [m, n]
      m, n = out
      k, groups = lhs[1], next(dims for _, dims in mats if len(dims) == 3)[0]
    else:  # lhs [k, m] x rhs [m, n] -> [G, k, n]
      groups, k, n = out
      m = lhs[1]
    rows = min(real_rows, m)
    sizes = [rows // groups + (g < rows % groups) for g in range(groups)]
    flops, moved = megablox_grid_cost(
      kernel.group(1),
      m,
      k,
      n,
      sizes,
      in_bytes=hlo_cost.nbytes([(lhs_dtype, ())]),
      out_bytes=hlo_cost.nbytes([(out_dtype, ())]),
    )
    return flops, moved, f"{routing}: {rows} real rows of {m}"

  return model


def ragged_model(real_rows: int, row_elements: int) -> hlo_cost.RaggedModel:
  """hlo_cost's ragged model: a ragged all-to-all moves `real_rows` rows of `row_elements` elements (the MoE's
  exchange: tokens' hidden vectors), as entries of its result's leading dimension, whatever XLA made of the rest
  ([rows, 2, 3072] for rows of 6144; [blocks, 8, 6144] for blocks of 8 rows, moe_parallel.BLOCK)."""

  def model(ins):
    return real_rows * row_elements / math.prod(hlo_cost.ragged_buffer(ins)[1:])

  return model


def _sig(v: float) -> float:
  return float(f"{v:.5g}")


def step_figures(
  seconds: float, calibration: dict | None, useful_flops: float, chips: int, tokens: int, peak_flops: float
) -> dict[str, float | None]:
  """A scheduled step's figures (5 significant digits): the step, MFU over useful_flops and tokens a second a chip,
  raw and calibrated (x calibration's realism factor; None without one)."""
  factor = calibration["realism_factor"] if calibration else None
  return {
    "estimated_step_seconds": _sig(seconds),
    "calibrated_step_seconds": _sig(seconds * factor) if factor else None,
    "estimated_mfu": _sig(useful_flops / (chips * peak_flops * seconds)),
    "calibrated_mfu": _sig(useful_flops / (chips * peak_flops * seconds * factor)) if factor else None,
    "tokens_per_s_per_chip": _sig(tokens / seconds / chips),
    "calibrated_tokens_per_s_per_chip": _sig(tokens / seconds / chips / factor) if factor else None,
  }


def step_bounds(cost: dict, chips: int, tokens: int) -> dict[str, float]:
  """What the cost model allows a program at best, from a pod row's `cost` (balanced routing), calibrated: MFU and
  tokens a second a chip if every collective were hidden behind compute (the step = its compute time), and if besides
  the recompute were gone (compute x useful / compiled FLOPs: the recomputed forward taken at the efficiency of the
  rest of the step's work)."""
  bal = cost["routings"]["balanced"]
  compute = bal["per_device_step"]["compute_seconds"]
  args = (cost.get("calibration"), cost["useful_flops_per_step"], chips, tokens, cost["peaks"]["bf16_flops"])
  hidden = step_figures(compute, *args)
  lean = step_figures(compute / bal["compiled_over_useful_step"], *args)
  return {
    "compute_seconds": compute,
    "exposed_collective_seconds": _sig(bal["estimated_step_seconds"] - compute),
    "hidden_mfu": hidden["calibrated_mfu"],
    "hidden_tokens_per_s_per_chip": hidden["calibrated_tokens_per_s_per_chip"],
    "no_recompute_mfu": lean["calibrated_mfu"],
    "no_recompute_tokens_per_s_per_chip": lean["calibrated_tokens_per_s_per_chip"],
  }


def moe_branch(routing: str) -> hlo_cost.BranchModel:
  """hlo_cost's branch model: the expert exchange's conditional (moe_parallel.py, model.moe_buffer_factor) runs its
  fast branch (the one whose ops carry moe_parallel.FAST_PATH) under balanced routing, which loads every shard
  with the balanced n*K rows, and the worst-case branch under hot routing (every pair to one shard); any other
  conditional is left to the default (every branch counted)."""

  def pick(branches: list[str]) -> int | None:
    fast = [i for i, names in enumerate(branches) if FAST_PATH in names]
    if len(branches) != 2 or len(fast) != 1:
      return None
    return fast[0] if routing == "balanced" else 1 - fast[0]

  return pick


def cost_report(
  config: ml_collections.ConfigDict, devices: Sequence[Any], depths: dict | None = None, *, top: int = 8
) -> dict[str, Any]:
  """The step's cost from the compiled TPU programs, op by op (glm_jax/sharding/hlo_cost.py), per layer kind and
  at full depth, for each routing of ROUTINGS: FLOPs, HBM and wire bytes, the serial and the scheduled step time
  (collectives on the slice's torus, overlapped where the program overlaps them), MFU with the useful-work
  numerator (glm_jax/train/flops.py, useful_flops) and, with the realism factor of a calibration against a
  measured run (hlo_cost.CALIBRATION), the calibrated step; and the linearity check.

  depths: compile_depths(config, devices, linearity=True)'s result (compiled here when None)."""
  depths = depths or compile_depths(config, devices, linearity=True)
  model_cfg = model_config_for_stage(config)
  mesh = make_mesh(config.mesh, devices)
  chips = mesh.size
  chip = hlo_cost.Chip.of(_generation(devices), torus_of(list(mesh.devices.flat)))
  peaks = chip.peaks
  b, t, stage = config.data.batch_size, config.data.seq_len, config.train.dsa_stage
  analytic = {
    k: analytic_flops(model_config_for_stage(_shallow(config, *k)), b, t, stage)["total"] / chips
    for k in depths["programs"]
  }
  _, a_dense, a_moe, base = _per_layer(analytic, config)
  full_analytic = analytic_flops(model_cfg, b, t, stage)["total"]
  useful = useful_flops(model_cfg, b, t, stage)["total"]
  calibration = hlo_cost.CALIBRATION
  report: dict[str, Any] = {
    "peaks": dataclasses.asdict(peaks),
    "links": dataclasses.asdict(chip.torus.links),
    "torus": {"dims": chip.torus.dims, "wrap": chip.torus.wrap},
    "chips": chips,
    "useful_flops_per_step": useful,
    "analytic_flops_per_step": full_analytic,
    "calibration": calibration,
    "routings": {},
  }
  for routing in ROUTINGS:
    rows = moe_real_rows(config, mesh, routing)
    ops = {
      k: hlo_cost.program_ops(
        text,
        kernel_model=kernel_model(rows, routing),
        ragged_rows=ragged_model(rows, model_cfg.hidden_size),
        chip=chip,
        branch_model=moe_branch(routing),
      )
      for k, (_, text) in depths["programs"].items()
    }
    sums = {
      k: dict(hlo_cost.summarize(v), scheduled_seconds=hlo_cost.schedule(depths["programs"][k][1], v, chip)["seconds"])
      for k, v in ops.items()
    }
    sub = lambda x, y: {key: x[key] - y[key] for key in x}
    s0, s_dense, s_moe, _ = _per_layer(sums, config, sub)
    rest = {key: s0[key] - base[0] * s_dense[key] - base[1] * s_moe[key] for key in s0}
    step = {
      key: rest[key] + model_cfg.num_dense_layers * s_dense[key] + model_cfg.num_moe_layers * s_moe[key] for key in s0
    }
    tables = {k: hlo_cost.by_source(v) for k, v in ops.items()}

    def layer_top(variant):  # where one more layer's cost goes, largest first
      more, less = tables[variant], tables[base]
      rows_ = {
        key: {
          f: more.get(key, {}).get(f, 0.0) - less.get(key, {}).get(f, 0.0)
          for f in ("flops", "hbm_bytes", "wire_bytes", "seconds")
        }
        for key in set(more) | set(less)
      }
      return [
        dict(op=key, **{f: float(f"{v:.4g}") for f, v in vals.items()})
        for key, vals in sorted(rows_.items(), key=lambda kv: -abs(kv[1]["seconds"]))[:top]
      ]

    seconds = step["scheduled_seconds"]
    entry = {
      "moe_real_rows_per_device": rows,
      "per_device_step": {k: float(f"{v:.4g}") for k, v in step.items()},
      "serial_step_seconds": _sig(step["seconds"]),
      **step_figures(seconds, calibration, useful, chips, b * t, peaks.bf16_flops),
      "compiled_over_analytic_step": round(step["flops"] * chips / full_analytic, 3),
      "compiled_over_useful_step": round(step["flops"] * chips / useful, 3),
      "per_moe_layer": dict(
        {k: float(f"{v:.4g}") for k, v in s_moe.items()},
        analytic_flops=float(f"{a_moe:.4g}"),
        compiled_over_analytic=round(s_moe["flops"] / a_moe, 3) if a_moe else None,
      ),
      "per_dense_layer": dict(
        {k: float(f"{v:.4g}") for k, v in s_dense.items()},
        analytic_flops=float(f"{a_dense:.4g}"),
        compiled_over_analytic=round(s_dense["flops"] / a_dense, 3) if a_dense else None,
      ),
      "top_ops_per_moe_layer": layer_top((base[0], 2)) if base[1] else [],
      "top_ops_per_dense_layer": layer_top((2, base[1])) if base[0] else [],
    }
    extra = [k for k in depths["programs"] if k not in depth_variants(config)]
    if extra:  # linearity: the deeper copy against what the three shallow ones predict
      nd, nm = extra[0]
      predicted = {key: s0[key] + (nd - base[0]) * s_dense[key] + (nm - base[1]) * s_moe[key] for key in s0}
      entry["linearity"] = {
        "variant": f"{nd}+{nm}",
        **{
          f"{key}_rel_error": round(abs(sums[extra[0]][key] - predicted[key]) / max(abs(sums[extra[0]][key]), 1e-30), 5)
          for key in ("flops", "hbm_bytes", "seconds", "scheduled_seconds")
        },
      }
    report["routings"][routing] = entry
  return report


def _generation(devices: Sequence[Any]) -> str:
  kind = devices[0].device_kind
  names = [g.name for g in GENERATIONS.values() if g.device_kind == kind and g.name in hlo_cost.PEAKS]
  if not names:
    raise ValueError(
      f"cost_report: device kind {kind!r} is not a TPU generation with peaks in hlo_cost.PEAKS "
      f"({sorted(hlo_cost.PEAKS)})"
    )
  return names[0]


def step_report(config: ml_collections.ConfigDict, result: CompiledStep, flops: dict | None = None) -> dict[str, Any]:
  """The config's sizes, compile times and FLOPs: analytic (glm_jax/train/flops.py), XLA's for the compiled step
  (loop bodies once) and, given extrapolated_flops' result, the compiled step's at full depth. Memory is the
  caller's (it depends on the device kind)."""
  model_cfg = model_config_for_stage(config)
  counts = param_counts(model_cfg)
  b, t, stage = config.data.batch_size, config.data.seq_len, config.train.dsa_stage
  n_dev = result.mesh.size
  analytic = analytic_flops(model_cfg, b, t, stage)
  trainable = step_lib.is_indexer_param if stage == "warmup" else None
  ns_flops = (
    muon_ns_flops(config.optimizer, result.abstract_params, trainable)[0] if (config.optimizer.name == "muon") else 0.0
  )
  report: dict[str, Any] = {
    "config": config.get("name", "?"),
    "params_total": counts["total"],
    "params_active": counts["active"],
    "params_mtp": counts["mtp"],
    "mesh": {a: int(result.mesh.shape[a]) for a in MESH_AXES},
    "devices": n_dev,
    "batch_size": b,
    "seq_len": t,
    "tokens_per_step": b * t,
    "microbatches": config.train.microbatches,
    "dsa_stage": stage,
    "attention_impl": model_cfg.attention_impl,
    "remat_policy": model_cfg.remat_policy,
    "optimizer": config.optimizer.name,
    "lower_seconds": round(result.lower_seconds, 1),
    "compile_seconds": round(result.compile_seconds, 1),
    "analytic_flops_per_step": analytic["total"],
    "analytic_optimizer_flops_per_step": ns_flops,
  }
  if result.compiled is not None:
    report["xla_flops_per_device_loop_bodies_once"] = compiled_flops(result.compiled)
  if flops is not None:
    report.update(
      {
        "compiled_flops_per_device": flops["per_device"],
        "compiled_flops_per_step": flops["per_device"] * n_dev,
        "compiled_over_analytic": round(flops["per_device"] * n_dev / (analytic["total"] + ns_flops), 3),
        "compiled_flops_source": "XLA cost analysis of unrolled 2- and 3-layer copies, extrapolated to full "
        "depth (aot.extrapolated_flops)",
        "flops_compile_seconds": round(flops["seconds"], 1),
      }
    )
  return report
