"""On-policy distillation from two teachers, small enough for a CPU (GLM-5's cross-stage distillation, Eq. 2).

Two teachers, each fine-tuned here on its own task (addition, sort) unless teachers.<name>.init_from names a
workdir with its checkpoint, and a student warm-started briefly on both. Each step samples one answer per
prompt from the student, prompts mixed from the teachers' tasks by weight; the teacher of each prompt's task
scores the student's tokens, and the advantage of each token is sg(log p_teacher - log p_student). The
student's per-token KL to its teachers (metrics: teacher_kl, teacher_kl/<name>) falls.

  bash scripts/with_env.sh python launch/train.py --config=configs/distill_tiny.py          # ~5 minutes on a laptop CPU
  bash scripts/with_env.sh python launch/train.py \
      --config=configs/distill_tiny.py:smoke  # a few steps of everything: seconds
"""

import ml_collections

from glm_jax.configs import common, grpo_tiny


def teacher(task: str, weight: float, seed: int, **task_kwargs) -> ml_collections.ConfigDict:
  """A teachers.<name> section: its task (a task, or with rl.tokenizer="model" an environment) and arguments."""
  return ml_collections.ConfigDict(
    dict(
      task=task,
      task_kwargs=ml_collections.ConfigDict(task_kwargs),
      weight=weight,
      init_from="",  # a workdir whose latest checkpoint is this teacher (else it is fine-tuned here, sft_steps)
      sft_steps=300,
      seed=seed,  # the fine-tuning's other settings are the student's sft section's
      model=ml_collections.ConfigDict(),  # overrides of the student's model fields (same vocab_size)
    )
  )


VARIANTS = ("smoke",)


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  v = common.variants(variant, "configs/distill_tiny.py", VARIANTS)
  config = grpo_tiny.get_config()
  config.name = "distill_tiny"
  config.trainer = "distill"
  del config["tasks"]
  config.teachers = ml_collections.ConfigDict()
  config.teachers.addition = teacher("addition", 0.5, seed=1, digits=1)
  config.teachers.sort = teacher("sort", 0.5, seed=2, length=3)
  config.sft.steps = 30  # the student's warm start (on both teachers' tasks): a weak earlier-stage model
  config.sft.seq_len = 9  # "s312=123<eos>"
  config.rl.max_new_tokens = 4
  config.rl.steps = 200
  config.rl.prompts_per_step = 64
  config.rl.group_size = 1  # distillation needs no group: the teacher gives every token its advantage
  config.rl.eval_every = 20
  config.optimizer.lr = 1e-3  # the advantages are log-prob gaps, not normalized: larger steps than GRPO's
  config.optimizer.lr_init = 0.0
  return grpo_tiny.smoke(config) if v.smoke else config
