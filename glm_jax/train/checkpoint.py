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
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from glm_jax.tree_paths import path_str

# Config fields that may change between a run and its resumption (they do not change the saved state).
RUNTIME_FIELDS = {
    "model": {"attention_impl", "dtype", "moe_capacity_factor", "remat_policy", "scan_unroll", "use_dsa"},
}
# Config sections whose other fields must match the checkpoint's.
COMPARED_SECTIONS = ("model", "optimizer")
COMPARED_TRAIN_FIELDS = ("dsa_stage",)


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                       sections: tuple[str, ...] = COMPARED_SECTIONS,
                       train_fields: tuple[str, ...] = COMPARED_TRAIN_FIELDS) -> list[str]:
  """Human-readable differences that make a checkpoint unusable under `current`."""
  current = json.loads(json.dumps(current))  # as the checkpoint stored it: tuples become lists
  diffs = []
  for section in sections:
    a, b = saved.get(section, {}), current.get(section, {})
    for key in sorted(set(a) | set(b)):
      if key in RUNTIME_FIELDS.get(section, ()):
        continue
      if a.get(key) != b.get(key):
        diffs.append(f"{section}.{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}")
  for key in train_fields:
    a, b = saved.get("train", {}).get(key), current.get("train", {}).get(key)
    if a != b:
      diffs.append(f"train.{key}: checkpoint {a!r}, config {b!r}")
  return diffs


class Checkpointer:

  def __init__(self, workdir: str, *, save_every: int = 1, keep: int = 1, async_save: bool = True,
               read_only: bool = False):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    if read_only and not os.path.isdir(self.directory):
      raise FileNotFoundError(f"{workdir}: no checkpoints directory ({self.directory} does not exist)")
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                           enable_async_checkpointing=async_save, create=not read_only,
                                           read_only=read_only)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def check_compatible(self, config: Mapping[str, Any], **compare) -> None:
    """Raises ValueError naming every field where the latest checkpoint's config differs from `config`
    (`compare`: config_differences' sections / train_fields)."""
    step = self.latest_step()
    if step is None:
      return
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    diffs = config_differences(saved, config, **compare)
    if diffs:
      raise ValueError(f"{self.directory} holds checkpoints (latest step {step}) of an incompatible config: "
                       + "; ".join(diffs) + ". Use another --workdir, or the checkpoint's config.")

  def save(self, step: int, state: Any, data_iter: grain.DatasetIterator | None, config: Mapping[str, Any],
           *, force: bool = False) -> bool:
    """Saves state, the config and, when given, the data iterator's position (a run whose data is a function
    of the step, such as the RL loops', has none)."""
    items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(dict(config)))
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None = None) -> Any:
    """The saved TrainState (onto `abstract_state`'s structure and shardings); `data_iter`, when given, is
    advanced in place to where the saved run stood."""
    items = {"state": ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state))}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

  def restore_weights(self, step: int, params: Any, rest: Any) -> tuple[Any, Any]:
    """(params, rest) with every array taken from the checkpoint at `step`, whatever optimizer state or
    stage it was saved with; a missing or differently shaped array is an error that names it. The arrays are
    read onto this process's first device whatever mesh (or number of processes) wrote them; the caller puts
    them in their sharded layout."""
    meta = ocp.StandardCheckpointer().metadata(os.path.join(self.directory, str(step), "state")).item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    saved = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]

    def fill(state, tree, name):
      out = []
      for path, var in nnx.to_flat_state(state):
        node = tree
        for key in [str(p) for p in path] + ["value"]:
          if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"{self.directory}/{step}: no {name} array at {path_str(path)}")
          node = node[key]
        if tuple(node.shape) != tuple(var.shape):
          raise ValueError(f"{self.directory}/{step}: {name} {path_str(path)} has shape "
                           f"{list(node.shape)}, the model expects {list(var.shape)}")
        out.append((path, var.replace(value=jnp.asarray(node, var.dtype))))
      return nnx.from_flat_state(out)

    return fill(params, saved["params"], "parameter"), fill(rest, saved["rest"], "variable")

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
