r"""Our pretraining step against the public reference, side by side in one process on the CPU.

  bash scripts/with_env.sh python experiments/bench_vs_transformers.py [--which=moe,dense] [--steps=10] [--warmup=2]

The same GLM-5-shaped model (hidden 256, 4 layers = 1 dense + 3 MoE with 16 experts top-4, or all 4 dense; MLA
with q_lora 128 / kv_lora 64; fp32; no MTP layer, which transformers does not train) trained on the same random
tokens (8 x 256) with the same optimizer (AdamW lr 1e-4, betas 0.9 / 0.95, weight decay 0.1, gradient clipping
at 1.0), by
  jax:    the real pretraining step (glm_jax/train/step.py: jit, dense DSA stage, the balance loss and the expert
          bias update included);
  torch:  transformers' GlmMoeDsaForCausalLM in eager mode, loss.backward(), clip_grad_norm_, AdamW.step().
Each is timed as the median of --steps steps after --warmup untimed ones (jax: compile included in the warm-up;
each step ended by block_until_ready), the two taking their steps in turn so that a change in the machine's speed
(neighbours on a shared VM) falls on both alike. One JSON line a config: tokens/s of each and jax / torch; the
step's analytic FLOPs (glm_jax/train/flops.py) over each step time; the machine's fp32 GEMM rate (XLA, a
[2048, 1024] x [1024, 1024] matmul, measured first) and `torch_over_gemm_bound`: torch's step time over the time of
the step's analytic FLOPs at that rate, the jax / torch of a step that ran every FLOP at that GEMM rate.
transformers runs its routed experts with its default `experts_implementation` (printed; grouped_mm in 5.x, only
the real rows' work, as ours).
transformers runs its lightning indexer in every layer (it has no dense stage), our dense stage does not; with
index_topk = T its top-k keeps every key, so both compute the same attention. Needs the test requirements
(torch, transformers), which `scripts/with_env.sh` installs.
"""

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import torch
from absl import app, flags
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from glm_jax.configs import common
from glm_jax import strict_json
from glm_jax.model import ModelConfig
from glm_jax.train import step as step_lib
from glm_jax.train.flops import analytic_flops
from glm_jax.train.trainer import create_train_state

_WHICH = flags.DEFINE_list("which", ["moe", "dense"], "Configs to compare: moe (1 dense + 3 MoE layers), dense.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps of each implementation.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first (jax compiles in the first).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences a step.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens a sequence.")

MODEL = dict(
  vocab_size=8192,
  hidden_size=256,
  intermediate_size=1024,
  moe_intermediate_size=256,
  num_hidden_layers=4,
  first_k_dense_replace=1,
  num_attention_heads=4,
  num_key_value_heads=4,
  n_routed_experts=16,
  num_experts_per_tok=4,
  n_shared_experts=1,
  q_lora_rank=128,
  kv_lora_rank=64,
  qk_nope_head_dim=32,
  qk_rope_head_dim=16,
  v_head_dim=32,
  index_n_heads=4,
  index_head_dim=32,
  num_nextn_predict_layers=0,
  max_position_embeddings=4096,
  dtype="float32",
  param_dtype="float32",
)
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def model_config(which: str, seq_len: int) -> ModelConfig:
  layers = MODEL["num_hidden_layers"]
  return ModelConfig(**{**MODEL, "index_topk": seq_len, "first_k_dense_replace": layers if which == "dense" else 1})


def timed(step: Callable[[], Any]) -> Callable[[], float]:
  """`step` wrapped to return its wall-clock seconds."""

  def run() -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0

  return run


