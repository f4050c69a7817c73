"""Orbax checkpoints of the train state with the Grain iterator state in the same step.

<workdir>/checkpoints/<step>/ holds the items "state" (TrainState), "data" (the Grain iterator), "config" (the
run's config as JSON) and "tokenizer" (the tokenizer's record: name, sha256 of its JSON, vocabulary size and the
JSON itself, so a sampler decodes with the tokenizer the model was trained with). Together, config and tokenizer
are the run's fingerprint. Saves are asynchronous; Orbax writes each step into a temporary directory and renames
it when complete, so a run killed mid-save resumes from the last complete step.

Safeguards:
  - A workdir whose checkpoints were written with an incompatible config (other model shapes, optimizer or DSA
    stage; for a pretraining resume also other data or another tokenizer, unless train.allow_data_change) is
    refused, naming each field, before anything is restored or overwritten.
  - A step that cannot be restored (a truncated or deleted file) is reported in one line and the step before it
    is restored instead; the bad step is moved aside to <step>.unreadable, never deleted.
  - Parameters that are not all finite are never saved.
  - An unwritable checkpoints directory fails at once, before any work; nothing is created until the first save.
  - A save that fails (a full disk, a lost mount) stops the run at the next step boundary (check_saves raises
    CheckpointWriteError naming the step and the cause); the steps saved before it are left as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging as pylogging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging

from glm_jax.data import config as data_config
from glm_jax.model.config import ModelConfig
from glm_jax.model.quantization import default_quant_config
from glm_jax.sharding.checkpoint_arrays import is_weights_only, read_weights
from glm_jax.train.config import default_train_config
from glm_jax.train.optimizer_config import default_optimizer_config
from glm_jax.train.guards import Diverged, first_nonfinite

# Config fields that may change between a run and its resumption (they change neither the saved state nor the data),
# as each section declares them.
RUNTIME_FIELDS = {"model": ModelConfig.runtime_fields(), "data": data_config.RUNTIME_FIELDS}
# Model fields that may differ between a run and one that starts from its weights (train.init_from): they change
# what the model computes, not its parameters; a sweep of the sparse stage over index_topk starts every point from
# one warm-up run.
INIT_FROM_FREE_FIELDS = {"model": {"index_topk"}}
# Differences that train.allow_data_change permits (a new data mix is a real use).
DATA_DIFFS = ("data.", "tokenizer:")
# The sections a pretraining or SFT run resumes only under the same values (or with allow_data_change for "data").
RESUME_SECTIONS = ("model", "optimizer", "data", "quant")
# Config sections whose other fields must match the checkpoint's.
COMPARED_SECTIONS = ("model", "optimizer")
COMPARED_TRAIN_FIELDS = ("dsa_stage",)
# The library's defaults of each section a checkpoint is compared on (and of train): a field that a checkpoint's
# config lacks, because it was added to the library after the checkpoint was written, counts as its default, so
# adding a field never breaks a resume (and a run that leaves a field out gets its default, as the library reads it).
SECTION_DEFAULTS: dict[str, Callable[[], Mapping[str, Any]]] = {
  "model": ModelConfig.defaults,
  "optimizer": lambda: default_optimizer_config().to_dict(),
  "data": lambda: data_config.default_data_config().to_dict(),
  "quant": lambda: default_quant_config().to_dict(),
  "train": lambda: default_train_config().to_dict(),
}
_ABSENT = object()


def _flat(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"a.b": leaf} of a nested section (JSON's view: tuples are lists)."""
  out = {}
  for key, value in section.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = list(value) if isinstance(value, tuple) else value
  return out


def _shown(section: Mapping[str, Any], key: str, default: Any) -> str:
  if key in section:
    return repr(section[key])
  return "absent" if default is _ABSENT else f"absent (default {default!r})"


