"""The post-training loops: GRPO on verifiable tasks (sync or with an asynchronous rollout worker) and on-policy
distillation from one or several teachers. `run(config, workdir)` is what launch/train.py calls when
config.trainer is "grpo" or "distill".

GRPO step (config.rl):
  prompts_per_step prompts (mixed from config.tasks by weight) x group_size answers each, sampled with the KV-cache
  sampler -> exact-match rewards (a failing reward function gives 0 and a logged sample id) -> group-normalized
  advantages -> one jit update (glm_jax/rl/step.py). rl.async_rollouts: a RolloutWorker generates with tagged
  weights while the trainer updates; batches older than rl.tau versions are dropped, and rl.objective="async"
  masks tokens whose ratio to the rollout policy leaves (1-eps_low, 1+eps_high) (GLM-5 Eq. 3-5).
Distillation step (config.teachers):
  prompts mixed from the teachers' tasks by weight, one answer each (group size 1), every row scored by the
  teacher its task belongs to; advantage = sg(log p_teacher - log p_student) per token (Eq. 2).
Warm start: rl.init_from (a workdir with a checkpoint of the same model), else config.sft.steps of supervised
fine-tuning on the tasks' demonstrations with the pretraining step. A teacher likewise loads its init_from or
is fine-tuned here for its sft_steps, then cached in <workdir>/teachers/<name>.
The workdir gets metrics.jsonl / tensorboard (reward mean and std, accuracy, IcePop's dropped fraction, KL,
lengths, ...) and checkpoints; step 0 is the warm-started policy, and a rerun resumes from the latest one.
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from glm_jax.inference.sampler import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import losses, rewards as rewards_lib, step as rl_step, tasks as tasks_lib
from glm_jax.rl.rollout import Rollout, RolloutWorker, is_stale
from glm_jax.train import optimizers, step as train_step_lib
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.metrics import MetricsWriter

TRAINERS = ("pretrain", "grpo", "distill")
_RL_POSITIVE_INTS = ("steps", "prompts_per_step", "group_size", "max_new_tokens", "log_every", "eval_every",
                     "eval_prompts", "checkpoint_every", "keep_checkpoints", "max_pending")


# ---------------------------------------------------------------------------------------------------- config


def _fail(field: str, value: Any, valid: str):
  raise ValueError(f"{field}={value!r} is invalid; {valid}")


def validate_rl_config(config: ml_collections.ConfigDict) -> None:
  """Checks config.rl (and the tasks / teachers sections the trainer needs) before any work starts."""
  rl = config.rl
  for field in _RL_POSITIVE_INTS:
    if not isinstance(rl[field], int) or rl[field] <= 0:
      _fail(f"rl.{field}", rl[field], "must be a positive integer")
  if not isinstance(rl.tau, int) or rl.tau < 0:
    _fail("rl.tau", rl.tau, "must be an integer >= 0 (versions a rollout may lag the trainer)")
  if not rl.temperature > 0:
    _fail("rl.temperature", rl.temperature, "must be > 0 (RL samples; the log-probs are of logits / temperature)")
  if not 0 < rl.top_p <= 1:
    _fail("rl.top_p", rl.top_p, "must be in (0, 1]")
  if rl.objective not in rl_step.OBJECTIVES:
    _fail("rl.objective", rl.objective, f"one of {rl_step.OBJECTIVES}")
  if rl.objective == "async" and not rl.async_rollouts:
    _fail("rl.objective", rl.objective, "'async' (Eq. 3-5) needs rl.async_rollouts=True")
  if rl.is_correction not in losses.IS_CORRECTIONS:
    _fail("rl.is_correction", rl.is_correction, f"one of {losses.IS_CORRECTIONS}")
  if not 0 <= rl.eps_low < 1:
    _fail("rl.eps_low", rl.eps_low, "must be in [0, 1)")
  if not rl.eps_high >= 0:
    _fail("rl.eps_high", rl.eps_high, "must be >= 0")
  if not rl.icepop_beta > 1:
    _fail("rl.icepop_beta", rl.icepop_beta, "must be > 1 (tokens are kept where 1/beta <= rho <= beta)")
  for field in ("kl_coef", "grad_clip_norm"):
    if not rl[field] >= 0:
      _fail(f"rl.{field}", rl[field], "must be >= 0")
  if rl.rollout_dtype not in ("", "float32", "bfloat16"):
    _fail("rl.rollout_dtype", rl.rollout_dtype, "'' (the model's dtype), 'float32' or 'bfloat16'")
  if config.trainer == "grpo":
    if rl.group_size < 2:
      _fail("rl.group_size", rl.group_size, "GRPO needs >= 2 answers a prompt (advantages are group-normalized)")
    _task_weights(config.tasks, "tasks")
  if config.trainer == "distill":
    if rl.group_size != 1:
      _fail("rl.group_size", rl.group_size, "on-policy distillation samples one answer a prompt: use 1")
    if rl.async_rollouts:
      _fail("rl.async_rollouts", rl.async_rollouts, "the distillation loop is synchronous")
    if not len(config.teachers):
      _fail("teachers", config.teachers.to_dict(), "give at least one teacher")
    for name, t in config.teachers.items():
      tasks_lib.make_task(t.task, **t.task_kwargs.to_dict())
      if not t.weight >= 0:
        _fail(f"teachers.{name}.weight", t.weight, "must be >= 0")
      vocab = t.model.get("vocab_size", config.model.vocab_size)
      if vocab != config.model.vocab_size:
        raise ValueError(f"teachers.{name}: vocab_size {vocab} differs from the student's model.vocab_size "
                         f"{config.model.vocab_size}; teachers must share the student's vocabulary")


def _task_weights(section: ml_collections.ConfigDict, where: str) -> list[tuple[Any, float]]:
  """[(task, weight)] from a {name: {weight, kwargs...}} section."""
  out = []
  for name, spec in section.items():
    kwargs = {k: v for k, v in spec.items() if k != "weight"}
    try:
      task = tasks_lib.make_task(name, **kwargs)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{where}.{name}: {e}") from e
    out.append((task, spec.weight))
  tasks_lib.mixed_prompts(out, np.random.default_rng(0), 1)  # validates the weights
  return out


# ---------------------------------------------------------------------------------------------------- pieces


def _policy(model_cfg: ModelConfig, opt_cfg, seed: int, freeze_indexer: bool):
  """(graphdef, TrainState, optimizer, schedule); the indexer is frozen when freeze_indexer (GLM-5's RL)."""
  model = GlmMoeDsa(model_cfg, nnx.Rngs(seed))
  trainable = (lambda path: not train_step_lib.is_indexer_param(path)) if freeze_indexer else None
  optimizer = optimizers.make_optimizer(opt_cfg, nnx.state(model, nnx.Param), trainable=trainable)
  graphdef, state = train_step_lib.init_train_state(model, optimizer)
  return graphdef, state, optimizer, optimizers.learning_rate_schedule(opt_cfg)


_SFT_STEPS: dict = {}


def _sft_step(graphdef, params, opt_cfg, stage: str):
  """(optimizer, jitted pretraining step) for fine-tuning, one per (model, optimizer config, stage): the teachers
  and the student of one architecture share a compilation."""
  key = (graphdef, json.dumps(opt_cfg.to_dict(), sort_keys=True), stage)
  if key not in _SFT_STEPS:
    train_cfg = ml_collections.ConfigDict(dict(
        dsa_stage=stage, microbatches=1, grad_clip_norm=1.0, mtp_loss_weight=0.3, balance_loss_weight=1e-4,
        indexer_loss_weight=1.0, expert_bias_rate=1e-3, spike_factor=0.0, spike_min_steps=0, spike_ema=0.99))
    optimizer = optimizers.make_optimizer(opt_cfg, params)
    _SFT_STEPS[key] = optimizer, train_step_lib.make_train_step(
        graphdef, optimizer, optimizers.learning_rate_schedule(opt_cfg), train_cfg)
  return _SFT_STEPS[key]


def supervised_finetune(graphdef, params, rest, model_cfg: ModelConfig, sft: ml_collections.ConfigDict,
                        tasks_and_weights, vocab: tasks_lib.CharVocab, seed: int, log_prefix: str = "sft"):
  """sft.steps updates of the pretraining step on the tasks' demonstrations (LM loss; with DSA active, the
  sparse stage, which also trains the indexer): returns (params, rest, the last step's loss)."""
  sparse = model_cfg.use_dsa and sft.seq_len > model_cfg.index_topk
  optimizer, step_fn = _sft_step(graphdef, params, sft.optimizer, "sparse" if sparse else "dense")
  state = train_step_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                                    opt_state=optimizer.init(params), loss_ema=jnp.zeros((), jnp.float32),
                                    skipped=jnp.zeros((), jnp.int32))
  rng = np.random.default_rng(seed)
  loss = float("nan")
  for i in range(sft.steps):
    batch = tasks_lib.sft_batch(tasks_and_weights, rng, sft.batch_size, sft.seq_len, vocab)
    state, m = step_fn(state, {k: jnp.asarray(v) for k, v in batch.items()})
    if (i + 1) % max(sft.steps // 5, 1) == 0 or i + 1 == sft.steps:
      loss = float(m["lm_loss"])
      logging.info("%s step %d/%d: lm_loss %.4f", log_prefix, i + 1, sft.steps, loss)
  return state.params, state.rest, loss


def _sampler(graphdef, model_cfg: ModelConfig, rl, tasks_and_weights, vocab, *, greedy: bool = False) -> Sampler:
  width = max(t.max_prompt_len for t, _ in tasks_and_weights)
  sampling = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=0.0 if greedy else rl.temperature,
                            top_p=1.0 if greedy else rl.top_p, stop_ids=(vocab.eos_id,), pad_id=vocab.pad_id)
  if rl.rollout_dtype and rl.rollout_dtype != model_cfg.dtype and not greedy:
    # The inference engine in another precision than the trainer: the train/inference mismatch IcePop filters.
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(model_cfg.replace(dtype=rl.rollout_dtype),
                                                             nnx.Rngs(0))))
  return Sampler(graphdef, model_cfg, sampling, width=width)


