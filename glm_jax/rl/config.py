"""The post-training config's checks and the task mix it names; everything here runs before any work starts.

A post-training config (configs/grpo_tiny.py, configs/distill_tiny.py) has the sections
  model      the policy's architecture (glm_jax/model)
  optimizer  the RL optimizer (glm_jax/train/optimizers.py)
  rl         the loop: steps, sampling, the objective and its clipping, IcePop, async rollouts, logging
  sft        the warm start's supervised fine-tuning: steps, batch_size, seq_len, its own optimizer, and
             train_step, the pretraining step's settings (glm_jax/train/step.py) it runs with
  tasks      (trainer "grpo") {label: {weight, task, the task's arguments}}; task (optional, else the label) is a
             name of glm_jax/rl/tasks.py's TASKS or the import path of a Task class, "package.module:TaskClass"
  teachers   (trainer "distill") {name: {task, task_kwargs, weight, init_from, sft_steps, seed, model}}; with
             rl.tokenizer="model" each task names an environment (glm_jax/rl/environment.py) the teacher knows
  quant      (optional) INT4 quantization-aware RL (glm_jax/model/quantization.py, slime's recipe): the updates
             fake-quantize the planned weights and the rollouts sample from them packed by the same quantizer
rl.reward is a name of glm_jax/rl/rewards.py's REWARD_FNS or the import path of a reward factory
("package.module:make_reward"): a new task and its reward live in a module of their own (docs/post_training.md).
`validate_rl_config` checks them, naming the field, its value and what is valid; `task_mix` is the run's
[(task, weight)].
"""

from __future__ import annotations

import importlib.util

import ml_collections
import numpy as np

from glm_jax.inference.sampling import MIN_TEMPERATURE
from glm_jax.model.quantization import WEIGHT_ONLY, check_quant_config
from glm_jax.rl import losses, rewards as rewards_lib, step as rl_step, tasks as tasks_lib
from glm_jax.train.config import invalid, require_sections, validate_step_config
from glm_jax.train.optimizer_config import checked_optimizer_config

TRAINERS = ("pretrain", "sft", "grpo", "distill")  # config.trainer's values; launch/train.py dispatches on it
TOKENIZERS = ("char", "model")  # rl.tokenizer
_RL_POSITIVE_INTS = (
  "max_turns",
  "max_turn_tokens",
  "cache_len",
  "tool_max_output_chars",
  "tool_workers",
  "steps",
  "prompts_per_step",
  "group_size",
  "max_new_tokens",
  "log_every",
  "eval_every",
  "eval_prompts",
  "checkpoint_every",
  "keep_checkpoints",
  "max_pending",
)


