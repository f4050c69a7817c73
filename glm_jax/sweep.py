"""Sweeps: the product of a few config overrides, each point trained by launch/train.py in its own run directory.

  bash scripts/with_env.sh python launch/sweep.py --config=configs/glm5_tiny.py --workdir=runs/lr_mtp \
      --sweep="optimizer.lr=1e-3,3e-3;model.num_nextn_predict_layers=0,1" --config.train.steps=200 --parallel=2

The spec: `;` separates the axes, `,` the values of an axis (a value holding a comma goes in brackets or quotes:
`model.x=(1,2),(3,4)`); the sweep is their product, in order. The `--config.*` flags given to the sweep apply to
every run. Each point's flags are parsed exactly as launch/train.py parses them and the resulting config is
checked (glm_jax.train.trainer.check_config, or the RL trainers' checks), all before the first run starts, so an
unknown field, a value of the wrong type or an invalid config fails at once, naming the point and the field.
An axis whose field the run ignores in its configured stage (UNUSED: model.index_topk in the dense DSA stage, rl.tau
without rl.async_rollouts, ...) would only repeat one run; it is refused then too, naming the field, the stage and
what makes it matter, unless allow_unused_axes (launch/sweep.py --allow_unused_axes) turns that into a warning.
Each finished run's line shows its final metrics (FINAL_METRICS of its final JSON line) beside its wall time.

Layout of the sweep's directory:
  DIR/sweep.json              the config and the shared overrides (a rerun under others is refused)
  DIR/<run name>/             one run's workdir: checkpoints, metrics.jsonl, stdout.log, stderr.log
  DIR/<run name>/result.json  written when the run has finished: its overrides, final JSON line and wall time
  DIR/results.jsonl           one row a finished run, in sweep order: {"run", "overrides", "result", "wall_s"}
  DIR/.compilation_cache/     jax's persistent compilation cache, shared by the runs (unless
                              JAX_COMPILATION_CACHE_DIR is set): a program compiled for one run is reused by the next
A run is named by its overrides (`optimizer.lr=1e-3,model.num_nextn_predict_layers=0`). Rerunning a sweep skips the runs
that have a result.json and resumes the others from their latest checkpoint, so a killed sweep finishes where it
stopped; adding values to an axis runs only the new points.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import ml_collections

from glm_jax import strict_json

SWEEP_FILE = "sweep.json"
RESULTS_FILE = "results.jsonl"
RESULT_FILE = "result.json"
COMPILATION_CACHE = ".compilation_cache"
_FIELD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_OPEN, _CLOSE = "([{", ")]}"


@dataclasses.dataclass(frozen=True)
class Axis:
  """One axis of a sweep: a dotted config field and the values (as command-line text) it takes."""

  field: str
  values: tuple[str, ...]


def _split_values(text: str, where: str) -> list[str]:
  """Splits `text` at the commas outside brackets and quotes."""
  out, depth, quote, start = [], 0, None, 0
  for i, ch in enumerate(text):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in _OPEN:
      depth += 1
    elif ch in _CLOSE:
      depth -= 1
      if depth < 0:
        raise ValueError(f"{where}: unbalanced {ch!r} in {text!r}")
    elif ch == "," and depth == 0:
      out.append(text[start:i])
      start = i + 1
  if depth or quote:
    raise ValueError(f"{where}: unclosed bracket or quote in {text!r}")
  out.append(text[start:])
  return [v.strip() for v in out]


def parse_spec(spec: str) -> list[Axis]:
  """'a.b=1,2;c.d=x,y' -> [Axis('a.b', ('1', '2')), Axis('c.d', ('x', 'y'))]; a malformed spec is a ValueError
  naming the axis and what is wrong with it."""
  if not spec or not spec.strip():
    raise ValueError("--sweep is empty; give axes like 'optimizer.lr=1e-3,3e-3;model.num_nextn_predict_layers=0,1'")
  axes: list[Axis] = []
  for i, part in enumerate(spec.split(";")):
    where = f"--sweep axis {i + 1} ({part.strip()!r})"
    if not part.strip():
      raise ValueError(f"--sweep={spec!r}: axis {i + 1} is empty (two ';' in a row, or one at an end)")
    field, eq, values_text = part.partition("=")
    field = field.strip().removeprefix("config.")
    if not eq:
      raise ValueError(f"{where}: expected 'field=value1,value2,...'")
    if not _FIELD.fullmatch(field):
      raise ValueError(f"{where}: {field!r} is not a dotted config field name like 'optimizer.lr'")
    values = _split_values(values_text, where)
    empty = [j + 1 for j, v in enumerate(values) if not v]
    if empty:
      raise ValueError(f"{where}: value(s) {empty} are empty; values are separated by single commas")
    dupes = sorted({v for v in values if values.count(v) > 1})
    if dupes:
      raise ValueError(f"{where}: value(s) {dupes} appear more than once")
    if any(a.field == field for a in axes):
      raise ValueError(f"{where}: the field {field!r} is already an axis of the sweep")
    axes.append(Axis(field, tuple(values)))
  return axes


def points(axes: Sequence[Axis]) -> list[dict[str, str]]:
  """The product of the axes, in order (the last axis varies fastest): [{field: value text}, ...]."""
  return [dict(zip([a.field for a in axes], combo)) for combo in itertools.product(*[a.values for a in axes])]


def run_name(point: dict[str, str]) -> str:
  """A run directory's name from its overrides: 'optimizer.lr=1e-3,model.num_nextn_predict_layers=0' (path
  separators and other unsafe characters become '_')."""
  name = ",".join(f"{k}={v}" for k, v in point.items()) or "base"
  return re.sub(r"[^\w.=,+\-]", "_", name)


def point_flags(point: dict[str, str]) -> list[str]:
  return [f"--config.{k}={v}" for k, v in point.items()]


def load_config(config_arg: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """The config that `launch/train.py --config=config_arg *overrides` would run: parsed by the same absl
  config_flags machinery (a fresh set of flags), so a value means exactly what it means there. A file that does
  not load, an unknown variant, an unknown field or a value of the wrong type raises ValueError."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["sweep", f"--config={config_arg}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
  try:
    fv(argv)
  except Exception as e:  # noqa: BLE001 - whatever parsing the flags raised is a mistake in the sweep's flags
    text = " ".join(str(e).strip("'\"").replace("\\n", " ").split())
    raise ValueError(text) from e
  return fv.config