def make_rollout(sampler: Sampler, params, rest, problems, group_size: int, key, reward_fn, version: int,
                 id_prefix: str) -> Rollout:
  """Samples group_size answers to each problem (rows grouped by problem) and scores them."""
  t0 = time.perf_counter()
  rows = [p for p in problems for _ in range(group_size)]
  out = jax.device_get(sampler(params, rest, [p.prompt_ids for p in rows], key))
  rollout = Rollout(version=version, problems=rows, tokens=np.asarray(out.tokens),
                    response_mask=np.asarray(out.response_mask), rollout_logp=np.asarray(out.logp),
                    prompt_lens=np.asarray(out.prompt_lens), lengths=np.asarray(out.lengths),
                    finished=np.asarray(out.finished), rewards=np.zeros(len(rows), np.float32), failures=[])
  rollout.rewards, rollout.failures = rewards_lib.score(reward_fn, rows, rollout.responses(),
                                                        [f"{id_prefix}/{i}" for i in range(len(rows))])
  rollout.seconds = time.perf_counter() - t0
  return rollout


def greedy_accuracy(sampler: Sampler, params, rest, problems, reward_fn) -> float:
  """Mean reward of greedy answers (the model's best guess) on fixed held-out problems."""
  rollout = make_rollout(sampler, params, rest, problems, 1, jax.random.key(0), reward_fn, 0, "eval")
  return float(np.mean(rollout.rewards))