def default_rl_config() -> ml_collections.ConfigDict:
  """Every field of the `rl` section (configs/common.py's rl()); where GLM-5 publishes a value it is the default
  (Eq. 1: IcePop with beta 2, clipping 0.2 / 0.28, no KL, groups of 32; its RL keeps the indexer fixed)."""
  c = ml_collections.ConfigDict()
  c.steps = 200
  c.seed = 0
  c.init_from = ""  # a workdir whose latest checkpoint (same model) starts the run instead of the SFT
  c.prompts_per_step = 32
  c.group_size = 32  # answers a prompt; advantages are normalized within each group
  c.max_new_tokens = 3
  c.temperature = 1.0
  c.top_p = 1.0
  c.reward = "exact_match"  # a name of glm_jax/rl/rewards.py's REWARD_FNS, or "package.module:make_reward"
  c.objective = "grpo"  # "grpo" (Eq. 1) | "async" (Eq. 3-5; needs async_rollouts)
  c.eps_low = 0.2
  c.eps_high = 0.28
  c.is_correction = "icepop"  # "icepop" | "truncated" | "none": the train/inference mismatch weight
  c.icepop_beta = 2.0
  c.tis_cap = 2.0  # the truncated-IS weight's cap
  c.kl_coef = 0.0  # KL to the warm-started policy (GLM-5 removes it)
  c.grad_clip_norm = 1.0
  c.max_consecutive_skips = 10  # stop (non-zero exit) after this many skipped updates in a row; 0 = never
  c.freeze_indexer = True  # GLM-5's RL keeps the indexer fixed (its top-k is deterministic here on every path)
  c.rollout_dtype = ""  # "" = the model's; "bfloat16" samples in bf16 while training in fp32 (a real mismatch)
  c.speculate = 0  # k >= 1: rollouts draft k tokens a round with the MTP layer (slime's speculative rollouts)
  c.async_rollouts = False  # a background rollout worker generating with tagged weights
  c.tau = 1  # drop rollouts more than tau versions behind the trainer (async)
  c.max_pending = 2  # rollouts the worker may queue ahead (async)
  # The rollout engine in its own process (glm_jax/rl/rollout_engine.py; async only): weights pushed by version over
  # a localhost socket, heartbeats, a worker that stops answering replaced and its requests retried.
  c.rollout_process = False
  c.heartbeat_every = 1.0  # seconds between the worker's heartbeats
  c.heartbeat_timeout = 30.0  # seconds without one before the worker is replaced
  c.worker_start_timeout = 300.0  # seconds a new worker may take to start (imports, compiling) before its first beat
  c.handshake_timeout = 30.0  # seconds to connect to a started worker and authenticate both ways, else it is replaced
  c.max_worker_restarts = 3  # replacements before the run fails
  # Rollouts through the serving engines' HTTP API (glm_jax/rl/rollout_server.py; GRPO, asynchronous or not, and
  # distillation; the single-turn tasks and the agent loop's episodes): rollout_engines engine processes behind
  # SGLang's router, weights pushed through their /update_weights.
  c.rollout_server = False
  c.rollout_engines = 1
  c.rollout_max_running = 64  # requests an engine decodes together
  # Agentic RL (glm_jax/rl/environment.py, agent_loop.py, agentic.py): rl.tokenizer="model" plays environments in
  # GLM-5's chat format with the model's tokenizer (rl.init_from's recorded one, else config.data's): GRPO the tasks
  # section's, distillation each teacher's (teachers.<name>.task names an environment); "char" keeps
  # glm_jax/rl/tasks.py's single-turn tasks on their character vocabulary.
  c.tokenizer = "char"
  c.rollout_fn = ""  # "" = agentic.default_rollout (group_size episodes a task), or "package.module:function"
  c.max_turns = 4  # the model's turns an episode
  c.max_turn_tokens = 64  # tokens the model may write in one turn
  c.cache_len = 1024  # an episode's whole sequence (prompt with the tools' block, turns, tool results), at most
  c.enable_thinking = True  # the generation prompt opens <think>
  c.clear_thinking = True  # GLM-5's default: reasoning of turns before the last user message is not shown again
  c.tool_timeout = 10.0  # seconds a tool call may run (its worker is killed past it; the model reads an error)
  c.tool_max_output_chars = 1024  # a tool's result is cut past this many characters
  c.tool_workers = 2  # tool worker processes (glm_jax/rl/tools.py ToolRunner)
  c.eval_prompts = 256  # held-out problems answered greedily for eval_accuracy
  c.eval_every = 50
  c.log_every = 1
  c.checkpoint_every = 50
  c.keep_checkpoints = 2
  c.tensorboard = True
  return c


