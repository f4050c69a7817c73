r"""Per-run summaries of metrics.jsonl columns, for the results table: the mean of the first and last N logged values,
the mean and the max over the run, one JSON line a run.

  bash scripts/with_env.sh python experiments/summarize.py --sweep=runs/repro/icepop \
      --metrics=reward_mean,mismatch_kl --window=20
  bash scripts/with_env.sh python experiments/summarize.py --workdirs=runs/repro/grpo_tiny \
      --metrics=reward_mean,eval_accuracy
"""

import json

from absl import app, flags

from glm_jax import cli, plots

_SWEEP = flags.DEFINE_string("sweep", None, "A sweep's directory: summarize each of its runs.")
_WORKDIRS = flags.DEFINE_list("workdirs", [], "Run directories.")
_METRICS = flags.DEFINE_list("metrics", ["loss"], "metrics.jsonl columns.")
_WINDOW = flags.DEFINE_integer("window", 20, "How many logged values the first / last means take.")


def summary(rows: list[dict], metric: str, window: int) -> dict | None:
  steps, values = plots.series(rows, metric)
  if not values:
    return None
  head, tail = values[:window], values[-window:]
  return {
    "first": sum(head) / len(head),
    "last": sum(tail) / len(tail),
    "mean": sum(values) / len(values),
    "max": max(values),
    "final": values[-1],
    "final_step": steps[-1],
    "n": len(values),
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  runs = plots.sweep_runs(_SWEEP.value) if _SWEEP.value else {w: w for w in _WORKDIRS.value}
  if not runs:
    raise app.UsageError("give --sweep or --workdirs")
  for label, workdir in runs.items():
    rows = plots.read_metrics(workdir)
    out = {m: summary(rows, m, _WINDOW.value) for m in _METRICS.value}
    missing = [m for m, s in out.items() if s is None]
    if missing:
      raise ValueError(f"{workdir}: no finite values of {missing}; its columns: {plots.logged_columns(rows)}")
    print(json.dumps({"run": label, "window": _WINDOW.value, **out}), flush=True)


if __name__ == "__main__":
  cli.run(main)