def _rollout_metrics(r: Rollout) -> dict[str, float]:
  resp_lens = r.lengths - r.prompt_lens
  return dict(reward_mean=float(np.mean(r.rewards)), reward_std=float(np.std(r.rewards)),
              response_len_mean=float(np.mean(resp_lens)), response_len_max=int(np.max(resp_lens)),
              truncated_frac=float(np.mean(~r.finished)), reward_failures=len(r.failures),
              rollout_s=r.seconds)


def _batch(r: Rollout, **extra) -> dict[str, jax.Array]:
  return dict(tokens=jnp.asarray(r.tokens), response_mask=jnp.asarray(r.response_mask),
              rollout_logp=jnp.asarray(r.rollout_logp), **{k: jnp.asarray(v) for k, v in extra.items()})


def _warm_start(config, workdir: str, graphdef, state, model_cfg, tasks_and_weights, vocab, checkpointer):
  """(state, step, info): the latest checkpoint's state; else the warm-started policy, kept in <workdir>/init
  (the KL term's reference policy, and no second fine-tuning when a run restarts before its first checkpoint):
  rl.init_from's weights, or config.sft.steps of fine-tuning, or the random initialization."""
  latest = checkpointer.latest_step()
  if latest is not None:
    logging.info("resuming from %s step %d", checkpointer.directory, latest)
    return checkpointer.restore(latest, state), latest, {}
  init = Checkpointer(os.path.join(workdir, "init"), save_every=1, keep=1, async_save=False)
  info = {}
  if init.latest_step() is not None:
    state.params, state.rest = init.restore_weights(init.latest_step(), state.params, state.rest)
  else:
    if config.rl.init_from:
      source = Checkpointer(config.rl.init_from, read_only=True)
      step = source.latest_step()
      if step is None:
        raise ValueError(f"rl.init_from={config.rl.init_from!r}: no complete checkpoint in {source.directory}")
      state.params, state.rest = source.restore_weights(step, state.params, state.rest)
      source.close()
    elif config.sft.steps:
      t0 = time.perf_counter()
      state.params, state.rest, info["sft_loss"] = supervised_finetune(
          graphdef, state.params, state.rest, model_cfg, config.sft, tasks_and_weights, vocab, config.rl.seed)
      info["sft_s"] = time.perf_counter() - t0
    init.save(0, state, None, config.to_dict(), force=True)
  init.close()
  return state, 0, info


