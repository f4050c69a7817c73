"""glm5_744b's 128K stage (131,072-token sequences) on v5p-1024, in DSA's sparse stage or, with the `warmup`
variant, the indexer's dense warm-up:

  bash scripts/with_env.sh python launch/compile.py --config=configs/glm5_744b_128k.py \
      --topology=v5p:8x8x8  # sparse (top-2048)
  bash scripts/with_env.sh python launch/compile.py --config=configs/glm5_744b_128k.py:warmup \
      --topology=v5p:8x8x8  # dense + indexer KL

GLM-5 extends the context 32K -> 128K -> 200K in mid-training, with DSA adapted first (a dense warm-up of the
indexer, then the sparse stage); docs/glm5_facts.md sections 1 and 3. The layout:
  - mesh context=32 x expert=8 x fsdp=2 (512 chips). Context parallelism (glm_jax/model/context_parallel.py)
    splits each sequence 32 ways, so a chip holds 4,096 of a sequence's tokens, glm5_744b's 4K per-chip scale:
    the layer-boundary residuals (4,096 x 6,144 bf16 a layer, 3.7 GiB over 78 layers under full remat) and the
    MoE's routed tokens are the 4K config's. Attention gathers the whole sequence's 576-wide latent key and
    128-wide indexer key a layer (151 + 34 MB in bf16) and runs the kernels on the chip's two zig-zag chunks.
    Parameters and optimizer state are split over context as over fsdp (the model dimension over fsdp x context),
    so the train state stays 1/512 of the model a chip, as in glm5_744b.
  - batch 16 sequences (the batch axes fsdp x expert = 16): 2.1M tokens a step, glm5_744b's 4K step size.
  - train.loss_chunk 8,192: the head and cross-entropy a strided chunk of tokens at a time, never the
    [4,096 x 154,880] fp32 logits a chip whole (2.4 GiB, and as much again for their gradient).
  - warm-up: dense attention (and the indexer's KL to it) model.attention_chunk=256 query rows at a time, in MLA's
    absorbed form against the gathered keys ([64 heads, 256, 131,072] fp32 scores a block, 8 GiB), never [T, T].
Measured figures are in docs/pods.md ("Long context").
"""

from glm_jax.configs import common, glm5_744b

VARIANTS = ("warmup",)


def get_config(variant: str = ""):
  return long_context(
    "glm5_744b_128k", variant, seq_len=131072, batch_size=16, context=32, attention_chunk=256, loss_chunk=8192
  )


def long_context(
  name: str, variant: str, *, seq_len: int, batch_size: int, context: int, attention_chunk: int, loss_chunk: int
):
  """glm5_744b's config for a long-context stage on the same v5p-1024 (configs/{name}.py; variant "" is
  the sparse stage, "warmup" the DSA warm-up): the sequence, the mesh's context axis, the chunked loss and, for the
  warm-up, blockwise dense attention."""
  warmup = common.variants(variant, f"configs/{name}.py", VARIANTS).warmup
  config = glm5_744b.get_config()
  config.name = name + ("_warmup" if warmup else "")
  config.data.seq_len = seq_len
  config.data.batch_size = batch_size
  config.mesh.context = context
  config.mesh.fsdp = -1  # the rest of the slice
  config.train.loss_chunk = loss_chunk
  config.model.attention_chunk = attention_chunk
  config.train.dsa_stage = "warmup" if warmup else "sparse"
  # GLM-5's rates (G5 2.3): the DSA warm-up (1,000 steps, the indexer alone) at 5e-3, the sparse stage at 1e-5
  config.optimizer.lr = 5e-3 if warmup else 1e-5
  return config
