r"""PNG figures of runs and sweeps (glm_jax/plots.py).

  # metrics.jsonl columns over steps, one line a run, one panel a metric
  python launch/plot.py --workdirs=runs/dense,runs/sparse --metrics=loss,eval_loss --out=curves.png
  python launch/plot.py --workdirs=runs/dense --metrics="expert_load_entropy[1]" --out=entropy.png
  # a sweep's final metric against one of its overrides, one line for each value of the others
  python launch/plot.py --sweep=runs/lr_topk --metric=eval_loss --against=optimizer.lr --out=lr.png
  # the curves of every run of a sweep, labelled by their overrides
  python launch/plot.py --sweep=runs/lr_topk --metrics=loss,eval_loss --out=lr_curves.png

A column no run logged, or an override that is not one of the sweep's, ends the script with one line naming it
and what there is; nothing is written.
"""

from absl import app, flags

from glm_jax import cli, plots

_WORKDIRS = flags.DEFINE_list("workdirs", [], "Run directories (each with a metrics.jsonl).")
_LABELS = flags.DEFINE_list("labels", [], "Legend labels for --workdirs (default: the directory names).")
_METRICS = flags.DEFINE_list(
  "metrics", ["loss"], "metrics.jsonl columns, a panel each (curves: --workdirs, or --sweep without --against)."
)
_SWEEP = flags.DEFINE_string("sweep", None, "A sweep's directory (launch/sweep.py --workdir) or its results.jsonl.")
_METRIC = flags.DEFINE_string("metric", "eval_loss", "A key of the runs' final JSON line (with --sweep).")
_AGAINST = flags.DEFINE_string(
  "against", None, "The override on the x axis (with --sweep; without it, --sweep draws its runs' curves of --metrics)."
)
_BY = flags.DEFINE_list("by", None, "Overrides that get a line each (with --sweep; default: the other axes).")
_TITLE = flags.DEFINE_string("title", None, "The figure's title.")
_LOGY = flags.DEFINE_bool("logy", False, "Logarithmic y axis (with --workdirs).")
_OUT = flags.DEFINE_string("out", None, "The PNG to write.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if bool(_WORKDIRS.value) == bool(_SWEEP.value):
    raise app.UsageError("give either --workdirs (curves over steps) or --sweep (a sweep's final metric)")
  if _SWEEP.value and not _AGAINST.value:
    fig = plots.curves(plots.sweep_runs(_SWEEP.value), _METRICS.value, title=_TITLE.value, logy=_LOGY.value)
  elif _SWEEP.value:
    fig = plots.sweep_plot(_SWEEP.value, _METRIC.value, _AGAINST.value, by=_BY.value, title=_TITLE.value)
  else:
    runs = _WORKDIRS.value
    if _LABELS.value:
      if len(_LABELS.value) != len(runs):
        raise app.UsageError(f"--labels has {len(_LABELS.value)} names for {len(runs)} --workdirs")
      runs = dict(zip(_LABELS.value, runs))
    fig = plots.curves(runs, _METRICS.value, title=_TITLE.value, logy=_LOGY.value)
  print(plots.save(fig, _OUT.value), flush=True)


if __name__ == "__main__":
  flags.mark_flag_as_required("out")
  cli.run(main)
