"""The post-training loops: GRPO on verifiable tasks (sync or with an asynchronous rollout worker) and on-policy
distillation from one or several teachers. `run(config, workdir)` is what launch/train.py calls when
config.trainer is "grpo" or "distill"; the config's sections and their checks: glm_jax/rl/config.py.

GRPO step (config.rl): prompts_per_step prompts (mixed from config.tasks by weight) x group_size answers, sampled with
the KV-cache sampler -> rewards -> group-normalized advantages -> one jit update (glm_jax/rl/step.py); with
rl.async_rollouts a RolloutWorker generates with tagged weights while the trainer updates (a thread, a worker process
with rl.rollout_process, engines behind a router with rl.rollout_server), batches older than rl.tau versions dropped.
Distillation step (config.teachers): one answer a prompt, scored by its task's teacher; advantage = sg(log p_teacher -
log p_student) per token (GLM-5 Eq. 2); with rl.tokenizer="model" a task is an environment and the advantage is taken
on the student's own turns. Before the first step (glm_jax/rl/warm_start.py) the policy loads rl.init_from or is
fine-tuned for config.sft.steps on the tasks' demonstrations; a teacher likewise, cached in <workdir>/teachers/<name>.
The workdir gets metrics.jsonl / tensorboard and checkpoints; step 0 is the warm-started policy, and a rerun resumes
from the latest one. Each objective and metric: docs/post_training.md.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from glm_jax.model import ModelConfig
from glm_jax.model.quantization import quant_plan
from glm_jax import data as data_lib
from glm_jax.rl import agentic, losses, rewards as rewards_lib, step as rl_step, tasks as tasks_lib
from glm_jax.rl.config import environment_mix, task_mix, validate_rl_config
from glm_jax.rl.context import RunContext, RunSetup
from glm_jax.rl.rollout import RolloutWorker, greedy_accuracy, is_stale, make_sampler, step_rollout
from glm_jax.rl.rollout_engine import ProcessRolloutWorker
from glm_jax.rl.warm_start import load_teacher, make_policy, reference_policy, warm_start
from glm_jax.train.checkpoint import Checkpointer, check_writable
from glm_jax.train.guards import ConsecutiveSkips
from glm_jax.train.lifecycle import StopSignals, Stopped, stopped_message, workdir_lock
from glm_jax.train.metrics import MetricsWriter, last_logged
from glm_jax.train.progress import Progress


def _server_worker(ctx, group_size: int):
  """The rollout client of the serving engines (rl.rollout_server), imported here: its HTTP client is the serve
  extra's, which training without it does not need."""
  from glm_jax.rl.rollout_server import ServerRolloutWorker

  return ServerRolloutWorker(ctx, group_size)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs config.trainer ("grpo" or "distill") for config.rl.steps updates; returns the summary line. The workdir
  is locked for the run (glm_jax/train/lifecycle.py); SIGTERM / SIGINT stop it after the next update with a
  checkpoint (raising Stopped)."""
  validate_rl_config(config)
  check_writable(os.path.join(os.path.abspath(workdir), "checkpoints"))  # before the lock creates the workdir
  with StopSignals() as stop, workdir_lock(workdir, config.trainer):
    return _run(config, workdir, stop)


def _run(config: ml_collections.ConfigDict, workdir: str, stop: StopSignals) -> dict[str, Any]:
  setup, state = _setup(config, workdir)
  with agentic.serving_tools(setup.environments, config.rl):  # an agentic run's tool workers, for the whole run
    return _train(config, workdir, stop, setup, state)


def _train(config, workdir: str, stop: StopSignals, setup: RunSetup, state) -> dict[str, Any]:
  state, start, info = warm_start(setup, state)
  ctx = _context(setup, start, stop)
  summary = dict(trainer=config.trainer, workdir=os.path.abspath(workdir), **info)
  ctx.progress.print(f"step {start}: greedy answers to {len(ctx.eval_problems)} held-out problems (eval_accuracy)")
  accuracy = _eval_accuracy(ctx, state)
  ctx.progress.print(f"step {start} eval_accuracy {accuracy:.4g}")
  if start == 0:
    ctx.writer.write(0, dict(eval_accuracy=accuracy, **info))
  summary["start_eval_accuracy"] = accuracy
  loop = _grpo_loop if config.trainer == "grpo" else _distill_loop
  try:
    if start < config.rl.steps:
      ctx.progress.compiling(f"the rollouts and the {config.trainer} step")
    state, extra = loop(ctx, state, start)
  finally:
    ctx.progress.close()
    ctx.checkpointer.close()
    ctx.writer.close()
  if start >= config.rl.steps:  # a rerun of a finished run: its last logged values, as the run reported them
    logging.warning("%s is complete at step %d (rl.steps=%d): nothing to train", workdir, start, config.rl.steps)
    extra = {k: last_logged(workdir, k, through=start) if v is None else v for k, v in extra.items()}
  summary.update(extra, step=int(state.step))
  summary["eval_accuracy"] = _eval_accuracy(ctx, state)
  summary.update(ctx.progress.summary())
  return summary


def _setup(config: ml_collections.ConfigDict, workdir: str):
  """(RunSetup, the policy's initial TrainState), once the vocabulary and the workdir's checkpoints are checked (the
  config is, by run)."""
  rl = config.rl
  model_cfg = ModelConfig.from_dict(config.model)
  environments = []
  if rl.tokenizer == "model":  # agentic: environments in the chat format, with the model's tokenizer
    vocab = model_tokenizer(config)
    data_lib.check_vocab(vocab, model_cfg.vocab_size)
    vocab.chat_ids  # noqa: B018 - a tokenizer without the chat format's tokens is refused here, by name
    tasks_and_weights, environments = [], environment_mix(config)
  else:
    vocab = tasks_lib.CharVocab()
    vocab.check_model_vocab(model_cfg.vocab_size)
    tasks_and_weights = task_mix(config)
  checkpointer = Checkpointer(workdir, save_every=rl.checkpoint_every, keep=rl.keep_checkpoints, async_save=False)
  checkpointer.check_compatible(
    config.to_dict(),
    sections=("model", "optimizer", "tasks", "teachers", "quant"),
    train_fields=(),
    tokenizer=vocab.record(),
  )
  graphdef, state, optimizer, schedule = make_policy(model_cfg, config.optimizer, rl.seed, rl.freeze_indexer)
  plan = quant_plan(state.params, config.quant) if "quant" in config else {}
  setup = RunSetup(
    config=config,
    workdir=workdir,
    model_cfg=model_cfg,
    vocab=vocab,
    tasks_and_weights=tasks_and_weights,
    graphdef=graphdef,
    optimizer=optimizer,
    schedule=schedule,
    checkpointer=checkpointer,
    quant_plan=plan,
    environments=environments,
  )
  return setup, state


def model_tokenizer(config: ml_collections.ConfigDict):
  """rl.tokenizer="model": the tokenizer rl.init_from's checkpoint recorded (the model's own), else config.data's."""
  if config.rl.init_from:
    source = Checkpointer(config.rl.init_from, read_only=True)
    steps = source.steps()
    record = source.recorded_tokenizer(steps[0]) if steps else None
    source.close()
    if record is not None:
      return data_lib.Tokenizer.from_record(record)
  if "data" not in config:
    raise ValueError(
      f"rl.tokenizer='model': rl.init_from={config.rl.init_from!r} records no tokenizer and the config has no data "
      "section to build one from"
    )
  return data_lib.load_tokenizer(config.data)


