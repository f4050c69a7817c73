"""Supervised fine-tuning of glm5_tiny with GLM-5's INT4 quantization-aware training (report section 2.4.3).

The SFT data: the embedded King James Bible as prompt/response pairs, one a verse: the prompt is its reference
("Genesis 1:3\\n"), the response its text; the loss counts the response tokens only, examples packed whole into
rows with segment ids. For a jsonl of {"prompt", "response"} lines instead:
  --config.data.source=jsonl --config.data.path=sft.jsonl

QAT: the routed experts' weights are fake-quantized to INT4 in every forward pass (symmetric absmax, groups of
quant.group_size = 32 along each weight's input: 128 in GLM-5 / slime, 32 here because glm5_tiny's widths are 32
and 64), with the straight-through gradient; `launch/quantize.py --scheme=int4 --group_size=32` then packs the
trained weights with the same quantizer, and the packed model computes the QAT model's logits bit for bit.

  bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py --workdir=runs/base     # pretrain first
  bash scripts/with_env.sh python launch/train.py --config=configs/sft_tiny.py --workdir=runs/sft \
      --config.train.init_from=runs/base
  bash scripts/with_env.sh python launch/train.py --config=configs/sft_tiny.py:smoke         # 20 steps: seconds, for CI
"""

import ml_collections

from glm_jax.configs import common, glm5_tiny


VARIANTS = ("smoke",)


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  v = common.variants(variant, "configs/sft_tiny.py", VARIANTS)
  config = glm5_tiny.get_config()
  config.name = "sft_tiny"
  config.trainer = "sft"
  config.data.format = "sft"
  config.data.seq_len = 256  # every verse fits (the longest is 245 tokens); examples are packed whole
  config.data.batch_size = 8
  config.train = common.train(steps=200, eval_every=50, checkpoint_every=100)
  config.optimizer = common.optimizer(lr=1e-3, lr_end=1e-4, warmup_steps=20, decay_steps=180)
  config.quant = common.quant(scheme="int4", group_size=32, scope="routed_experts")
  return common.smoke(config) if v.smoke else config
