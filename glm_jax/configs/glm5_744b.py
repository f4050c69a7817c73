"""GLM-5 744B-A40B as released (HF GlmMoeDsaConfig defaults = zai-org/GLM-5 config.json; G5 Table 10).

Field names under `model` are HF GlmMoeDsaConfig's; see glm_jax/model/config.py for the few of ours. The data,
train, mesh and optimizer sections are pretraining at 4096 tokens on a v5p-1024 (GLM-5's own batch schedule is
not published); configs/glm5_744b_128k.py is the long-context stage.
"""

import ml_collections

from glm_jax.configs import common


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.name = "glm5_744b"
  # The released model is configs/common.py's model() (ModelConfig's defaults: 78 layers, 3 dense then 75 MoE of
  # 256 routed experts, 8 a token, and one shared; MLA with q / kv ranks 2048 / 512; DSA's indexer picking 2048
  # keys; one MTP layer). GLM-5.2's IndexShare: --config.model.indexer_types=FSF ("S" layers reuse the previous
  # "F" layer's top-k).
  config.model = common.model(
    attention_impl="pallas",  # DSA's kernels (compiled on TPU; the reference on a GPU, interpret mode on CPU)
    dtype="bfloat16",  # matmuls in bf16 with fp32 accumulation; softmax, router, losses in fp32
    remat_policy="full",
    moe_buffer_factor=2.0,
  )  # expert parallelism's fast path (see the mesh below)

  # Pretraining data: point data.path at ArrayRecord (or jsonl / text) shards and data.tokenizer at GLM-5's
  # tokenizer.json (vocab 154880); launch/compile.py needs only seq_len and batch_size.
  config.data = common.data(
    source="arrayrecord",
    bpe_vocab_size=154880,
    seq_len=4096,
    # 4M tokens a step, two sequences a chip on v5p-1024: the weights' all-gathers are
    # shared by twice the tokens, and it still fits the chip's HBM (docs/pods.md's
    # table of levers has the figures)
    batch_size=1024,
    eval_fraction=0.0,
  )
  config.train = common.train(steps=100_000, eval_every=1000, checkpoint_every=1000)
  # XLA:TPU's async collective fusion and overlap flags. Its all-gather fusion (which overlapped some of the
  # partitioner's FSDP all-gathers with compute under libtpu 0.0.42) is not among them: under libtpu 0.0.50 it leaves
  # them synchronous on v5p, and with --xla_enable_async_all_gather the compile fails ("Continuation fusion for
  # AllGather ... not supported/recommended on platforms other than TPU v5e").
  # The expert exchange stays synchronous (libtpu 0.0.50 makes a ragged all-to-all of blocks async by default): the
  # async form hides part of it but keeps its buffers live longer, past the chip's HBM (bench_pod.py's
  # 4k_dense_async_ragged; docs/pods.md's table of levers). The scheduler tracks memory pressure, as MaxText's v5p
  # recipes have it: under libtpu 0.0.50 the Muon step takes 82.37 GiB a chip with it and 96.85 GiB, over HBM,
  # without (docs/pods.md).
  config.train.xla_flags = " ".join(
    [
      "--xla_tpu_enable_async_ragged_all_to_all=false",
      "--xla_tpu_enable_scheduler_memory_pressure_tracking=true",
      "--xla_tpu_enable_all_experimental_scheduler_features=true",
      "--xla_tpu_enable_async_collective_fusion=true",
      "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
      "--xla_tpu_overlap_compute_collective_tc=true",
      "--xla_enable_async_all_gather=true",
    ]
  )

  # The mesh for v5p-1024 (512 chips; `python launch/compile.py --config=configs/glm5_744b.py --topology=v5p:8x8x8`
  # prints its memory a chip, docs/pods.md has the figures). On other slices fsdp = -1 takes the rest.
  # - fsdp 64 x expert 8 shards every parameter 512 ways (the routed experts' experts dimension over expert, the
  #   rest over fsdp x expert) together with its gradient and Muon momentum. data = 1 because a data axis
  #   replicates it.
  # - expert 8: the dropless ragged all-to-all's receive buffer holds the worst case, P x n x K rows (P the expert
  #   axis, n = 8192 tokens a chip, K = 8), 6 GiB in bf16 at P = 8 (the grouped matmul runs only the real rows);
  #   P = 16 doubles it; model.moe_capacity_factor bounds it (glm_jax/model/moe_parallel.py). 32 experts a chip.
  #   model.moe_buffer_factor = 2 adds a fast path with a buffer of 2 x n x K rows (1.5 GiB), taken while no shard
  #   receives more (balanced routing loads each with n x K), so the buffer-sized work (relayouts, elementwise
  #   ops) is a quarter of the worst case's; skewed routing takes the worst-case buffer, dropless either way.
  # - tensor 1: at 4096 tokens the reference attention's [64 heads, T, T] fp32 scores (4 GiB) fit, and every
  #   chip keeps sequences of its own (the batch is split over data x fsdp x expert = 512).
  config.mesh = common.mesh(expert=8)

  # GLM-5's Muon and LR range are configs/common.py's defaults; the decay fills the rest of the run.
  config.optimizer = common.optimizer(decay_steps=98_000)
  return config
