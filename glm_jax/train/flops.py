"""FLOP counts of a training step: analytic (from the model config) and read from XLA's optimized HLO.

The formulas are written out in experiments/bench_train_step.py's docstring; in short, training costs
6 N P (N tokens, P matmul parameters a token passes through) plus the attention scores, with the DSA stages
(warmup: forward-only main model + indexer; sparse: attention over index_topk keys + the indexer) and Muon's
Newton-Schulz reported apart.

`hlo_dot_flops` reads the dots and convolutions of an optimized HLO module (jax.stages.Compiled.as_text()) and
multiplies a while body's by its known trip count, which XLA's own cost_analysis() does not (it counts a scanned layer
stack's body once). On an SPMD-partitioned program the figures are per device.
"""

from __future__ import annotations

import collections
import math
import re

import jax

from glm_jax.model import ModelConfig
from glm_jax.sharding import hlo_cost
from glm_jax.train.optimizer_config import checked_optimizer_config
from glm_jax.train.param_plan import leaf_plan, matrix_axes
from glm_jax.tree_paths import path_names


def matmul_params(cfg: ModelConfig) -> dict[str, int]:
  """Matmul parameters one token passes through, per component (see the module docstring)."""
  d, h = cfg.hidden_size, cfg.num_attention_heads
  p_attn = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim + d * cfg.kv_latent_dim
            + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d)
  p_mlp = 3 * d * cfg.intermediate_size
  expert = 3 * d * cfg.moe_intermediate_size
  p_moe = d * cfg.n_routed_experts + expert * cfg.n_shared_experts + expert * cfg.num_experts_per_tok
  p_head = d * cfg.vocab_size
  p_idx = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim + d * cfg.index_n_heads
  n_mtp = cfg.num_nextn_predict_layers
  mtp_moe = [cfg.num_hidden_layers + k >= cfg.first_k_dense_replace for k in range(n_mtp)]
  p_main = cfg.num_hidden_layers * p_attn + cfg.num_dense_layers * p_mlp + cfg.num_moe_layers * p_moe + p_head
  p_mtp = sum(2 * d * d + p_attn + (p_moe if moe else p_mlp) + p_head for moe in mtp_moe)
  return {"attn_per_layer": p_attn, "dense_mlp_per_layer": p_mlp, "moe_active_per_layer": p_moe,
          "head": p_head, "indexer_per_layer": p_idx, "main": p_main, "mtp": p_mtp,
          "moe_layers_incl_mtp": cfg.num_moe_layers + sum(mtp_moe), "routed_expert": expert}


def analytic_flops(cfg: ModelConfig, b: int, t: int, stage: str) -> dict[str, float]:
  """Training FLOPs of one step by the formulas of the module docstring, with their parts."""
  p = matmul_params(cfg)
  n = b * t
  h, layers, n_mtp = cfg.num_attention_heads, cfg.num_hidden_layers, cfg.num_nextn_predict_layers
  a_dense = 2 * b * h * t * t * cfg.qk_head_dim + 2 * b * h * t * t * cfg.v_head_dim
  a_sparse = (2 * b * t * h * cfg.index_topk * cfg.kv_latent_dim + 2 * b * t * h * cfg.index_topk * cfg.kv_lora_rank)
  a_idx = 2 * b * t * t * cfg.index_n_heads * cfg.index_head_dim + 2 * b * t * t * cfg.index_n_heads
  out: dict[str, float] = {}
  if stage == "dense":
    out["params_main"] = 6 * n * p["main"]
    out["params_mtp"] = 6 * n * p["mtp"]
    out["attention"] = 3 * a_dense * (layers + n_mtp)
    out["attention_causal_half_flops"] = out["attention"] / 2
  elif stage == "warmup":
    out["params_main_forward_only"] = 2 * n * p["main"]
    out["params_mtp_forward_only"] = 2 * n * p["mtp"]
    out["attention_forward_only"] = a_dense * (layers + n_mtp)
    out["attention_causal_half_flops"] = out["attention_forward_only"] / 2
    out["indexer_projections"] = 4 * n * p["indexer_per_layer"] * layers
    out["indexer_scores"] = 3 * a_idx * layers
  elif stage == "sparse":
    out["params_main"] = 6 * n * p["main"]
    out["params_mtp"] = 6 * n * p["mtp"]
    out["attention_sparse"] = 3 * a_sparse * (layers + n_mtp)
    out["indexer_projections"] = 4 * n * p["indexer_per_layer"] * layers + 2 * n * p["indexer_per_layer"] * n_mtp
    out["indexer_scores"] = 3 * a_idx * layers + a_idx * n_mtp
  else:
    raise ValueError(f"dsa_stage={stage!r}")
  out["total"] = sum(v for k, v in out.items() if k != "attention_causal_half_flops")
  return out