def validate_rl_config(config: ml_collections.ConfigDict) -> None:
  """Checks config.trainer, that the sections it needs are there, and config.rl, config.sft.train_step and the
  tasks / teachers sections the trainer reads."""
  if config.trainer not in ("grpo", "distill"):
    invalid("trainer", config.trainer, "rl.trainer.run takes 'grpo' or 'distill'")
  require_sections(
    config,
    ("model", "rl", "sft", "optimizer", "tasks" if config.trainer == "grpo" else "teachers"),
    f"trainer {config.trainer!r}",
    "configs/grpo_tiny.py and configs/distill_tiny.py",
  )
  rl = config.rl
  _validate_rl_section(rl)
  checked_optimizer_config(config.optimizer)  # the policy's optimizer, checked before the warm start builds it
  if "optimizer" in config.sft:
    try:
      checked_optimizer_config(config.sft.optimizer)
    except ValueError as e:
      raise ValueError(f"sft.{e}") from e
  if rl.speculate and config.model.num_nextn_predict_layers < 1:
    invalid(
      "rl.speculate",
      rl.speculate,
      "speculative rollouts draft with the MTP layer, but "
      f"model.num_nextn_predict_layers={config.model.num_nextn_predict_layers}",
    )
  if rl.tokenizer not in TOKENIZERS:
    invalid("rl.tokenizer", rl.tokenizer, f"one of {TOKENIZERS}")
  if rl.tokenizer == "model":
    _validate_agentic(config)
  elif rl.rollout_fn:
    invalid("rl.rollout_fn", rl.rollout_fn, "a custom rollout function plays environments: set rl.tokenizer='model'")
  if config.trainer == "grpo":
    if rl.group_size < 2:
      invalid("rl.group_size", rl.group_size, "GRPO needs >= 2 answers a prompt (advantages are group-normalized)")
    if rl.tokenizer == "char":
      _task_weights(config.tasks, "tasks")
  if config.trainer == "distill":
    _validate_distill(config)
  _validate_sft_train_step(config.sft)
  if "quant" in config:  # QAT of the policy, its rollouts sampled from the packed weights
    check_quant_config(config.quant)
    if config.quant.scheme not in ("none",) + WEIGHT_ONLY:
      invalid("quant.scheme", config.quant.scheme, f"quantization-aware RL takes {list(WEIGHT_ONLY)} (or 'none')")


def _validate_rl_section(rl: ml_collections.ConfigDict) -> None:
  for field in _RL_POSITIVE_INTS:
    if not isinstance(rl[field], int) or rl[field] <= 0:
      invalid(f"rl.{field}", rl[field], "must be a positive integer")
  if not isinstance(rl.max_consecutive_skips, int) or rl.max_consecutive_skips < 0:
    invalid("rl.max_consecutive_skips", rl.max_consecutive_skips, "must be an integer >= 0 (0 = never stop)")
  if not isinstance(rl.tau, int) or rl.tau < 0:
    invalid("rl.tau", rl.tau, "must be an integer >= 0 (versions a rollout may lag the trainer)")
  if not rl.temperature >= MIN_TEMPERATURE:
    invalid(
      "rl.temperature",
      rl.temperature,
      f"must be at least {MIN_TEMPERATURE} (RL samples; the log-probs are of logits / temperature)",
    )
  if not 0 < rl.top_p <= 1:
    invalid("rl.top_p", rl.top_p, "must be in (0, 1]")
  try:
    rewards_lib.make_reward_fn(rl.reward, tasks_lib.CharVocab())
  except ValueError as e:
    invalid("rl.reward", rl.reward, str(e))
  if rl.objective not in rl_step.OBJECTIVES:
    invalid("rl.objective", rl.objective, f"one of {rl_step.OBJECTIVES}")
  if rl.objective == "async" and not rl.async_rollouts:
    invalid("rl.objective", rl.objective, "'async' (Eq. 3-5) needs rl.async_rollouts=True")
  if rl.is_correction not in losses.IS_CORRECTIONS:
    invalid("rl.is_correction", rl.is_correction, f"one of {losses.IS_CORRECTIONS}")
  if not 0 <= rl.eps_low < 1:
    invalid("rl.eps_low", rl.eps_low, "must be in [0, 1)")
  if not rl.eps_high >= 0:
    invalid("rl.eps_high", rl.eps_high, "must be >= 0")
  if not rl.icepop_beta > 1:
    invalid("rl.icepop_beta", rl.icepop_beta, "must be > 1 (tokens are kept where 1/beta <= rho <= beta)")
  if not rl.tis_cap > 0:
    invalid("rl.tis_cap", rl.tis_cap, "must be > 0 (the cap of the truncated importance weight)")
  for field in ("kl_coef", "grad_clip_norm"):
    if not rl[field] >= 0:
      invalid(f"rl.{field}", rl[field], "must be >= 0")
  if rl.rollout_dtype not in ("", "float32", "bfloat16"):
    invalid("rl.rollout_dtype", rl.rollout_dtype, "'' (the model's dtype), 'float32' or 'bfloat16'")
  if rl.rollout_process:
    if not rl.async_rollouts:
      invalid(
        "rl.rollout_process",
        rl.rollout_process,
        "the rollout engine apart from the trainer is asynchronous: set rl.async_rollouts=True",
      )
    for field in ("heartbeat_every", "heartbeat_timeout", "worker_start_timeout", "handshake_timeout"):
      if not rl[field] > 0:
        invalid(f"rl.{field}", rl[field], "must be > 0 (seconds)")
    if not rl.heartbeat_timeout > rl.heartbeat_every:
      invalid("rl.heartbeat_timeout", rl.heartbeat_timeout, f"must exceed rl.heartbeat_every={rl.heartbeat_every}")
    if not isinstance(rl.max_worker_restarts, int) or rl.max_worker_restarts < 0:
      invalid("rl.max_worker_restarts", rl.max_worker_restarts, "must be an integer >= 0")
  if rl.rollout_server:
    missing = [m for m in ("httpx", "uvicorn", "fastapi", "sglang_router") if importlib.util.find_spec(m) is None]
    if missing:
      invalid(
        "rl.rollout_server", rl.rollout_server, f'needs the serve extra (pip install "glm-jax[serve]"): {missing}'
      )
    why = {
      "rl.rollout_process": (rl.rollout_process, "one rollout engine at a time: rl.rollout_server or this"),
      "rl.speculate": (bool(rl.speculate), "the rollouts through the engines decode without MTP drafts: 0"),
    }
    for field, (bad, valid) in why.items():
      if bad:
        invalid(field, rl[field.split(".")[1]], f"with rl.rollout_server=True: {valid}")
    for field in ("rollout_engines", "rollout_max_running"):
      if isinstance(rl[field], bool) or not isinstance(rl[field], int) or rl[field] < 1:
        invalid(f"rl.{field}", rl[field], "must be a positive integer")
  speculate = rl.speculate
  if isinstance(speculate, bool) or not isinstance(speculate, int) or speculate < 0:
    invalid("rl.speculate", speculate, "must be an integer >= 0 (0: plain decoding; k: MTP drafts a round)")


