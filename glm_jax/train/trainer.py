"""The pretraining loop: data -> jit step -> metrics, evals and checkpoints; resumes from its workdir.

`train_and_evaluate(config, workdir)` is everything launch/train.py does. Everything that can be checked
before work starts is checked first (config values, data path, tokenizer size, the workdir's checkpoints),
so a bad run stops with a message and touches nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from glm_jax import data as data_lib
from glm_jax.data.config import EXAMPLE_FORMATS, check_process_split
from glm_jax.model import GlmMoeDsa, ModelConfig, context_parallel, param_counts
from glm_jax.model.quantization import WEIGHT_ONLY, check_quant_config, quant_plan
from glm_jax.sharding.mesh import batch_sharding, make_mesh
from glm_jax.sharding.state import abstract_sharded, with_shardings
from glm_jax.train import optimizers, step as step_lib
from glm_jax.train.checkpoint import INIT_FROM_FREE_FIELDS, RESUME_SECTIONS, Checkpointer, check_writable
from glm_jax.train.config import invalid, model_config_for_stage, require_sections, validate_train_config
from glm_jax.train.flops import useful_flops
from glm_jax.train.guards import ConsecutiveSkips
from glm_jax.train.optimizer_config import checked_optimizer_config
from glm_jax.train.lifecycle import StopSignals, Stopped, stopped_message, workdir_lock
from glm_jax.train.metrics import MetricsWriter, last_logged
from glm_jax.train.progress import Progress


def create_train_state(config: ml_collections.ConfigDict, model_cfg: ModelConfig):
  """(graphdef, initial TrainState, optimizer, lr schedule) for a config; the warm-up stage's optimizer
  freezes everything but the indexer."""
  model = GlmMoeDsa(model_cfg, nnx.Rngs(config.train.seed))
  trainable = step_lib.is_indexer_param if config.train.dsa_stage == "warmup" else None
  optimizer = optimizers.make_optimizer(config.optimizer, nnx.state(model, nnx.Param), trainable=trainable)
  graphdef, state = step_lib.init_train_state(model, optimizer)
  return graphdef, state, optimizer, optimizers.learning_rate_schedule(config.optimizer)


def train_state_factory(config: ml_collections.ConfigDict, model_cfg: ModelConfig):
  """(make_state, built): make_state() returns create_train_state's state and, when first traced, fills
  built with its graphdef, optimizer and schedule (for jax.eval_shape or a jit that never materializes the
  model on the host)."""
  built = {}

  def make_state():
    graphdef, state, optimizer, schedule = create_train_state(config, model_cfg)
    built.update(graphdef=graphdef, optimizer=optimizer, schedule=schedule)
    return state

  return make_state, built


def create_sharded_train_state(config: ml_collections.ConfigDict, model_cfg: ModelConfig, mesh):
  """create_train_state's (graphdef, state, optimizer, schedule) with the state created directly in its
  sharded layout on `mesh` (no host holds it whole), and the state's shardings."""
  target = abstract_train_state(config, model_cfg, mesh)
  return target.graphdef, target.fresh(), target.optimizer, target.schedule, target.shardings


@dataclasses.dataclass
class AbstractTrainState:
  """A run's train state before anything is allocated: `state` has a ShapeDtypeStruct with its sharding for every
  leaf (the mesh's, from the logical axes, or the first local device's without a mesh), the target a checkpoint is
  restored onto. `fresh()` makes the random initialization, `from_weights(params, rest)` step 0 of given weights;
  each is created in place on its devices (jit with the state's out_shardings), never on one host."""

  graphdef: Any
  state: step_lib.TrainState
  optimizer: Any
  schedule: Any
  shardings: Any  # the state's NamedShardings under a mesh, else None
  make_state: Callable[[], step_lib.TrainState]
  mesh: Any

  def fresh(self) -> step_lib.TrainState:
    return self._create(self.make_state)

  def from_weights(self, params, rest) -> step_lib.TrainState:
    """Step 0 of these weights (a fresh optimizer state), their buffers donated to the state."""
    return self._create(
      lambda p, r: step_lib.new_train_state(p, r, self.optimizer), params, rest, donate_argnums=(0, 1)
    )

  def _create(self, fn, *args, **jit_kw):
    if self.mesh is None:  # committed to the device a restored state is on, so both compile one same step program
      out_shardings = jax.tree.map(lambda leaf: leaf.sharding, self.state)
      platform = jax.local_devices()[0].platform
    else:
      out_shardings = self.shardings
      platform = self.mesh.devices.flat[0].platform
    if platform == "cpu":
      jit_kw["compiler_options"] = INIT_CPU_COMPILER_OPTIONS
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      return jax.jit(fn, out_shardings=out_shardings, **jit_kw)(*args)


