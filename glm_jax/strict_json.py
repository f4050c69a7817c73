"""Strict JSON for everything the project writes (metrics.jsonl, the final line of launch/train.py, reports).

Python's json writes NaN and Infinity as bare words, which strict parsers (JavaScript's JSON.parse, jq, Go,
DuckDB) reject. Here a non-finite number is written as null, and an object that had any gets a "nonfinite"
list naming where they were, so a NaN loss is neither lost nor mistaken for a missing value:

  dumps({"step": 3, "loss": nan, "per_layer": [1.0, inf]})
  -> {"step": 3, "loss": null, "per_layer": [1.0, null], "nonfinite": ["loss", "per_layer[1]"]}

numpy scalars and arrays are written as numbers and lists.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

NONFINITE_KEY = "nonfinite"


def finite_or_null(value: Any, where: str = "") -> tuple[Any, list[str]]:
  """(value with every non-finite float replaced by None and numpy values made Python, the paths replaced)."""
  if isinstance(value, (np.ndarray, np.generic)):
    value = value.tolist()
  if isinstance(value, float):
    return (value, []) if math.isfinite(value) else (None, [where])
  if isinstance(value, dict):
    out, bad = {}, []
    for k, v in value.items():
      out[k], b = finite_or_null(v, f"{where}.{k}" if where else str(k))
      bad += b
    return out, bad
  if isinstance(value, (list, tuple)):
    out, bad = [], []
    for i, v in enumerate(value):
      v, b = finite_or_null(v, f"{where}[{i}]")
      out.append(v)
      bad += b
    return out, bad
  return value, []


def dumps(obj: Any, **kwargs) -> str:
  """json.dumps that never writes NaN or Infinity; a dict with non-finite numbers gets the "nonfinite" list."""
  clean, bad = finite_or_null(obj)
  if bad and isinstance(clean, dict):
    clean[NONFINITE_KEY] = bad
  return json.dumps(clean, allow_nan=False, **kwargs)
