"""Metrics to <workdir>/metrics.jsonl (one JSON object a logged step) and to TensorBoard event files.

Scalars are written as numbers; a per-layer vector (e.g. expert_load_entropy) as a list in the JSON line
and as one TensorBoard scalar a layer. TensorBoard's tags are grouped by `tensorboard_tag`: eval/ (the held-out
metrics), moe/ (routing: balance loss, expert load, dropped tokens), dsa/ (the indexer), rl/ (rewards, the rollout
policy's mismatch, IcePop, staleness), distill/ (the teachers' KL), speed/ (the rates and timings) and train/ (the
rest: losses, gradient norm, learning rate), e.g. "moe/expert_load_entropy/layer_3". The lines are strict JSON
(glm_jax/strict_json.py): a NaN or infinite value is written as null and the row's "nonfinite" list names it.

A resumed run continues from its checkpoint's step, so the rows a killed run wrote after that checkpoint would
be written twice. `keep_through` reconciles the file when the writer opens: rows of later steps (and a line
torn by the kill) are moved to <workdir>/metrics.dropped.jsonl, nothing is deleted, and every step appears
once in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

from glm_jax import strict_json
from glm_jax.train.progress import TIMING_KEYS

DROPPED_FILE = "metrics.dropped.jsonl"


# A metric's TensorBoard group by its name's prefix (the first match wins); train/ for the rest.
_GROUPS = (
  ("eval_", "eval"),
  ("expert_", "moe"),
  ("balance_", "moe"),
  ("moe_", "moe"),
  ("indexer_", "dsa"),
  ("teacher_kl", "distill"),
  ("reward_", "rl"),
  ("mismatch_", "rl"),
  ("icepop_", "rl"),
  ("is_weight", "rl"),
  ("ratio_", "rl"),
  ("clip_", "rl"),
  ("staleness", "rl"),
  ("dropped_stale", "rl"),
  ("async_", "rl"),
  ("response_", "rl"),
  ("truncated_", "rl"),
  ("rollout_", "rl"),
  ("kl_ref", "rl"),
)


def tensorboard_tag(key: str) -> str:
  """The TensorBoard tag of metric `key`: "eval_loss" -> "eval/loss", "indexer_kl" -> "dsa/indexer_kl",
  "tokens_per_s" -> "speed/tokens_per_s", "lm_loss" -> "train/lm_loss" (see the module docstring)."""
  if key in TIMING_KEYS or key.endswith("_s"):
    return f"speed/{key}"
  for prefix, group in _GROUPS:
    if key.startswith(prefix):
      return f"eval/{key[len(prefix) :]}" if group == "eval" else f"{group}/{key}"
  return f"train/{key}"


def to_python(value: Any) -> float | int | list:
  arr = np.asarray(value)
  if arr.ndim == 0:
    return arr.item()
  return arr.tolist()


def _row_step(line: str) -> int | None:
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return None


def reconcile(path: str, keep_through: int) -> int:
  """Moves the rows of `path` whose step is after `keep_through` (and unreadable lines) to DROPPED_FILE beside
  it; returns how many were moved."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [line for line in f.read().splitlines() if line.strip()]
  keep, drop = [], []
  for line in lines:
    step = _row_step(line)
    (keep if step is not None and step <= keep_through else drop).append(line)
  if drop:
    with open(os.path.join(os.path.dirname(path), DROPPED_FILE), "a") as f:
      f.write("".join(line + "\n" for line in drop))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    logging.warning(
      "%s: moved %d row(s) after step %d to %s (the run resumes from step %d)",
      path,
      len(drop),
      keep_through,
      DROPPED_FILE,
      keep_through,
    )
  return len(drop)


def last_logged(workdir: str, key: str, *, through: int) -> Any:
  """The value of `key` in the last row of <workdir>/metrics.jsonl at or before step `through` that has it (None when
  none does): what a rerun of a finished run reports of its last logged step."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  value = None
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict) and key in row and isinstance(row.get("step"), int) and row["step"] <= through:
        value = row[key]
  return value


class MetricsWriter:
  """enabled=False (every process of a multi-process run but the first) formats rows but writes nothing.

  keep_through: the step the run starts from; rows after it already in metrics.jsonl are moved aside
  (see the module docstring). None keeps the file as it is."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True, keep_through: int | None = None):
    self.enabled = enabled
    self.jsonl = self.tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if keep_through is not None:
      reconcile(path, keep_through)
    self.jsonl = open(path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported here: TensorBoard is optional for library users

      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Writes one row; returns it with Python numbers (non-finite values as they are)."""
    # A value that does not exist (e.g. the held-out loss of a split whose responses were all cut) is left out.
    row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items() if v is not None}}
    if not self.enabled:
      return row
    self.jsonl.write(strict_json.dumps(row) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for key, value in row.items():
        if key == "step":
          continue
        tag = tensorboard_tag(key)
        if isinstance(value, list):
          for i, v in enumerate(value):
            self.tb.add_scalar(f"{tag}/layer_{i}", v, step)
        else:
          self.tb.add_scalar(tag, value, step)
      self.tb.flush()
    return row

  def close(self) -> None:
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tb is not None:
      self.tb.close()
