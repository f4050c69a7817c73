"""Figures of runs and sweeps, with matplotlib (no pyplot state: each function returns its own Figure).

  from glm_jax import plots
  fig = plots.curves({"dense": "runs/dense", "sparse": "runs/sparse"}, ["loss", "eval_loss"])
  plots.save(fig, "curves.png")
  fig = plots.sweep_plot("runs/lr_topk", "eval_loss", against="optimizer.lr")   # a line per index_topk
  fig = plots.curves(plots.sweep_runs("runs/lr_topk"), "loss")                   # every run of the sweep

`curves` draws any column of the runs' metrics.jsonl over steps (one panel a metric, one line a run; a per-layer
column such as expert_load_entropy is named with its layer, `expert_load_entropy[2]`); `sweep_plot` draws a
sweep's final metric (a key of each run's final JSON line in results.jsonl) against one override, a line for
each combination of the other overrides. A column that no run logged, or an override that is not an axis of the
sweep, is a ValueError naming it and what there is. launch/plot.py is the command line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.jsonl"  # glm_jax/sweep.py writes it
_INDEXED = re.compile(r"(.+)\[(\d+)\]")


def read_jsonl(path: str) -> list[dict]:
  """The JSON objects of a .jsonl file; a missing file is a ValueError naming it."""
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def read_metrics(workdir: str) -> list[dict]:
  """The rows of a run's metrics.jsonl (launch/train.py writes one a logged step, and eval rows)."""
  return read_jsonl(os.path.join(workdir, METRICS_FILE))


def _number(value) -> float | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value) if math.isfinite(value) else None


def _value(row: dict, metric: str) -> float | None:
  """row[metric] as a float (None when absent or not finite); 'name[i]' is element i of a per-layer list."""
  m = _INDEXED.fullmatch(metric)
  if m and isinstance(row.get(m.group(1)), list):
    values = row[m.group(1)]
    i = int(m.group(2))
    return _number(values[i]) if i < len(values) else None
  return _number(row.get(metric))


