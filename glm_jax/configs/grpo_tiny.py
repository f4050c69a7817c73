"""GRPO with IcePop on a verifiable task, small enough for a CPU: glm5_tiny's architecture (MoE, MLA, DSA with
index_topk below the sequence length, so the indexer selects during RL) on a character vocabulary, warm-started
by a brief supervised fine-tuning on one-digit addition (to about 10% exact answers when sampling), then RL
with an exact-match reward: the sampled answers' mean reward climbs past 50% within 200 steps.

  bash scripts/with_env.sh python launch/train.py --config=configs/grpo_tiny.py             # ~5 minutes on a laptop CPU
  bash scripts/with_env.sh python launch/train.py --config=configs/grpo_tiny.py --config.rl.async_rollouts=True \
      --config.rl.objective=async --config.rl.tau=1  # GLM-5's asynchronous form
  bash scripts/with_env.sh python launch/train.py \
      --config=configs/grpo_tiny.py:smoke  # a few steps of everything: seconds
"""

import ml_collections

from glm_jax.configs import common, glm5_tiny


VARIANTS = ("smoke",)


def smoke(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A post-training config as a run of seconds: 4 fine-tuning steps, 2 updates on small batches, evaluated at each."""
  config.sft.steps, config.sft.batch_size = 4, 16
  config.sft.optimizer.warmup_steps, config.sft.optimizer.decay_steps = 1, 3
  config.rl.update(dict(steps=2, prompts_per_step=8, eval_prompts=16, log_every=1, eval_every=2, checkpoint_every=2))
  for spec in config.get("teachers", {}).values():
    spec.sft_steps = 4
  return config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  v = common.variants(variant, "configs/grpo_tiny.py", VARIANTS)
  config = ml_collections.ConfigDict()
  config.name = "grpo_tiny"
  config.trainer = "grpo"  # launch/train.py: "pretrain" | "grpo" | "distill"
  config.model = glm5_tiny.get_config().model
  config.model.vocab_size = 32  # the tasks' character vocabulary (glm_jax/rl/tasks.py) has 18 ids
  config.model.index_topk = 4  # "7+8=15<eos>" is 7 tokens: DSA selects 4 keys for the later ones
  config.model.max_position_embeddings = 64

  # The task mix: {task name: weight and the task's arguments} (glm_jax/rl/tasks.py: addition, sort, reverse).
  config.tasks = ml_collections.ConfigDict()
  config.tasks.addition = ml_collections.ConfigDict(dict(weight=1.0, digits=1))

  # The warm start: supervised fine-tuning on the tasks' demonstrations (skipped when rl.init_from is set).
  sft = config.sft = ml_collections.ConfigDict()
  sft.steps = 60
  sft.batch_size = 64
  sft.seq_len = 8
  sft.optimizer = glm5_tiny.get_config().optimizer
  sft.optimizer.lr = 3e-3
  sft.optimizer.warmup_steps = 20
  sft.optimizer.decay_steps = 40
  sft.optimizer.lr_end = 3e-4
  # The pretraining step's settings (glm_jax/train/step.py; glm_jax/train/config.py's default_train_config
  # documents each one).
  # Its DSA stage is not set here: sparse when DSA is active at sft.seq_len (seq_len > model.index_topk), else dense.
  sft.train_step = ml_collections.ConfigDict(
    dict(
      microbatches=1,
      grad_clip_norm=1.0,
      mtp_loss_weight=0.3,
      balance_loss_weight=1e-4,
      indexer_loss_weight=1.0,
      expert_bias_rate=1e-3,
      spike_factor=0.0,  # no loss-spike skipping: a fine-tuning of tens of steps has no settled running mean
      spike_min_steps=0,
      spike_ema=0.99,
    )
  )

  # The loop (configs/common.py's rl(): GLM-5's Eq. 1 with IcePop, beta 2, clipping 0.2 / 0.28, no KL, the indexer
  # frozen), 200 steps of 64 prompts x 8 answers (GLM-5: 32 x 32).
  config.rl = common.rl(steps=200, prompts_per_step=64, group_size=8, max_new_tokens=3)

  # The RL optimizer (the SFT has its own above).
  o = config.optimizer = glm5_tiny.get_config().optimizer
  o.name = "adamw"
  o.lr = 3e-4  # RL moves far less than pretraining (3e-3); 1e-3 learned faster at first but less reliably
  o.lr_init = 0.0
  o.warmup_steps = 5
  o.schedule = "constant"
  o.weight_decay = 0.0
  o.b2 = 0.99
  return smoke(config) if v.smoke else config
