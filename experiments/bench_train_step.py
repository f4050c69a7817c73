"""Speed and FLOP efficiency of the pretraining step on CPU: tokens/s, and XLA's FLOPs over an analytic count.

  bash scripts/with_env.sh python experiments/bench_train_step.py [--which=tiny|medium|both] [--steps=20] [--warmup=2]
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
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from glm_jax import strict_json
from glm_jax.model import param_counts
from glm_jax.train import step as step_lib
from glm_jax.sharding.topology import compiled_flops
from glm_jax.train import config as train_config, trainer
from glm_jax.train.flops import (
  analytic_flops,
  hlo_dot_flops,
  matmul_params,
  muon_ns_flops,
  ragged_dot_extra_flops,
)

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


# ----------------------------------------------------------------------------------------------- bench


def random_batch(b: int, t: int, vocab: int, seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {
    "input_ids": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
    "segment_ids": jnp.ones((b, t), jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
  }


def bench(config, args) -> dict:
  if args.batch_size:
    config.data.batch_size = args.batch_size
  if args.seq_len:
    config.data.seq_len = args.seq_len
  if args.dsa_stage:
    config.train.dsa_stage = args.dsa_stage
  stage = config.train.dsa_stage
  b, t = config.data.batch_size, config.data.seq_len
  train_config.validate_train_config(config.train)
  model_cfg = train_config.model_config_for_stage(config)
  counts = param_counts(model_cfg)

  trainable = step_lib.is_indexer_param if stage == "warmup" else None
  graphdef, state, optimizer, schedule = trainer.create_train_state(config, model_cfg)
  ns_flops, ns_matrices = muon_ns_flops(config.optimizer, state.params, trainable)
  step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)
  batch = random_batch(b, t, model_cfg.vocab_size, config.train.seed)

  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_seconds = time.perf_counter() - t0
  raw_flops = compiled_flops(compiled)
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
      config, model_cfg.replace(scan_unroll=True)
    )
    step_u = step_lib.make_train_step(graphdef_u, optimizer_u, schedule_u, config.train)
    t0 = time.perf_counter()
    compiled_u = step_u.lower(state_u, batch).compile()
    unrolled_compile = time.perf_counter() - t0
    unrolled_flops = compiled_flops(compiled_u)
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
    "params_total": counts["total"],
    "params_active": counts["active"],
    "params_mtp": counts["mtp"],
    "batch_size": b,
    "seq_len": t,
    "dsa_stage": stage,
    "compile_seconds": round(compile_seconds, 2),
    "step_seconds": round(step_seconds, 4),
    "step_seconds_min": round(min(times), 4),
    "step_seconds_max": round(max(times), 4),
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
  parser.add_argument(
    "--no_unrolled_cost",
    dest="unrolled_cost",
    action="store_false",
    help="skip the extra compile with unrolled layer scans (xla_flops is then the raw figure)",
  )
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
    print(strict_json.dumps(row), flush=True)
    print(
      f"# {row['name']}: {row['tokens_per_s']:.0f} tokens/s ({row['step_seconds']} s/step, load "
      f"{row['loadavg_1min_before_after']}); ratio {row['ratio']} ({row['ratio_with_optimizer']} with Muon NS), "
      f"dots {row['dot_ratio']}, dots after ragged_dot waste {row['dot_ratio_after_known_waste']}",
      file=sys.stderr,
      flush=True,
    )


if __name__ == "__main__":
  main()
