"""Ahead-of-time compilation of serving: the real decode step and prefill for a slice, and what fits.

`compile_decode(config, devices, batch_size=B, cache_len=S)` builds what the Sampler runs under a mesh
(glm_jax/inference/sampler.py): the model with its weights in the compute dtype (as served: model.dtype, not the
training state's fp32), laid out by their logical axes over config.mesh; the cache [L, B, S, W] with its rows over
the batch axes; GlmMoeDsa.decode (one token a row against the cache, the cache donated and written in place) and
GlmMoeDsa.prefill (prefill_len tokens a row). Everything is abstract, so with devices from
glm_jax.sharding.topology.tpu_topology_devices it is XLA:TPU's compile for a slice on a machine without a TPU.
`decode_report` gives launch/compile.py --decode's JSON: per-chip bytes (weights and cache apart), the cache that
still fits, and a roofline time a token from the compiled program's ops (glm_jax/sharding/hlo_cost.py).
With speculate=k it also compiles a speculative round's programs (glm_jax/inference/speculative.py): the main model's
verification of k + 1 tokens a row (GlmMoeDsa.decode_tokens), one MTP draft step and the MTP layer's rewrite of k
slots, with the MTP layer's cache beside the main one; the report gives a round's roofline time and the acceptance
length above which speculation beats plain decoding (a round's time over a decode step's).
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

from glm_jax.inference import speculative
from glm_jax.inference.sampler import batch_rows, check_heads
from glm_jax.mesh_axes import MESH_AXES
from glm_jax.model import GlmMoeDsa, ModelConfig, param_counts
from glm_jax.model.kv_cache import KVCache, LayerCache
from glm_jax.model.layers import dtype_of
from glm_jax.model.platform import target_platform
from glm_jax.sharding import hlo_cost, topology
from glm_jax.sharding.mesh import make_mesh
from glm_jax.sharding.state import weight_shardings, with_shardings


@dataclasses.dataclass
class CompiledServing:
  decode: Any  # jax.stages.Compiled or None (error says why)
  prefill: Any  # jax.stages.Compiled, None when prefill_len is 0 or it failed
  errors: dict[str, str]
  mesh: jax.sharding.Mesh
  model_cfg: ModelConfig
  batch_size: int
  cache_len: int
  prefill_len: int
  weight_bytes_per_chip: int  # the parameters' shards one chip holds
  cache_bytes_per_chip: int  # the cache's rows one chip holds
  seconds: dict[str, float]
  speculate: int = 0
  rounds: dict[str, Any] = dataclasses.field(default_factory=dict)  # "verify", "draft", "rewrite": compiled or None


def serving_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The model as served: the config's model with its weights in the compute dtype and no rematerialization."""
  cfg = ModelConfig.from_dict(config.model)
  return cfg.replace(param_dtype=cfg.dtype, remat_policy="none")