def series(rows: Sequence[dict], metric: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows that logged `metric` with a finite value."""
  xs, ys = [], []
  for row in rows:
    y = _value(row, metric)
    if y is not None and "step" in row:
      xs.append(int(row["step"]))
      ys.append(y)
  return xs, ys


def logged_columns(rows: Sequence[dict]) -> list[str]:
  """The plottable columns of metrics rows: numbers, and name[i] for each element of a per-layer list."""
  out = set()
  for row in rows:
    for key, value in row.items():
      if key == "step":
        continue
      if _number(value) is not None:
        out.add(key)
      elif isinstance(value, list) and any(_number(v) is not None for v in value):
        out.update(f"{key}[{i}]" for i in range(len(value)))
  return sorted(out)


def _labelled(runs: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
  if isinstance(runs, str):
    runs = [runs]
  if isinstance(runs, Mapping):
    return dict(runs)
  return {os.path.basename(os.path.normpath(w)) or w: w for w in runs}


def curves(
  runs: Mapping[str, str] | Sequence[str] | str,
  metrics: Sequence[str] | str,
  *,
  title: str | None = None,
  logy: bool = False,
  width: float = 5.0,
) -> Figure:
  """One panel a metric, one line a run: the metric over steps. `runs` is {label: workdir} or workdirs (labelled
  by their directory names). Raises ValueError, before drawing, naming a metric that no run logged."""
  metrics = [metrics] if isinstance(metrics, str) else list(metrics)
  if not metrics:
    raise ValueError("curves: no metric named")
  data = {label: read_metrics(workdir) for label, workdir in _labelled(runs).items()}
  if not data:
    raise ValueError("curves: no run named")
  for metric in metrics:
    if not any(series(rows, metric)[0] for rows in data.values()):
      logged = sorted(set().union(*(logged_columns(rows) for rows in data.values())))
      raise ValueError(
        f"metric {metric!r}: no run logged it (runs: {list(_labelled(runs).values())}); the columns logged: {logged}"
      )
  fig = Figure(figsize=(width * len(metrics), 3.6), layout="constrained")
  for i, metric in enumerate(metrics):
    ax = fig.add_subplot(1, len(metrics), i + 1)
    for label, rows in data.items():
      xs, ys = series(rows, metric)
      if xs:
        ax.plot(xs, ys, label=label, marker="o" if len(xs) < 12 else None, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    if logy:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(data) > 1:
      ax.legend(fontsize="small")
  if title:
    fig.suptitle(title)
  return fig


def read_results(sweep: str | Sequence[dict]) -> list[dict]:
  """A sweep's rows: a sweep directory (its results.jsonl) or the rows themselves."""
  if isinstance(sweep, str):
    path = sweep if sweep.endswith(".jsonl") else os.path.join(sweep, RESULTS_FILE)
    return read_jsonl(path)
  return list(sweep)


def sweep_runs(sweep: str | Sequence[dict]) -> dict[str, str]:
  """{label: workdir} of a sweep's finished runs, labelled by their overrides: curves(sweep_runs(d), "loss")."""
  rows = read_results(sweep)
  if not rows:
    raise ValueError(f"sweep {sweep if isinstance(sweep, str) else '(rows)'}: no finished run")
  out = {}
  for row in rows:
    workdir = row["result"].get("workdir")
    if not workdir and isinstance(sweep, str):
      workdir = os.path.join(sweep if not sweep.endswith(".jsonl") else os.path.dirname(sweep), row["run"])
    out[", ".join(f"{k}={v}" for k, v in row["overrides"].items()) or row["run"]] = workdir
  return out


def _as_number(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None


def sweep_plot(
  sweep: str | Sequence[dict],
  metric: str,
  against: str,
  *,
  by: Sequence[str] | None = None,
  title: str | None = None,
  logx: bool | None = None,
) -> Figure:
  """A sweep's final `metric` (a key of each run's final JSON line) against the override `against`, one line for
  each combination of the overrides in `by` (default: all the sweep's other axes). Numeric override values go on
  a numeric axis (logarithmic when they are positive and span 10x or more, unless `logx` says), others are
  categories in sweep order. Raises ValueError naming an unknown override or a metric no run reported."""
  rows = read_results(sweep)
  if not rows:
    raise ValueError(f"sweep {sweep if isinstance(sweep, str) else '(rows)'}: no finished run")
  axes_seen = list(dict.fromkeys(k for row in rows for k in row["overrides"]))
  against = against.removeprefix("config.")
  if against not in axes_seen:
    raise ValueError(f"against={against!r} is not an override of the sweep; its overrides: {axes_seen}")
  by = [a for a in axes_seen if a != against] if by is None else [b.removeprefix("config.") for b in by]
  unknown = [b for b in by if b not in axes_seen]
  if unknown:
    raise ValueError(f"by={unknown} are not overrides of the sweep; its overrides: {axes_seen}")
  if not any(_value(row["result"], metric) is not None for row in rows):
    reported = sorted({k for row in rows for k, v in row["result"].items() if _number(v) is not None})
    raise ValueError(f"metric {metric!r}: no run of the sweep reported it; the runs' final JSON lines have {reported}")

  values = list(dict.fromkeys(row["overrides"][against] for row in rows))
  numeric = all(_as_number(v) is not None for v in values)
  position = {v: (_as_number(v) if numeric else i) for i, v in enumerate(values)}
  if logx is None:
    nums = [position[v] for v in values]
    logx = numeric and min(nums) > 0 and max(nums) >= 10 * min(nums)
  lines: dict[str, list[tuple[float, float]]] = {}
  for row in rows:
    y = _value(row["result"], metric)
    if y is None:
      continue
    key = ", ".join(f"{b}={row['overrides'].get(b)}" for b in by) or metric
    lines.setdefault(key, []).append((position[row["overrides"][against]], y))
  fig = Figure(figsize=(5.5, 3.8), layout="constrained")
  ax = fig.add_subplot(1, 1, 1)
  for key, points in lines.items():
    points.sort()
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
  if not numeric:
    ax.set_xticks(range(len(values)), values)
  elif logx:
    ax.set_xscale("log")
  ax.set_xlabel(against)
  ax.set_ylabel(metric)
  ax.grid(alpha=0.3)
  if len(lines) > 1 or by:
    ax.legend(fontsize="small")
  if title:
    fig.suptitle(title)
  return fig


def save(fig: Figure, path: str, dpi: int = 120) -> str:
  """Writes the figure as a PNG (creating the folder); returns the path."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fig.savefig(path, dpi=dpi, format="png")
  return path
