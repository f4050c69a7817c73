"""GLM-130B's recipe at a size that trains on a CPU: blank infilling, DeepNorm, 2-D rope, embedding gradient shrink.

GLM-130B's shape in small: a dense decoder (no MoE layers, no DSA selection, no MTP), Post-LN DeepNorm layers
(alpha = (2N)^1/2, Xavier init with beta = (2N)^-1/2 on the FFN, v_proj and out_proj), GLM's 2-D positions in the
rotary embedding, embedding gradient shrink alpha = 0.1, trained on the embedded corpus with the autoregressive
blank-infilling objective: per document, 30% [MASK] (Poisson(3) spans, 15% of the tokens) and 70% [gMASK] (one span
of 50-100% at the end), bidirectional attention over the context, spans generated after <sop> until <eop>. The
attention is still GLM-5's MLA (this codebase's one attention), where GLM-130B had plain multi-head attention.
The final JSON line adds the held-out infilling loss and eval_span_exact: the share of held-out spans that greedy
decoding fills exactly.

Variants (`--config=configs/glm130b_tiny.py:<variant>`):
  causal  the same model trained on the same documents as a plain causal LM (data.objective "lm"; the block
          positions are then all 0): the baseline of experiments/glm_infilling.py
  smoke   20 steps: seconds, for CI

  bash scripts/with_env.sh python launch/train.py --config=configs/glm130b_tiny.py --workdir=runs/glm130b
  bash scripts/with_env.sh python launch/sample.py --workdir=runs/glm130b \\
      --prompt="In the beginning God created the [MASK] and the earth." --infill
"""

import ml_collections

from glm_jax.configs import common, glm5_tiny

VARIANTS = ("causal", "smoke")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  v = common.variants(variant, "configs/glm130b_tiny.py", VARIANTS)
  config = glm5_tiny.get_config()
  config.name = "glm130b_tiny"
  m = config.model
  m.num_hidden_layers = 4
  m.first_k_dense_replace = 4  # every layer dense, as GLM-130B
  m.intermediate_size = 176  # ~ 8/3 x hidden_size, GLM-130B's GeGLU ratio (here SwiGLU)
  m.num_nextn_predict_layers = 0
  m.use_dsa = False
  m.norm_style = "deepnorm"
  m.rope_2d = True
  m.qk_rope_head_dim = 32  # GLM-130B rotates the whole head; 2-D halves it: 8 frequencies for each position id
  m.index_head_dim = 32  # (no DSA here; the config check wants the indexer head to hold the rope)
  config.data = common.data(seq_len=256, batch_size=16, objective="glm")
  config.train = common.train(steps=600, embedding_grad_shrink=0.1)
  config.optimizer = common.optimizer(lr=3e-3, lr_end=3e-4, warmup_steps=50, decay_steps=550)
  if v.causal:
    config.name = "glm130b_tiny_causal"
    config.data.objective = "lm"
  if v.smoke:
    common.smoke(config)
  return config
