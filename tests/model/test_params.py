"""param_counts against the public figures for GLM-5 744B-A40B and against a count written from the weight shapes
in docs/glm5_facts.md (section 1) for the tiny config."""

import pytest

from glm_jax.configs import glm5_744b, glm5_tiny
from glm_jax.model.config import ModelConfig
from glm_jax.model.params import param_counts


def count_by_hand(c: ModelConfig) -> dict[str, int]:
  """Parameters from the weight shapes: q_a_proj D->q_lora, q_a_layernorm, q_b_proj q_lora->H x (nope + rope),
  kv_a_proj_with_mqa D->kv_lora + rope, kv_a_layernorm, kv_b_proj kv_lora->H x (nope + v), o_proj H x v->D;
  indexer wq_b q_lora->H_I x d_I, wk D->d_I, k_norm LayerNorm (weight and bias), weights_proj D->H_I;
  two RMSNorms a layer; dense SwiGLU 3 D I; MoE E experts of 3 D I_moe, shared experts 3 D I_moe each, router D E
  (the e_score_correction_bias buffer is not a parameter); embedding V D, head D V unless tied, final norm D;
  MTP: enorm, hnorm, eh_proj 2D->D, one decoder layer, shared_head norm."""
  d, v, h = c.hidden_size, c.vocab_size, c.num_attention_heads
  dn, dr, dv, qr, kr = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
  attention = d * qr + qr + qr * h * (dn + dr) + d * (kr + dr) + kr + kr * h * (dn + dv) + h * dv * d
  indexer = qr * c.index_n_heads * c.index_head_dim + d * c.index_head_dim + 2 * c.index_head_dim + d * c.index_n_heads
  common = attention + indexer + 2 * d
  dense_layer = common + 3 * d * c.intermediate_size
  expert = 3 * d * c.moe_intermediate_size
  moe_layer = common + c.n_routed_experts * expert + c.n_shared_experts * expert + d * c.n_routed_experts
  n_dense = min(c.first_k_dense_replace, c.num_hidden_layers)
  n_moe = c.num_hidden_layers - n_dense
  total = v * d + (0 if c.tie_word_embeddings else d * v) + d + n_dense * dense_layer + n_moe * moe_layer
  inactive = n_moe * (c.n_routed_experts - c.num_experts_per_tok) * expert
  mtp = sum(
    3 * d + 2 * d * d + (moe_layer if c.num_hidden_layers + k >= c.first_k_dense_replace else dense_layer)
    for k in range(c.num_nextn_predict_layers)
  )
  return {"total": total, "active": total - inactive, "mtp": mtp}


def test_glm5_744b_matches_the_published_figures():
  counts = param_counts(glm5_744b.get_config().model)
  assert counts["total"] == pytest.approx(743.91e9, abs=0.005e9)
  assert counts["active"] == pytest.approx(41.78e9, abs=0.005e9)
  assert counts["mtp"] == pytest.approx(9.95e9, abs=0.005e9)
  assert counts == count_by_hand(ModelConfig.from_dict(glm5_744b.get_config().model))


def test_hand_count_of_the_744b_config_matches_the_figures():
  # The formula itself, checked against the public reference's numbers (so it is not tuned to the code).
  counts = count_by_hand(ModelConfig.from_dict(glm5_744b.get_config().model))
  assert abs(counts["total"] - 743.91e9) < 0.005e9
  assert abs(counts["active"] - 41.78e9) < 0.005e9
  assert abs(counts["mtp"] - 9.95e9) < 0.005e9


@pytest.mark.parametrize(
  "changes",
  [
    {},
    {"tie_word_embeddings": True},
    {"first_k_dense_replace": 0},
    {"first_k_dense_replace": 3},  # all dense main layers; the MTP layer (index 3) is MoE
    {"first_k_dense_replace": 5},  # ... and here the MTP layer (index 3) is dense too
    {"n_shared_experts": 0, "num_nextn_predict_layers": 2},
  ],
)
def test_tiny_config_matches_the_hand_count(changes):
  cfg = ModelConfig.from_dict(glm5_tiny.get_config().model).replace(**changes)
  assert param_counts(cfg) == count_by_hand(cfg)


def test_tiny_config_numbers_by_hand():
  # D=64 V=512 H=4 nope/rope/v=16/8/16 q_lora=kv_lora=32, indexer 4 x 16, I=128, I_moe=32, E=8 (K=2), 1 shared.
  # attention 64*32 + 32 + 32*4*24 + 64*40 + 32 + 32*4*32 + 4*16*64 = 15936; indexer 2048 + 1024 + 32 + 256 = 3360;
  # + 2 norms of 64: 19424 a layer. Dense layer 19424 + 3*64*128 = 44000; MoE layer 19424 + 9*6144 + 64*8 = 75232.
  # Total 2*512*64 + 64 + 44000 + 2*75232 = 260064; inactive 2 layers * 6 experts * 6144 = 73728;
  # MTP 3*64 + 2*64*64 + 75232 = 83616.
  assert param_counts(glm5_tiny.get_config().model) == {"total": 260064, "active": 186336, "mtp": 83616}
  tied = param_counts(ModelConfig.from_dict(glm5_tiny.get_config().model).replace(tie_word_embeddings=True))
  assert tied["total"] == 260064 - 512 * 64  # the head is the only difference
