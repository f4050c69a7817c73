"""Speed and FLOP efficiency of the pretraining step on CPU: tokens/s, and XLA's FLOPs over an analytic count.

  bash scripts/with_env.sh python experiments/bench_train_step.py [--which=tiny|medium|both] [--steps=20] [--warmup=2]
      [--config=configs/glm5_tiny.py] [--batch_size=N] [--seq_len=T] [--dsa_stage=dense|warmup|sparse]
      [--no_unrolled_cost] [--verbose]

For glm5_tiny and "medium" (`medium_config`, a bigger small config derived from it) it builds the real step
(Muon + AdamW, grad clipping, spike guard, expert-bias update, MTP), feeds random tokens (one segment a row), and
prints one JSON line a config: compile_seconds (lower + compile), step_seconds (the median over --steps calls after
--warmup untimed ones, each ended by block_until_ready), tokens_per_s = B*T / step_seconds, the 1-minute load average
at the start and end of the timed loop (the machine may be shared), and XLA's FLOPs against the analytic count
(glm_jax/train/flops.py): xla_flops_per_step (the layer scans unrolled in one extra compile, as XLA counts a loop body
once; _raw without), xla_dot_flops_per_step and _by_phase (the dots of the timed step's HLO), the ratios and
`known_waste`. What each figure counts, the analytic formulas and what the ratios show on CPU: docs/training.md,
"The FLOP count of a training step".
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
