"""glm5_744b's long-context stage: 128K-token sequences in DSA's sparse stage (index_topk 2048 keys a query).

GLM-5 extends the context 32K -> 128K -> 200K in mid-training, with DSA adapted first (dense warm-up of the
indexer, then the sparse stage); see docs/glm5_facts.md sections 1 and 3. This config is that step's shape:

  python launch/compile.py --config=configs/glm5_744b_128k.py --topology=v5p:8x8x8

It does NOT fit yet, and compile.py says so (fits: false, with XLA's figure). With the DSA kernels
(attention_impl="pallas", inherited from glm5_744b) XLA asks for 976.6 GiB of temporaries a v5p chip (of 95.7);
with the pure-jnp reference, which materializes the indexer's [T, S] scores (T = S = 131072, fp32: 64 GiB per
head-summed score matrix and more per indexer head) and a [T, S] mask, it asked for 3.71 TiB. What is left:
  1. Context parallelism: a `context` mesh axis splitting each sequence's tokens (and its all-gathered latent
     KV cache, 576 numbers a token) over chips. With one 128K sequence per chip, the per-layer residual that
     full remat keeps is 131072 x 6144 bf16 = 1.5 GiB, x 78 layers = 117 GiB, more than a v5p chip's HBM, before
     any attention. Splitting tokens 8 ways brings that to 15 GiB and n (tokens a chip routes to experts) back
     to glm5_744b's 16384-token scale.
  2. Or, without context parallelism, remat offload of those residuals to host memory (jax's
     save_and_offload_only_these_names) and microbatches.
"""

from configs import glm5_744b


def get_config():
  config = glm5_744b.get_config()
  config.name = "glm5_744b_128k"
  config.data.seq_len = 131072
  config.data.batch_size = 512  # one sequence per batch shard: 67M tokens a step (GLM-5: 14 x 202752 in warm-up)
  config.train.dsa_stage = "sparse"
  config.optimizer.lr = 1e-5  # GLM-5's sparse-stage rate (G5: 20B tokens at 1e-5)
  return config