def _context(setup: RunSetup, start: int, stop: StopSignals) -> RunContext:
  """The setup with the reward function, the samplers, the held-out problems and the metrics writer (whose rows
  after `start` are moved aside: a resumed run writes them again)."""
  rl = setup.config.rl
  rollout_fn = None
  if setup.environments:  # agentic: the agent loop, sampling and greedy, and the environments' own rewards
    reward_fn, rollout_fn = None, agentic.load_rollout_fn(rl.rollout_fn)
    sampler, greedy = agentic.make_agent_loops(setup.graphdef, setup.model_cfg, rl, setup.vocab)
    eval_problems = agentic.mixed_items(setup.environments, np.random.default_rng(10**6 + rl.seed), rl.eval_prompts)
  else:
    reward_fn = rewards_lib.make_reward_fn(rl.reward, setup.vocab)
    sampler = make_sampler(setup.graphdef, setup.model_cfg, rl, setup.tasks_and_weights, setup.vocab)
    greedy = make_sampler(setup.graphdef, setup.model_cfg, rl, setup.tasks_and_weights, setup.vocab, greedy=True)
    eval_problems = tasks_lib.mixed_prompts(
      setup.tasks_and_weights, np.random.default_rng(10**6 + rl.seed), rl.eval_prompts
    )
  # A fresh run (start 0) writes its step-0 row again, so it keeps none.
  writer = MetricsWriter(setup.workdir, tensorboard=rl.tensorboard, keep_through=start if start else -1)
  skips = ConsecutiveSkips(rl.max_consecutive_skips, "rl.max_consecutive_skips")
  # MFU is left out: most of an RL step is sampling, whose useful FLOPs useful_flops does not count
  progress = Progress(setup.config.get("name", setup.config.trainer), total=rl.steps, start=start)
  return RunContext.after_warm_start(
    setup,
    reward_fn=reward_fn,
    sampler=sampler,
    greedy=greedy,
    eval_problems=eval_problems,
    writer=writer,
    progress=progress,
    skips=skips,
    stop=stop,
    rollout_fn=rollout_fn,
  )