# The state is made once, so on CPU its program is compiled at LLVM's O1: XLA's default level (3) spends over half
# the compile on the initializers' rolled threefry loops (docs/training.md, "Compile times"). O1 makes the same
# values to within a few float32 ulps (its loops' remainders contract other multiplies and adds into FMAs than O3's;
# tests/train/test_trainer.py bounds it); O0 leaves thousands of elements unfused.
INIT_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def abstract_train_state(config: ml_collections.ConfigDict, model_cfg: ModelConfig, mesh=None) -> AbstractTrainState:
  """The run's AbstractTrainState on `mesh` (None: one device)."""
  make_state, built = train_state_factory(config, model_cfg)
  if mesh is None:
    state = with_shardings(jax.eval_shape(make_state), jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    shardings = None
  else:
    state, shardings = abstract_sharded(make_state, lambda s: s.params, mesh)
  return AbstractTrainState(
    built["graphdef"], state, built["optimizer"], built["schedule"], shardings, make_state, mesh
  )


BATCH_KEYS = (
  "input_ids",
  "segment_ids",
  "positions",
  "loss_mask",  # every batch
  "targets",
  "block_positions",
  "prefix_end",
)  # the blank-infilling objective's (data.objective "glm")


def _global_batch(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """This process's rows -> the global batch: as is on one device, assembled across processes on a mesh."""
  keys = [k for k in BATCH_KEYS if k in batch]
  if sharding is None:
    return {k: jnp.asarray(batch[k]) for k in keys}
  return {k: jax.make_array_from_process_local_data(sharding, batch[k]) for k in keys}


def evaluate(
  eval_step, state: step_lib.TrainState, batches: list[dict[str, np.ndarray]], sharding=None
) -> float | None:
  """Held-out loss in nats per target token; None when there is no held-out data (eval_fraction 0)."""
  return eval_metrics(eval_step, state, batches, sharding)["eval_loss"]


def eval_metrics(
  eval_step, state: step_lib.TrainState, batches: list[dict[str, np.ndarray]], sharding=None
) -> dict[str, float | None]:
  """{"eval_loss"} (see evaluate) and, for blank-infilling batches, {"eval_spans": the held-out spans,
  "eval_span_exact": the share of them greedy decoding fills exactly} (step.make_eval_step)."""
  sums: dict[str, float] = {}
  for batch in batches:
    for k, v in eval_step(state.params, state.rest, _global_batch(batch, sharding)).items():
      sums[k] = sums.get(k, 0.0) + float(v)
  out = {"eval_loss": sums["nll"] / sums["tokens"] if sums.get("tokens") else None}
  if "spans" in sums:
    out["eval_spans"] = int(sums["spans"])
    out["eval_span_exact"] = sums["spans_exact"] / sums["spans"] if sums["spans"] else None
  return out


@dataclasses.dataclass
class RestoredRun:
  """A run's latest checkpoint, ready to sample from or evaluate: what restore_run returns."""

  step: int
  model_cfg: ModelConfig
  graphdef: Any
  state: step_lib.TrainState
  tokenizer: data_lib.Tokenizer


def restore_run(config: ml_collections.ConfigDict, workdir: str) -> RestoredRun:
  """The latest checkpoint of `workdir` (trained under `config`: a checkpoint of another model is refused by
  name; or a weights-only one from launch/convert.py, of the same model), with the tokenizer it was trained with
  (whatever config.data says), on one device.
  launch/sample.py and the notebooks sample from it."""
  model_cfg = model_config_for_stage(config)
  with Checkpointer(workdir, read_only=True) as checkpointer:
    if not checkpointer.steps():
      raise FileNotFoundError(f"--workdir={workdir}: no checkpoint in {checkpointer.directory}")
    weights_only = checkpointer.weights_only(checkpointer.steps()[0])
    if weights_only:  # a converted checkpoint (launch/convert.py): the model must match; it has no optimizer state
      checkpointer.check_compatible(config.to_dict(), sections=("model",), train_fields=(), free=INIT_FROM_FREE_FIELDS)
    else:
      checkpointer.check_compatible(config.to_dict())
    record = checkpointer.recorded_tokenizer(checkpointer.steps()[0])
    if record is not None:  # the tokenizer the model was trained with, whatever config.data says
      tokenizer = data_lib.Tokenizer.from_record(record)
    else:
      logging.warning(
        "%s records no tokenizer (saved before runs recorded one); using config.data's", checkpointer.directory
      )
      tokenizer = data_lib.load_tokenizer(config.data)
    data_lib.check_vocab(tokenizer, model_cfg.vocab_size)
    target = abstract_train_state(config, model_cfg)  # read straight into place: no random initialization first
    if weights_only:
      step, weights = checkpointer.restore_latest_weights(target.state.params, target.state.rest)
      state = target.from_weights(*weights)
    else:
      step, state = checkpointer.restore_latest(target.state)
  return RestoredRun(step, model_cfg, target.graphdef, state, tokenizer)


def check_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The checks a pretraining config passes before any work starts (its sections, the train, optimizer and data
  fields, the model of its DSA stage), each failure a ValueError naming the field, its value and what is valid.
  Returns the model config of the run's DSA stage. launch/sweep.py runs it on every point before the first run."""
  require_sections(config, ("model", "data", "train", "optimizer"), "training", "configs/glm5_tiny.py")
  train = config.train
  validate_train_config(train)
  model_cfg = model_config_for_stage(config)
  checked_optimizer_config(config.optimizer)
  data_lib.validate_data_config(config.data)
  if config.data.batch_size % train.microbatches:
    invalid("train.microbatches", train.microbatches, f"must divide data.batch_size={config.data.batch_size}")
  if train.loss_chunk and config.data.seq_len % train.loss_chunk:
    invalid("train.loss_chunk", train.loss_chunk, f"must divide data.seq_len={config.data.seq_len} (or be 0)")
  context = config.mesh.get("context", 1) if "mesh" in config else 1
  if context > 1:  # context parallelism's sizes, named before any compile
    context_parallel.check(config.data.seq_len, context, model_cfg)
  kind = config.get("trainer", "pretrain")
  data_formats = EXAMPLE_FORMATS if kind == "sft" else ("lm",)
  if config.data.format not in data_formats:
    invalid(
      "data.format",
      config.data.format,
      f"config.trainer={kind!r} trains on {' or '.join(map(repr, data_formats))} data",
    )
  if config.data.objective == "glm" and not model_cfg.rope_2d:
    invalid(
      "model.rope_2d",
      model_cfg.rope_2d,
      "data.objective='glm' gives GLM's 2-D positions (position, block position): set model.rope_2d=True",
    )
  if "quant" in config:
    check_quant_config(config.quant)
    if config.quant.scheme not in ("none",) + WEIGHT_ONLY:
      invalid(
        "quant.scheme",
        config.quant.scheme,
        f"quantization-aware training takes {list(WEIGHT_ONLY)} (or "
        "'none'); W8A8 / W4A8 are post-training schemes (launch/quantize.py)",
      )
  return model_cfg


def training_quant_plan(config: ml_collections.ConfigDict, params) -> dict:
  """The QAT plan of config.quant for these parameters ({} without a quant section or with scheme 'none')."""
  return quant_plan(params, config.quant) if "quant" in config else {}


StepHook = Callable[[int, step_lib.TrainState, dict[str, Any]], None]


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, *, hooks: Sequence[StepHook] = ()
) -> dict[str, Any]:
  """Trains for config.train.steps steps (resuming from workdir's latest checkpoint) and returns the
  summary that launch/train.py prints: eval_loss and unigram_entropy in nats per token, and more.

  hooks: callables hook(step, state, metrics) run in order after each step, once the step's metrics are logged
  and its checkpoint (when one is due) has been started, asynchronously: a place for a probe, a custom
  evaluation or a stopping rule in a notebook or sweep, without editing the loop. `step` counts the steps done;
  `metrics` is the step's metrics dict (jax arrays; numpy values on logged steps). An exception in a hook ends the
  run (the checkpointer is closed, as on any error)."""
  # Everything cheap to check is checked before anything is built or written.
  model_cfg = check_config(config)
  check_process_split(config.data, jax.process_index(), jax.process_count())
  mesh = make_mesh(config.mesh) if "mesh" in config else None
  check_writable(os.path.join(os.path.abspath(workdir), "checkpoints"))  # before the lock creates the workdir
  with StopSignals() as stop, workdir_lock(workdir, "training"):
    return _train(config, workdir, model_cfg, mesh, hooks, stop)


def _train(config, workdir, model_cfg, mesh, hooks, stop) -> dict[str, Any]:
  """train_and_evaluate once the config is checked and the workdir is locked."""
  train = config.train
  checkpointer = Checkpointer(
    workdir, save_every=train.checkpoint_every, keep=train.keep_checkpoints, async_save=train.async_checkpoints
  )
  config_dict = config.to_dict()
  init_source = None
  if not checkpointer.steps() and train.init_from:
    init_source = Checkpointer(train.init_from, read_only=True)
    if not init_source.steps():
      raise ValueError(f"train.init_from={train.init_from!r}: no complete checkpoint in {init_source.directory}")
    init_source.check_compatible(config_dict, sections=("model",), train_fields=(), free=INIT_FROM_FREE_FIELDS)
  tokenizer = data_lib.load_tokenizer(config.data)
  data_lib.check_vocab(tokenizer, model_cfg.vocab_size)
  tokenizer_record = tokenizer.record()
  if init_source is not None:
    init_source.require_tokenizer(tokenizer_record, f"train.init_from={train.init_from!r}")
  data_changed = checkpointer.check_compatible(
    config_dict, sections=RESUME_SECTIONS, tokenizer=tokenizer_record, allow_data_change=train.allow_data_change
  )

  if mesh is not None and mesh.size == 1:
    mesh = None  # one device: the plain path, nothing to shard
  # Nothing is allocated until we know where the state comes from: a checkpoint to resume, init_from's weights
  # (read slice by slice onto the state's shardings) or the random initialization.
  target = abstract_train_state(config, model_cfg, mesh)
  graphdef, optimizer, schedule, shardings = target.graphdef, target.optimizer, target.schedule, target.shardings
  data_sharding = None if mesh is None else batch_sharding(mesh)
  plan = training_quant_plan(config, target.state.params)
  train_step = step_lib.make_train_step(
    graphdef, optimizer, schedule, train, state_shardings=shardings, batch_sharding=data_sharding, quant_plan=plan
  )
  eval_step = step_lib.make_eval_step(graphdef, plan, loss_chunk=config.train.loss_chunk)

  data_iter = data_lib.make_train_iterator(
    config.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count()
  )
  eval_batches = data_lib.make_eval_batches(
    config.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count()
  )
  start, state = checkpointer.restore_latest(target.state, None if data_changed else data_iter)
  if start is not None:
    logging.info("resumed from %s at step %d", checkpointer.directory, start)
  elif init_source is not None:
    # read onto the state's own shardings, each process reading only its devices' slices
    source_step, weights = init_source.restore_latest_weights(target.state.params, target.state.rest)
    init_source.close()
    state = target.from_weights(*weights)
    logging.info("initialized from %s step %d", init_source.directory, source_step)
  else:
    state = target.fresh()
  start = start or 0
  counts = param_counts(model_cfg)
  logging.info(
    "glm5 %s: %.3e params (%.3e active), stage %s, %d steps",
    config.get("name", "?"),
    counts["total"],
    counts["active"],
    train.dsa_stage,
    train.steps,
  )

  def mesh_context():  # the MoE's expert parallelism reads the mesh from this context
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

  writer = MetricsWriter(workdir, tensorboard=train.tensorboard, enabled=jax.process_index() == 0, keep_through=start)
  skips = ConsecutiveSkips(train.max_consecutive_skips, "train.max_consecutive_skips")
  progress = Progress(
    config.get("name", "train"),
    total=train.steps,
    start=start,
    tokens_per_step=config.data.batch_size * config.data.seq_len,
    flops_per_step=useful_flops(model_cfg, config.data.batch_size, config.data.seq_len, train.dsa_stage)["total"],
    enabled=jax.process_index() == 0,
    devices=1 if mesh is None else mesh.size,
  )
  shown = ("loss", "lm_loss") + (("indexer_kl",) if train.dsa_stage != "dense" else ())
  last_loss = last_lm_loss = math.nan
  eval_loss, evals = None, {}
  try:
    if start < train.steps:
      progress.compiling("the train step")
    for step in range(start, train.steps):
      with mesh_context():
        state, metrics = train_step(state, _global_batch(next(data_iter), data_sharding))
      done = step + 1
      progress.step_done(done, metrics)
      skips.update(done, metrics["skipped"])  # raises Diverged after too many skipped steps in a row
      if done % train.log_every == 0 or done == train.steps:
        metrics = jax.device_get(metrics)
        rates = progress.rates()
        row = writer.write(done, {**metrics, **rates})
        last_loss, last_lm_loss = row["loss"], row["lm_loss"]
        if row["skipped"]:
          logging.warning("step %d skipped: loss %.4g, grad norm %.4g", done, row["loss"], row["grad_norm"])
        progress.log(done, {k: row[k] for k in shown if k in row}, rates)
      if (done % train.eval_every == 0 or done == train.steps) and eval_batches:
        with progress.aside(state), mesh_context():
          evals = eval_metrics(eval_step, state, eval_batches, data_sharding)
        eval_loss = evals["eval_loss"]
        writer.write(done, evals)
        progress.print(f"step {done} " + "  ".join(f"{k} {v:.4g}" for k, v in evals.items() if v is not None))
      with progress.aside(state if checkpointer.due(done, force=done == train.steps) else None):
        saved = checkpointer.save(
          done, state, data_iter, config_dict, tokenizer=tokenizer_record, force=done == train.steps
        )
        for hook in hooks:
          hook(done, state, metrics)
      checkpointer.check_saves()  # a failed save stops the run here, not at the next one
      signum = stop.due(done)
      if signum is not None:
        if not saved:
          checkpointer.save(done, state, data_iter, config_dict, tokenizer=tokenizer_record, force=True)
        skips.finish()
        checkpointer.wait()
        raise Stopped(signum, stopped_message(signum, done, checkpointer.directory))
    skips.finish()
    with progress.aside():
      checkpointer.wait()
  finally:
    progress.close()
    checkpointer.close()
    writer.close()

  if start >= train.steps:  # a rerun of a finished run: its last logged loss, as the run reported it
    last_loss = last_logged(workdir, "loss", through=start)
    last_lm_loss = last_logged(workdir, "lm_loss", through=start)
    logging.warning(
      "%s is complete at step %d (train.steps=%d): nothing to train; raise train.steps to go on",
      workdir,
      start,
      train.steps,
    )
  if eval_loss is None:  # nothing left to train (or no held-out data): report the model as it stands
    with mesh_context():
      evals = eval_metrics(eval_step, state, eval_batches, data_sharding)
    eval_loss = evals["eval_loss"]
  return {
    "step": int(state.step),
    **evals,
    "eval_loss": eval_loss,
    "unigram_entropy": data_lib.unigram_entropy(config.data, tokenizer),
    "train_loss": last_loss,  # the step's whole objective (MTP, balance, indexer terms included)
    "train_lm_loss": last_lm_loss,  # its next-token loss alone, comparable with eval_loss
    "skipped_steps": int(state.skipped),
    "params": counts["total"],
    "active_params": counts["active"],
    **progress.summary(),
    "workdir": os.path.abspath(workdir),
  }
