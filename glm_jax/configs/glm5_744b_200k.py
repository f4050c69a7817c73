"""glm5_744b's last context stage, 202,752-token sequences (GLM-5's 200K: its DSA warm-up ran 1,000 steps of
14 x 202,752 tokens), on v5p-1024, in the sparse stage or, with the `warmup` variant, the indexer's dense warm-up:

  bash scripts/with_env.sh python launch/compile.py --config=configs/glm5_744b_200k.py --topology=v5p:8x8x8
  bash scripts/with_env.sh python launch/compile.py --config=configs/glm5_744b_200k.py:warmup --topology=v5p:8x8x8

As configs/glm5_744b_128k.py, with the sequence split 64 ways (mesh context=64 x expert=8, fsdp=1): a chip holds
3,168 of a sequence's tokens (202,752 = 64 x 3,168, two zig-zag chunks of 1,584), at most glm5_744b's 4K per-chip
scale; context=32 would put 6,336 tokens on a chip, half as much again as the 4K step's, whose temporaries
already take most of a chip. The batch is then 8 sequences (the batch axes expert x fsdp = 8), 1.6M tokens a step:
GLM-5's 14 does not divide over a slice's batch shards. The warm-up's dense attention goes 144 query rows at a
time (1,584 = 11 x 144): [64 heads, 144, 202,752] fp32 scores a block, 7.0 GiB. The loss takes 6,336 tokens of a
row at a time (8,192 does not divide 202,752).
"""

from glm_jax.configs.glm5_744b_128k import VARIANTS, long_context  # noqa: F401 - its variants are the 128K config's


def get_config(variant: str = ""):
  return long_context(
    "glm5_744b_200k", variant, seq_len=202752, batch_size=8, context=64, attention_chunk=144, loss_chunk=6336
  )