def ragged_dot_extra_flops(cfg: ModelConfig, b: int, t: int, stage: str) -> float:
  """FLOPs the CPU lowering of ragged_dot adds: every routed row against all E experts, not just its own."""
  p = matmul_params(cfg)
  passes = 2 if stage == "warmup" else 6  # forward only in the warm-up stage (the model is frozen there)
  return (passes * b * t * cfg.num_experts_per_tok * p["routed_expert"] * (cfg.n_routed_experts - 1)
          * p["moe_layers_incl_mtp"])


def muon_ns_flops(opt_cfg, params, trainable) -> tuple[float, int]:
  """(Newton-Schulz FLOPs of one optimizer step, number of matrices orthogonalized)."""
  plan = leaf_plan(opt_cfg, params, trainable=trainable)
  steps = int(checked_optimizer_config(opt_cfg).muon_ns_steps)
  shapes = {path_names(path): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(params)}
  total, count = 0.0, 0
  for names, lp in plan.items():
    if lp.label != "muon":
      continue
    shape = shapes[names]
    parts = [shape[:-1] + (s,) for s in lp.split_sizes] if lp.split_sizes else [shape]
    for part, dims in zip(parts, lp.muon_dims):
      red, outp = matrix_axes(dims, len(part))
      m = math.prod(part[a] for a in red)
      n = math.prod(part[a] for a in outp)
      batch = math.prod(part) // (m * n)
      lo, hi = min(m, n), max(m, n)
      total += batch * steps * (4 * lo * lo * hi + 2 * lo ** 3)
      count += batch
  return total, count


# ----------------------------------------------------------------------------------------------- HLO dots

_TRIP_RE = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _phase(op_name: str) -> str:
  if "transpose(jvp" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  if "vmap(" in op_name:
    return "optimizer"
  return "no_op_name" if not op_name else "other"


def hlo_dot_flops(hlo_text: str) -> dict:
  """Dot and convolution FLOPs of an optimized HLO module (glm_jax/sharding/hlo_cost.py reads them), every
  computation times how often it runs: a while body times its known trip count; split by phase."""
  comps, entry, by_name = hlo_cost.parse_module(hlo_text)
  runs: dict[str, int] = collections.defaultdict(int)
  unknown_trip = 0

  def visit(comp: str, mult: int):
    nonlocal unknown_trip
    runs[comp] += mult
    for ins in comps.get(comp, ()):
      m = 1
      if ins.opcode == "while":
        trip = _TRIP_RE.search(ins.attrs)
        m = int(trip.group(1)) if trip else 1
        unknown_trip += trip is None
      for callee in hlo_cost.called_computations(ins):
        visit(callee, mult * m)

  visit(entry, 1)
  by_phase, top = collections.Counter(), collections.Counter()
  for comp, mult in runs.items():
    for ins in comps.get(comp, ()):
      flops = hlo_cost.matmul_flops(ins, by_name) * mult
      if flops:
        op_name = hlo_cost.op_name(ins)
        shapes = [by_name[o].shapes[0][1] if o in by_name and by_name[o].shapes else None for o in ins.operands[:2]]
        short = re.sub(r"(while/body/|closed_call/|jit\(step\)/)", "", op_name)
        by_phase[_phase(op_name)] += flops
        top[(_phase(op_name), str(shapes[0]), str(shapes[1]), str(ins.shapes[0][1]), short)] += flops
  return {"total": float(sum(by_phase.values())), "by_phase": {k: float(v) for k, v in sorted(by_phase.items())},
          "while_loops": hlo_text.count(" while("), "while_loops_without_trip_count": unknown_trip, "top": top}
