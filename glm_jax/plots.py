"""Figures of runs and sweeps, with matplotlib (no pyplot state: each function returns its own Figure).

  from glm_jax import plots
  fig = plots.curves({"dense": "runs/dense", "sparse": "runs/sparse"}, ["lm_loss", "eval_loss"], smooth=10)
  plots.save(fig, "curves.png")
  fig = plots.timeline(["runs/dense", "runs/warmup", "runs/sparse"], "lm_loss")   # DSA's stages on one step axis
  fig = plots.sweep_plot("runs/lr_mtp", "eval_loss", against="optimizer.lr")      # a line per MTP depth
  fig = plots.curves(plots.sweep_runs("runs/lr_mtp"), "loss")                    # every run of the sweep

`curves` draws metrics.jsonl columns over steps (a per-layer column named with its layer, `expert_load_entropy[2]`;
a held-out column on its training column's panel, dashed); `smooth=K` adds a trailing mean over K logged points over
the faint raw training curve. `timeline` puts consecutive stages, each counting from step 0, on one step axis.
`sweep_plot` draws a sweep's final metric (results.jsonl) against one override: numbers on a numeric axis
(logarithmic for a learning rate or positive values spanning more than LOG_SPAN), a line for each combination of the
others; other values as points (or bars). `reference` (a number, None or "auto": the runs' recorded
unigram_entropy) draws the data's unigram entropy on the LM_LOSSES panels. A column no run logged, or an override
that is not an axis of the sweep, is a ValueError naming it and what there is. launch/plot.py is the command line;
what each figure shows: docs/training.md, "Plots".
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter

METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.jsonl"  # glm_jax/sweep.py writes it, and result.json in each run's directory
RUN_RESULT_FILE = "result.json"
_INDEXED = re.compile(r"(.+)\[(\d+)\]")
LOG_SPAN = 30  # a sweep axis of positive numbers spanning more than this factor is drawn on a log scale
LM_LOSSES = ("lm_loss", "mtp_loss", "eval_loss")  # per-token cross-entropies: the unigram entropy is their reference
_NATS = {*LM_LOSSES, "unigram_entropy", "indexer_kl", "teacher_kl", "mismatch_kl", "kl_ref"}
_LEARNING_RATE = re.compile(r"(^|_)(lr|learning_rate)($|_)")


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


def trailing_mean(values: Sequence[float], k: int) -> list[float]:
  """values[i] replaced by the mean of values[max(0, i - k + 1)] .. values[i]: at each step, what the last k logged
  values say (no look-ahead, so a change shows where it happened)."""
  if k < 1:
    raise ValueError(f"smooth={k!r} is invalid; a number of logged points >= 1 (1 = no smoothing)")
  return [sum(values[max(0, i - k + 1) : i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(values))]


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


def unit(metric: str, pretraining: bool = True) -> str:
  """The unit of a metric ('' when it has none): nats/token for the cross-entropies and KLs (and, in a pretraining
  run, the total `loss` and the summary's train_loss; an RL run's loss is a policy loss), tokens/s, s for the *_s
  timings."""
  name = _INDEXED.sub(r"\1", metric)
  if name in _NATS or name.startswith("teacher_kl/") or (name in ("loss", "train_loss") and pretraining):
    return "nats/token"
  if name == "tokens_per_s":
    return "tokens/s"
  if name.endswith("_s"):
    return "s"
  return ""


def axis_label(metrics: Sequence[str], pretraining: bool = True) -> str:
  """'lm_loss / eval_loss (nats/token)': the metrics of a panel and their unit, when they share one."""
  units = {unit(m, pretraining) for m in metrics}
  text = " / ".join(metrics)
  return f"{text} ({units.pop()})" if len(units) == 1 and "" not in units else text


def panels(metrics: Sequence[str]) -> list[list[str]]:
  """The metrics grouped a panel each: a held-out column joins its training column's panel when both are asked
  (eval_loss: lm_loss, else loss, else train_loss; eval_X: X)."""
  out: list[list[str]] = []
  for metric in metrics:
    partners = ("lm_loss", "loss", "train_loss") if metric == "eval_loss" else (metric.removeprefix("eval_"),)
    homes = [p for t in partners for p in out if t in p] if metric.startswith("eval_") else []
    home = homes[0] if homes else None
    if home is None:
      out.append([metric])
    else:
      home.append(metric)
  return out


def _labelled(runs: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
  if isinstance(runs, str):
    runs = [runs]
  if isinstance(runs, Mapping):
    return dict(runs)
  return {os.path.basename(os.path.normpath(w)) or w: w for w in runs}


def recorded_unigram_entropy(workdir: str) -> float | None:
  """The unigram_entropy of a run's final JSON line where its directory keeps it: a sweep's run (result.json, written
  by glm_jax/sweep.py) or a run whose stdout was saved as stdout.log; else None."""
  try:
    with open(os.path.join(workdir, RUN_RESULT_FILE)) as f:
      return _number(json.load(f).get("result", {}).get("unigram_entropy"))
  except (OSError, ValueError, AttributeError):
    pass
  try:
    with open(os.path.join(workdir, "stdout.log")) as f:
      lines = [line for line in f.read().splitlines() if line.startswith("{")]
    return _number(json.loads(lines[-1]).get("unigram_entropy")) if lines else None
  except (OSError, ValueError, AttributeError):
    return None


def _references(reference, found: Sequence[float | None]) -> list[float]:
  """The unigram-entropy lines to draw: `reference` itself, none, or ("auto") each distinct value found."""
  if reference is None:
    return []
  if reference == "auto":
    return sorted({round(v, 6) for v in found if v is not None})
  value = _number(reference)
  if value is None:
    raise ValueError(f"reference={reference!r} is invalid; a number (nats/token), None or 'auto'")
  return [value]


def _draw_references(ax, values: Sequence[float]) -> None:
  """A dashed line at each value; one far off the data's range (more than its span away: the data would fill less
  than half the axis) is a note at the axes' edge instead."""
  lo, hi = ax.dataLim.y0, ax.dataLim.y1
  margin = hi - lo if hi > lo else 0.5 * abs(hi) or 1.0
  for v in values:
    if lo - margin <= v <= hi + margin:
      ax.axhline(v, color="0.4", ls="--", lw=1, label=f"unigram entropy {v:.3f}")
    else:
      where = "above" if v > hi else "below"
      ax.text(
        0.99,
        0.98 if where == "above" else 0.02,
        f"unigram entropy {v:.3f} ({where} the axis)",
        transform=ax.transAxes,
        ha="right",
        va="top" if where == "above" else "bottom",
        fontsize="small",
        color="0.4",
      )