def _eval_accuracy(ctx: RunContext, state) -> float:
  """The policy's greedy accuracy on the held-out problems, once a step (kept in ctx.eval_accuracy)."""
  step = int(state.step)
  if step not in ctx.eval_accuracy:
    if ctx.environments:  # the mean reward of greedy episodes on the held-out tasks
      actx = agentic.rollout_context(ctx, ctx.greedy, ctx.served(state.params), state.rest, 1, 0)
      accuracy = float(np.mean(actx.run_episodes(ctx.eval_problems, jax.random.key(0)).rewards))
    else:
      accuracy = greedy_accuracy(ctx.greedy, ctx.served(state.params), state.rest, ctx.eval_problems, ctx.reward_fn)
    ctx.eval_accuracy[step] = accuracy
  return ctx.eval_accuracy[step]


def _step_rollout(ctx: RunContext, params, rest, version: int, index: int, group_size: int):
  """The rollout of step `index` (rollout.step_rollout; agentic: agentic.step_rollout) from the policy's weights as
  served."""
  if ctx.environments:
    return agentic.step_rollout(ctx, ctx.served(params), rest, version, index, group_size)
  return step_rollout(
    ctx.sampler,
    ctx.served(params),
    rest,
    ctx.tasks_and_weights,
    ctx.config.rl,
    ctx.reward_fn,
    version,
    index,
    group_size,
  )


def _log_and_eval(ctx: RunContext, done: int, metrics: dict, state, tokens: int) -> dict:
  """After update `done` (whose rollout and batch had `tokens` tokens): adds eval_accuracy every rl.eval_every steps,
  writes the metrics and a progress line every rl.log_every, and checkpoints."""
  rl = ctx.config.rl
  ctx.progress.step_done(done, tokens=tokens)
  ctx.skips.count(done, metrics["skipped"])  # raises Diverged after too many skipped updates in a row
  if done % rl.eval_every == 0 or done == rl.steps:
    with ctx.progress.aside():
      metrics["eval_accuracy"] = _eval_accuracy(ctx, state)
  if done % rl.log_every == 0 or done == rl.steps or "eval_accuracy" in metrics:
    rates = ctx.progress.rates()
    row = ctx.writer.write(done, {**rates, **metrics})  # the loop's own step_s (this step's) over the window's
    shown = _SHOWN[ctx.config.trainer] + ("eval_accuracy",)
    ctx.progress.log(done, {k: row[k] for k in shown if k in row}, rates)
  with ctx.progress.aside():
    saved = ctx.checkpointer.save(
      done, state, None, ctx.config.to_dict(), tokenizer=ctx.vocab.record(), force=done == rl.steps
    )
  signum = ctx.stop.due(done)
  if signum is not None:
    if not saved:
      ctx.checkpointer.save(done, state, None, ctx.config.to_dict(), tokenizer=ctx.vocab.record(), force=True)
    ctx.checkpointer.wait()
    raise Stopped(signum, stopped_message(signum, done, ctx.checkpointer.directory))
  return metrics


