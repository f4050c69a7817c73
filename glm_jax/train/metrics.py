"""Metrics to <workdir>/metrics.jsonl (one JSON object a logged step) and to TensorBoard event files.

Scalars are written as numbers; a per-layer vector (e.g. expert_load_entropy) as a list in the JSON line
and as one TensorBoard scalar a layer ("expert_load_entropy/layer_3").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np


def to_python(value: Any) -> float | int | list:
  arr = np.asarray(value)
  if arr.ndim == 0:
    return arr.item()
  return arr.tolist()


class MetricsWriter:
  """enabled=False (every process of a multi-process run but the first) formats rows but writes nothing."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True):
    self.enabled = enabled
    self.jsonl = self.tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported here: TensorBoard is optional for library users
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
    if not self.enabled:
      return row
    self.jsonl.write(json.dumps(row) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for key, value in row.items():
        if key == "step":
          continue
        if isinstance(value, list):
          for i, v in enumerate(value):
            self.tb.add_scalar(f"{key}/layer_{i}", v, step)
        else:
          self.tb.add_scalar(key, value, step)
      self.tb.flush()
    return row

  def close(self) -> None:
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tb is not None:
      self.tb.close()