def _proxies(colours: Mapping[str, str], styles: Mapping[str, dict]) -> list:
  """Legend entries: a colour a run (or series), a line style (and marker) a metric."""
  return [Line2D([], [], color=c, label=name) for name, c in colours.items()] + [
    Line2D([], [], color="0.3", label=name, **style) for name, style in styles.items()
  ]


def _legend(fig: Figure, proxies: Sequence | None = None) -> None:
  """One legend for the figure, outside the axes (right), of `proxies` (runs by colour, metrics by style) and the
  reference lines, or else of every labelled artist (each label once); none for a single entry."""
  seen = {}
  for ax in fig.axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      if proxies is None or label.startswith("unigram entropy"):
        seen.setdefault(label, handle)
  handles = [*(proxies or []), *seen.values()]
  if len(handles) > 1:
    fig.legend(handles, [h.get_label() for h in handles], loc="outside right center", fontsize="small")


def chain(
  stages: Mapping[str, str] | Sequence[str], branches: Mapping[str, str] | Sequence[str] | None = None
) -> tuple[dict[str, str], dict[str, int], list[tuple[int, str]]]:
  """(runs, offsets, boundaries) for consecutive stages, each started from the previous one's last checkpoint and
  counting its steps from 0: stage i is offset by the last logged step of each stage before it; `branches` all
  continue from the last stage. boundaries: (step, name) where each stage starts ("branches" for the branches)."""
  stages, branches = _labelled(stages), _labelled(branches or {})
  offsets, boundaries, at = {}, [], 0
  for label, workdir in stages.items():
    offsets[label] = at
    boundaries.append((at, label))
    at += max((int(r["step"]) for r in read_metrics(workdir) if "step" in r), default=0)
  clash = sorted(set(stages) & set(branches))
  if clash:
    raise ValueError(f"{clash} name both a stage and a branch; label them apart")
  if branches:
    boundaries.append((at, "branches" if len(branches) > 1 else next(iter(branches))))
  offsets.update({label: at for label in branches})
  return {**stages, **branches}, offsets, boundaries


