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
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from glm_jax.model import param_counts
from glm_jax.model.platform import target_platform
from glm_jax.sharding.mesh import MESH_AXES, batch_sharding, make_mesh
from glm_jax.sharding.state import abstract_sharded
from glm_jax.sharding.topology import compiled_flops
from glm_jax.train import step as step_lib, trainer
from glm_jax.train.config import model_config_for_stage, require_sections, validate_train_config
from glm_jax.train.flops import analytic_flops, muon_ns_flops


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


def compile_train_step(config: ml_collections.ConfigDict, devices: Sequence[Any], *, unrolled: bool = False
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
  data_sharding = batch_sharding(mesh)
  b, t = config.data.batch_size, config.data.seq_len
  batch_shards = math.prod(mesh.shape[a] for a in data_sharding.spec[0])
  if b % (batch_shards * config.train.microbatches):
    raise ValueError(f"data.batch_size={b} must be divisible by train.microbatches={config.train.microbatches} "
                     f"x the {batch_shards} batch shards of mesh {dict(mesh.shape)} (axes {data_sharding.spec[0]})")

  make_state, built = trainer.train_state_factory(config, model_cfg)
  abstract_state, shardings = abstract_sharded(make_state, lambda s: s.params, mesh)
  train_step = step_lib.make_train_step(built["graphdef"], built["optimizer"], built["schedule"], config.train,
                                        state_shardings=shardings, batch_sharding=data_sharding,
                                        unroll_microbatches=unrolled)
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=data_sharding)
           for k in ("input_ids", "segment_ids", "positions")}
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
  return CompiledStep(lowered, compiled, error, mesh, lower_seconds, time.perf_counter() - t0,
                      abstract_state.params)


def extrapolated_flops(config: ml_collections.ConfigDict, devices: Sequence[Any]) -> dict[str, Any]:
  """XLA's FLOPs per device of the full-depth step, from fully unrolled compiles of shallow copies.

  XLA's cost analysis counts a while body once, so the scanned step's own figure misses all but one layer of
  each stack. Unrolling glm5_744b's 78 layers would make the compile minutes long; instead the step is compiled
  unrolled with (dense, MoE) layer counts (1, 1), (2, 1) and (1, 2) (one stack at a time when the model has
  only one kind), and, FLOPs being c + n_dense * a + n_moe * b for the same widths, mesh and batch, the full
  depth's count is c + N_dense * a + N_moe * b. Exact up to work that is not linear in depth: the optimizer's
  padding of the Muon matrix stacks to the device count (see glm_jax/train/muon.py: orthogonalize), and the few elementwise
  ops XLA fuses or folds differently at another depth (2.7e-4 of the count for a 4-layer tiny model with AdamW,
  tests/train/test_aot.py).
  """
  model_cfg = model_config_for_stage(config)
  n_dense, n_moe = model_cfg.num_dense_layers, model_cfg.num_moe_layers
  base = (min(n_dense, 1), min(n_moe, 1))
  variants = [base] + [tuple(b + (i == j) for j, b in enumerate(base)) for i in range(2) if base[i]]
  t0 = time.perf_counter()
  flops = {}
  for nd, nm in variants:
    shallow = config.copy_and_resolve_references()
    shallow.model.num_hidden_layers = nd + nm
    shallow.model.first_k_dense_replace = nd
    result = compile_train_step(shallow, devices, unrolled=True)
    if result.compiled is None:
      raise RuntimeError(f"the unrolled {nd}+{nm}-layer copy did not compile: {result.error}")
    flops[(nd, nm)] = compiled_flops(result.compiled)
  f0 = flops[base]
  per_dense = flops[(2, base[1])] - f0 if base[0] else 0.0
  per_moe = flops[(base[0], 2)] - f0 if base[1] else 0.0
  rest = f0 - base[0] * per_dense - base[1] * per_moe
  return {"per_device": rest + n_dense * per_dense + n_moe * per_moe, "per_dense_layer": per_dense,
          "per_moe_layer": per_moe, "outside_layers": rest, "seconds": time.perf_counter() - t0}


def step_report(config: ml_collections.ConfigDict, result: CompiledStep, flops: dict | None = None
                ) -> dict[str, Any]:
  """The config's sizes, compile times and FLOPs: analytic (glm_jax/train/flops.py), XLA's for the compiled step
  (loop bodies once) and, given extrapolated_flops' result, the compiled step's at full depth. Memory is the
  caller's (it depends on the device kind)."""
  model_cfg = model_config_for_stage(config)
  counts = param_counts(model_cfg)
  b, t, stage = config.data.batch_size, config.data.seq_len, config.train.dsa_stage
  n_dev = result.mesh.size
  analytic = analytic_flops(model_cfg, b, t, stage)
  trainable = step_lib.is_indexer_param if stage == "warmup" else None
  ns_flops = muon_ns_flops(config.optimizer, result.abstract_params, trainable)[0] if (
      config.optimizer.name == "muon") else 0.0
  report: dict[str, Any] = {
      "config": config.get("name", "?"),
      "params_total": counts["total"], "params_active": counts["active"], "params_mtp": counts["mtp"],
      "mesh": {a: int(result.mesh.shape[a]) for a in MESH_AXES},
      "devices": n_dev,
      "batch_size": b, "seq_len": t, "tokens_per_step": b * t, "microbatches": config.train.microbatches,
      "dsa_stage": stage, "attention_impl": model_cfg.attention_impl, "remat_policy": model_cfg.remat_policy,
      "optimizer": config.optimizer.name,
      "lower_seconds": round(result.lower_seconds, 1),
      "compile_seconds": round(result.compile_seconds, 1),
      "analytic_flops_per_step": analytic["total"],
      "analytic_optimizer_flops_per_step": ns_flops,
  }
  if result.compiled is not None:
    report["xla_flops_per_device_loop_bodies_once"] = compiled_flops(result.compiled)
  if flops is not None:
    report.update({
        "compiled_flops_per_device": flops["per_device"],
        "compiled_flops_per_step": flops["per_device"] * n_dev,
        "compiled_over_analytic": round(flops["per_device"] * n_dev / (analytic["total"] + ns_flops), 3),
        "compiled_flops_source": "XLA cost analysis of unrolled 2- and 3-layer copies, extrapolated to full "
                                 "depth (aot.extrapolated_flops)",
        "flops_compile_seconds": round(flops["seconds"], 1),
    })
  return report