def chip_bytes(tree) -> int:
  """Bytes one chip holds of an abstract tree whose leaves carry shardings (the first device's shard of each)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shard = x.sharding.shard_shape(x.shape)
    total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
  return total


def abstract_cache(cfg: ModelConfig, batch: int, cache_len: int, sharding, mtp_sharding=None) -> KVCache:
  """The decode cache of `batch` rows and `cache_len` slots (kv_cache.py's layout), abstract, in `sharding`; with
  mtp_sharding, the MTP layer's [B, S, W] cache too (speculative decoding)."""
  dt = dtype_of(cfg.dtype)

  def stack(lead, shard):
    index_k = (
      jax.ShapeDtypeStruct((*lead, batch, cache_len, cfg.index_head_dim), dt, sharding=shard) if cfg.use_dsa else None
    )
    return LayerCache(
      kv=jax.ShapeDtypeStruct((*lead, batch, cache_len, cfg.kv_latent_dim), dt, sharding=shard), index_k=index_k
    )

  return KVCache(
    dense=stack((cfg.num_dense_layers,), sharding) if cfg.num_dense_layers else None,
    moe=stack((cfg.num_moe_layers,), sharding) if cfg.num_moe_layers else None,
    mtp=None if mtp_sharding is None else stack((), mtp_sharding),
  )


def compile_decode(
  config: ml_collections.ConfigDict,
  devices: Sequence[Any],
  *,
  batch_size: int,
  cache_len: int,
  prefill_len: int = 0,
  speculate: int = 0,
) -> CompiledServing:
  """Compiles the decode step (and, with prefill_len > 0, the prefill of prefill_len tokens a row; with speculate=k,
  a speculative round's programs: module docstring) for config.mesh over `devices`. Bad sizes (a cache past
  max_position_embeddings, a batch or head count the mesh does not divide, a prefill longer than the cache, k < 0
  or a model without an MTP layer) raise ValueError before compiling; a compile that fails (the program does not
  fit) comes back with None and XLA's message in errors."""
  cfg = serving_config(config)
  if speculate:
    try:
      speculative.check(cfg, speculate)
    except ValueError as e:
      raise ValueError(f"--{e}") from e
  for name, v in (("batch_size", batch_size), ("cache_len", cache_len)):
    if not isinstance(v, int) or v <= 0:
      raise ValueError(f"--{name}={v!r}; a positive integer")
  if cache_len > cfg.max_position_embeddings:
    raise ValueError(f"--cache_len={cache_len} exceeds model.max_position_embeddings={cfg.max_position_embeddings}")
  if not 0 <= prefill_len <= cache_len:
    raise ValueError(f"--prefill_len={prefill_len}; in [0, cache_len={cache_len}]")
  mesh = make_mesh(config.mesh, devices)
  check_heads(cfg, mesh)
  batch = batch_rows(mesh, batch_size)
  model = nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  weights = with_shardings((params, rest), weight_shardings(params, rest, mesh))
  rows, cache_rows = NamedSharding(mesh, P(batch or None)), NamedSharding(mesh, P(None, batch or None))
  mtp_rows = NamedSharding(mesh, P(batch or None)) if speculate else None
  cache = abstract_cache(cfg, batch_size, cache_len, cache_rows, mtp_rows)
  vocab = NamedSharding(mesh, P(batch or None, None))

  def decode(params, rest, token_B, pos_B, cache):
    return nnx.merge(graphdef, params, rest).decode(token_B, pos_B, cache)

  def prefill(params, rest, prompts_BT):
    logits, cache = nnx.merge(graphdef, params, rest).prefill(prompts_BT, cache_len)
    return logits[:, -1], jax.lax.with_sharding_constraint(cache, cache_rows)

  token = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=rows)
  programs = {
    "decode": (jax.jit(decode, donate_argnums=(4,), out_shardings=(vocab, cache_rows)), (*weights, token, token, cache))
  }
  if prefill_len:
    prompts = jax.ShapeDtypeStruct((batch_size, prefill_len), jnp.int32, sharding=rows)
    programs["prefill"] = (jax.jit(prefill, out_shardings=(vocab, cache_rows)), (*weights, prompts))
  if speculate:  # a round: k draft steps (one token), the verification (k + 1 tokens), the MTP rewrite (k tokens)

    def verify(params, rest, tokens_BT, pos_B, cache):
      logits, h, cache = nnx.merge(graphdef, params, rest).decode_tokens(tokens_BT, pos_B, cache)
      return logits, h, cache

    def draft(params, rest, h_BTD, tokens_BT, pos_B, cache):
      return nnx.merge(graphdef, params, rest).draft(h_BTD, tokens_BT, pos_B, cache)

    def tokens(t):
      return jax.ShapeDtypeStruct((batch_size, t), jnp.int32, sharding=rows)

    def hidden(t):
      return jax.ShapeDtypeStruct((batch_size, t, cfg.hidden_size), dtype_of(cfg.dtype), sharding=rows)

    programs["verify"] = (jax.jit(verify, donate_argnums=(4,)), (*weights, tokens(speculate + 1), token, cache))
    programs["draft"] = (jax.jit(draft, donate_argnums=(5,)), (*weights, hidden(1), tokens(1), token, cache))
    programs["rewrite"] = (
      jax.jit(draft, donate_argnums=(5,)),
      (*weights, hidden(speculate), tokens(speculate), token, cache),
    )
  compiled, errors, seconds = {}, {}, {}
  for name, (fn, args) in programs.items():
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), target_platform(devices[0].platform):
      lowered = fn.lower(*args)
    try:
      compiled[name] = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      errors[name] = str(e)
    seconds[name] = time.perf_counter() - t0
  return CompiledServing(
    compiled.get("decode"),
    compiled.get("prefill"),
    errors,
    mesh,
    cfg,
    batch_size,
    cache_len,
    prefill_len,
    chip_bytes(weights),
    chip_bytes(cache),
    seconds,
    speculate,
    {name: compiled.get(name) for name in ("verify", "draft", "rewrite") if speculate},
  )


