"""GLM-5 744B-A40B as released (HF GlmMoeDsaConfig defaults = zai-org/GLM-5 config.json; G5 Table 10).

Field names under `model` are HF GlmMoeDsaConfig's; see glm_jax/model/config.py for the few of ours.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.name = "glm5_744b"
  m = config.model = ml_collections.ConfigDict()
  m.vocab_size = 154880
  m.hidden_size = 6144
  m.intermediate_size = 12288  # dense MLP of the first 3 layers
  m.moe_intermediate_size = 2048
  m.num_hidden_layers = 78  # 3 dense + 75 MoE
  m.first_k_dense_replace = 3
  m.num_nextn_predict_layers = 1  # MTP, stored as layer 78
  m.num_attention_heads = 64
  m.num_key_value_heads = 64
  m.q_lora_rank = 2048
  m.kv_lora_rank = 512
  m.qk_nope_head_dim = 192
  m.qk_rope_head_dim = 64
  m.v_head_dim = 256
  m.n_routed_experts = 256
  m.n_shared_experts = 1
  m.num_experts_per_tok = 8
  m.routed_scaling_factor = 2.5
  m.n_group = 1
  m.topk_group = 1
  m.norm_topk_prob = True
  m.index_topk = 2048
  m.index_n_heads = 32
  m.index_head_dim = 128
  m.rope_theta = 1e6
  m.rope_interleave = True
  m.indexer_rope_interleave = True
  m.max_position_embeddings = 202752
  m.rms_norm_eps = 1e-5
  m.tie_word_embeddings = False
  m.initializer_range = 0.02
  m.use_dsa = True
  m.attention_impl = "reference"
  m.dtype = "bfloat16"  # matmuls in bf16 with fp32 accumulation; softmax, router, losses in fp32
  m.param_dtype = "float32"
  m.remat_policy = "full"
  return config
