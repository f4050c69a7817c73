"""Speed and FLOP efficiency of the pretraining step on CPU: tokens/s, and XLA's FLOPs over an analytic count.

  .venv/bin/python experiments/bench_train_step.py [--which=tiny|medium|both] [--steps=20] [--warmup=2]
      [--config=configs/glm5_tiny.py] [--batch_size=N] [--seq_len=T] [--dsa_stage=dense|warmup|sparse]
      [--no_unrolled_cost] [--verbose]

For glm5_tiny and "medium" (a bigger small config derived from it below, `medium_config`) it builds the real
step (trainer.model_config_for_stage, optimizers.make_optimizer, step.make_train_step: Muon + AdamW, grad
clipping, spike guard, expert-bias update, MTP), feeds random tokens (one segment per row: segment_ids 1,
positions 0..T-1), and prints one JSON line per config. Timings: compile_seconds is lower + compile of the
step; step_seconds is the median over --steps calls of the compiled step (after --warmup untimed calls), each
ended by block_until_ready; tokens_per_s = B*T / step_seconds. The machine is shared (tests may be running),
so the JSON carries the 1-minute load average at the start and end of the timed loop.

XLA FLOPs. `xla_flops_per_step_raw` is cost_analysis()["flops"] of the step as compiled and timed. XLA's
HloCostAnalysis counts a while-loop body ONCE, whatever its trip count, and the model scans its layer stacks
(jax.lax.scan -> while), so the raw figure misses (L_moe - 1) MoE layers forward and backward (and
(L_dense - 1) dense ones). `xla_flops_per_step` is therefore cost_analysis()["flops"] of the same step with the
layer scans fully unrolled (model.scan_unroll=True for that one extra compile; the
timed step is untouched). It counts every HLO op: matmuls and also elementwise work (softmax, norms, rope,
masks, the optimizer's elementwise updates), one FLOP per element per op. `xla_dot_flops_per_step` counts the
dot ops only, read from the timed step's optimized HLO: 2 * |output| * |contracted dims| per dot, a while
body's dots multiplied by its known_trip_count; it is the figure to set against the analytic (matmul-only)
count. `xla_dot_flops_by_phase` splits it into forward (jvp), backward (transpose(jvp)) and optimizer (vmap:
Muon's Newton-Schulz), from each dot's op_name metadata; dots XLA created without metadata land in
"no_op_name" (seen so far: some Muon Newton-Schulz products and the indexer's head-weighted-sum passes; in the
dense stage optimizer + no_op_name = the Muon NS count exactly).

Analytic count (all dims from the model config; N = B*T tokens; D hidden, V vocab, H heads, R_q q_lora_rank,
R_kv kv_lora_rank, d_n qk_nope_head_dim, d_r qk_rope_head_dim, d_v v_head_dim, I intermediate_size,
I_e moe_intermediate_size, E routed experts, k experts per token, S shared experts, H_I / d_I indexer heads /
head dim, K_t index_topk, L = L_dense + L_moe layers, M MTP layers):

  Matmul parameters a token passes through (the embedding is a lookup, not a matmul: excluded):
    P_attn  = D R_q + R_q H (d_n + d_r) + D (R_kv + d_r) + R_kv H (d_n + d_v) + H d_v D      per MLA layer
              (q_a, q_b, kv_a_with_mqa, kv_b = W_UK;W_UV, o; the absorbed form applies W_UK/W_UV to the
              query/output instead of the latent, same count)
    P_mlp   = 3 D I                                   dense SwiGLU
    P_moe   = D E + 3 D I_e S + 3 D I_e k             router + shared experts + the k routed experts used
    P_head  = D V
    P_main  = L P_attn + L_dense P_mlp + L_moe P_moe + P_head
    P_mtp   = M (2 D D + P_attn + P_moe + P_head)     eh_proj, one MoE decoder layer, the shared head again
    P_idx   = R_q H_I d_I + D d_I + D H_I             indexer wq_b, wk, weights_proj (per layer, when it runs)
  Attention (per layer, forward; the FULL score matrix: the reference computes all T x T scores and masks the
  upper triangle with a select, as XLA sees it, so no causal 1/2; `attention_causal_half_flops` in the
  breakdown is what a causal kernel would do):
    A_dense  = 2 B H T T (d_n + d_r) + 2 B H T T d_v                 MHA-form scores + P.V
    A_sparse = 2 B T H K_t (R_kv + d_r) + 2 B T H K_t R_kv           absorbed form over the top-k keys
    A_idx    = 2 B T T H_I d_I + 2 B T T H_I                         indexer q.k per head + the weighted sum
  Training = forward (2 FLOPs per parameter-token / per MAC) + backward (2x forward: input and weight grads):
    dense  : 6 N (P_main + P_mtp) + 3 A_dense (L + M)
    warmup : every parameter but the indexer frozen, loss = indexer KL only, so the model runs forward only:
             2 N (P_main + P_mtp) + A_dense (L + M) + 4 N P_idx L + 3 A_idx L
             (the indexer reads stop_gradient inputs: forward + weight grads = 4 N P_idx, no input grads;
             its scores need both q and k grads = 3x; the MTP layer runs no indexer in this stage)
    sparse : 6 N (P_main + P_mtp) + 3 A_sparse (L + M) + 4 N P_idx L + 3 A_idx L
             + (2 N P_idx + A_idx) M                  the MTP layer's indexer picks its top-k, forward only
             (the KL recomputes the selected keys' scores exactly as the sparse attention did; XLA CSEs the
             two, so that recomputation is not counted)
  Optimizer (reported apart, not in 6ND): Muon orthogonalizes each hidden matrix (as leaf_plan splits it:
  stacked layers/experts and, with muon_split, heads are separate matrices) with ns_steps quintic
  Newton-Schulz steps on X (p x q, p = min(m, n) <= q = max(m, n), optax transposes to that shape):
    A = X X^T: 2 p^2 q;  A A: 2 p^3;  (bA + cAA) X: 2 p^2 q   =>   per step 4 p^2 q + 2 p^3 = 2 (2 p^2 q + p^3)
  muon_ns_flops_per_step = sum over matrices of ns_steps (4 p^2 q + 2 p^3); AdamW and the rest of Muon are
  elementwise (a few tens of FLOPs per parameter) and left out.

ratio = xla_flops_per_step / analytic_flops_per_step; ratio_with_optimizer divides by analytic + Muon NS;
dot_ratio(_with_optimizer) use xla_dot_flops_per_step. On CPU expect the dot ratio well above 1 for a known,
structural reason recorded in `known_waste`: jax.lax.ragged_dot has no grouped kernel on CPU; JAX lowers it to
a dense dot_general of every sorted (token, slot) row against EVERY expert with the other experts' rows masked
to zero (in the optimized HLO: (N k, E D) x (E D, I_e) dots forward, [E, N k, .] x [E, N k, .] for the weight
grads), and its two backward products the same way, so the routed experts cost E times the useful work:
extra = 6 N k 3 D I_e (E - 1) per MoE layer, MTP's included (2 N k 3 D I_e (E - 1), forward only, in warmup).
`dot_ratio_after_known_waste` = dot FLOPs / (analytic + Muon NS + that extra); near 1 means every other dot is
accounted for (dense stage: exactly 1; warmup/sparse: 0.998-0.999, because XLA runs one of the three passes of
the indexer's head-weighted sum, 2 B T T H_I per layer, as multiply + reduce, not as a dot). What remains
between `ratio` and the dot ratio is elementwise work (softmax, masks, norms, rope, optimizer updates).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glm_jax.model import ModelConfig, param_counts  # noqa: E402
from glm_jax.train import optimizers, step as step_lib, trainer  # noqa: E402


# ----------------------------------------------------------------------------------------------- configs


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def medium_config(base):
  """A bigger small config from the tiny one: every mechanism the same, ~10x the matmul work per token."""
  config = base.copy_and_resolve_references()
  config.name = "glm5_medium_cpu"
  m = config.model
  m.hidden_size = 256
  m.intermediate_size = 512
  m.moe_intermediate_size = 64
  m.num_hidden_layers = 4
  m.first_k_dense_replace = 1
  m.n_routed_experts = 16
  m.num_experts_per_tok = 4
  m.q_lora_rank = 128
  m.kv_lora_rank = 64
  m.num_attention_heads = 4
  m.num_key_value_heads = 4
  m.qk_nope_head_dim = 32
  m.qk_rope_head_dim = 16
  m.v_head_dim = 32
  m.index_topk = 64
  m.index_n_heads = 4
  m.index_head_dim = 32
  m.vocab_size = 512
  config.data.seq_len = 256
  config.data.batch_size = 8
  return config


# ----------------------------------------------------------------------------------------------- analytic


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


def _axes(a) -> tuple[int, ...]:
  return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def muon_ns_flops(opt_cfg, params, trainable) -> tuple[float, int]:
  """(Newton-Schulz FLOPs of one optimizer step, number of matrices orthogonalized)."""
  plan = optimizers.leaf_plan(opt_cfg, params, trainable=trainable)
  steps = int(optimizers._checked(opt_cfg).muon_ns_steps)  # pylint: disable=protected-access
  shapes = {optimizers.path_names(path): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(params)}
  total, count = 0.0, 0
  for names, lp in plan.items():
    if lp.label != "muon":
      continue
    shape = shapes[names]
    parts = [shape[:-1] + (s,) for s in lp.split_sizes] if lp.split_sizes else [shape]
    for part, dims in zip(parts, lp.muon_dims):
      red = [a % len(part) for a in _axes(dims.reduction_axis)]
      outp = [a % len(part) for a in _axes(dims.output_axis)]
      m = math.prod(part[a] for a in red)
      n = math.prod(part[a] for a in outp)
      batch = math.prod(part) // (m * n)
      lo, hi = min(m, n), max(m, n)
      total += batch * steps * (4 * lo * lo * hi + 2 * lo ** 3)
      count += batch
  return total, count


# ----------------------------------------------------------------------------------------------- HLO dots

_COMP_RE = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$")
_SHAPE_RE = re.compile(r"%([\w.\-]+) = [a-z]+[0-9]*\[([\d,]*)\]")
_DOT_RE = re.compile(r"%([\w.\-]+) = [a-z]+[0-9]*\[([\d,]*)\][^ ]* dot\(%([\w.\-]+), %([\w.\-]+)\)")
_CALL_RE = re.compile(r"(?:calls|body|to_apply)=%([\w.\-]+)")
_CALLS_LIST_RE = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')


def _dims(s: str) -> tuple[int, ...]:
  return tuple(int(x) for x in s.split(",") if x)


def _phase(op_name: str) -> str:
  if "transpose(jvp" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  if "vmap(" in op_name:
    return "optimizer"
  return "no_op_name" if not op_name else "other"


def hlo_dot_flops(hlo_text: str) -> dict:
  """Dot FLOPs of an optimized HLO module, while bodies times their known trip count, split by phase."""
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMP_RE.match(line)
    if m:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  local: dict[str, collections.Counter] = {}
  calls: dict[str, list[tuple[str, int]]] = {}
  details: dict[str, list] = {}
  unknown_trip = 0
  for name, lines in comps.items():
    shapes = {m.group(1): _dims(m.group(2)) for m in (_SHAPE_RE.search(l) for l in lines) if m}
    counter, callees, det = collections.Counter(), [], []
    for l in lines:
      d = _DOT_RE.search(l)
      if d:
        out, lhs, rhs = _dims(d.group(2)), shapes.get(d.group(3)), shapes.get(d.group(4))
        cm = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", l)
        contract = math.prod(lhs[i] for i in _dims(cm.group(1))) if (cm and lhs is not None) else 0
        flops = 2 * math.prod(out) * contract
        op = _OPNAME_RE.search(l)
        op_name = op.group(1) if op else ""
        counter[_phase(op_name)] += flops
        det.append((flops, _phase(op_name), lhs, rhs, out, op_name))
      mult = 1
      if " while(" in l:
        tm = _TRIP_RE.search(l)
        if tm:
          mult = int(tm.group(1))
        else:
          unknown_trip += 1
      for c in _CALL_RE.findall(l):
        callees.append((c, mult))
      for group in _CALLS_LIST_RE.findall(l):
        callees.extend((c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip())
    local[name], calls[name], details[name] = counter, callees, det
  memo: dict[str, collections.Counter] = {}

  def total(name: str) -> collections.Counter:
    if name not in memo:
      acc = collections.Counter(local.get(name, {}))
      for callee, mult in calls.get(name, []):
        for k, v in total(callee).items():
          acc[k] += mult * v
      memo[name] = acc
    return memo[name]

  by_phase = total(entry)
  # Multiplicity of every computation (for the verbose listing of the largest dots).
  mult_of: dict[str, int] = collections.defaultdict(int)

  def visit(name: str, mult: int):
    mult_of[name] += mult
    for callee, m in calls.get(name, []):
      visit(callee, mult * m)

  visit(entry, 1)
  top = collections.Counter()
  for name, det in details.items():
    for flops, phase, lhs, rhs, out, op_name in det:
      short = re.sub(r"(while/body/|closed_call/|jit\(step\)/)", "", op_name)
      top[(phase, str(lhs), str(rhs), str(out), short)] += flops * mult_of.get(name, 0)
  n_while = hlo_text.count(" while(")
  return {"total": float(sum(by_phase.values())), "by_phase": {k: float(v) for k, v in sorted(by_phase.items())},
          "while_loops": n_while, "while_loops_without_trip_count": unknown_trip, "top": top}


# ----------------------------------------------------------------------------------------------- bench


def _cost_flops(compiled) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost["flops"])


def random_batch(b: int, t: int, vocab: int, seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {"input_ids": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
          "segment_ids": jnp.ones((b, t), jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}


def bench(config, args) -> dict:
  if args.batch_size:
    config.data.batch_size = args.batch_size
  if args.seq_len:
    config.data.seq_len = args.seq_len
  if args.dsa_stage:
    config.train.dsa_stage = args.dsa_stage
  stage = config.train.dsa_stage
  b, t = config.data.batch_size, config.data.seq_len
  trainer.validate_train_config(config.train)
  model_cfg = trainer.model_config_for_stage(config)
  counts = param_counts(model_cfg)

  trainable = step_lib.is_indexer_param if stage == "warmup" else None
  graphdef, state, optimizer, schedule = trainer.create_train_state(config, model_cfg)
  ns_flops, ns_matrices = muon_ns_flops(config.optimizer, state.params, trainable)
  step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)
  batch = random_batch(b, t, model_cfg.vocab_size, config.train.seed)

  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_seconds = time.perf_counter() - t0
  raw_flops = _cost_flops(compiled)
  dots = hlo_dot_flops(compiled.as_text())

  times = []
  load_before = os.getloadavg()[0]
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
  load_after = os.getloadavg()[0]
  loss = float(metrics["loss"])
  del state, compiled

  unrolled_flops, unrolled_compile = None, None
  if args.unrolled_cost:
    graphdef_u, state_u, optimizer_u, schedule_u = trainer.create_train_state(
        config, model_cfg.replace(scan_unroll=True))
    step_u = step_lib.make_train_step(graphdef_u, optimizer_u, schedule_u, config.train)
    t0 = time.perf_counter()
    compiled_u = step_u.lower(state_u, batch).compile()
    unrolled_compile = time.perf_counter() - t0
    unrolled_flops = _cost_flops(compiled_u)
    unrolled_text = compiled_u.as_text()
    dots_u = hlo_dot_flops(unrolled_text)
    del state_u, compiled_u

  analytic = analytic_flops(model_cfg, b, t, stage)
  extra = ragged_dot_extra_flops(model_cfg, b, t, stage)
  an = analytic["total"]
  step_seconds = statistics.median(times)
  xla = unrolled_flops if unrolled_flops is not None else raw_flops
  row = {
      "name": config.get("name", "?"),
      "params_total": counts["total"], "params_active": counts["active"], "params_mtp": counts["mtp"],
      "batch_size": b, "seq_len": t, "dsa_stage": stage,
      "compile_seconds": round(compile_seconds, 2),
      "step_seconds": round(step_seconds, 4),
      "step_seconds_min": round(min(times), 4), "step_seconds_max": round(max(times), 4),
      "timed_steps": len(times),
      "tokens_per_s": round(b * t / step_seconds, 1),
      "xla_flops_per_step": xla,
      "xla_flops_per_step_raw": raw_flops,
      "xla_flops_source": "unrolled layer scans" if unrolled_flops is not None else "raw (while bodies counted once)",
      "xla_dot_flops_per_step": dots["total"],
      "xla_dot_flops_by_phase": dots["by_phase"],
      "analytic_flops_per_step": an,
      "muon_ns_flops_per_step": ns_flops,
      "ratio": round(xla / an, 3),
      "ratio_with_optimizer": round(xla / (an + ns_flops), 3),
      "dot_ratio": round(dots["total"] / an, 3),
      "dot_ratio_with_optimizer": round(dots["total"] / (an + ns_flops), 3),
      "known_waste": {"ragged_dot_cpu_all_experts_extra_flops": extra},
      "dot_ratio_after_known_waste": round(dots["total"] / (an + ns_flops + extra), 3),
      "non_dot_flops_share": round(1 - dots["total"] / xla, 3) if unrolled_flops is not None else None,
      "xla_flops_per_s": round(xla / step_seconds / 1e9, 2),
      "xla_flops_per_s_unit": "GFLOP/s",
      "analytic_flops_per_s_gflops": round(an / step_seconds / 1e9, 2),
      "analytic_breakdown": analytic,
      "matmul_params_per_token": matmul_params(model_cfg),
      "muon_matrices": ns_matrices,
      "while_loops_in_timed_step": dots["while_loops"],
      "unrolled_compile_seconds": None if unrolled_compile is None else round(unrolled_compile, 2),
      "loss_last_step": round(loss, 4),
      "loadavg_1min_before_after": [round(load_before, 2), round(load_after, 2)],
      "cpu_count": os.cpu_count(),
  }
  if args.unrolled_cost:
    row["xla_dot_flops_unrolled_check"] = dots_u["total"]
  if args.verbose:
    print(f"--- {row['name']}: largest dot groups (FLOPs x trip count) ---", file=sys.stderr)
    for (phase, lhs, rhs, out, name), f in dots["top"].most_common(25):
      print(f"{f:12.4g} {f / dots['total']:6.1%} {phase:9s} {lhs} x {rhs} -> {out}  {name}", file=sys.stderr)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/glm5_tiny.py")
  parser.add_argument("--which", choices=("tiny", "medium", "both"), default="both")
  parser.add_argument("--steps", type=int, default=20, help="timed steps")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
  parser.add_argument("--batch_size", type=int, default=0, help="override data.batch_size (0: the config's)")
  parser.add_argument("--seq_len", type=int, default=0, help="override data.seq_len (0: the config's)")
  parser.add_argument("--dsa_stage", choices=step_lib.STAGES, default=None, help="override train.dsa_stage")
  parser.add_argument("--no_unrolled_cost", dest="unrolled_cost", action="store_false",
                      help="skip the extra compile with unrolled layer scans (xla_flops is then the raw figure)")
  parser.add_argument("--verbose", action="store_true", help="list the largest dot groups on stderr")
  args = parser.parse_args()
  base = load_config(args.config)
  configs = []
  if args.which in ("tiny", "both"):
    configs.append(base.copy_and_resolve_references())
  if args.which in ("medium", "both"):
    configs.append(medium_config(base))
  print(f"# jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPU cores", file=sys.stderr)
  for config in configs:
    row = bench(config, args)
    print(json.dumps(row), flush=True)
    print(f"# {row['name']}: {row['tokens_per_s']:.0f} tokens/s ({row['step_seconds']} s/step, load "
          f"{row['loadavg_1min_before_after']}); ratio {row['ratio']} ({row['ratio_with_optimizer']} with Muon NS), "
          f"dots {row['dot_ratio']}, dots after ragged_dot waste {row['dot_ratio_after_known_waste']}",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
  main()
