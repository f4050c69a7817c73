"""Ahead-of-time compilation of the serving engine for a slice: its decode and chunked-prefill steps, and what fits.

`compile_engine(config, devices, engine)` builds what `Engine(..., mesh=...)` runs (glm_jax/serving/engine.py): the
model with its weights in the compute dtype laid out by their logical axes over config.mesh (the Sampler's serving
layout, glm_jax/inference/aot.py), the page pool [L, num_pages, page_size, W] with its pages split over the batch
axes like the requests' rows, and the engine's programs as it runs them, the pool donated and written in place: the
decode program (`compiled_decode`: decode_steps steps of [max_running, 1] tokens in one call, each the paged decode
over each row's own pages) and the prefill step (`compiled_step`, [prefill_rows, prefill_chunk]). Everything is
abstract, so with devices from glm_jax.sharding.topology.tpu_topology_devices it is XLA:TPU's compile for a slice on
a machine without a TPU.
With engine.speculate = k the decode program is a speculative round ([max_running, k + 1] tokens, the MTP layer's
drafts and its paged cache included). `engine_report` gives launch/compile.py --serve's JSON: per-chip bytes of the
weights and the pool, each program's memory analysis, `fits`, the tokens the pool holds, and each step's roofline
time from its compiled ops (glm_jax/sharding/hlo_cost.py; the grouped matmuls as their grids run for the step's tokens,
evenly routed, as launch/compile.py --flops costs a training step's).
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
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glm_jax.inference.aot import chip_bytes, serving_config
from glm_jax.mesh_axes import MESH_AXES
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model.platform import target_platform
from glm_jax.serving import paged_cache
from glm_jax.serving.engine import EngineConfig, batch_axes, compiled_decode, compiled_round, compiled_step
from glm_jax.sharding import hlo_cost, topology
from glm_jax.sharding.mesh import make_mesh
from glm_jax.sharding.state import weight_shardings, with_shardings
from glm_jax.train import aot as train_aot


@dataclasses.dataclass
class CompiledEngine:
  programs: dict[str, Any]  # "decode", "prefill": jax.stages.Compiled, or None when it failed (errors says why)
  errors: dict[str, str]
  mesh: jax.sharding.Mesh
  model_cfg: ModelConfig
  engine: EngineConfig
  shards: int  # the batch shards that split the rows and the pages
  weight_bytes_per_chip: int
  pool_bytes_per_chip: int
  seconds: dict[str, float]


def compile_engine(config: ml_collections.ConfigDict, devices: Sequence[Any], engine: EngineConfig) -> CompiledEngine:
  """Compiles the engine's decode and prefill steps for config.mesh over `devices`. Bad sizes (engine fields, sizes
  the mesh does not divide) raise ValueError before compiling; a compile that fails (the program does not fit)
  comes back as None with XLA's message in errors."""
  cfg = serving_config(config)
  engine.check(cfg)
  mesh = make_mesh(config.mesh, devices)
  axes = batch_axes(mesh, cfg, engine)
  model = nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  weights = with_shardings((params, rest), weight_shardings(params, rest, mesh))
  pages = NamedSharding(mesh, P(None, axes or None))
  pool = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=pages),
    jax.eval_shape(lambda: paged_cache.empty_pool(cfg, engine.num_pages, engine.page_size, mtp=engine.speculate > 0)),
  )
  rows = NamedSharding(mesh, P(axes or None))
  i32, f32 = jnp.int32, jnp.float32

  def arr(shape, dtype=i32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=rows)

  def sampling(r: int):  # page tables, temperatures, top_p, seeds
    return arr((r, engine.table_width)), arr((r,), f32), arr((r,), f32), arr((r,))

  def step(r: int, t: int):  # tokens, positions, tokens fed a row, ..., the token after them
    return compiled_step(graphdef), (arr((r, t)), arr((r,)), arr((r,)), *sampling(r), arr((r,)))

  r = engine.max_running
  programs = {  # the decode program: decode_steps steps a call (last tokens, slots, 1 for a live row, ...)
    "decode": (compiled_decode(graphdef, engine.decode_steps), (arr((r,)), arr((r,)), arr((r,)), *sampling(r))),
    "prefill": step(engine.prefill_rows, engine.prefill_chunk),
  }
  if engine.speculate:  # decoding rows run speculative rounds: next tokens, slots, hidden states, ...
    hidden = arr((r, cfg.hidden_size), f32)
    programs["decode"] = (compiled_round(graphdef, engine.speculate), (arr((r,)), arr((r,)), hidden, *sampling(r)))
  compiled, errors, seconds = {}, {}, {}
  for name, (fn, operands) in programs.items():
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), target_platform(devices[0].platform):
      lowered = fn.lower(*weights, pool, *operands)
    try:
      compiled[name] = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      compiled[name], errors[name] = None, str(e)
    seconds[name] = time.perf_counter() - t0
  shards = math.prod(mesh.shape[a] for a in axes)
  return CompiledEngine(compiled, errors, mesh, cfg, engine, shards, chip_bytes(weights), chip_bytes(pool), seconds)