def decode_report(result: CompiledServing, usable_bytes: int) -> dict[str, Any]:
  """launch/compile.py --decode's report: sizes, per-chip bytes of each program, the cache that fits beside the
  decode step, and the decode step's roofline time a token from its compiled ops (TPU devices: their peaks)."""
  cfg, b, s = result.model_cfg, result.batch_size, result.cache_len
  counts = param_counts(cfg)
  report: dict[str, Any] = {
    "params_total": counts["total"],
    "params_active": counts["active"],
    "weights_dtype": cfg.param_dtype,
    "mesh": {a: int(result.mesh.shape[a]) for a in MESH_AXES},
    "devices": result.mesh.size,
    "batch_size": b,
    "cache_len": s,
    "prefill_len": result.prefill_len,
    "dsa_selects": cfg.dsa_selects(s),
    "attention_impl": cfg.attention_impl,
    "weights_bytes_per_chip": result.weight_bytes_per_chip,
    "cache_bytes_per_chip": result.cache_bytes_per_chip,
    "compile_seconds": {k: round(v, 1) for k, v in result.seconds.items()},
  }
  fits = True
  for name in ("decode", "prefill", *result.rounds):
    compiled = result.rounds[name] if name in result.rounds else getattr(result, name)
    if compiled is None:
      if name in result.errors:
        fits = False
        report[f"{name}_error"] = result.errors[name].strip().splitlines()[0][:2000]
      continue
    mem = topology.compiled_memory(compiled)
    report[f"{name}_per_chip_bytes"] = {
      k: mem[k] for k in ("arguments", "outputs", "temporaries", "generated_code", "aliased", "total", "peak")
    }
    fits &= mem["total"] <= usable_bytes and mem["peak"] <= usable_bytes
  report["fits"] = fits
  if result.decode is not None:
    mem = topology.compiled_memory(result.decode)
    # The cache is the only operand that grows with batch x cache_len: the room left beside everything else holds
    # this many more cache slots a chip (an estimate: the step's temporaries are taken as fixed).
    slot_bytes = result.cache_bytes_per_chip / (b * s)
    spare = usable_bytes - max(mem["total"], mem["peak"])
    report["hbm_headroom_bytes"] = spare
    report["max_cache_len_at_batch"] = int(s + spare / slot_bytes / b) if spare > 0 else None
    report["max_batch_at_cache_len"] = int(b + spare / slot_bytes / s) if spare > 0 else None
    device = next(iter(result.mesh.devices.flat))
    gen = topology.generation_of(device) if device.platform == "tpu" else None
    if gen in hlo_cost.PEAKS:
      chip = hlo_cost.Chip.of(gen, topology.torus_of(list(result.mesh.devices.flat)))
      peaks = chip.peaks
      step = hlo_cost.program_time(result.decode.as_text(), chip)
      report["decode_step"] = {
        k: step[k]
        for k in (
          "flops",
          "hbm_bytes",
          "wire_bytes",
          "compute_seconds",
          "collective_seconds",
          "seconds",
          "scheduled_seconds",
        )
      }
      seconds = step["scheduled_seconds"]
      report["roofline_ms_per_token"] = round(seconds * 1e3, 3)  # each row gets one token a step
      report["serial_ms_per_token"] = round(step["seconds"] * 1e3, 3)
      if hlo_cost.CALIBRATION:  # measured on a training step; decoding's ops are smaller
        report["calibrated_ms_per_token"] = round(seconds * hlo_cost.CALIBRATION["realism_factor"] * 1e3, 3)
      report["tokens_per_s"] = round(b / seconds, 1)
      report["weights_and_cache_read_ms"] = round(
        (result.weight_bytes_per_chip + result.cache_bytes_per_chip) / peaks.hbm_bytes_per_s * 1e3, 3
      )
      report["peaks_source"] = peaks.source
      if result.rounds and all(result.rounds.values()):
        k = result.speculate
        secs = {
          name: hlo_cost.program_time(c.as_text(), chip)["scheduled_seconds"] for name, c in result.rounds.items()
        }
        round_s = secs["verify"] + k * secs["draft"] + secs["rewrite"]
        report["speculative"] = {
          "k": k,
          **{f"{name}_ms": round(v * 1e3, 4) for name, v in secs.items()},
          "round_ms": round(round_s * 1e3, 4),
          # A round makes (acceptance length) tokens a row; plain decoding one a step.
          "break_even_acceptance_length": round(round_s / seconds, 3),
          "tokens_per_s_per_unit_acceptance_length": round(b / round_s, 1),
        }
  return report
