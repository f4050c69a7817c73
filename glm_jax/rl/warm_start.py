"""Where a post-training run's weights come from: the policy, its warm start, the KL term's reference policy, and
the distillation teachers.

Warm start (`warm_start`): the workdir's latest checkpoint when the run resumes; else the warm-started policy,
kept in <workdir>/init: rl.init_from's weights (a workdir with a checkpoint of the same model), else
config.sft.steps of supervised fine-tuning on the tasks' demonstrations, else the random initialization. An agentic
run (rl.tokenizer="model") does both, GLM-5's order: rl.init_from's weights (a pretrained base), then config.sft.steps
of agentic SFT on its environments' scripted conversations (glm_jax/rl/agentic.py demonstration_batch).
<workdir>/init is also the KL term's reference policy (`reference_policy`), and a run that restarts before its
first checkpoint does not fine-tune again.
Fine-tuning (`supervised_finetune`): the pretraining step (glm_jax/train/step.py) with config.sft.train_step's
settings and config.sft.optimizer, on the tasks' demonstrations (LM loss); with DSA active at sft.seq_len, the
sparse stage, which also trains the indexer, else the dense stage.
Teachers (`load_teacher`): a teacher loads its init_from, or is fine-tuned here for its sft_steps on its task (an
agentic run's: its environment's scripted conversations), with the student's sft section otherwise, then cached in
<workdir>/teachers/<name>.
"""

from __future__ import annotations

import copy
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import agentic, tasks as tasks_lib
from glm_jax.rl.context import RunSetup
from glm_jax.train import optimizers, step as train_step_lib
from glm_jax.train.checkpoint import Checkpointer, describe_tokenizer
from glm_jax.train.packed_checkpoint import is_packed, load_packed
from glm_jax.train.progress import Progress


def make_policy(model_cfg: ModelConfig, opt_cfg: ml_collections.ConfigDict, seed: int, freeze_indexer: bool):
  """(graphdef, TrainState, optimizer, schedule); the indexer is frozen when freeze_indexer (GLM-5's RL)."""
  model = GlmMoeDsa(model_cfg, nnx.Rngs(seed))
  trainable = (lambda path: not train_step_lib.is_indexer_param(path)) if freeze_indexer else None
  optimizer = optimizers.make_optimizer(opt_cfg, nnx.state(model, nnx.Param), trainable=trainable)
  graphdef, state = train_step_lib.init_train_state(model, optimizer)
  return graphdef, state, optimizer, optimizers.learning_rate_schedule(opt_cfg)


def sft_step(compiled: dict, graphdef, model_cfg: ModelConfig, params, sft: ml_collections.ConfigDict):
  """(optimizer, jitted pretraining step) for fine-tuning with `sft`, kept in `compiled` (the run's
  RunSetup.sft_steps) by (model, sft.optimizer, sft.train_step, DSA stage): the teachers and the student of one
  architecture share a compilation. The DSA stage is sparse when DSA is active at sft.seq_len, else dense."""
  sparse = model_cfg.use_dsa and sft.seq_len > model_cfg.index_topk
  train_cfg = ml_collections.ConfigDict(dict(sft.train_step.to_dict(), dsa_stage="sparse" if sparse else "dense"))
  key = (graphdef, json.dumps(dict(optimizer=sft.optimizer.to_dict(), step=train_cfg.to_dict()), sort_keys=True))
  if key not in compiled:
    optimizer = optimizers.make_optimizer(sft.optimizer, params)
    compiled[key] = (
      optimizer,
      train_step_lib.make_train_step(graphdef, optimizer, optimizers.learning_rate_schedule(sft.optimizer), train_cfg),
    )
  return compiled[key]