# The values of a trainer's progress line (eval_accuracy too, at the steps that evaluate).
_SHOWN = {"grpo": ("reward_mean", "response_len_mean", "mismatch_kl"), "distill": ("teacher_kl", "reward_mean")}


def _host_metrics(m) -> dict:
  """A step's metrics as Python numbers."""
  return {k: np.asarray(v).item() for k, v in jax.device_get(m).items()}


def _grpo_loop(ctx: RunContext, state, start: int):
  """GRPO updates from step `start` to rl.steps: (state, the summary's reward_mean and dropped_stale)."""
  rl = ctx.config.rl
  step_fn = rl_step.make_grpo_step(ctx.graphdef, ctx.optimizer, ctx.schedule, rl, ctx.quant_plan)
  ref = None
  if rl.kl_coef > 0:  # the reference policy: the warm-started weights
    ref = (rl_step.make_score_fn(ctx.graphdef, rl.temperature), *reference_policy(ctx.workdir, state))

  def produce(params, rest, version, index):
    return _step_rollout(ctx, params, rest, version, index, rl.group_size)

  worker = None
  if rl.rollout_server:  # through the serving engines' API (glm_jax/rl/rollout_server.py)
    worker = _server_worker(ctx, rl.group_size)
    worker.push_weights(start, state.params, state.rest)
    worker.start(first_index=start, produce=rl.async_rollouts)
    if not rl.async_rollouts:  # a rollout a step, from the step's weights

      def produce(params, rest, version, index):
        return worker.rollout_at(index, version, params, rest)

  elif rl.async_rollouts and rl.rollout_process:  # a worker process (glm_jax/rl/rollout_engine.py)
    worker = ProcessRolloutWorker(ctx.config, ctx.workdir, served=ctx.served, tokenizer=ctx.vocab)
    worker.push_weights(start, state.params, state.rest)
    worker.start(first_index=start)
  elif rl.async_rollouts:
    worker = RolloutWorker(produce, max_pending=rl.max_pending)
    worker.push_weights(start, state.params, state.rest)
    worker.start()
  last, dropped = {}, 0
  try:
    done = start
    while done < rl.steps:
      t0 = time.perf_counter()
      if rl.async_rollouts:
        rollout = worker.get()
        if is_stale(rollout.version, done, rl.tau):
          dropped += 1
          logging.info("dropped a rollout of version %d at version %d (tau %d)", rollout.version, done, rl.tau)
          continue
      else:
        rollout = produce(state.params, state.rest, done, done)
      if rollout.groups is not None:  # an agentic rollout's groups (a rollout function may fan out)
        adv = agentic.group_advantages_by_id(rollout.rewards, rollout.groups)
      else:
        adv = np.asarray(losses.group_advantages(rollout.rewards, rl.group_size))
      extra = {}
      if ref is not None:
        extra["ref_logp"] = ref[0](ref[1], ref[2], jnp.asarray(rollout.tokens))
      t1 = time.perf_counter()
      state, m = step_fn(state, rollout.train_batch(advantages=adv, **extra))
      m = _host_metrics(m)
      done += 1
      if rl.async_rollouts:
        worker.push_weights(done, state.params, state.rest)
      m.update(
        rollout.metrics(),
        train_s=time.perf_counter() - t1,
        step_s=time.perf_counter() - t0,
        staleness=done - 1 - rollout.version,
        dropped_stale=dropped,
        rollout_index=rollout.index,
      )
      if isinstance(worker, ProcessRolloutWorker):
        m["workers_replaced"] = worker.replaced
      last = _log_and_eval(ctx, done, m, state, int(np.sum(rollout.lengths)))
  finally:
    if worker is not None:
      worker.stop()
  extra = dict(reward_mean=last.get("reward_mean"), dropped_stale=dropped)
  if isinstance(worker, ProcessRolloutWorker):
    extra["workers_replaced"] = worker.replaced
  return state, extra