def check_config(config: ml_collections.ConfigDict) -> None:
  """The checks the run's trainer makes before any work (pretraining or the RL trainers')."""
  kind = config.get("trainer", "pretrain")
  if kind in ("pretrain", "sft"):
    from glm_jax.train.trainer import check_config as check_pretrain

    check_pretrain(config)
  else:
    from glm_jax.rl.config import TRAINERS, validate_rl_config

    if kind not in TRAINERS:
      raise ValueError(f"config.trainer={kind!r} is invalid; one of {TRAINERS}")
    validate_rl_config(config)


@dataclasses.dataclass(frozen=True)
class Unused:
  """Fields that a run of one of `trainers` ignores while `when(config)` holds (`stage` names that setting, `why`
  says why), so a sweep axis over one of them trains one run a value, all the same; `matters`: what makes them
  count."""

  trainers: tuple[str, ...]
  fields: tuple[str, ...]
  when: Callable[[ml_collections.ConfigDict], bool]
  stage: str
  why: str
  matters: str


_PRETRAIN = ("pretrain", "sft")


def _stage_is(stage: str) -> Callable[[ml_collections.ConfigDict], bool]:
  return lambda config: config.train.dsa_stage == stage


# tests/test_sweep.py checks each pretraining row and rl.tis_cap's: two values of a field give the same programs
# (the state's initialization, the train and eval steps; the GRPO step) where a row says it is unused, and different
# ones (or a refused config) where `matters` says. rl.tau and rl.max_pending are read only by the asynchronous
# rollout workers and the staleness check (glm_jax/rl/trainer.py _grpo_loop); distillation refuses those.
UNUSED = (
  Unused(
    _PRETRAIN,
    (
      "model.index_topk",
      "model.use_dsa",
      "model.indexer_types",
      "model.indexer_rope_interleave",
      "model.index_norm_eps",
      "train.indexer_loss_weight",
    ),
    _stage_is("dense"),
    "train.dsa_stage='dense'",
    "dense attention; the DSA indexer neither runs nor trains",
    "--config.train.dsa_stage=sparse (from a warm-up run's checkpoint: experiments/dsa_quality.py)",
  ),
  Unused(
    _PRETRAIN,
    ("model.index_topk", "model.use_dsa", "train.indexer_loss_weight"),
    _stage_is("warmup"),
    "train.dsa_stage='warmup'",
    "dense attention; the loss is the indexer's KL to it over every visible key, unweighted",
    "--config.train.dsa_stage=sparse",
  ),
  Unused(
    _PRETRAIN,
    ("train.mtp_loss_weight", "train.balance_loss_weight", "train.expert_bias_rate"),
    _stage_is("warmup"),
    "train.dsa_stage='warmup'",
    "only the indexer trains, on its KL alone; the rest of the model is frozen",
    "--config.train.dsa_stage=dense or sparse",
  ),
  Unused(
    ("grpo",),
    ("rl.tau", "rl.max_pending"),
    lambda config: not config.rl.async_rollouts,
    "rl.async_rollouts=False",
    "every rollout comes from the step's own weights: none is queued or stale",
    "--config.rl.async_rollouts=True",
  ),
  Unused(
    ("distill",),
    ("rl.tau", "rl.max_pending"),
    lambda config: True,
    "config.trainer='distill'",
    "distillation's rollouts are synchronous",
    "GRPO with --config.rl.async_rollouts=True",
  ),
  Unused(
    ("grpo", "distill"),
    ("rl.tis_cap",),
    lambda config: config.rl.objective == "async",
    "rl.objective='async'",
    "Eq. 3-5's loss has no importance weight to cap",
    "--config.rl.objective=grpo --config.rl.is_correction=truncated",
  ),
  Unused(
    ("grpo", "distill"),
    ("rl.tis_cap",),
    lambda config: config.rl.is_correction != "truncated",
    "rl.is_correction other than 'truncated'",
    "only the truncated importance weight is capped",
    "--config.rl.is_correction=truncated",
  ),
)