def supervised_finetune(
  setup: RunSetup,
  graphdef,
  params,
  rest,
  model_cfg: ModelConfig,
  sft: ml_collections.ConfigDict,
  tasks_and_weights,
  seed: int,
  log_prefix: str = "sft",
  environments=(),
):
  """sft.steps updates of the pretraining step on the tasks' demonstrations, or when `environments` are given
  ([(label, environment, weight)], an agentic run's) on their scripted conversations: returns (params, rest, the
  last step's loss)."""
  compiled_before = len(setup.sft_steps)
  optimizer, step_fn = sft_step(setup.sft_steps, graphdef, model_cfg, params, sft)
  state = train_step_lib.new_train_state(params, rest, optimizer)
  rng = np.random.default_rng(seed)
  loss = float("nan")
  name = f"{setup.config.get('name', setup.config.trainer)} {log_prefix}"
  progress = Progress(name, total=sft.steps, start=0, tokens_per_step=sft.batch_size * sft.seq_len)
  if len(setup.sft_steps) > compiled_before:  # a new step function: its first call compiles
    progress.compiling("the fine-tuning step")
  try:
    for i in range(sft.steps):
      if environments:  # agentic: the environments' scripted conversations, loss on the model's turns
        batch = agentic.demonstration_batch(environments, setup.vocab, rng, sft.batch_size, sft.seq_len)
      else:
        batch = tasks_lib.sft_batch(tasks_and_weights, rng, sft.batch_size, sft.seq_len, setup.vocab)
      state, m = step_fn(state, {k: jnp.asarray(v) for k, v in batch.items()})
      progress.step_done(i + 1, m)
      if (i + 1) % max(sft.steps // 5, 1) == 0 or i + 1 == sft.steps:
        loss = float(m["lm_loss"])
        progress.log(i + 1, {"lm_loss": loss}, progress.rates())
  finally:
    progress.close()
  return state.params, state.rest, loss


def committed(state):
  """`state` with every array committed to its devices, as the outputs of a jitted step are. Restored or fine-tuned
  weights are committed while a freshly initialized optimizer state is not, and jit compiles a function again for
  arguments that differ only in that: the first step's program would then serve no later step."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, state)


def warm_start(setup: RunSetup, state):
  """(state, step, info): the latest checkpoint's state; else the warm-started policy, kept in <workdir>/init:
  rl.init_from's weights, or config.sft.steps of fine-tuning, or the random initialization. Every array of the
  state is committed to its devices (`committed`)."""
  config, checkpointer = setup.config, setup.checkpointer
  latest, restored = checkpointer.restore_latest(state)
  if latest is not None:
    logging.info("resuming from %s step %d", checkpointer.directory, latest)
    return committed(restored), latest, {}
  init = Checkpointer(os.path.join(setup.workdir, "init"), save_every=1, keep=1, async_save=False)
  info = {}
  if init.steps():
    _, (state.params, state.rest) = init.restore_latest_weights(state.params, state.rest)
  else:
    if config.rl.init_from:
      source = Checkpointer(config.rl.init_from, read_only=True)
      if not source.steps():
        raise ValueError(f"rl.init_from={config.rl.init_from!r}: no complete checkpoint in {source.directory}")
      source.require_tokenizer(setup.vocab.record(), f"rl.init_from={config.rl.init_from!r}")
      _, (state.params, state.rest) = source.restore_latest_weights(state.params, state.rest)
      source.close()
    if config.sft.steps and (not config.rl.init_from or setup.environments):
      t0 = time.perf_counter()
      state.params, state.rest, info["sft_loss"] = supervised_finetune(
        setup,
        setup.graphdef,
        state.params,
        state.rest,
        setup.model_cfg,
        config.sft,
        setup.tasks_and_weights,
        config.rl.seed,
        environments=setup.environments,
      )
      info["sft_s"] = time.perf_counter() - t0
    init.save(0, state, None, config.to_dict(), tokenizer=setup.vocab.record(), force=True)
  init.close()
  return committed(state), 0, info


def reference_policy(workdir: str, state):
  """(params, rest) of the warm-started policy (<workdir>/init)."""
  init = Checkpointer(os.path.join(workdir, "init"), read_only=True)
  _, (params, rest) = init.restore_latest_weights(state.params, state.rest)
  init.close()
  return params, rest


def load_teacher(setup: RunSetup, name: str):
  """(graphdef, params, rest) of config.teachers[name]: its init_from checkpoint (a training run's, or a packed
  model's from launch/quantize.py, whose params hold packed weights), or fine-tuned here on its task (cached in
  <workdir>/teachers/<name>)."""
  config, spec = setup.config, setup.config.teachers[name]
  cfg = ModelConfig.from_dict({**config.model.to_dict(), **spec.model.to_dict()})
  if spec.init_from and is_packed(spec.init_from):  # a quantized teacher (launch/quantize.py): it scores as served
    packed = load_packed(spec.init_from, cfg)
    field = f"teachers.{name}.init_from={spec.init_from!r}"
    if packed.tokenizer is not None and packed.tokenizer["sha256"] != setup.vocab.record()["sha256"]:
      raise ValueError(
        f"{field}: the packed model was trained with the tokenizer "
        f"{describe_tokenizer(packed.tokenizer)}, not this run's {describe_tokenizer(setup.vocab.record())}"
      )
    return packed.graphdef, packed.params, packed.rest
  graphdef, state, _, _ = make_policy(cfg, config.optimizer, spec.seed, freeze_indexer=False)
  source = spec.init_from or os.path.join(setup.workdir, "teachers", name)
  cache = Checkpointer(source, save_every=1, keep=1, async_save=False, read_only=bool(spec.init_from))
  if cache.steps():
    if spec.init_from:
      cache.require_tokenizer(setup.vocab.record(), f"teachers.{name}.init_from={spec.init_from!r}")
    _, (state.params, state.rest) = cache.restore_latest_weights(state.params, state.rest)
  elif spec.init_from:
    raise ValueError(f"teachers.{name}.init_from={spec.init_from!r}: no complete checkpoint in {cache.directory}")
  else:
    sft = copy.deepcopy(config.sft)
    sft.steps = spec.sft_steps
    if setup.environments:  # agentic: its environment's demonstrations (environment_mix labels it by the teacher)
      tasks, envs = [], [(label, env, 1.0) for label, env, _ in setup.environments if label == name]
    else:
      tasks, envs = [(tasks_lib.make_task(spec.task, **spec.task_kwargs.to_dict()), 1.0)], ()
    state.params, state.rest, loss = supervised_finetune(
      setup, graphdef, state.params, state.rest, cfg, sft, tasks, spec.seed, f"teacher {name}", envs
    )
    logging.info("teacher %s fine-tuned on %s: lm_loss %.4f", name, spec.task, loss)
    cache.save(
      0, state, None, {"teacher": spec.to_dict(), "model": cfg.to_dict()}, tokenizer=setup.vocab.record(), force=True
    )
  cache.close()
  return graphdef, state.params, state.rest
