"""Orbax checkpoints of the train state with the Grain iterator state in the same step.

<workdir>/checkpoints/<step>/ holds three items: "state" (TrainState), "data" (the Grain iterator) and
"config" (the run's config as JSON). Saves are asynchronous; Orbax writes each step into a temporary
directory and renames it when complete, so a run killed mid-save resumes from the last complete step.
A workdir whose checkpoints were written with an incompatible config (other model shapes, optimizer or
DSA stage) is refused before anything is restored or overwritten.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

# Config fields that may change between a run and its resumption (they do not change the saved state).
RUNTIME_FIELDS = {
    "model": {"attention_impl", "dtype", "remat_policy", "scan_unroll", "use_dsa"},
}
# Config sections whose other fields must match the checkpoint's.
COMPARED_SECTIONS = ("model", "optimizer")
COMPARED_TRAIN_FIELDS = ("dsa_stage",)


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """Human-readable differences that make a checkpoint unusable under `current`."""
  current = json.loads(json.dumps(current))  # as the checkpoint stored it: tuples become lists
  diffs = []
  for section in COMPARED_SECTIONS:
    a, b = saved.get(section, {}), current.get(section, {})
    for key in sorted(set(a) | set(b)):
      if key in RUNTIME_FIELDS.get(section, ()):
        continue
      if a.get(key) != b.get(key):
        diffs.append(f"{section}.{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}")
  for key in COMPARED_TRAIN_FIELDS:
    a, b = saved.get("train", {}).get(key), current.get("train", {}).get(key)
    if a != b:
      diffs.append(f"train.{key}: checkpoint {a!r}, config {b!r}")
  return diffs


class Checkpointer:

  def __init__(self, workdir: str, *, save_every: int, keep: int, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                           enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def check_compatible(self, config: Mapping[str, Any]) -> None:
    """Raises ValueError naming every field where the latest checkpoint's config differs from `config`."""
    step = self.latest_step()
    if step is None:
      return
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    diffs = config_differences(saved, config)
    if diffs:
      raise ValueError(f"{self.directory} holds checkpoints (latest step {step}) of an incompatible config: "
                       + "; ".join(diffs) + ". Use another --workdir, or the checkpoint's config.")

  def save(self, step: int, state: Any, data_iter: grain.DatasetIterator, config: Mapping[str, Any],
           *, force: bool = False) -> bool:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=grain.checkpoint.CheckpointSave(data_iter),
                              config=ocp.args.JsonSave(dict(config)))
    return self.manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None = None) -> Any:
    """The saved TrainState (onto `abstract_state`'s structure and shardings); `data_iter`, when given, is
    advanced in place to where the saved run stood."""
    items = {"state": ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state))}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