def unused_in(config: ml_collections.ConfigDict, field: str) -> Unused | None:
  """The row of UNUSED saying that a run of `config` ignores `field` (a dotted name), or None."""
  kind = config.get("trainer", "pretrain")
  for row in UNUSED:
    if kind in row.trainers and field in row.fields and row.when(config):
      return row
  return None


def unused_axes(
  axes: Sequence[Axis], point_configs: Sequence[tuple[str, ml_collections.ConfigDict]]
) -> tuple[list[str], list[str]]:
  """(refused, warned) messages, one an axis: `refused` for an axis whose field every point's run ignores (UNUSED),
  `warned` for one whose field the runs of some points ignore (those points repeat each other).
  point_configs: (run name, config) of every point."""
  refused, warned = [], []
  for axis in axes:
    ignored = [(name, row) for name, config in point_configs if (row := unused_in(config, axis.field))]
    if not ignored:
      continue
    row = ignored[0][1]
    if len(ignored) == len(point_configs):
      refused.append(
        f"--sweep axis {axis.field}={','.join(axis.values)} changes nothing with {row.stage} ({row.why}): every "
        f"value would train the same run; it matters with {row.matters}"
      )
    else:
      names = [name for name, _ in ignored]
      warned.append(
        f"--sweep axis {axis.field} changes nothing with {row.stage} ({row.why}), so the points "
        f"{', '.join(names)} repeat each other"
      )
  return refused, warned


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  overrides: dict[str, str]
  workdir: str

  @property
  def result_path(self) -> str:
    return os.path.join(self.workdir, RESULT_FILE)

  def finished(self) -> bool:
    return os.path.exists(self.result_path)


UNUSED_FLAG = "--allow_unused_axes"