def _validate_agentic(config: ml_collections.ConfigDict) -> None:
  """rl.tokenizer="model": environments in the tasks section (GRPO) or the teachers' (distillation), a rollout
  function that imports, bounded tools, and only what the agent loop supports."""
  rl = config.rl
  if rl.speculate:
    invalid("rl.speculate", rl.speculate, "the agent loop decodes without MTP drafts; not with rl.tokenizer='model'")
  if not (isinstance(rl.tool_timeout, (int, float)) and 0 < rl.tool_timeout < float("inf")):
    invalid("rl.tool_timeout", rl.tool_timeout, "must be a finite number of seconds > 0")
  if rl.tool_max_output_chars < 100:
    invalid("rl.tool_max_output_chars", rl.tool_max_output_chars, "must be >= 100 (room for the truncation marker)")
  if rl.cache_len > config.model.max_position_embeddings:
    limit = config.model.max_position_embeddings
    invalid("rl.cache_len", rl.cache_len, f"must be <= model.max_position_embeddings={limit}")
  if "data" not in config and not rl.init_from:
    invalid("rl.tokenizer", rl.tokenizer, "'model' takes rl.init_from's recorded tokenizer or config.data's: give one")
  from glm_jax.rl import agentic  # the agentic modules import the tokenizer and the agent loop

  agentic.load_rollout_fn(rl.rollout_fn)
  environment_mix(config)