def config_differences(
  saved: Mapping[str, Any],
  current: Mapping[str, Any],
  *,
  sections: tuple[str, ...] = COMPARED_SECTIONS,
  train_fields: tuple[str, ...] = COMPARED_TRAIN_FIELDS,
  free: Mapping[str, set[str]] | None = None,
) -> list[str]:
  """Human-readable differences that make a checkpoint unusable under `current`; the fields of RUNTIME_FIELDS and
  of `free` ({section: fields}) may differ. A field either side lacks counts as its SECTION_DEFAULTS default; the
  fields the checkpoint lacks are logged in one line."""
  free = free or {}
  current = json.loads(json.dumps(current))  # as the checkpoint stored it: tuples become lists
  diffs, unstated = [], []

  def compare(section: str, keys) -> None:
    defaults = _flat(SECTION_DEFAULTS[section]()) if section in SECTION_DEFAULTS else {}
    a, b = _flat(saved.get(section, {})), _flat(current.get(section, {}))
    for key in keys(a, b, defaults):
      top = key.split(".")[0]
      if top in RUNTIME_FIELDS.get(section, ()) or top in free.get(section, ()):
        continue
      default = defaults.get(key, _ABSENT)
      if key not in a and default is not _ABSENT:
        unstated.append(f"{section}.{key}")
      x, y = a.get(key, default), b.get(key, default)
      if x != y:
        diffs.append(f"{section}.{key}: checkpoint {_shown(a, key, default)}, config {_shown(b, key, default)}")

  for section in sections:
    compare(section, lambda a, b, defaults: sorted(set(a) | set(b)))
  if train_fields:
    compare("train", lambda a, b, defaults: list(train_fields))
  if unstated:
    logging.info(
      "The checkpoint's config does not give %s (fields added since, or left out): taken as their defaults",
      ", ".join(unstated),
    )
  return diffs


class CheckpointWriteError(OSError):
  """A checkpoint could not be written; the message names the step, the cause and the last good step."""


class _ReadOnlyNotice(pylogging.Filter):
  def filter(self, record: pylogging.LogRecord) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def _without_read_only_warning():
  """Orbax's "Given directory is read only" warning left out of absl's log while a read-only manager opens."""
  notice = _ReadOnlyNotice()
  logger = logging.get_absl_logger()
  logger.addFilter(notice)
  try:
    yield
  finally:
    logger.removeFilter(notice)