def curves(
  runs: Mapping[str, str] | Sequence[str] | str,
  metrics: Sequence[str] | str,
  *,
  title: str | None = None,
  logy: bool = False,
  width: float = 5.0,
  smooth: int = 1,
  reference: float | str | None = "auto",
  offsets: Mapping[str, int] | None = None,
  boundaries: Sequence[tuple[int, str]] = (),
) -> Figure:
  """The metrics over steps, one line a run, a panel a group of panels(metrics). `runs` is {label: workdir} or
  workdirs (labelled by their directory names); `offsets` {label: steps} shifts a run's steps (timeline), and
  `boundaries` [(step, name)] are marked by vertical lines. smooth, reference: the module docstring. Raises ValueError,
  before drawing, naming a metric that no run logged."""
  metrics = [metrics] if isinstance(metrics, str) else list(metrics)
  if not metrics:
    raise ValueError("curves: no metric named")
  if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
    raise ValueError(f"smooth={smooth!r} is invalid; a number of logged points >= 1 (1 = no smoothing)")
  labelled = _labelled(runs)
  data = {label: read_metrics(workdir) for label, workdir in labelled.items()}
  if not data:
    raise ValueError("curves: no run named")
  for metric in metrics:
    if not any(series(rows, metric)[0] for rows in data.values()):
      logged = sorted(set().union(*(logged_columns(rows) for rows in data.values())))
      raise ValueError(
        f"metric {metric!r}: no run logged it (runs: {list(labelled.values())}); the columns logged: {logged}"
      )
  groups = panels(metrics)
  pretraining = not any("pg_loss" in logged_columns(rows) for rows in data.values())  # RL runs log their policy loss
  refs = _references(reference, [recorded_unigram_entropy(w) for w in labelled.values()])
  fig = Figure(figsize=(width * len(groups) + 1.8, 3.8), layout="constrained")
  colours = {label: f"C{j % 10}" for j, label in enumerate(data)}
  for i, group in enumerate(groups):
    ax = fig.add_subplot(1, len(groups), i + 1)
    for label, rows in data.items():
      for metric in group:
        name = ": ".join([label] * (len(data) > 1 or len(group) == 1) + [metric] * (len(group) > 1))
        _draw_series(ax, rows, metric, name, colours[label], smooth, (offsets or {}).get(label, 0))
    if any(m in LM_LOSSES for m in group):
      _draw_references(ax, refs)
    _mark_boundaries(ax, boundaries)
    ax.set_xlabel("step" if not offsets else "step (the stages' steps end to end)")
    ax.set_ylabel(axis_label(group, pretraining))
    if logy:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
  suffix = f" ({smooth}-point trailing mean)" if smooth > 1 else ""
  fig.suptitle(title or f"{', '.join(metrics)} over training steps{suffix}")
  shared = [m for group in groups if len(group) > 1 for m in group]  # several runs and metrics: a legend of each
  _legend(fig, _proxies(colours, {m: _style(m) for m in shared}) if shared and len(data) > 1 else None)
  return fig


def _style(metric: str) -> dict:
  """A held-out column dashed with markers (logged rarely), a training column solid."""
  return dict(ls="--", marker="o", markersize=3) if metric.startswith("eval_") else dict(ls="-")


