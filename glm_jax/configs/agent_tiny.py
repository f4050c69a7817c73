"""Agentic GRPO on CPU: glm5_tiny (BPE vocabulary of 512, the chat format's tokens included) plays two tool
environments in GLM-5's chat format (glm_jax/rl/environment.py), multi-turn, through the agent loop on the KV cache:
  calculator    "What is 48 * 73?" with the calculator tool
  verse_lookup  "What is the last word of John 11:35?" with the lookup_verse tool over the embedded corpus
Warm start: rl.init_from (a pretraining run of glm5_tiny: its tokenizer is the run's), else sft.steps of agentic SFT on
the environments' scripted demonstrations (loss on the model's turns only). experiments/agent_tools.py measures it.

  bash scripts/with_env.sh python launch/train.py --config=configs/agent_tiny.py \
      --config.rl.init_from=workdirs/glm5_tiny
  bash scripts/with_env.sh python launch/train.py --config=configs/agent_tiny.py:smoke      # a few steps of everything
  bash scripts/with_env.sh python launch/train.py --config=configs/agent_tiny.py:distill \
      --config.teachers.calculator.init_from=RUN ...
                         # on-policy distillation on the same environments, a teacher an environment (GLM-5 Eq. 2)
"""

import ml_collections

from glm_jax.configs import common, distill_tiny, glm5_tiny, grpo_tiny

# smoke: a few steps of SFT and RL on small batches, for tests. distill: trainer "distill", the tasks section turned
# into teachers (one an environment, labelled as the task was), each its init_from or fine-tuned here like the student.
VARIANTS = ("smoke", "distill")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  v = common.variants(variant, "configs/agent_tiny.py", VARIANTS)
  base = glm5_tiny.get_config()
  config = ml_collections.ConfigDict()
  config.name = "agent_tiny"
  config.trainer = "grpo"
  config.model = base.model
  # Episodes are 600-1000 tokens, most of them the tools' block. With index_topk at cache_len every query keeps all its
  # keys: DSA's top-k selection at these lengths costs a CPU more than the rest of the step (docs/post_training.md),
  # and the agentic recipe, not the indexer, is what this config is for.
  config.model.index_topk = 1024
  config.data = base.data  # the trained BPE (its cache key: the corpus and bpe_vocab_size), as glm5_tiny's runs use

  # The environments: {label: weight, the environment (registered name or import path) and its arguments}.
  config.tasks = ml_collections.ConfigDict()
  # A well-formed tool call that ran, then a wrong answer, earns format_reward: a first signal for GRPO where exact
  # answers are rare after the SFT.
  config.tasks.calculator = ml_collections.ConfigDict(dict(weight=1.0, digits=2, ops="*", format_reward=0.1))
  config.tasks.verse_lookup = ml_collections.ConfigDict(dict(weight=1.0, format_reward=0.1))

  sft = config.sft = grpo_tiny.get_config().sft
  # 400 steps taught the form (well-formed calls) but not copying: the model called the tool with other numbers and
  # answered other words (0-2% success); 1200 steps copy the calculator's arguments and result exactly (docs/results.md)
  sft.steps = 1200
  sft.batch_size = 8
  sft.seq_len = 1024  # a demonstration with the tools' block is 600-900 tokens
  sft.optimizer.warmup_steps = 30
  sft.optimizer.decay_steps = 1170

  config.rl = common.rl(
    steps=100,
    prompts_per_step=8,
    group_size=4,
    tokenizer="model",
    max_turns=3,
    max_turn_tokens=64,
    cache_len=1024,
    eval_prompts=32,
    eval_every=25,
    checkpoint_every=25,
    tool_timeout=5.0,
  )
  config.optimizer = grpo_tiny.get_config().optimizer
  if v.distill:
    config.trainer = "distill"
    config.teachers = ml_collections.ConfigDict()
    for label, spec in config.tasks.items():
      kwargs = {k: val for k, val in spec.items() if k != "weight"}
      config.teachers[label] = distill_tiny.teacher(label, spec.weight, seed=1 + len(config.teachers), **kwargs)
    del config["tasks"]
    config.rl.group_size = 1  # the teacher scores every token: no group needed
    config.rl.prompts_per_step = 16
  if v.smoke:
    sft.steps, sft.batch_size = 2, 2
    config.rl.steps, config.rl.prompts_per_step, config.rl.group_size = 2, 2, 1 if v.distill else 2
    config.rl.eval_prompts, config.rl.max_turn_tokens = 2, 16
  for t in config.get("teachers", {}).values():  # a teacher without init_from is fine-tuned as long as the student
    t.sft_steps = sft.steps
  return config