def _teachers(ctx: RunContext):
  """[(graphdef, params, rest, score_fn)] of config.teachers, in order; one compiled scorer per architecture."""
  teachers = [load_teacher(ctx, name) for name in ctx.config.teachers.keys()]
  scorer_of = {}
  for graphdef, _, _ in teachers:
    if graphdef not in scorer_of:
      scorer_of[graphdef] = rl_step.make_score_fn(graphdef, ctx.config.rl.temperature)
  return [(*t, scorer_of[t[0]]) for t in teachers]


def _row_teachers(ctx: RunContext, names: list[str], problems) -> np.ndarray:
  """Each row's teacher (its index in `names`): an agentic row's by its label (environment_mix labels a teacher's
  environment by the teacher's name), another by its task (task_mix keeps the teachers' order)."""
  if ctx.environments:
    return np.asarray([names.index(label) for label, _ in problems])
  task_of = {task.name: k for k, (task, _) in enumerate(ctx.tasks_and_weights)}
  return np.asarray([task_of[p.task] for p in problems])


def _distill_loop(ctx: RunContext, state, start: int):
  """Distillation updates from step `start` to rl.steps: (state, the summary's teacher_kl and reward_mean)."""
  rl = ctx.config.rl
  teachers = _teachers(ctx)
  step_fn = rl_step.make_distill_step(ctx.graphdef, ctx.optimizer, ctx.schedule, rl, ctx.quant_plan)
  worker = None
  if rl.rollout_server:  # the student's rollouts through the serving engines' API, a rollout a step
    worker = _server_worker(ctx, 1)
    worker.push_weights(start, state.params, state.rest)
    worker.start(first_index=start, produce=False)
  try:
    state, last = _distill_steps(ctx, state, start, worker, teachers, step_fn)
  finally:
    if worker is not None:
      worker.stop()
  return state, dict(teacher_kl=last.get("teacher_kl"), reward_mean=last.get("reward_mean"))


def _distill_steps(ctx: RunContext, state, start: int, worker, teachers, step_fn):
  """_distill_loop's updates: (state, the last step's metrics)."""
  rl, names, last = ctx.config.rl, list(ctx.config.teachers.keys()), {}
  for done in range(start, rl.steps):
    t0 = time.perf_counter()
    if worker is not None:
      rollout = worker.rollout_at(done, done, state.params, state.rest)
    else:
      rollout = _step_rollout(ctx, state.params, state.rest, done, done, 1)
    which = _row_teachers(ctx, names, rollout.problems)
    tokens = jnp.asarray(rollout.tokens)
    teacher_logp = np.zeros(rollout.tokens.shape, np.float32)
    for k, (_, params, rest, score) in enumerate(teachers):
      if np.any(which == k):  # every row is scored by every teacher (one compile); each keeps its own rows
        teacher_logp[which == k] = np.asarray(score(params, rest, tokens))[which == k]
    t1 = time.perf_counter()
    state, m = step_fn(state, rollout.train_batch(teacher_logp=teacher_logp))
    m = _host_metrics(m)
    mask = rollout.response_mask
    for k, name in enumerate(names):  # per teacher: KL(student || teacher) on the student's samples
      rows = mask & (which == k)[:, None]
      m[f"teacher_kl/{name}"] = float(np.sum((rollout.rollout_logp - teacher_logp)[rows]) / max(rows.sum(), 1))
    m.update(rollout.metrics(), train_s=time.perf_counter() - t1, step_s=time.perf_counter() - t0)
    last = _log_and_eval(ctx, done + 1, m, state, int(np.sum(rollout.lengths)))
  return state, last
