r"""The small-scale reproductions: runs them, then writes docs/results.md, the figures and the numbers from the runs.

  bash scripts/with_env.sh python experiments/reproduce.py                    # everything, full size: hours on 2 cores
  bash scripts/with_env.sh python experiments/reproduce.py --only=grpo_tiny,distill_tiny
  bash scripts/with_env.sh python experiments/reproduce.py --render_only      # docs/results.md from the runs so far
  bash scripts/with_env.sh python experiments/reproduce.py --shrink --runs=/tmp/r --out=/tmp/o   # seconds a run

Each result is a claim of the GLM-5 report (or of GLM-130B's, whose ideas GLM inherits) measured at glm5_tiny's
scale: its runs (a sweep of launch/train.py, or an experiment script), its figures (--out/figures, by default
experiments/figures), its numbers (--out/results/<name>.json, by default experiments/results) and one row of the
table in docs/results.md (its section between the reproduce.py markers; --out/results.md), every number of which is
read from the runs. A learning result runs
--seeds seeds (3) and reports the mean over them with the range (min to max), so that a figure means the same on
another machine; a verdict is "reproduces" only when it holds in every seed.

Runs go to --runs/<name> (default runs/repro). A run that has finished is not run again (the sweeps and the trainers
resume), so the script can be stopped and started again; a result whose runs are all done costs only its rendering.
Each result's runs record the machine they ran on (<runs>/<name>/machine.json), which the table shows: a result can
run on another machine (`--only=dsa_quality --runs=DIR` on a GPU, say) and its directory be copied into --runs here.
--shrink runs every result's commands at a few steps on small batches (one seed): the same code from the command
to the table's columns and the figures, in seconds a run; tests/test_reproduce.py runs it in CI.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ONLY = flags.DEFINE_list("only", [], "Run only these results (names below; default: all). The table has every row.")
_RUNS = flags.DEFINE_string("runs", "runs/repro", "Where the runs go (one directory a result).")
_OUT = flags.DEFINE_string("out", "", "Write results.md, figures/ and results/ here (default: docs/, experiments/).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds of each learning result (>= 1; --shrink: 1).")
_SHRINK = flags.DEFINE_bool("shrink", False, "A few steps on small batches (CI's check of the code, not a result).")
_RENDER_ONLY = flags.DEFINE_bool("render_only", False, "Run nothing: write the table and figures from the runs.")


@dataclasses.dataclass(frozen=True)
class Ctx:
  """Where a result's runs, figures and numbers go, and how big its runs are."""

  runs: str
  figures: str
  results: str
  seeds: tuple[int, ...]
  shrink: bool
  render_only: bool = False

  def run_dir(self, name: str, *parts: str) -> str:
    return os.path.join(self.runs, name, *parts)

  def run(self, name: str, argv: Sequence[str]) -> None:
    """`python argv...` from the repository root, its output shown; the wall time of its first complete invocation
    is kept in <runs>/<name>/wall_s.json and the machine it ran on in machine.json (a rerun that finds the runs
    done costs seconds and is not recorded)."""
    if self.render_only:
      return
    os.makedirs(self.run_dir(name), exist_ok=True)
    print(f"[reproduce] {name}: python {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True)
    path = self.run_dir(name, "wall_s.json")
    walls = _read_json(path) or {}
    key = " ".join(argv)
    if key in walls:
      return
    walls[key] = round(time.perf_counter() - t0, 1)
    with open(path, "w") as f:
      json.dump(walls, f, indent=1)
    path = self.run_dir(name, "machine.json")
    machines = _read_json(path) or []
    if this_machine() not in machines:
      with open(path, "w") as f:
        json.dump([*machines, this_machine()], f)

  def wall_s(self, name: str) -> float | None:
    walls = _read_json(self.run_dir(name, "wall_s.json"))
    return round(sum(walls.values()), 1) if walls else None

  def machines(self, name: str) -> list[str]:
    """The machines <name>'s runs ran on (<runs>/<name>/machine.json, written by run; runs from before that file
    existed ran here)."""
    return _read_json(self.run_dir(name, "machine.json")) or [this_machine()]


@functools.cache
def this_machine() -> str:
  """What a run started here computes on, as jax there sees it (JAX_PLATFORMS and all): "2 x86_64 CPUs", or the
  accelerators and the CPUs, "1 NVIDIA H200 (16 x86_64 CPUs)"."""
  cpus = f"{os.cpu_count()} {platform.machine()} CPUs"
  probe = "import jax; d = jax.devices(); print(len(d), d[0].platform, d[0].device_kind)"
  proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
  if proc.returncode != 0 or not proc.stdout.strip():
    return cpus
  count, backend, kind = proc.stdout.strip().splitlines()[-1].split(maxsplit=2)
  return cpus if backend == "cpu" else f"{count} {kind} ({cpus})"


def _read_json(path: str):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# The sizes: full, or shrunk to seconds
# ---------------------------------------------------------------------------------------------------------------

# glm5_tiny (and the sweeps on it) shrunk: 2 steps of 2 x 32 tokens, evaluated at the end on one batch.
_SHRUNK_PRETRAIN = [
  "--config.train.steps=2",
  "--config.train.log_every=1",
  "--config.train.eval_every=2",
  "--config.train.checkpoint_every=2",
  "--config.data.seq_len=32",
  "--config.data.batch_size=2",
  "--config.data.eval_batches=1",
  "--config.optimizer.warmup_steps=1",
  "--config.optimizer.decay_steps=1",
]


_QUIET = "--verbosity=-1"  # the experiment scripts: absl's WARNING and up (Orbax logs every save at INFO)


def _rl_config(ctx: Ctx, name: str) -> str:
  return f"configs/{name}.py" + (":smoke" if ctx.shrink else "")


def _sweep(ctx: Ctx, name: str, config: str, axes: str, shared: Sequence[str] = ()) -> None:
  ctx.run(
    name,
    ["launch/sweep.py", f"--config={config}", f"--workdir={ctx.run_dir(name, 'sweep')}", f"--sweep={axes}", *shared],
  )


def _seed_axis(field: str, ctx: Ctx) -> str:
  return f"{field}={','.join(map(str, ctx.seeds))}"


def _sweep_rows(ctx: Ctx, name: str) -> list[dict]:
  """The sweep's results.jsonl rows that finished."""
  from glm_jax import plots

  path = ctx.run_dir(name, "sweep", "results.jsonl")
  return [r for r in plots.read_jsonl(path) if r.get("result")] if os.path.exists(path) else []


# ---------------------------------------------------------------------------------------------------------------
# Numbers over seeds
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spread:
  """A number over seeds: its mean and range."""

  values: tuple[float, ...]

  @property
  def mean(self) -> float:
    return statistics.fmean(self.values)

  def fmt(self, digits: int = 3) -> str:
    """ "0.512 (0.481 to 0.540)" over several seeds, "0.512" over one (or when every seed gives it)."""
    f = f"{{:,.{digits}f}}"
    if len(set(self.values)) == 1:
      return f.format(self.values[0])
    return f"{f.format(self.mean)} ({f.format(min(self.values))} to {f.format(max(self.values))})"

  def below(self, other: Spread) -> bool:
    """Every value of self is below every value of other: the order holds in every seed, whichever pairing."""
    return max(self.values) < min(other.values)


def spread(values) -> Spread:
  return Spread(tuple(float(v) for v in values))


def window_means(workdir: str, metric: str, window: int) -> tuple[float, float] | None:
  """The mean of `metric`'s first and of its last `window` logged values in a run (None when it logged none)."""
  from glm_jax import plots

  _, ys = plots.series(plots.read_metrics(workdir), metric)
  if not ys:
    return None
  w = max(1, min(window, len(ys) // 2 or 1))
  return statistics.fmean(ys[:w]), statistics.fmean(ys[-w:])


def verdict(holds_in_every_seed: bool, fails_in_every_seed: bool) -> str:
  if holds_in_every_seed:
    return "reproduces"
  return "does not reproduce" if fails_in_every_seed else "mixed across seeds"


# ---------------------------------------------------------------------------------------------------------------
# The results
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
  name: str
  claim: str
  command: str  # the full-size command, as the table shows it
  figures: tuple[str, ...]
  run: Callable[[Ctx], None]
  measure: Callable[[Ctx], dict | None]  # {"measured": text, "verdict": text, ...numbers}; None before it ran
  # The runs' numbers in more detail, a table under the main one (its lines, under a "###" title); None before it ran
  details: Callable[[Ctx], list[str] | None] = lambda ctx: None
  runs_of: str = ""  # the result whose runs this one reads (its wall time and machine), if not its own

  @property
  def runs_name(self) -> str:
    return self.runs_of or self.name


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  """A markdown table's lines."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def _window(ctx: Ctx) -> int:
  return 1 if ctx.shrink else 20


def run_optimizer_mtp(ctx: Ctx) -> None:
  shared = [] if not ctx.shrink else _SHRUNK_PRETRAIN
  config = "configs/glm5_tiny.py"
  axes = "optimizer.name=muon,adamw;model.num_nextn_predict_layers=1,0;" + _seed_axis("train.seed", ctx)
  _sweep(ctx, "optimizer_mtp", config, axes, shared)
  if not _sweep_rows(ctx, "optimizer_mtp"):
    return
  from glm_jax import plots

  sweep = ctx.run_dir("optimizer_mtp", "sweep")
  fig = plots.sweep_plot(
    sweep,
    "eval_loss",
    "optimizer.name",
    by=["model.num_nextn_predict_layers"],
    title="held-out loss, each seed a point",
  )
  plots.save(fig, os.path.join(ctx.figures, "optimizer_mtp_eval_loss.png"))
  seed0 = {r["run"]: r["result"]["workdir"] for r in _sweep_rows(ctx, "optimizer_mtp") if _seed_of(r) == ctx.seeds[0]}
  fig = plots.curves({k.replace(f",train.seed={ctx.seeds[0]}", ""): v for k, v in seed0.items()}, ["lm_loss"], smooth=5)
  plots.save(fig, os.path.join(ctx.figures, "optimizer_mtp_curves.png"))


def _seed_of(row: dict) -> int:
  over = row["overrides"]
  return int(over.get("train.seed", over.get("rl.seed", 0)))


def measure_optimizer_mtp(ctx: Ctx) -> dict | None:
  rows = _sweep_rows(ctx, "optimizer_mtp")
  if not rows:
    return None
  loss = {}
  for opt in ("muon", "adamw"):
    for mtp in ("1", "0"):
      sel = [
        r
        for r in rows
        if r["overrides"]["optimizer.name"] == opt and r["overrides"]["model.num_nextn_predict_layers"] == mtp
      ]
      loss[(opt, mtp)] = spread(r["result"]["eval_loss"] for r in sel)
  muon_wins = [loss[("muon", m)].below(loss[("adamw", m)]) for m in ("1", "0")]
  adamw_wins = [loss[("adamw", m)].below(loss[("muon", m)]) for m in ("1", "0")]
  text = (
    f"held-out loss, Muon vs AdamW: {loss[('muon', '1')].fmt()} vs {loss[('adamw', '1')].fmt()} with MTP, "
    f"{loss[('muon', '0')].fmt()} vs {loss[('adamw', '0')].fmt()} without"
  )
  return {
    "measured": text,
    "verdict": verdict(all(muon_wins), all(adamw_wins)),
    "eval_loss": {f"{o},mtp={m}": s.values for (o, m), s in loss.items()},
  }


def measure_mtp(ctx: Ctx) -> dict | None:
  rows = _sweep_rows(ctx, "optimizer_mtp")
  if not rows:
    return None
  effect, parts = {}, []
  for opt in ("muon", "adamw"):
    on = {
      _seed_of(r): r["result"]["eval_loss"]
      for r in rows
      if r["overrides"]["optimizer.name"] == opt and r["overrides"]["model.num_nextn_predict_layers"] == "1"
    }
    off = {
      _seed_of(r): r["result"]["eval_loss"]
      for r in rows
      if r["overrides"]["optimizer.name"] == opt and r["overrides"]["model.num_nextn_predict_layers"] == "0"
    }
    effect[opt] = spread(off[s] - on[s] for s in sorted(on.keys() & off.keys()))
    parts.append(f"{opt} {effect[opt].fmt()}")
  lower = [v > 0 for s in effect.values() for v in s.values]
  return {
    "measured": "the MTP layer lowers the main model's held-out loss by (off - on, same seed) " + ", ".join(parts),
    "verdict": verdict(all(lower), not any(lower)),
    "eval_loss_off_minus_on": {k: s.values for k, s in effect.items()},
  }


def run_icepop(ctx: Ctx) -> None:
  axes = "rl.is_correction=icepop,truncated,none;" + _seed_axis("rl.seed", ctx)
  _sweep(ctx, "icepop", _rl_config(ctx, "grpo_tiny"), axes, ["--config.rl.rollout_dtype=bfloat16"])
  rows = _sweep_rows(ctx, "icepop")
  if not rows:
    return
  from glm_jax import plots

  seed0 = {r["overrides"]["rl.is_correction"]: r["result"]["workdir"] for r in rows if _seed_of(r) == ctx.seeds[0]}
  fig = plots.curves(
    seed0, ["reward_mean", "mismatch_kl", "icepop_drop_frac"], smooth=5, title="GRPO with bf16 rollouts, fp32 training"
  )
  plots.save(fig, os.path.join(ctx.figures, "icepop.png"))


def measure_icepop(ctx: Ctx) -> dict | None:
  rows = _sweep_rows(ctx, "icepop")
  if not rows:
    return None
  from glm_jax import plots

  acc, drop, kl = {}, [], {}
  for corr in ("icepop", "truncated", "none"):
    sel = [r for r in rows if r["overrides"]["rl.is_correction"] == corr]
    acc[corr] = spread(r["result"]["eval_accuracy"] for r in sel)
    kl[corr] = spread(
      statistics.fmean(plots.series(plots.read_metrics(r["result"]["workdir"]), "mismatch_kl")[1]) for r in sel
    )
    if corr == "icepop":
      drop += [v for r in sel for v in plots.series(plots.read_metrics(r["result"]["workdir"]), "icepop_drop_frac")[1]]
  dropped = statistics.fmean(drop) if drop else 0.0
  text = (
    f"final greedy accuracy icepop {acc['icepop'].fmt()}, truncated {acc['truncated'].fmt()}, "
    f"none {acc['none'].fmt()}; "
    f"mean mismatch KL {kl['icepop'].fmt(6)} / {kl['truncated'].fmt(6)} / {kl['none'].fmt(6)}; "
    f"{100 * dropped:.2f}% of tokens outside IcePop's band"
  )
  if dropped < 0.01:
    v = "not tested: the mismatch is too small here for the correction to matter"
  else:  # IcePop's final accuracy against no correction's, seed by seed
    better = [i >= n for i, n in zip(acc["icepop"].values, acc["none"].values)]
    v = verdict(all(better), not any(better))
  return {
    "measured": text,
    "verdict": v,
    "eval_accuracy": {k: s.values for k, s in acc.items()},
    "icepop_drop_frac": dropped,
  }


def _run_config_over_seeds(ctx: Ctx, name: str, metrics: Sequence[str]) -> None:
  """configs/<name>.py once a seed (a sweep over rl.seed), then <name>.png: `metrics` of every seed's run."""
  _sweep(ctx, name, _rl_config(ctx, name), _seed_axis("rl.seed", ctx))
  rows = _sweep_rows(ctx, name)
  if rows:
    from glm_jax import plots

    runs = {f"seed {_seed_of(r)}": r["result"]["workdir"] for r in rows}
    fig = plots.curves(runs, metrics, smooth=5, title=f"configs/{name}.py, each seed")
    plots.save(fig, os.path.join(ctx.figures, f"{name}.png"))


def run_grpo(ctx: Ctx) -> None:
  _run_config_over_seeds(ctx, "grpo_tiny", ["reward_mean", "eval_accuracy"])


def measure_grpo(ctx: Ctx) -> dict | None:
  rows = _sweep_rows(ctx, "grpo_tiny")
  if not rows:
    return None
  w = _window(ctx)
  rewards = [window_means(r["result"]["workdir"], "reward_mean", w) for r in rows]
  first, last = spread(a for a, _ in rewards), spread(b for _, b in rewards)
  start, end = (
    spread(r["result"]["start_eval_accuracy"] for r in rows),
    spread(r["result"]["eval_accuracy"] for r in rows),
  )
  rose = [b > a for a, b in rewards] + [e > s for s, e in zip(start.values, end.values)]
  text = (
    f"reward {first.fmt()} to {last.fmt()} (first to last {w} steps); greedy accuracy on held-out additions "
    f"{start.fmt()} to {end.fmt()}"
  )
  return {
    "measured": text,
    "verdict": verdict(all(rose), not any(rose)),
    "reward": [first.values, last.values],
    "eval_accuracy": [start.values, end.values],
  }


def run_distill(ctx: Ctx) -> None:
  _run_config_over_seeds(ctx, "distill_tiny", ["teacher_kl", "teacher_kl/addition", "teacher_kl/sort"])


def measure_distill(ctx: Ctx) -> dict | None:
  rows = _sweep_rows(ctx, "distill_tiny")
  if not rows:
    return None
  w = _window(ctx)
  kls = [window_means(r["result"]["workdir"], "teacher_kl", w) for r in rows]
  first, last = spread(a for a, _ in kls), spread(b for _, b in kls)
  start, end = (
    spread(r["result"]["start_eval_accuracy"] for r in rows),
    spread(r["result"]["eval_accuracy"] for r in rows),
  )
  fell = [b < a for a, b in kls]
  text = f"teacher KL {first.fmt()} to {last.fmt()} (first to last {w} steps), accuracy {start.fmt()} to {end.fmt()}"
  return {"measured": text, "verdict": verdict(all(fell), not any(fell)), "teacher_kl": [first.values, last.values]}


def _seed_results(ctx: Ctx, name: str, seed: int) -> str:
  """A seed's results file, which its script writes last: where it exists, the seed is done."""
  return ctx.run_dir(name, f"seed_{seed}", "results.json")


def _per_seed_script(
  ctx: Ctx, name: str, script: str, full: Sequence[str], shrunk: Sequence[str], figures: dict
) -> None:
  """An experiment script once a seed: its workdir and results under <runs>/<name>/seed_<k>; seed 0's figures to
  `figures` ({flag: file name}), the other seeds' beside their runs."""
  for seed in ctx.seeds:
    d, results = ctx.run_dir(name, f"seed_{seed}"), _seed_results(ctx, name, seed)
    if os.path.exists(results):
      continue  # the script writes it last: this seed is done (perhaps on another machine, without checkpoints here)
    argv = [script, f"--workdir={d}", f"--seed={seed}", f"--results={results}", _QUIET]
    for flag, file in figures.items():
      target = os.path.join(ctx.figures, file) if seed == ctx.seeds[0] else os.path.join(d, file)
      argv.append(f"--{flag}={target}")
    ctx.run(name, [*argv, *(shrunk if ctx.shrink else full)])


def _script_results(ctx: Ctx, name: str) -> list:
  """Each seed's results file (a JSON object, or JSON lines), in seed order; [] when a seed has none yet."""
  from glm_jax import plots

  out = []
  for seed in ctx.seeds:
    path = _seed_results(ctx, name, seed)
    if not os.path.exists(path):
      return []
    with open(path) as f:
      text = f.read()
    try:
      out.append(json.loads(text))  # one JSON object (dsa_quality.py)
    except json.JSONDecodeError:
      out.append(plots.read_jsonl(path))  # JSON lines, a row a run (glm_infilling.py, glm_stability.py)
  return out


def run_infilling(ctx: Ctx) -> None:
  _per_seed_script(ctx, "glm_infilling", "experiments/glm_infilling.py", [], ["--steps=3"], {})


def measure_infilling(ctx: Ctx) -> dict | None:
  per_seed = _script_results(ctx, "glm_infilling")
  if not per_seed:
    return None
  nll = {
    m: spread(next(r["span_nll"] for r in rows if r["model"] == m) for rows in per_seed) for m in ("glm", "causal")
  }
  exact = {m: spread(next(r["exact"] for r in rows if r["model"] == m) for rows in per_seed) for m in ("glm", "causal")}
  better = [g < c for g, c in zip(nll["glm"].values, nll["causal"].values)]
  text = (
    f"span NLL blank infilling {nll['glm'].fmt()} vs causal {nll['causal'].fmt()}; exact match "
    f"{exact['glm'].fmt()} vs {exact['causal'].fmt()}"
  )
  return {
    "measured": text,
    "verdict": verdict(all(better), not any(better)),
    "span_nll": {k: s.values for k, s in nll.items()},
  }


def details_infilling(ctx: Ctx) -> list[str] | None:
  per_seed = _script_results(ctx, "glm_infilling")
  if not per_seed:
    return None

  def of(rows, model, kind):
    row = next(r for r in rows if r["model"] == model)
    return row if kind == "all" else row["by_kind"][kind]

  kinds = ["all", *next(r for r in per_seed[0] if r["model"] == "glm")["by_kind"]]
  body = []
  for kind in kinds:
    cells = [kind, spread(of(rows, "glm", kind)["blanks"] for rows in per_seed).fmt(0)]
    cells.append(spread(of(rows, "glm", kind)["span_tokens"] for rows in per_seed).fmt(0))
    for key in ("span_nll", "exact"):
      cells += [spread(of(rows, m, kind)[key] for rows in per_seed).fmt() for m in ("glm", "causal")]
    body.append(cells)
  header = ["held-out blanks", "count", "tokens", "GLM NLL", "causal NLL", "GLM exact", "causal exact"]
  return [
    "### Blank infilling against a causal LM, by kind of blank",
    "",
    "glm130b_tiny and its `causal` variant (the same model on the same documents) on the same held-out blanks: the "
    "NLL a token of each blank (GLM: given both sides; causal: the text before it) and the share of blanks whose "
    "every token is the model's argmax.",
    "",
    *table(header, body),
  ]


def run_stability(ctx: Ctx) -> None:
  _per_seed_script(
    ctx,
    "glm_stability",
    "experiments/glm_stability.py",
    ["--lr=1e-2"],
    ["--lr=1e-2", "--steps=4"],
    {"figure": "glm_stability.png"},
  )


def measure_stability(ctx: Ctx) -> dict | None:
  per_seed = _script_results(ctx, "glm_stability")
  if not per_seed:
    return None
  runs = ("Pre-LN", "Pre-LN + EGS", "DeepNorm", "DeepNorm + EGS")
  jump = {k: spread(next(r["max_jump"] for r in rows if r["run"] == k) for rows in per_seed) for k in runs}
  loss = {k: spread(next(r["eval_loss"] for r in rows if r["run"] == k) for rows in per_seed) for k in runs}
  deepnorm = [d < p for d, p in zip(jump["DeepNorm"].values, jump["Pre-LN"].values)]
  egs = [e < p for e, p in zip(jump["Pre-LN + EGS"].values, jump["Pre-LN"].values)]
  text = "; ".join(f"{k}: largest loss jump {jump[k].fmt(2)}, final held-out loss {loss[k].fmt(2)}" for k in runs)
  return {
    "measured": text,
    "verdict": f"DeepNorm: {verdict(all(deepnorm), not any(deepnorm))}; EGS: {verdict(all(egs), not any(egs))}",
    "max_jump": {k: s.values for k, s in jump.items()},
  }


def details_stability(ctx: Ctx) -> list[str] | None:
  per_seed = _script_results(ctx, "glm_stability")
  if not per_seed:
    return None
  body = []
  for run in [r["run"] for r in per_seed[0]]:
    row = [next(r for r in rows if r["run"] == run) for rows in per_seed]
    body.append([run, *(spread(r[k] for r in row).fmt(digits) for k, digits in STABILITY_COLUMNS)])
  return [
    "### Stability at a high learning rate, by run",
    "",
    f"AdamW at lr {per_seed[0][0]['lr']:g}, no clipping, no spike guard; the largest rise of the training loss from "
    "one logged step to the next, and the held-out loss and span exact match at the end.",
    "",
    *table(["run", "largest loss jump", "held-out loss", "held-out span exact"], body),
  ]


STABILITY_COLUMNS = (("max_jump", 2), ("eval_loss", 3), ("eval_span_exact", 3))


def run_dsa(ctx: Ctx) -> None:
  shrunk = ["--dense_steps=2", "--warmup_steps=2", "--steps=2", "--topk=4,8", "--batch_size=1", "--seq_len=32"]
  figures = {"figure": "dsa_quality.png", "branch_figure": "dsa_quality_branches.png"}
  _per_seed_script(ctx, "dsa_quality", "experiments/dsa_quality.py", [], shrunk, figures)


def measure_dsa(ctx: Ctx) -> dict | None:
  per_seed = _script_results(ctx, "dsa_quality")
  if not per_seed:
    return None
  names = [k for k in per_seed[0]["eval_loss_minus_dense"] if k != "dense"]
  gap = {k: spread(s["eval_loss_minus_dense"][k] for s in per_seed) for k in names}
  dense = spread(s["eval_loss"]["dense"] for s in per_seed)
  close = [g <= 0.01 * d for k in names for g, d in zip(gap[k].values, dense.values)]
  text = f"held-out loss dense {dense.fmt()}; sparse minus dense: " + ", ".join(
    f"top-k {k.removeprefix('sparse_')} {gap[k].fmt(4)}" for k in names
  )
  return {
    "measured": text,
    "verdict": verdict(all(close), not any(close)) + " (within 1% of dense)",
    "gap": {k: s.values for k, s in gap.items()},
  }


def run_agent_tools(ctx: Ctx) -> None:
  base = ctx.run_dir("agent_tools", "base")
  shrunk_base = ["--config=configs/glm5_tiny.py:smoke", *_SHRUNK_PRETRAIN]
  ctx.run(
    "agent_tools",
    ["launch/train.py", f"--workdir={base}", *(shrunk_base if ctx.shrink else ["--config=configs/glm5_tiny.py"])],
  )
  for seed in ctx.seeds:
    d, results = ctx.run_dir("agent_tools", f"seed_{seed}"), _seed_results(ctx, "agent_tools", seed)
    if os.path.exists(results):
      continue  # done (as _per_seed_script)
    figure = os.path.join(ctx.figures if seed == ctx.seeds[0] else d, "agent_tools.png")
    size = (
      ["--sft_steps=2", "--rl_steps=1", "--eval_tasks=2"]
      if ctx.shrink
      else ["--sft_steps=1200", "--rl_steps=60", "--eval_tasks=64"]
    )
    argv = [
      "experiments/agent_tools.py",
      f"--base={base}",
      f"--out={d}",
      f"--seed={seed}",
      f"--figure={figure}",
      _QUIET,
    ]
    ctx.run("agent_tools", [*argv, f"--results={results}", *size])


def measure_agent_tools(ctx: Ctx) -> dict | None:
  per_seed = _script_results(ctx, "agent_tools")
  if not per_seed:
    return None
  envs = sorted({k.split("/")[0] for k in per_seed[0]["eval"]})
  parts, better, gained = [], [], []
  for env in envs:
    rate = {p: spread(s["eval"][f"{env}/{p}/tools"]["success_rate"] for s in per_seed) for p in ("base", "sft", "grpo")}
    parts.append(
      f"{env}: success with its tool base {rate['base'].fmt()}, SFT {rate['sft'].fmt()}, GRPO {rate['grpo'].fmt()}"
    )
    better += [g > b for g, b in zip(rate["grpo"].values, rate["base"].values)]
    gained += [g > s for g, s in zip(rate["grpo"].values, rate["sft"].values)]
  return {
    "measured": "; ".join(parts),
    # the pipeline against the base, and GRPO's own part (GLM-5's RL stage after SFT), each in every env and seed
    "verdict": f"SFT then GRPO over the base: {verdict(all(better), not any(better))}; "
    f"GRPO over SFT: {verdict(all(gained), not any(gained))}",
  }


POLICIES = (("base", "base"), ("sft", "after agentic SFT"), ("grpo", "after GRPO"))


def details_agent_tools(ctx: Ctx) -> list[str] | None:
  per_seed = _script_results(ctx, "agent_tools")
  if not per_seed:
    return None

  def cell(env, policy, tools, key, digits=3):
    values = [s["eval"][f"{env}/{policy}/{tools}"][key] for s in per_seed]
    return "-" if any(v is None for v in values) else spread(values).fmt(digits)

  body = []
  for env in sorted({k.split("/")[0] for k in per_seed[0]["eval"]}):
    for policy, label in POLICIES:
      body.append(
        [
          env if policy == "base" else "",
          label,
          cell(env, policy, "tools", "success_rate"),
          cell(env, policy, "no_tools", "success_rate"),
          cell(env, policy, "tools", "tool_call_validity", 2),
          cell(env, policy, "tools", "mean_turns", 2),
        ]
      )
  header = ["environment", "policy", "success with the tool", "without", "tool-call validity", "mean turns"]
  speed = {way: spread(s["speed"][way]["tokens_per_s"] for s in per_seed) for way in ("kv_continuation", "reprefill")}
  return [
    "### Agentic post-training with tools, by environment",
    "",
    f"Greedy on {per_seed[0]['eval'][next(iter(per_seed[0]['eval']))]['episodes']} held-out tasks an environment; "
    "the base is the main job's run (configs/glm5_tiny.py).",
    "",
    *table(header, body),
    "",
    "The agent loop on greedy calculator episodes (experiments/agent_tools.py's speed check), "
    f"{per_seed[0]['speed']['kv_continuation']['sampled_tokens']:,} sampled tokens: "
    f"{speed['kv_continuation'].fmt(0)} sampled tokens/s continuing on the KV cache, "
    f"{speed['reprefill'].fmt(0)} re-prefilling every turn.",
  ]


QUANT_SCOPES = (
  ("int4_g32_experts", "routed experts"),
  ("int4_g32_all", "every linear layer"),
  ("int4_row_all", "every linear layer per row (GLM-130B)"),
)


def run_quant(ctx: Ctx) -> None:
  _per_seed_script(ctx, "quant", "experiments/quant_table.py", [], ["--base_steps=2", "--sft_steps=2"], {})


def _quant_rows(ctx: Ctx) -> list[dict[str, dict]] | None:
  """Each seed's quant_table rows by what was served ("fp32", "PTQ <scheme>", "packed <scheme>" for QAT)."""
  per_seed = _script_results(ctx, "quant")
  return [{r["served"]: r for r in rows} for rows in per_seed] if per_seed else None


def measure_quant(ctx: Ctx) -> dict | None:
  per_seed = _quant_rows(ctx)
  if not per_seed:
    return None
  parts, verdicts = [], []
  for scheme, label in QUANT_SCOPES:
    ptq = spread(s[f"PTQ {scheme}"]["minus_fp32"] for s in per_seed)
    qat = spread(s[f"packed {scheme}"]["minus_fp32"] for s in per_seed)
    parts.append(f"{label}: PTQ {ptq.fmt(4)}, QAT {qat.fmt(4)}")
    recovers = [q <= p for q, p in zip(qat.values, ptq.values)]  # QAT's loss at most PTQ's, seed by seed
    verdicts.append(f"{label}: {verdict(all(recovers), not any(recovers))}")
  return {
    "measured": "held-out loss of the INT4 model as served minus fp32's; " + "; ".join(parts),
    "verdict": "; ".join(verdicts),
  }


def details_quant(ctx: Ctx) -> list[str] | None:
  per_seed = _quant_rows(ctx)
  if not per_seed:
    return None
  body = []
  for served in per_seed[0]:
    rows = [s[served] for s in per_seed]
    body.append(
      [
        rows[0]["model"],
        served,
        spread(r["eval_loss"] for r in rows).fmt(4),
        spread(r["minus_fp32"] for r in rows).fmt(4),
        f"{rows[0]['weight_bytes']:,}",
      ]
    )
  return [
    "### Quantization, by scheme",
    "",
    "glm5_tiny pretrained, then SFT on the verses without QAT and with QAT under three INT4 scopes; the held-out "
    "response loss (nats a token) of each model as served, and its weight bytes (unquantized parameters in fp32).",
    "",
    *table(["model", "served as", "held-out loss", "minus fp32", "weight bytes"], body),
  ]


RESULTS = (
  Result(
    "dsa_quality",
    "DSA keeps quality: warm-up + sparse training matches dense",
    "experiments/dsa_quality.py (2,048-token rows, batch 2: 150 dense steps, 40 warm-up steps, 100 steps a branch)",
    ("dsa_quality.png", "dsa_quality_branches.png"),
    run_dsa,
    measure_dsa,
  ),
  Result(
    "optimizer_mtp",
    "Muon (with the Muon split) beats AdamW at matched steps and learning rate",
    'launch/sweep.py --config=configs/glm5_tiny.py --sweep="optimizer.name=muon,adamw;'
    'model.num_nextn_predict_layers=1,0;train.seed=0,1,2" (600 steps, lr 3e-3)',
    ("optimizer_mtp_eval_loss.png", "optimizer_mtp_curves.png"),
    run_optimizer_mtp,
    measure_optimizer_mtp,
  ),
  Result(
    "mtp",
    "The MTP layer helps the main model's loss",
    "the same sweep",
    ("optimizer_mtp_eval_loss.png",),
    lambda ctx: None,
    measure_mtp,
    runs_of="optimizer_mtp",
  ),
  Result(
    "icepop",
    "IcePop vs truncated IS vs none, bf16 rollouts against fp32 training",
    'launch/sweep.py --config=configs/grpo_tiny.py --sweep="rl.is_correction=icepop,truncated,none;rl.seed=0,1,2" '
    "--config.rl.rollout_dtype=bfloat16",
    ("icepop.png",),
    run_icepop,
    measure_icepop,
  ),
  Result(
    "grpo_tiny",
    "GRPO raises reward and accuracy",
    'launch/sweep.py --config=configs/grpo_tiny.py --sweep="rl.seed=0,1,2"',
    ("grpo_tiny.png",),
    run_grpo,
    measure_grpo,
  ),
  Result(
    "distill_tiny",
    "On-policy distillation lowers the student's KL to its teachers",
    'launch/sweep.py --config=configs/distill_tiny.py --sweep="rl.seed=0,1,2"',
    ("distill_tiny.png",),
    run_distill,
    measure_distill,
  ),
  Result(
    "agent_tools",
    "Agentic SFT then GRPO teaches a small model to use its tools (calculator, verse lookup)",
    "launch/train.py --config=configs/glm5_tiny.py (the base), then experiments/agent_tools.py --sft_steps=1200 "
    "--rl_steps=60 --eval_tasks=64 a seed",
    ("agent_tools.png",),
    run_agent_tools,
    measure_agent_tools,
    details_agent_tools,
  ),
  Result(
    "quant",
    "INT4 quantization-aware training recovers the loss of INT4 post-training quantization",
    "experiments/quant_table.py (glm5_tiny, 600 steps, then 200 SFT steps without and with QAT) a seed",
    (),
    run_quant,
    measure_quant,
    details_quant,
  ),
  Result(
    "glm_infilling",
    "Blank infilling fills spans better than a causal LM of the same size (GLM)",
    "experiments/glm_infilling.py (glm130b_tiny and its causal variant, 600 steps each)",
    (),
    run_infilling,
    measure_infilling,
    details_infilling,
  ),
  Result(
    "glm_stability",
    "DeepNorm and embedding gradient shrink keep a high learning rate stable (GLM-130B)",
    "experiments/glm_stability.py --lr=1e-2 (4 runs of 300 steps)",
    ("glm_stability.png",),
    run_stability,
    measure_stability,
    details_stability,
  ),
)
FIGURES = sorted({f for r in RESULTS for f in r.figures})


def _git_commit() -> str:
  proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
  return proc.stdout.strip() or "unknown"


BEGIN, END = "<!-- reproduce.py: begin -->", "<!-- reproduce.py: end -->"


def render(ctx: Ctx, measured: dict[str, dict | None]) -> str:
  """The section of docs/results.md this script owns (between BEGIN and END): the table of every result."""
  when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
  lines = [
    BEGIN,
    "## Small-scale reproductions",
    "",
    "Written by `experiments/reproduce.py` from its runs; do not edit by hand. "
    f"Last written {when} at commit {_git_commit()}{' (shrunk runs: not results)' if ctx.shrink else ''}. "
    f"Learning results over {len(ctx.seeds)} seed(s): each "
    "number is the mean and, in parentheses, the range over the seeds; a verdict holds in every seed or says so.",
    "",
  ]
  rows = []
  for r in RESULTS:
    m = measured.get(r.name)
    wall = ctx.wall_s(r.runs_name)
    rows.append(
      [
        r.claim,
        f"`{r.command}`",
        str(len(ctx.seeds)),
        "-" if wall is None else f"{wall / 60:.1f} min",
        ", ".join(ctx.machines(r.runs_name)) if m else "-",
        m["measured"] if m else "not run",
        f"**{m['verdict']}**" if m else "-",
        ", ".join(f"[`{f}`](../experiments/figures/{f})" for f in r.figures) or "-",
      ]
    )
  lines += table(["claim", "command", "seeds", "wall time", "ran on", "measured", "verdict", "figures"], rows)
  for r in RESULTS:
    more = r.details(ctx)
    if more:
      lines += ["", *more]
  lines += ["", END]
  return "\n".join(lines)


def write_page(path: str, section: str) -> None:
  """Replaces the section between BEGIN and END in `path` (a page without them, or no page: the section alone)."""
  text = open(path).read() if os.path.exists(path) else ""
  if BEGIN in text and END in text:
    text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
  else:
    text = section + "\n"
  with open(path, "w") as f:
    f.write(text)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  names = [r.name for r in RESULTS]
  unknown = [n for n in _ONLY.value if n not in names]
  if unknown:
    raise app.UsageError(f"--only={','.join(_ONLY.value)}: unknown result(s) {unknown}; valid: {names}")
  if _SEEDS.value < 1:
    raise app.UsageError(f"--seeds={_SEEDS.value} is invalid; at least 1")
  out = _OUT.value
  ctx = Ctx(
    runs=os.path.abspath(_RUNS.value),
    figures=os.path.abspath(os.path.join(out, "figures") if out else os.path.join(ROOT, "experiments", "figures")),
    results=os.path.abspath(os.path.join(out, "results") if out else os.path.join(ROOT, "experiments", "results")),
    seeds=(0,) if _SHRINK.value else tuple(range(_SEEDS.value)),
    shrink=_SHRINK.value,
    render_only=_RENDER_ONLY.value,
  )
  for d in (ctx.runs, ctx.figures, ctx.results):
    os.makedirs(d, exist_ok=True)
  # The runs share jax's persistent compilation cache (unless one is set): the seeds of a result compile the same
  # programs, which the later seeds then load instead of compiling (the same executables, so the same numbers).
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ctx.runs, "jax_cache"))
  measured = {}
  for r in RESULTS:
    if not _ONLY.value or r.name in _ONLY.value:
      print(f"[reproduce] {datetime.datetime.now().strftime('%H:%M:%S')} {r.name}", flush=True)
      r.run(ctx)
    m = r.measure(ctx)
    measured[r.name] = m
    if m is not None:
      with open(os.path.join(ctx.results, f"{r.name}.json"), "w") as f:
        numbers = {"claim": r.claim, "seeds": list(ctx.seeds), "wall_s": ctx.wall_s(r.runs_name)}
        json.dump({**numbers, "ran_on": ctx.machines(r.runs_name), **m}, f, indent=1)
  page = os.path.join(out, "results.md") if out else os.path.join(ROOT, "docs", "results.md")
  write_page(page, render(ctx, measured))
  print(f"[reproduce] wrote {page}", flush=True)


if __name__ == "__main__":
  app.run(main)