def _draw_series(ax, rows, metric: str, label: str, color: str, smooth: int, offset: int) -> None:
  """One run's metric: a held-out column dashed with markers; a training column solid, raw and faint under its
  trailing mean when smooth > 1."""
  xs, ys = series(rows, metric)
  if not xs:
    return
  xs = [x + offset for x in xs]
  if metric.startswith("eval_"):
    ax.plot(xs, ys, color=color, label=label, **_style(metric))
  elif smooth > 1:
    ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
    ax.plot(xs, trailing_mean(ys, smooth), color=color, lw=1.8, label=label)
  else:
    ax.plot(xs, ys, color=color, label=label, marker="o" if len(xs) < 12 else None, markersize=3)


def _mark_boundaries(ax, boundaries: Sequence[tuple[int, str]]) -> None:
  """A dotted vertical line where each stage starts (but the first), its name written up along it."""
  for step, name in boundaries:
    if step > 0:
      ax.axvline(step, color="0.3", ls=":", lw=1)
    ax.text(
      step,
      0.98,
      f" {name}",
      transform=ax.get_xaxis_transform(),
      rotation=90,
      ha="left",
      va="top",
      fontsize="small",
      color="0.3",
    )


def timeline(
  stages: Mapping[str, str] | Sequence[str],
  metrics: Sequence[str] | str,
  *,
  branches: Mapping[str, str] | Sequence[str] | None = None,
  title: str | None = None,
  **kwargs,
) -> Figure:
  """curves of consecutive stages (and the branches that continue from the last) on one step axis (chain), each
  stage's start marked and named. kwargs: curves'."""
  runs, offsets, boundaries = chain(stages, branches)
  names = " -> ".join(_labelled(stages)) + (" -> branches" if branches else "")
  metrics = [metrics] if isinstance(metrics, str) else list(metrics)
  title = title or f"{', '.join(metrics)} over the stages {names}"
  return curves(runs, metrics, title=title, offsets=offsets, boundaries=boundaries, **kwargs)


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


def is_learning_rate(field: str) -> bool:
  """optimizer.lr, optimizer.lr_end, sft.optimizer.lr, ...: a field whose sweep axis is logarithmic."""
  return bool(_LEARNING_RATE.search(field.rsplit(".", 1)[-1]))


def sweep_plot(
  sweep: str | Sequence[dict],
  metric: Sequence[str] | str,
  against: str,
  *,
  by: Sequence[str] | None = None,
  title: str | None = None,
  logx: bool | None = None,
  bars: bool = False,
  reference: float | str | None = "auto",
) -> Figure:
  """A sweep's final `metric` (a key of each run's final JSON line; several, e.g. train_loss and eval_loss, share the
  axis: solid, dashed, ...) against the override `against`, one series for each combination of the overrides in `by`
  (default: all the sweep's other axes). Numeric override values go on a numeric axis, logarithmic for a learning rate
  or positive values spanning more than LOG_SPAN (unless `logx` says), ticked at the swept values; other values are
  categories in sweep order, each series' points side by side (bars=True: grouped bars), never joined by a line.
  Raises ValueError naming an unknown override or a metric no run reported."""
  rows = read_results(sweep)
  if not rows:
    raise ValueError(f"sweep {sweep if isinstance(sweep, str) else '(rows)'}: no finished run")
  metrics = [metric] if isinstance(metric, str) else list(metric)
  axes_seen = list(dict.fromkeys(k for row in rows for k in row["overrides"]))
  against = against.removeprefix("config.")
  if against not in axes_seen:
    raise ValueError(f"against={against!r} is not an override of the sweep; its overrides: {axes_seen}")
  by = [a for a in axes_seen if a != against] if by is None else [b.removeprefix("config.") for b in by]
  unknown = [b for b in by if b not in axes_seen]
  if unknown:
    raise ValueError(f"by={unknown} are not overrides of the sweep; its overrides: {axes_seen}")
  for m in metrics:
    if not any(_value(row["result"], m) is not None for row in rows):
      reported = sorted({k for row in rows for k, v in row["result"].items() if _number(v) is not None})
      raise ValueError(f"metric {m!r}: no run of the sweep reported it; the runs' final JSON lines have {reported}")

  values = list(dict.fromkeys(row["overrides"][against] for row in rows))
  numeric = all(_as_number(v) is not None for v in values)
  position = {v: (_as_number(v) if numeric else i) for i, v in enumerate(values)}
  if logx is None:
    nums = [position[v] for v in values]
    logx = numeric and min(nums) > 0 and (is_learning_rate(against) or max(nums) > LOG_SPAN * min(nums))
  series_of = _sweep_series(rows, metrics, against, by, position)
  fig = Figure(figsize=(7.5, 4.0), layout="constrained")
  ax = fig.add_subplot(1, 1, 1)
  _draw_sweep(ax, series_of, metrics, numeric, bars)
  if not numeric:
    ax.set_xticks(range(len(values)), values)
  else:
    if logx:
      ax.set_xscale("log")
    if len(values) <= 10:  # the swept values themselves, as written, not a crowd of decades and minor ticks
      ax.set_xticks([position[v] for v in values], values)
      ax.xaxis.set_minor_formatter(NullFormatter())
      ax.tick_params(axis="x", which="minor", length=0)
  if any(m in LM_LOSSES for m in metrics):
    _draw_references(ax, _references(reference, [_number(row["result"].get("unigram_entropy")) for row in rows]))
  ax.set_xlabel(against + (" (log scale)" if numeric and logx else ""))
  pretraining = not any("trainer" in row["result"] for row in rows)  # the RL trainers' final lines name them
  ax.set_ylabel(axis_label(metrics, pretraining))
  ax.grid(alpha=0.3)
  steps = {row["result"].get("step") for row in rows}
  at = f" at step {steps.pop()}" if len(steps) == 1 and None not in steps else " at the end of each run"
  fig.suptitle(title or f"{', '.join(metrics)}{at}, against {against}")
  names = list(dict.fromkeys(name for name, _ in series_of if name))
  styles = {m: _sweep_style(metrics, m, numeric) for m in metrics}
  _legend(
    fig, _proxies({n: f"C{i % 10}" for i, n in enumerate(names)}, styles) if len(names) > 1 < len(metrics) else None
  )
  return fig


