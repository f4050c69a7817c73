"""FLOP counts of a training step: analytic (from the model config) and read from XLA's optimized HLO.

The formulas are written out in docs/training.md, "The FLOP count of a training step"; in short, training costs
6 N P (N tokens, P matmul parameters a token passes through) plus the attention scores, with the DSA stages
(warmup: forward-only main model + indexer; sparse: attention over index_topk keys + the indexer) and Muon's
Newton-Schulz reported apart. That count follows the reference implementation (attention over the full T x T
scores, the indexer's backward over every score), to set against XLA's; `useful_flops` is the numerator for MFU:
only the work a training step needs, whatever the implementation (causal attention, top-k pairs, no
recomputation; its docstring gives the rules).

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
  """Matmul parameters one token passes through, per component (docs/training.md, "The FLOP count of a training
  step")."""
  d, h = cfg.hidden_size, cfg.num_attention_heads
  p_attn = (
    d * cfg.q_lora_rank
    + cfg.q_lora_rank * h * cfg.qk_head_dim
    + d * cfg.kv_latent_dim
    + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    + h * cfg.v_head_dim * d
  )
  p_mlp = 3 * d * cfg.intermediate_size
  expert = 3 * d * cfg.moe_intermediate_size
  p_moe = d * cfg.n_routed_experts + expert * cfg.n_shared_experts + expert * cfg.num_experts_per_tok
  p_head = d * cfg.vocab_size
  p_idx = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim + d * cfg.index_n_heads
  n_mtp = cfg.num_nextn_predict_layers
  mtp_moe = [cfg.num_hidden_layers + k >= cfg.first_k_dense_replace for k in range(n_mtp)]
  p_main = cfg.num_hidden_layers * p_attn + cfg.num_dense_layers * p_mlp + cfg.num_moe_layers * p_moe + p_head
  p_mtp = sum(2 * d * d + p_attn + (p_moe if moe else p_mlp) + p_head for moe in mtp_moe)
  return {
    "attn_per_layer": p_attn,
    "dense_mlp_per_layer": p_mlp,
    "moe_active_per_layer": p_moe,
    "head": p_head,
    "indexer_per_layer": p_idx,
    "main": p_main,
    "mtp": p_mtp,
    "moe_layers_incl_mtp": cfg.num_moe_layers + sum(mtp_moe),
    "routed_expert": expert,
  }


def pair_flops(cfg: ModelConfig) -> dict[str, int]:
  """Forward FLOPs of one (query, key) pair in one layer:
  dense   = 2 H (d_n + d_r) + 2 H d_v             MHA form: q . k per head, then p . v
  sparse  = 2 H (R_kv + d_r) + 2 H R_kv            absorbed form: q~ . [c_kv ; k_rope] per head, then p . c_kv
  indexer = 2 H_I d_I + 2 H_I                      q_I . k_I per indexer head, then the w-weighted sum"""
  h, hi = cfg.num_attention_heads, cfg.index_n_heads
  return {
    "dense": 2 * h * (cfg.qk_head_dim + cfg.v_head_dim),
    "sparse": 2 * h * (cfg.kv_latent_dim + cfg.kv_lora_rank),
    "indexer": 2 * hi * cfg.index_head_dim + 2 * hi,
  }


def causal_pairs(t: int) -> int:
  """(query, key) pairs of a causal sequence of t tokens: query i sees keys 0..i, sum_{i<t} (i + 1)."""
  return t * (t + 1) // 2


def topk_pairs(t: int, k: int) -> int:
  """(query, key) pairs of a causal top-k over t tokens: query i sees min(i + 1, k) keys, sum_{i<t} min(i + 1, k)."""
  m = min(t, k)
  return causal_pairs(m) + (t - m) * k


def analytic_flops(cfg: ModelConfig, b: int, t: int, stage: str) -> dict[str, float]:
  """Training FLOPs of one step by the formulas of docs/training.md ("The FLOP count of a training step"), with their
  parts."""
  p = matmul_params(cfg)
  pair = pair_flops(cfg)
  n = b * t
  layers, n_mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
  a_dense = b * t * t * pair["dense"]
  a_sparse = b * t * cfg.index_topk * pair["sparse"]
  a_idx = b * t * t * pair["indexer"]
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


def useful_flops(cfg: ModelConfig, b: int, t: int, stage: str) -> dict[str, float]:
  """The useful-work numerator of MFU: the FLOPs one training step of b sequences of t tokens needs in `stage`
  (dense, warmup or sparse), with their parts and "total". It counts what the step's loss and gradients need,
  the same for any implementation (MaxText's convention: causal attention counted as causal), not what a given
  program executes (that is `analytic_flops`, and the HLO's dots). Matmuls only, 2 FLOPs a multiply-add; a
  backward pass costs twice its forward (input and weight gradients, or q and k gradients), so forward +
  backward = 3x. Not counted: remat recomputation, Muon's Newton-Schulz and the rest of the optimizer,
  elementwise work (softmax, norms, rope, the KL), and the embedding (a lookup). Each sequence is one document
  (packed documents would see fewer keys). L decoder layers, M MTP layers, N = b t tokens; P_main, P_mtp and
  P_idx as in `matmul_params`; per-pair costs as in `pair_flops`; glm_jax/model/mla.py is MLA.__call__.

  Parameters: 6 N P for the parts a stage trains, 2 N P where only a forward runs.
    dense, sparse: 6 N (P_main + P_mtp): the LM + MTP loss trains every layer, MTP's included.
    warmup: 2 N (P_main + P_mtp): the loss is the indexer KL alone (glm_jax/train/step.py, _forward_losses),
      the indexer reads a stop_gradient copy of its inputs and the KL's target is a constant (mla.py own_indexer;
      glm_jax/model/blockwise.py kl_rows), so no gradient reaches the main model: its forward only (the heads'
      forward included: the step reports the LM and MTP losses).
  Attention, every layer (L + M), each query i of a sequence seeing i + 1 keys, t (t + 1) / 2 pairs a sequence:
    dense: 3 b t (t + 1) / 2 pair_dense (L + M).
    warmup: b t (t + 1) / 2 pair_dense (L + M), forward only (the frozen model; it is also the KL's target).
    Both in the MHA form, the cheaper one; with model.attention_chunk the code attends in the absorbed form
    (glm_jax/model/blockwise.py: pair_sparse a pair, 2.1x for GLM-5), an implementation's cost.
    sparse: query i sees min(i + 1, index_topk) keys, b sum_i min(i + 1, K) pairs, in MLA's absorbed form (the
      form DSA attends in): 3 b sum_i min(i + 1, K) pair_sparse (L + M). The KL's target (the attention's
      probabilities of the selected keys, summed over heads) is a by-product of that forward, not counted again
      (the kernel path recomputes its scores, dsa.head_probs: an implementation's cost, like remat).
      When t <= index_topk DSA does not select (ModelConfig.dsa_selects: every key is visible to the top-k) and
      the layer attends densely (mla.py): the dense stage's 3 b t (t + 1) / 2 pair_dense (L + M).
  Indexer (warmup and sparse only; the dense stage runs none), in every layer with its own indexer (L_I = the
  "full" layers of model.indexer_types, all L by default: an IndexShare "shared" layer reuses another's top-k
  and its indexer neither scores nor learns) and in the M MTP layers (each learns the same KL:
  glm_jax/model/transformer.py, GlmMoeDsa.__call__):
    projections: 4 N P_idx (L_I + M): forward, and the weight gradients of the KL; no input gradients (its
      inputs x and c_q are stop_gradient, mla.py own_indexer).
    warmup scores: trained on every visible key (the KL to the dense attention over all of them):
      3 b t (t + 1) / 2 pair_indexer (L_I + M).
    sparse scores: the selection, a forward over every causal pair, with no gradient (the top-k kernel's inputs
      are stop_gradient, pallas_kernels/lightning_indexer.py): "indexer_selection" =
      b t (t + 1) / 2 pair_indexer (L_I + M); and the KL's scores over the selected keys only, forward and
      backward (the KL is a function of the indexer's q, k, w at the selected keys: glm_jax/model/dsa.py
      selected_index_scores evaluates them anew with gradient): "indexer_scores" =
      3 b sum_i min(i + 1, K) pair_indexer (L_I + M). With t <= index_topk nothing is selected: the KL covers
      every visible key, 3 b t (t + 1) / 2 pair_indexer (L_I + M), and there is no selection pass."""
  if stage not in ("dense", "warmup", "sparse"):
    raise ValueError(f"dsa_stage={stage!r}; one of 'dense', 'warmup', 'sparse'")
  p = matmul_params(cfg)
  pair = pair_flops(cfg)
  n, n_mtp = b * t, cfg.num_nextn_predict_layers
  layers = cfg.num_hidden_layers + n_mtp
  indexer_layers = cfg.num_hidden_layers - sum(cfg.shared_indexer_layers) + n_mtp
  trained = stage != "warmup"
  selects = stage == "sparse" and t > cfg.index_topk
  suffix = "" if trained else "_forward_only"
  passes = 3 if trained else 1
  out: dict[str, float] = {}
  out["params_main" + suffix] = 2 * passes * n * p["main"]
  out["params_mtp" + suffix] = 2 * passes * n * p["mtp"]
  if selects:
    out["attention_sparse"] = 3 * b * topk_pairs(t, cfg.index_topk) * pair["sparse"] * layers
  else:
    out["attention" + suffix] = passes * b * causal_pairs(t) * pair["dense"] * layers
  if stage != "dense":
    out["indexer_projections"] = 4 * n * p["indexer_per_layer"] * indexer_layers
    if selects:
      out["indexer_selection"] = b * causal_pairs(t) * pair["indexer"] * indexer_layers
    kl_pairs = topk_pairs(t, cfg.index_topk) if selects else causal_pairs(t)
    out["indexer_scores"] = 3 * b * kl_pairs * pair["indexer"] * indexer_layers
  out["total"] = sum(out.values())
  return out


def ragged_dot_extra_flops(cfg: ModelConfig, b: int, t: int, stage: str) -> float:
  """FLOPs the CPU lowering of ragged_dot adds: every routed row against all E experts, not just its own."""
  p = matmul_params(cfg)
  passes = 2 if stage == "warmup" else 6  # forward only in the warm-up stage (the model is frozen there)
  return (
    passes
    * b
    * t
    * cfg.num_experts_per_tok
    * p["routed_expert"]
    * (cfg.n_routed_experts - 1)
    * p["moe_layers_incl_mtp"]
  )


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
      total += batch * steps * (4 * lo * lo * hi + 2 * lo**3)
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
  return {
    "total": float(sum(by_phase.values())),
    "by_phase": {k: float(v) for k, v in sorted(by_phase.items())},
    "while_loops": hlo_text.count(" while("),
    "while_loops_without_trip_count": unknown_trip,
    "top": top,
  }