def engine_report(result: CompiledEngine, usable_bytes: int) -> dict[str, Any]:
  """launch/compile.py --serve's report (module docstring)."""
  e, mesh = result.engine, result.mesh
  report: dict[str, Any] = {
    "mesh": {a: int(mesh.shape[a]) for a in MESH_AXES},
    "devices": mesh.size,
    "engine": dataclasses.asdict(e),
    "batch_shards": result.shards,
    "pool_tokens": (e.num_pages - result.shards) * e.page_size,  # a scratch page a shard
    "max_running": e.max_running,
    "weights_dtype": result.model_cfg.param_dtype,
    "weights_bytes_per_chip": result.weight_bytes_per_chip,
    "pool_bytes_per_chip": result.pool_bytes_per_chip,
    "compile_seconds": {k: round(v, 1) for k, v in result.seconds.items()},
  }
  fits = True
  device = next(iter(mesh.devices.flat))
  gen = topology.generation_of(device) if device.platform == "tpu" else None
  chip = hlo_cost.Chip.of(gen, topology.torus_of(list(mesh.devices.flat))) if gen in hlo_cost.PEAKS else None
  for name, program in result.programs.items():
    if program is None:
      fits = False
      report[f"{name}_error"] = result.errors[name].strip().splitlines()[0][:2000]
      continue
    mem = topology.compiled_memory(program)
    report[f"{name}_per_chip_bytes"] = {
      k: mem[k] for k in ("arguments", "outputs", "temporaries", "aliased", "total", "peak")
    }
    fits &= mem["total"] <= usable_bytes and mem["peak"] <= usable_bytes
    if chip is not None:
      # megablox's calls as their grids run for the step's real rows (their declared cost is the whole static buffer,
      # the worst case), evenly routed; the ragged all-to-alls move those rows (train/aot.py's models, as for a step)
      # (a grouped matmul's call: one step's tokens; hlo_cost counts a call in the decode program's loop per step)
      tokens = e.max_running * (e.speculate + 1) if name == "decode" else e.prefill_rows * e.prefill_chunk
      rows = tokens // result.shards * result.model_cfg.num_experts_per_tok
      step = hlo_cost.program_time(
        program.as_text(),
        chip,
        kernel_model=train_aot.kernel_model(rows, "balanced"),
        ragged_rows=train_aot.ragged_model(rows, result.model_cfg.hidden_size),
      )
      report[f"{name}_step_ms"] = round(step["scheduled_seconds"] * 1e3, 3)
      report[f"{name}_step_hbm_bytes"] = step["hbm_bytes"]
  report["fits"] = fits
  if "decode_step_ms" in report:  # a call of the decode program: decode_steps tokens a request (a round: at least 1)
    per_call = 1 if e.speculate else e.decode_steps
    report["decode_tokens_per_s"] = round(e.max_running * per_call / (report["decode_step_ms"] / 1e3), 1)
  if "prefill_step_ms" in report:
    report["prefill_tokens_per_s"] = round(e.prefill_rows * e.prefill_chunk / (report["prefill_step_ms"] / 1e3), 1)
  return report