def jax_stepper(cfg: ModelConfig, ids: np.ndarray) -> Callable[[], float]:
  """One step of our jit pretraining step a call (state carried between calls), returning its seconds."""
  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict(cfg.to_dict())
  config.train = common.train(grad_clip_norm=CLIP, spike_factor=0.0)
  config.optimizer = common.optimizer(
    name="adamw",
    lr=LR,
    warmup_steps=0,
    schedule="constant",
    b1=BETAS[0],
    b2=BETAS[1],
    eps=EPS,
    weight_decay=WEIGHT_DECAY,
  )
  graphdef, state, optimizer, schedule = create_train_state(config, cfg.replace(use_dsa=False))
  step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)
  b, t = ids.shape
  batch = {
    "input_ids": jnp.asarray(ids),
    "segment_ids": jnp.ones((b, t), jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
  }
  carry = {"state": state}

  def one():
    carry["state"], metrics = step(carry["state"], batch)
    jax.block_until_ready(metrics["loss"])

  return timed(one)


def torch_stepper(cfg: ModelConfig, ids: np.ndarray) -> tuple[Callable[[], float], str | None]:
  """One step of transformers' model with torch's AdamW a call, returning its seconds; and the model's
  experts_implementation (None without MoE layers)."""
  torch.manual_seed(0)
  hf_config = GlmMoeDsaConfig(**cfg.to_hf_dict())
  hf_config._attn_implementation = "eager"  # pylint: disable=protected-access  # as fast as sdpa here, measured
  model = GlmMoeDsaForCausalLM(hf_config).train()
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
  tokens = torch.as_tensor(ids, dtype=torch.long)

  def one():
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)

  experts = model.config._experts_implementation if cfg.num_moe_layers else None  # pylint: disable=protected-access
  return timed(one), experts


def interleaved_medians(steppers: Sequence[Callable[[], float]], warmup: int, steps: int) -> list[float]:
  """Each stepper's median step seconds, the steps taken in turn (one of each, `steps` times) after `warmup`
  untimed rounds, so that a change in the machine's speed during the run (a shared 2-core VM's neighbours)
  falls on all of them alike."""
  for _ in range(warmup):
    for run in steppers:
      run()
  times = [[] for _ in steppers]
  for _ in range(steps):
    for run, ts in zip(steppers, times):
      ts.append(run())
  return [statistics.median(ts) for ts in times]


def gemm_flops_per_s(m: int = 2048, k: int = 1024, n: int = 1024, repeats: int = 7) -> float:
  """The fp32 matmul rate XLA reaches on this machine for a mid-sized GEMM (median of `repeats`)."""
  a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  (seconds,) = interleaved_medians([timed(lambda: jax.block_until_ready(matmul(a, b)))], 1, repeats)
  return 2.0 * m * k * n / seconds


def main(argv):
  del argv
  torch.set_num_threads(os.cpu_count())
  gemm = gemm_flops_per_s()
  for which in _WHICH.value:
    if which not in ("moe", "dense"):
      raise app.UsageError(f"--which={which!r}; one of moe, dense")
    cfg = model_config(which, _SEQ.value)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (_BATCH.value, _SEQ.value)).astype(np.int32)
    tokens = ids.size
    flops = analytic_flops(cfg.replace(use_dsa=False), _BATCH.value, _SEQ.value, "dense")["total"]
    torch_step, experts_impl = torch_stepper(cfg, ids)
    jax_s, torch_s = interleaved_medians([jax_stepper(cfg, ids), torch_step], _WARMUP.value, _STEPS.value)
    print(
      strict_json.dumps(
        {
          "config": which,
          "layers": f"{cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE",
          "experts": f"{cfg.n_routed_experts} top-{cfg.num_experts_per_tok}",
          "tokens_per_step": tokens,
          "jax_step_s": round(jax_s, 4),
          "torch_step_s": round(torch_s, 4),
          "jax_tokens_per_s": round(tokens / jax_s),
          "torch_tokens_per_s": round(tokens / torch_s),
          "jax_over_torch": round(torch_s / jax_s, 3),
          "analytic_gflop_per_step": round(flops / 1e9, 2),
          "jax_gflop_per_s": round(flops / jax_s / 1e9, 1),
          "torch_gflop_per_s": round(flops / torch_s / 1e9, 1),
          "cpu_fp32_gemm_gflop_per_s": round(gemm / 1e9, 1),
          "torch_over_gemm_bound": round(torch_s * gemm / flops, 3),
          "torch_experts_implementation": experts_impl,
          "cpu_count": os.cpu_count(),
          "load_avg_1min": round(os.getloadavg()[0], 2),
        }
      ),
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)
