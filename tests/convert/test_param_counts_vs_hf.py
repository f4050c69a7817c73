"""param_counts against the public reference: transformers' model built on the meta device (no memory)."""

import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from glm_jax.configs import glm5_744b
from glm_jax.model import ModelConfig, param_counts


def hf_count(cfg: ModelConfig) -> int:
  hf = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type", "dtype")}
  with torch.device("meta"):
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**hf))
  return sum(p.numel() for p in model.parameters())


def test_glm5_744b_total_equals_transformers():
  cfg = ModelConfig.from_dict(glm5_744b.get_config().model)
  assert param_counts(cfg)["total"] == hf_count(cfg) == 743_911_199_232


@pytest.mark.parametrize(
  "changes",
  [
    dict(),
    dict(tie_word_embeddings=True),
    dict(first_k_dense_replace=0),
    dict(n_shared_experts=2, n_group=4, topk_group=2),
  ],
)
def test_small_config_total_equals_transformers(changes):
  base = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=4,
    v_head_dim=8,
    qk_nope_head_dim=8,
    index_head_dim=8,
    index_n_heads=2,
    index_topk=4,
    first_k_dense_replace=1,
  )
  cfg = ModelConfig(**{**base, **changes})
  assert param_counts(cfg)["total"] == hf_count(cfg)