def _sweep_style(metrics: Sequence[str], metric: str, numeric: bool) -> dict:
  """A metric's line style (numeric axis: solid, dashed, ...) or, for points at categories, its marker."""
  k = metrics.index(metric)
  return dict(ls=("-", "--", ":", "-.")[k % 4], marker="o") if numeric else dict(ls="none", marker="osD^v<>"[k % 7])


def _sweep_series(rows, metrics, against, by, position) -> dict[tuple[str, str], list[tuple[float, float]]]:
  """{(series name, metric): sorted [(x, y)]}; a run without the metric is left out."""
  out: dict[tuple[str, str], list[tuple[float, float]]] = {}
  for metric in metrics:
    for row in rows:
      y = _value(row["result"], metric)
      if y is not None:
        name = ", ".join(f"{b}={row['overrides'].get(b)}" for b in by)
        out.setdefault((name, metric), []).append((position[row["overrides"][against]], y))
  return {k: sorted(v) for k, v in out.items()}


def _draw_sweep(ax, series_of, metrics, numeric: bool, bars: bool) -> None:
  """Numeric: a line a series. Categorical: each series dodged beside the others at each category, as points or
  bars."""
  names = list(dict.fromkeys(name for name, _ in series_of))
  n = len(series_of)
  for k, ((name, metric), points) in enumerate(series_of.items()):
    label = ": ".join([name] * bool(name) + [metric] * (len(metrics) > 1 or not name))
    color, style = f"C{names.index(name) % 10}", _sweep_style(metrics, metric, numeric)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if numeric:
      ax.plot(xs, ys, color=color, label=label, **style)
      continue
    width = 0.8 / n
    xs = [x + (k - (n - 1) / 2) * width for x in xs]
    if bars:
      ax.bar(xs, ys, width=width, color=color, label=label, hatch=None if k < len(names) else "//", alpha=0.85)
    else:
      ax.plot(xs, ys, color=color, label=label, markersize=7, **style)


def save(fig: Figure, path: str, dpi: int = 120) -> str:
  """Writes the figure as a PNG (creating the folder); returns the path."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fig.savefig(path, dpi=dpi, format="png")
  return path