class Checkpointer:
  """Orbax's CheckpointManager over <workdir>/checkpoints.

  The directory is created on the first save, not before, so a run that fails while it is being set up leaves
  nothing behind; whether it can be written is checked at once (a probe file, removed), so an unwritable one
  fails in a line before any work. read_only: restore only; the directory must exist. close() it, or use it in a
  `with` block, so that Orbax's threads stop."""

  def __init__(
    self, workdir: str, *, save_every: int = 1, keep: int = 1, async_save: bool = True, read_only: bool = False
  ):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.read_only = read_only
    if read_only and not os.path.isdir(self.directory):
      raise FileNotFoundError(f"{workdir}: no checkpoints directory ({self.directory} does not exist)")
    if not read_only:
      check_writable(self.directory)
    # Read-only: the interval and the number kept that Orbax would set itself (it warns when it has to).
    self._options = ocp.CheckpointManagerOptions(
      save_interval_steps=0 if read_only else save_every,
      max_to_keep=None if read_only else keep,
      enable_async_checkpointing=async_save,
      create=not read_only,
      read_only=read_only,
    )
    self._unconfirmed: int | None = None  # the step of the last save started
    self._save_error: BaseException | None = None
    self._manager = self._open() if os.path.isdir(self.directory) else None

  def _open(self) -> ocp.CheckpointManager:
    with _without_read_only_warning():  # Orbax warns that a read-only manager is read-only: asked for, not news
      manager = ocp.CheckpointManager(self.directory, options=self._options)
    # Orbax's manager, on finishing an asynchronous save, asks its checkpointer for the save thread's error and only
    # logs it (leaving the step unfinalized); the error is kept here so that check_saves can stop the run.
    check = manager.check_for_errors

    def recording_check():
      try:
        check()
      except Exception as e:
        self._save_error = self._save_error or e
        raise

    manager.check_for_errors = recording_check
    return manager

  @property
  def manager(self) -> ocp.CheckpointManager:
    """The Orbax manager; its directory is created when first asked for (to save)."""
    if self._manager is None:
      os.makedirs(self.directory, exist_ok=True)
      self._manager = self._open()
    return self._manager

  def latest_step(self) -> int | None:
    return None if self._manager is None else self._manager.latest_step()

  def steps(self) -> list[int]:
    """The saved steps, newest first."""
    return [] if self._manager is None else sorted(self._manager.all_steps(), reverse=True)

  def _read_json(self, step: int, item: str) -> Any:
    if not os.path.isdir(os.path.join(self.directory, str(step), item)):
      return None  # a checkpoint from before the item existed
    return self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]

  def recorded_tokenizer(self, step: int) -> dict | None:
    """The tokenizer record saved with `step` (Tokenizer.record(): name, sha256, vocab_size and, for a
    tokenizers.Tokenizer, its JSON), or None for a checkpoint saved without one."""
    return self._read_json(step, "tokenizer")

  def recorded_config(self, step: int) -> dict | None:
    """The config saved with `step` (the run's whole config as JSON; a converted checkpoint's is the config it was laid
    out for, or just its model section), or None for a checkpoint saved without one."""
    return self._read_json(step, "config")

  def require_tokenizer(self, tokenizer: Mapping[str, Any], field: str) -> None:
    """Raises ValueError (naming `field`, the config field that chose this checkpoint) when the newest step
    recorded another tokenizer than `tokenizer` (a record); a step that recorded none is accepted."""
    steps = self.steps()
    recorded = self.recorded_tokenizer(steps[0]) if steps else None
    if recorded is not None and recorded["sha256"] != tokenizer["sha256"]:
      raise ValueError(
        f"{field}: {self.directory} (step {steps[0]}) was trained with the tokenizer "
        f"{describe_tokenizer(recorded)}, but this run uses {describe_tokenizer(tokenizer)}; its "
        "weights would read other tokens"
      )

  def check_compatible(
    self,
    config: Mapping[str, Any],
    *,
    tokenizer: Mapping[str, Any] | None = None,
    allow_data_change: bool = False,
    **compare,
  ) -> list[str]:
    """Raises ValueError naming every field where the newest checkpoint's config differs from `config`
    (`compare`: config_differences' sections / train_fields) and, given this run's tokenizer record, where the
    recorded tokenizer differs. Differences in the data section and the tokenizer are allowed with
    allow_data_change (logged, and returned so the caller starts its data afresh). A step whose config cannot be
    read is passed over (restore_latest reports it)."""
    for step in self.steps():
      try:
        saved = self._read_json(step, "config")
        recorded = self.recorded_tokenizer(step)
        break
      except Exception:  # noqa: BLE001 - reported when restore_latest reaches it
        continue
    else:
      return []
    diffs = config_differences(saved, config, **compare)
    if tokenizer is not None and recorded is not None and recorded["sha256"] != tokenizer["sha256"]:
      diffs.append(f"tokenizer: checkpoint {describe_tokenizer(recorded)}, config {describe_tokenizer(tokenizer)}")
    data = [d for d in diffs if d.startswith(DATA_DIFFS)]
    fixed = [d for d in diffs if d not in data]
    where = f"{self.directory} holds checkpoints (latest step {step}) of"
    if fixed or (data and not allow_data_change):
      hint = (
        " Or, to go on training this run on other data, --config.train.allow_data_change=True (the train "
        "state is restored; the data starts afresh)."
        if data and not fixed
        else ""
      )
      raise ValueError(
        f"{where} an incompatible config: "
        + "; ".join(fixed + data)
        + ". Use another --workdir, or the checkpoint's config."
        + hint
      )
    if data:
      logging.warning(
        "%s other data (allowed by train.allow_data_change): %s; the data starts afresh", where, "; ".join(data)
      )
    return data

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether save(step, ..., force=force) writes a checkpoint."""
    return force or self.manager.should_save(step)

  def save(
    self,
    step: int,
    state: Any,
    data_iter: grain.DatasetIterator | None,
    config: Mapping[str, Any],
    *,
    tokenizer: Mapping[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Saves state, the config, the tokenizer record when given and, when given, the data iterator's position
    (a run whose data is a function of the step, such as the RL loops', has none). Refuses (Diverged, nothing
    written) a state whose parameters are not all finite."""
    if not self.due(step, force=force):
      return False
    bad = first_nonfinite(state.params) if hasattr(state, "params") else None
    if bad is not None:
      raise Diverged(
        f"not saving step {step}: parameter {bad} is not finite; {self.directory} keeps its "
        f"checkpoints (latest step {self.latest_step()})"
      )
    items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(dict(config)))
    if tokenizer is not None:
      items["tokenizer"] = ocp.args.JsonSave(dict(tokenizer))
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    if self._unconfirmed is not None:  # Orbax waits for the previous save before it starts one: wait here, so that
      self._wait()  # its failure is reported as its own
    self.check_saves()
    self._unconfirmed = step
    try:
      return self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # a synchronous save's write error (asynchronous ones: check_saves)
      self._save_error = self._save_error or e
      self.check_saves()
      raise

  def check_saves(self) -> None:
    """Raises CheckpointWriteError, naming the step and the cause, when a save has failed (an asynchronous one is
    seen once its thread has ended). The training loops call it after every step, so a run whose checkpoints cannot
    be written stops at once instead of at its next save."""
    if self._manager is not None and self._save_error is None:
      with contextlib.suppress(Exception):  # recorded by recording_check
        self._manager.check_for_errors()
    if self._save_error is None:
      return
    good = [int(n) for n in os.listdir(self.directory) if n.isdigit() and int(n) != self._unconfirmed]
    kept = f"step {max(good)} is the latest one written" if good else "no step was written"
    raise CheckpointWriteError(
      f"the checkpoint of step {self._unconfirmed} could not be written to {self.directory} "
      f"({first_line(self._save_error)}); the run stops: {kept}"
    ) from self._save_error

  def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None = None) -> Any:
    """The saved TrainState (onto `abstract_state`'s structure and shardings); `data_iter`, when given, is
    advanced in place to where the saved run stood."""
    items = {"state": ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state))}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

  def restore_latest(
    self, abstract_state: Any, data_iter: grain.DatasetIterator | None = None
  ) -> tuple[int | None, Any]:
    """(step, state) from the newest step that restores (see restore), or (None, abstract_state) when there is
    none. A step that fails to restore (a truncated or missing file) is reported in one line each, and once an
    older one has restored it is moved aside to <step>.unreadable (never deleted; left in place when read_only),
    so the run's next saves do not meet it. When no step restores, nothing is moved and the error names each."""
    return self._newest_restorable(lambda step: self.restore(step, abstract_state, data_iter), abstract_state)

  def restore_latest_weights(self, params: Any, rest: Any) -> tuple[int, tuple[Any, Any]]:
    """(step, restore_weights(step, ...)) for the newest step that restores, as restore_latest chooses it."""
    step, weights = self._newest_restorable(lambda step: self.restore_weights(step, params, rest), None)
    if step is None:
      raise ValueError(f"{self.directory}: no checkpoint to initialize from")
    return step, weights

  def _newest_restorable(self, restore, default):
    failed = []
    for step in self.steps():
      try:
        out = restore(step)
      except Exception as e:  # noqa: BLE001 - any failure to read a step is reported and the next one tried
        reason = first_line(e)
        logging.warning(
          "checkpoint %s/%d cannot be restored (%s); trying the step before it", self.directory, step, reason
        )
        failed.append((step, reason))
        continue
      if failed:
        moved = [self._set_aside(bad) for bad, _ in failed]
        logging.warning(
          "restored step %d of %s instead of step %s; the unreadable step(s) are kept in %s",
          step,
          self.directory,
          ", ".join(str(b) for b, _ in failed),
          ", ".join(moved),
        )
      return step, out
    if failed:
      raise ValueError(
        f"no checkpoint in {self.directory} can be restored: "
        + "; ".join(f"step {s} ({r})" for s, r in failed)
        + ". They are left as they are; use another --workdir"
      )
    return None, default

  def _set_aside(self, step: int) -> str:
    path = os.path.join(self.directory, str(step))
    if self.read_only or jax.process_index() != 0:
      return path
    target = f"{path}.unreadable"
    n = 1
    while os.path.exists(target):
      n += 1
      target = f"{path}.unreadable{n}"
    os.rename(path, target)
    self._manager.reload()
    return target

  def restore_weights(self, step: int, params: Any, rest: Any) -> tuple[Any, Any]:
    """(params, rest) with every array taken from the checkpoint at `step` (a training run's, whatever optimizer
    state or stage it was saved with, or a weights-only one from launch/convert.py); a missing or differently
    shaped array is an error that names it. Each array is read onto the sharding of the one it replaces (one
    device when that is not a jax.Array), each process reading only its own devices' slices
    (glm_jax/sharding/checkpoint_arrays.py), whatever mesh or number of processes wrote it; the optimizer state is
    never read."""
    return read_weights(self.state_dir(step), params, rest, where=f"{self.directory}/{step}")

  def state_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step), "state")

  def weights_only(self, step: int) -> bool:
    """Whether `step` holds only weights (launch/convert.py's checkpoints), not a whole train state."""
    return is_weights_only(self.state_dir(step))

  def _wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # an asynchronous save's write error, re-raised by the wait
      self._save_error = self._save_error or e

  def wait(self) -> None:
    """Waits for a pending save; raises CheckpointWriteError if it failed."""
    self._wait()
    self.check_saves()

  def close(self) -> None:
    """Waits for a pending save and stops Orbax's threads; creates nothing (a checkpointer that never saved has
    no directory, and closing it leaves none)."""
    if self._manager is not None:
      self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first line of the innermost cause of `error` (tensorstore's, which names the file), without the
  tensorstore spec that follows it; a long one keeps its start and its end, where the cause is."""
  while True:
    inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if inner is None:
      break
    error = inner
  text = (str(error).strip().splitlines() or [""])[0]
  text = re.split(r" \[tensorstore_spec| See full TensorStore details", text)[0]
  text = f"{type(error).__name__}: {text}"
  return text if len(text) <= limit else f"{text[: limit // 2]} ... {text[-limit // 2 :]}"  # the cause is at the end


def describe_tokenizer(record: Mapping[str, Any]) -> str:
  return f"{record['name']!r} (sha256 {record['sha256'][:12]}, {record['vocab_size']} ids)"


def check_writable(directory: str) -> None:
  """Raises PermissionError (one line, naming the directory) unless files can be created in `directory`, or,
  when it does not exist yet, in its nearest existing parent; the probe file is removed, nothing is created."""
  existing = directory
  while not os.path.isdir(existing):
    if os.path.exists(existing):
      raise NotADirectoryError(f"{directory}: cannot hold checkpoints: {existing} is a file, not a directory")
    existing = os.path.dirname(existing)
  probe = os.path.join(existing, f".glm_jax_write_probe_{os.getpid()}")
  try:
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise PermissionError(
      f"{directory}: checkpoints cannot be written there ({existing}: {e.strerror}); use another --workdir"
    ) from e
