r"""Our pretraining step against the public reference, side by side in one process on the CPU.

  .venv/bin/python experiments/bench_vs_transformers.py [--which=moe,dense] [--steps=10] [--warmup=2]

The same GLM-5-shaped model (hidden 256, 4 layers = 1 dense + 3 MoE with 16 experts top-4, or all 4 dense; MLA
with q_lora 128 / kv_lora 64; fp32; no MTP layer, which transformers does not train) trained on the same random
tokens (8 x 256) with the same optimizer (AdamW lr 1e-4, betas 0.9 / 0.95, weight decay 0.1, gradient clipping
at 1.0), by
  jax:    the real pretraining step (glm_jax/train/step.py: jit, dense DSA stage, the balance loss and the expert
          bias update included);
  torch:  transformers' GlmMoeDsaForCausalLM in eager mode, loss.backward(), clip_grad_norm_, AdamW.step().
Each is timed as the median of --steps steps after --warmup untimed ones (jax: compile included in the warm-up;
each step ended by block_until_ready). One JSON line a config: tokens/s of each and jax / torch.
transformers runs its lightning indexer in every layer (it has no dense stage), our dense stage does not; with
index_topk = T its top-k keeps every key, so both compute the same attention. Needs the test requirements
(torch, transformers), which `scripts/with_env.sh` installs.
"""

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import torch
from absl import app, flags
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from configs import common
from glm_jax.model import ModelConfig
from glm_jax.train import step as step_lib
from glm_jax.train.trainer import create_train_state

_WHICH = flags.DEFINE_list("which", ["moe", "dense"], "Configs to compare: moe (1 dense + 3 MoE layers), dense.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps of each implementation.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first (jax compiles in the first).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences a step.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens a sequence.")

MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
             n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, q_lora_rank=128, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32,
             num_nextn_predict_layers=0, max_position_embeddings=4096, dtype="float32", param_dtype="float32")
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def model_config(which: str, seq_len: int) -> ModelConfig:
  layers = MODEL["num_hidden_layers"]
  return ModelConfig(**{**MODEL, "index_topk": seq_len, "first_k_dense_replace": layers if which == "dense" else 1})


def jax_step_seconds(cfg: ModelConfig, ids: np.ndarray) -> list[float]:
  """Times of each step of our jit pretraining step (warm-up included)."""
  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict(cfg.to_dict())
  config.train = common.train(grad_clip_norm=CLIP, spike_factor=0.0)
  config.optimizer = common.optimizer(name="adamw", lr=LR, warmup_steps=0, schedule="constant", b1=BETAS[0],
                                      b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
  graphdef, state, optimizer, schedule = create_train_state(config, cfg.replace(use_dsa=False))
  step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)
  b, t = ids.shape
  batch = {"input_ids": jnp.asarray(ids), "segment_ids": jnp.ones((b, t), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
  times = []
  for _ in range(_WARMUP.value + _STEPS.value):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times.append(time.perf_counter() - t0)
  return times


def torch_step_seconds(cfg: ModelConfig, ids: np.ndarray) -> list[float]:
  """Times of each step of transformers' model with torch's AdamW (warm-up included)."""
  torch.manual_seed(0)
  hf_config = GlmMoeDsaConfig(**cfg.to_hf_dict())
  hf_config._attn_implementation = "eager"  # pylint: disable=protected-access
  model = GlmMoeDsaForCausalLM(hf_config).train()
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
  tokens = torch.as_tensor(ids, dtype=torch.long)
  times = []
  for _ in range(_WARMUP.value + _STEPS.value):
    t0 = time.perf_counter()
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
  return times


def main(argv):
  del argv
  torch.set_num_threads(os.cpu_count())
  for which in _WHICH.value:
    if which not in ("moe", "dense"):
      raise app.UsageError(f"--which={which!r}; one of moe, dense")
    cfg = model_config(which, _SEQ.value)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (_BATCH.value, _SEQ.value)).astype(np.int32)
    tokens = ids.size
    jax_s = statistics.median(jax_step_seconds(cfg, ids)[_WARMUP.value:])
    torch_s = statistics.median(torch_step_seconds(cfg, ids)[_WARMUP.value:])
    print(json.dumps({
        "config": which, "layers": f"{cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE",
        "experts": f"{cfg.n_routed_experts} top-{cfg.num_experts_per_tok}", "tokens_per_step": tokens,
        "jax_step_s": round(jax_s, 4), "torch_step_s": round(torch_s, 4),
        "jax_tokens_per_s": round(tokens / jax_s), "torch_tokens_per_s": round(tokens / torch_s),
        "jax_over_torch": round(torch_s / jax_s, 3), "cpu_count": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
  app.run(main)