def plan(
  config_arg: str,
  workdir: str,
  axes: Sequence[Axis],
  shared: Sequence[str],
  *,
  allow_unused_axes: bool = False,
  log: Callable[[str], None] = print,
) -> list[Run]:
  """Every point's run, each point's config loaded and checked first: the first bad point raises ValueError
  naming it (and nothing has been written). Then an axis whose field the runs ignore (unused_axes) raises
  ValueError naming it, unless allow_unused_axes (then it is logged as a warning, as an axis that only some points
  ignore always is). Also refuses a workdir that holds a sweep of another config or other shared overrides."""
  bad = [a for a in shared if not a.startswith("--config.") or "=" not in a]
  if bad:
    raise ValueError(f"shared override(s) {bad}: write each as --config.<section>.<field>=<value>")
  runs, point_configs = [], []
  for point in points(axes):
    name = run_name(point)
    try:
      config = load_config(config_arg, [*shared, *point_flags(point)])
      check_config(config)
    except ValueError as e:
      raise ValueError(f"sweep point {name!r}: {e}") from e
    runs.append(Run(name, point, os.path.join(workdir, name)))
    point_configs.append((name, config))
  refused, warned = unused_axes(axes, point_configs)
  if refused and not allow_unused_axes:
    raise ValueError(f"{'; '.join(refused)}; pass {UNUSED_FLAG} to sweep anyway")
  for message in [*refused, *warned]:
    log(f"[sweep] warning: {message}")
  names = [r.name for r in runs]
  clash = sorted({n for n in names if names.count(n) > 1})
  if clash:
    raise ValueError(f"points {clash} map to the same run directory; use values that differ in letters or digits")
  recorded = _read_json(os.path.join(workdir, SWEEP_FILE))
  want = {"config": config_arg, "shared_overrides": list(shared)}
  if recorded is not None and {k: recorded.get(k) for k in want} != want:
    raise ValueError(
      f"--workdir={workdir!r} holds a sweep of config {recorded.get('config')!r} with shared "
      f"overrides {recorded.get('shared_overrides')}, not {config_arg!r} with {list(shared)}; "
      "use another --workdir"
    )
  return runs


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def _write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(strict_json.dumps(obj) + "\n")
  os.replace(tmp, path)


def last_json_line(text: str) -> dict | None:
  """The last line of `text` that is a JSON object (launch/train.py's summary), else None."""
  for line in reversed(text.splitlines()):
    line = line.strip()
    if line.startswith("{"):
      try:
        obj = json.loads(line)
      except ValueError:
        continue
      if isinstance(obj, dict):
        return obj
  return None


def _error_line(stderr_path: str) -> str:
  try:
    with open(stderr_path) as f:
      lines = [line.strip() for line in f.read().splitlines() if line.strip()]
  except OSError:
    return ""
  errors = [line for line in lines if line.startswith("error:")]
  return (errors or lines or [""])[-1]


# The keys of a run's final JSON line that final_metrics shows, in this order: pretraining and SFT
# (launch/train.py's summary: glm_jax/train/trainer.py), GLM's blank infilling, then GRPO and distillation.
FINAL_METRICS = ("eval_loss", "train_loss", "eval_span_exact", "eval_accuracy", "reward_mean", "teacher_kl")
_BOOKKEEPING = ("step", "params", "active_params", "skipped_steps", "wall_s")


def final_metrics(summary: dict) -> str:
  """'eval_loss 3.024, train_loss 2.981' from a run's final JSON line: its FINAL_METRICS that are numbers (4
  significant digits), else its other numbers but the bookkeeping (step, params, ...); '' when it has none."""

  def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)

  keys = [k for k in FINAL_METRICS if number(summary.get(k))]
  if not keys:
    keys = [k for k, v in summary.items() if number(v) and k not in _BOOKKEEPING]
  return ", ".join(f"{k} {summary[k]:.4g}" for k in keys)


def collect(workdir: str, runs: Sequence[Run]) -> list[dict]:
  """Writes DIR/results.jsonl from the finished runs' result.json, in sweep order; returns the rows."""
  rows = [r for r in (_read_json(run.result_path) for run in runs) if r is not None]
  tmp = os.path.join(workdir, RESULTS_FILE + ".tmp")
  with open(tmp, "w") as f:
    f.write("".join(strict_json.dumps(row) + "\n" for row in rows))
  os.replace(tmp, os.path.join(workdir, RESULTS_FILE))
  return rows


TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch", "train.py")


def train_command(config_arg: str, shared: Sequence[str], run: Run) -> list[str]:
  """The command of one run: this package's launch/train.py (glm_jax/launch, which launch/ links to)."""
  return [
    sys.executable,
    TRAIN_SCRIPT,
    f"--config={config_arg}",
    *shared,
    *point_flags(run.overrides),
    f"--workdir={run.workdir}",
  ]


def run_sweep(
  config_arg: str,
  workdir: str,
  axes: Sequence[Axis],
  shared: Sequence[str] = (),
  *,
  parallel: int = 1,
  log: Callable[[str], None] = print,
  command: Callable[[str, Sequence[str], Run], list[str]] = train_command,
  allow_unused_axes: bool = False,
) -> tuple[list[dict], list[str]]:
  """Runs every unfinished point of the sweep, `parallel` processes at a time; returns (results rows, names of
  the runs that failed). A failed run is reported with its last error line and retried on the next rerun; a finished
  one with its wall time and final metrics (final_metrics). allow_unused_axes: see plan."""
  if not isinstance(parallel, int) or parallel < 1:
    raise ValueError(f"--parallel={parallel!r} is invalid; a positive number of runs at a time")
  runs = plan(config_arg, workdir, axes, shared, allow_unused_axes=allow_unused_axes, log=log)
  os.makedirs(workdir, exist_ok=True)
  _write_json(
    os.path.join(workdir, SWEEP_FILE),
    {"config": config_arg, "shared_overrides": list(shared), "axes": [dataclasses.asdict(a) for a in axes]},
  )
  # The runs share one persistent compilation cache (unless the environment names one): points that differ only
  # in values the programs do not depend on (seeds, data, logging) compile once.
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.abspath(workdir), COMPILATION_CACHE))
  todo = [r for r in runs if not r.finished()]
  for r in runs:
    if r.finished():
      log(f"[sweep] {r.name}: finished earlier, skipped")
  failed: list[str] = []
  active: dict[subprocess.Popen, tuple[Run, float]] = {}

  def stop_children(signum, frame):  # a killed sweep takes its runs with it; a rerun resumes them
    for proc in active:
      proc.terminate()
    raise SystemExit(128 + signum)

  previous = signal.signal(signal.SIGTERM, stop_children)
  try:
    queue = list(todo)
    while queue or active:
      while queue and len(active) < parallel:
        run = queue.pop(0)
        os.makedirs(run.workdir, exist_ok=True)
        log(f"[sweep] {run.name}: started ({len(runs) - len(queue) - len(active)}/{len(runs)})")
        with (
          open(os.path.join(run.workdir, "stdout.log"), "w") as out,
          open(os.path.join(run.workdir, "stderr.log"), "w") as err,
        ):
          proc = subprocess.Popen(command(config_arg, shared, run), stdout=out, stderr=err, env=env)
        active[proc] = (run, time.perf_counter())
      time.sleep(0.2)
      for proc in [p for p in active if p.poll() is not None]:
        run, t0 = active.pop(proc)
        wall = time.perf_counter() - t0
        with open(os.path.join(run.workdir, "stdout.log")) as f:
          summary = last_json_line(f.read())
        if proc.returncode == 0 and summary is not None:
          _write_json(
            run.result_path, {"run": run.name, "overrides": run.overrides, "result": summary, "wall_s": round(wall, 1)}
          )
          metrics = final_metrics(summary)
          log(f"[sweep] {run.name}: done in {wall:.0f} s" + (f": {metrics}" if metrics else ""))
          collect(workdir, runs)
        else:
          failed.append(run.name)
          why = _error_line(os.path.join(run.workdir, "stderr.log"))
          log(f"[sweep] {run.name}: FAILED (exit code {proc.returncode}) {why}; see {run.workdir}/stderr.log")
  except BaseException:
    for proc in active:
      proc.terminate()
    for proc in active:
      proc.wait()
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
  return collect(workdir, runs), failed