def reference_policy(workdir: str, state):
  """(params, rest) of the warm-started policy (<workdir>/init)."""
  init = Checkpointer(os.path.join(workdir, "init"), read_only=True)
  params, rest = init.restore_weights(init.latest_step(), state.params, state.rest)
  init.close()
  return params, rest


def _teacher(name: str, spec, config, workdir: str, vocab):
  """(graphdef, params, rest) of a teacher: its init_from checkpoint, or fine-tuned here on its task (cached)."""
  cfg = ModelConfig.from_dict({**config.model.to_dict(), **spec.model.to_dict()})
  graphdef, state, _, _ = _policy(cfg, config.optimizer, spec.seed, freeze_indexer=False)
  source = spec.init_from or os.path.join(workdir, "teachers", name)
  cache = Checkpointer(source, save_every=1, keep=1, async_save=False, read_only=bool(spec.init_from))
  step = cache.latest_step()
  if step is not None:
    state.params, state.rest = cache.restore_weights(step, state.params, state.rest)
  elif spec.init_from:
    raise ValueError(f"teachers.{name}.init_from={spec.init_from!r}: no complete checkpoint in {cache.directory}")
  else:
    task = tasks_lib.make_task(spec.task, **spec.task_kwargs.to_dict())
    sft = copy.deepcopy(config.sft)
    sft.steps = spec.sft_steps
    state.params, state.rest, loss = supervised_finetune(graphdef, state.params, state.rest, cfg, sft,
                                                         [(task, 1.0)], vocab, spec.seed, f"teacher {name}")
    logging.info("teacher %s fine-tuned on %s: lm_loss %.4f", name, spec.task, loss)
    cache.save(0, state, None, {"teacher": spec.to_dict(), "model": cfg.to_dict()}, force=True)
  cache.close()
  return graphdef, state.params, state.rest