def environment_mix(config: ml_collections.ConfigDict) -> list[tuple[str, object, float]]:
  """[(label, environment, weight)] of an agentic run (glm_jax/rl/environment.py make_environment). GRPO: the tasks
  section, tasks.<label>.task (else the label) naming the environment, its other fields but weight the
  environment's arguments. Distillation: one a teacher, in the teachers' order, labelled by the teacher's name:
  its task and task_kwargs (the loop finds a row's teacher by its label)."""
  from glm_jax.rl import environment

  if config.trainer == "distill":
    section = "teachers"
    specs = [(n, t.task, t.task_kwargs.to_dict(), t.weight) for n, t in config.teachers.items()]
  else:
    section = "tasks"
    specs = [
      (label, s.get("task", label), {k: v for k, v in s.items() if k not in ("weight", "task")}, s.weight)
      for label, s in config.tasks.items()
    ]
  out = []
  for label, name, kwargs, weight in specs:
    try:
      env = environment.make_environment(name, **kwargs)
    except ValueError as e:
      raise ValueError(f"{section}.{label}: {e}") from e
    if not weight >= 0:
      invalid(f"{section}.{label}.weight", weight, "must be >= 0")
    out.append((label, env, float(weight)))
  if not out or not sum(w for _, _, w in out) > 0:
    invalid(section, config[section].to_dict(), "give at least one environment with a positive weight")
  return out


def _validate_distill(config: ml_collections.ConfigDict) -> None:
  rl = config.rl
  if rl.group_size != 1:
    invalid("rl.group_size", rl.group_size, "on-policy distillation samples one answer a prompt: use 1")
  if rl.async_rollouts:
    invalid("rl.async_rollouts", rl.async_rollouts, "the distillation loop is synchronous")
  if not len(config.teachers):
    invalid("teachers", config.teachers.to_dict(), "give at least one teacher")
  for name, t in config.teachers.items():
    if rl.tokenizer == "char":  # agentic: an environment, made by environment_mix
      _make_task(f"teachers.{name}.task", t.task, t.task_kwargs.to_dict())
    if not t.weight >= 0:
      invalid(f"teachers.{name}.weight", t.weight, "must be >= 0")
    vocab = t.model.get("vocab_size", config.model.vocab_size)
    if vocab != config.model.vocab_size:
      raise ValueError(
        f"teachers.{name}: vocab_size {vocab} differs from the student's model.vocab_size "
        f"{config.model.vocab_size}; teachers must share the student's vocabulary"
      )


def _validate_sft_train_step(sft: ml_collections.ConfigDict) -> None:
  """sft.train_step: the pretraining step's fields, checked as for pretraining, and the microbatches split the
  fine-tuning batch."""
  validate_step_config(sft.train_step, "sft.train_step")
  if sft.batch_size % sft.train_step.microbatches:
    invalid("sft.train_step.microbatches", sft.train_step.microbatches, f"must divide sft.batch_size={sft.batch_size}")


def _make_task(field: str, name: str, kwargs: dict) -> tasks_lib.Task:
  """make_task(name, **kwargs); its errors name the config field that chose the task."""
  try:
    return tasks_lib.make_task(name, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{field}: {e}") from e


def _task_weights(section: ml_collections.ConfigDict, where: str) -> list[tuple[tasks_lib.Task, float]]:
  """[(task, weight)] from a {label: {weight, task (optional; else the label), kwargs...}} section."""
  out = []
  for label, spec in section.items():
    kwargs = {k: v for k, v in spec.items() if k not in ("weight", "task")}
    if "task" in spec:  # a task of this library under a label of its own, or one of yours by its import path
      task = _make_task(f"{where}.{label}.task", spec.task, kwargs)
    else:
      task = _make_task(f"{where}.{label}", label, kwargs)
    out.append((task, spec.weight))
  tasks_lib.mixed_prompts(out, np.random.default_rng(0), 1)  # validates the weights
  return out


def task_mix(config: ml_collections.ConfigDict) -> list[tuple[tasks_lib.Task, float]]:
  """The run's [(task, weight)]: config.tasks for GRPO; for distillation, each teacher's task, in the teachers'
  order (the distillation loop finds a row's teacher by its task)."""
  if config.trainer == "grpo":
    return _task_weights(config.tasks, "tasks")
  return [
    (_make_task(f"teachers.{n}.task", t.task, t.task_kwargs.to_dict()), t.weight) for n, t in config.teachers.items()
  ]