# ---------------------------------------------------------------------------------------------------- loops


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs config.trainer ("grpo" or "distill") for config.rl.steps updates; returns the summary line."""
  if config.trainer not in ("grpo", "distill"):
    _fail("trainer", config.trainer, "rl.trainer.run takes 'grpo' or 'distill'")
  missing = [s for s in ("model", "rl", "sft", "optimizer") if s not in config]
  missing += [s for s in (("tasks",) if config.trainer == "grpo" else ("teachers",)) if s not in config]
  if missing:
    raise ValueError(f"config {config.get('name', '?')!r} lacks section(s) {missing}; see configs/grpo_tiny.py "
                     "and configs/distill_tiny.py")
  validate_rl_config(config)
  rl = config.rl
  vocab = tasks_lib.CharVocab()
  model_cfg = ModelConfig.from_dict(config.model)
  vocab.check_model_vocab(model_cfg.vocab_size)
  if config.trainer == "grpo":
    tasks_and_weights = _task_weights(config.tasks, "tasks")
  else:
    tasks_and_weights = [(tasks_lib.make_task(t.task, **t.task_kwargs.to_dict()), t.weight)
                         for t in config.teachers.values()]
  checkpointer = Checkpointer(workdir, save_every=rl.checkpoint_every, keep=rl.keep_checkpoints,
                              async_save=False)
  checkpointer.check_compatible(config.to_dict(), sections=("model", "optimizer", "tasks", "teachers"),
                                train_fields=())
  graphdef, state, optimizer, schedule = _policy(model_cfg, config.optimizer, rl.seed, rl.freeze_indexer)
  state, start, info = _warm_start(config, workdir, graphdef, state, model_cfg, tasks_and_weights, vocab,
                                   checkpointer)
  reward_fn = rewards_lib.make_reward_fn(rl.reward, vocab)
  sampler = _sampler(graphdef, model_cfg, rl, tasks_and_weights, vocab)
  greedy = _sampler(graphdef, model_cfg, rl, tasks_and_weights, vocab, greedy=True)
  eval_problems = tasks_lib.mixed_prompts(tasks_and_weights, np.random.default_rng(10**6 + rl.seed),
                                          rl.eval_prompts)
  writer = MetricsWriter(workdir, tensorboard=rl.tensorboard)
  summary = dict(trainer=config.trainer, workdir=os.path.abspath(workdir), **info)
  accuracy = greedy_accuracy(greedy, state.params, state.rest, eval_problems, reward_fn)
  if start == 0:
    writer.write(0, dict(eval_accuracy=accuracy, **info))
  summary["start_eval_accuracy"] = accuracy
  loop = _grpo_loop if config.trainer == "grpo" else _distill_loop
  try:
    state, extra = loop(config, workdir, graphdef, state, optimizer, schedule, start, sampler, greedy,
                        tasks_and_weights, eval_problems, reward_fn, writer, checkpointer, model_cfg, vocab)
  finally:
    checkpointer.close()
    writer.close()
  summary.update(extra, step=int(state.step))
  summary["eval_accuracy"] = greedy_accuracy(greedy, state.params, state.rest, eval_problems, reward_fn)
  return summary


def _prompts(config, tasks_and_weights, step: int):
  """The problems of a step: a function of (seed, step), so a resumed run sees the same prompts."""
  return tasks_lib.mixed_prompts(tasks_and_weights, np.random.default_rng((config.rl.seed, step)),
                                 config.rl.prompts_per_step)


def _log_and_eval(config, writer, done: int, metrics: dict, greedy, state, eval_problems, reward_fn,
                  checkpointer) -> dict:
  rl = config.rl
  if done % rl.eval_every == 0 or done == rl.steps:
    metrics["eval_accuracy"] = greedy_accuracy(greedy, state.params, state.rest, eval_problems, reward_fn)
  if done % rl.log_every == 0 or done == rl.steps or "eval_accuracy" in metrics:
    row = writer.write(done, metrics)
    logging.info("step %d: %s", done, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
  checkpointer.save(done, state, None, config.to_dict(), force=done == rl.steps)
  return metrics


def _grpo_loop(config, workdir, graphdef, state, optimizer, schedule, start, sampler, greedy, tasks_and_weights,
               eval_problems, reward_fn, writer, checkpointer, model_cfg, vocab):
  rl = config.rl
  step_fn = rl_step.make_grpo_step(graphdef, optimizer, schedule, rl)
  ref = None
  if rl.kl_coef > 0:  # the reference policy: the warm-started weights
    ref = (rl_step.make_score_fn(graphdef, rl.temperature), *reference_policy(workdir, state))

  def produce(params, rest, version, index):
    key = jax.random.fold_in(jax.random.key(rl.seed), index)
    return make_rollout(sampler, params, rest, _prompts(config, tasks_and_weights, index), rl.group_size, key,
                        reward_fn, version, f"step{index}")

  worker = None
  if rl.async_rollouts:
    worker = RolloutWorker(produce, max_pending=rl.max_pending)
    worker.push_weights(start, state.params, state.rest)
    worker.start()
  last, dropped = {}, 0
  try:
    done = start
    while done < rl.steps:
      t0 = time.perf_counter()
      if worker is not None:
        rollout = worker.get()
        if is_stale(rollout.version, done, rl.tau):
          dropped += 1
          logging.info("dropped a rollout of version %d at version %d (tau %d)", rollout.version, done, rl.tau)
          continue
      else:
        rollout = produce(state.params, state.rest, done, done)
      adv = np.asarray(losses.group_advantages(rollout.rewards, rl.group_size))
      extra = {}
      if ref is not None:
        extra["ref_logp"] = ref[0](ref[1], ref[2], jnp.asarray(rollout.tokens))
      t1 = time.perf_counter()
      state, m = step_fn(state, _batch(rollout, advantages=adv, **extra))
      m = {k: np.asarray(v).item() for k, v in jax.device_get(m).items()}
      done += 1
      if worker is not None:
        worker.push_weights(done, state.params, state.rest)
      m.update(_rollout_metrics(rollout), train_s=time.perf_counter() - t1, step_s=time.perf_counter() - t0,
               staleness=done - 1 - rollout.version, dropped_stale=dropped)
      last = _log_and_eval(config, writer, done, m, greedy, state, eval_problems, reward_fn, checkpointer)
  finally:
    if worker is not None:
      worker.stop()
  return state, dict(reward_mean=last.get("reward_mean"), dropped_stale=dropped)


def _distill_loop(config, workdir, graphdef, state, optimizer, schedule, start, sampler, greedy,
                  tasks_and_weights, eval_problems, reward_fn, writer, checkpointer, model_cfg, vocab):
  rl = config.rl
  names = list(config.teachers.keys())
  teachers = [_teacher(n, config.teachers[n], config, workdir, vocab) for n in names]
  scorer_of = {}  # one compiled scorer per teacher architecture
  for graphdef_t, _, _ in teachers:
    if graphdef_t not in scorer_of:
      scorer_of[graphdef_t] = rl_step.make_score_fn(graphdef_t, rl.temperature)
  scorers = [scorer_of[t[0]] for t in teachers]
  task_of = {tasks_and_weights[i][0].name: i for i in range(len(names))}
  step_fn = rl_step.make_distill_step(graphdef, optimizer, schedule, rl)
  last = {}
  for done in range(start, rl.steps):
    t0 = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(rl.seed), done)
    rollout = make_rollout(sampler, state.params, state.rest, _prompts(config, tasks_and_weights, done), 1, key,
                           reward_fn, done, f"step{done}")
    which = np.asarray([task_of[p.task] for p in rollout.problems])
    tokens = jnp.asarray(rollout.tokens)
    teacher_logp = np.zeros(rollout.tokens.shape, np.float32)
    for k, ((_, params, rest), score) in enumerate(zip(teachers, scorers)):
      if np.any(which == k):  # every row is scored by every teacher (one compile); each keeps its own rows
        teacher_logp[which == k] = np.asarray(score(params, rest, tokens))[which == k]
    t1 = time.perf_counter()
    state, m = step_fn(state, _batch(rollout, teacher_logp=teacher_logp))
    m = {k: np.asarray(v).item() for k, v in jax.device_get(m).items()}
    mask = rollout.response_mask
    for k, name in enumerate(names):  # per teacher: KL(student || teacher) on the student's samples
      rows = mask & (which == k)[:, None]
      m[f"teacher_kl/{name}"] = float(np.sum((rollout.rollout_logp - teacher_logp)[rows]) / max(rows.sum(), 1))
    m.update(_rollout_metrics(rollout), train_s=time.perf_counter() - t1, step_s=time.perf_counter() - t0)
    last = _log_and_eval(config, writer, done + 1, m, greedy, state, eval_problems, reward_fn, checkpointer)
  return state, dict(teacher_kl=last.get("teacher_kl"), reward_mean=last.get("reward_mean"))
