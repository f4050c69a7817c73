r"""PNG figures of runs and sweeps (glm_jax/plots.py).

  # metrics.jsonl columns over steps, one line a run; a held-out column shares its training column's panel
  bash scripts/with_env.sh python launch/plot.py --workdirs=runs/dense,runs/sparse --metrics=lm_loss,eval_loss \
      --smooth=10 --out=curves.png
  bash scripts/with_env.sh python launch/plot.py --workdirs=runs/dense --metrics="expert_load_entropy[1]" \
      --out=entropy.png
  # DSA's stages on one step axis (each stage started from the last one's checkpoint), the boundaries marked
  bash scripts/with_env.sh python launch/plot.py --workdirs=runs/dense,runs/warmup,runs/sparse --stages \
      --metrics=lm_loss --out=dsa.png
  # a sweep's final metric against one of its overrides, one line (or, for categories, points) for each value of
  # the others; train_loss and eval_loss on one axis
  bash scripts/with_env.sh python launch/plot.py --sweep=runs/lr_mtp --metric=train_loss,eval_loss \
      --against=optimizer.lr --out=lr.png
  # the curves of every run of a sweep, labelled by their overrides
  bash scripts/with_env.sh python launch/plot.py --sweep=runs/lr_mtp --metrics=loss,eval_loss --out=lr_curves.png

Every figure has a title (the metrics' unless --title), units on its axes and its legend outside them. The panels
of lm_loss, mtp_loss and eval_loss get a dashed line at the data's unigram entropy: --reference=auto (the default)
takes it from the runs' final JSON lines where a sweep keeps them, --reference=5.179 gives it (launch/train.py prints
unigram_entropy in its last line), --reference=none draws none. A learning-rate axis, or one of positive values
spanning more than 30x, is logarithmic.

A column no run logged, or an override that is not one of the sweep's, ends the script with one line naming it
and what there is; nothing is written.
"""

from absl import app, flags

from glm_jax import cli

cli.require_extra("plots", "matplotlib")

from glm_jax import plots  # noqa: E402

_WORKDIRS = flags.DEFINE_list("workdirs", [], "Run directories (each with a metrics.jsonl).")
_LABELS = flags.DEFINE_list("labels", [], "Legend labels for --workdirs (default: the directory names).")
_STAGES = flags.DEFINE_bool(
  "stages", False, "--workdirs are consecutive stages (dense, warmup, sparse): one step axis, boundaries marked."
)
_BRANCHES = flags.DEFINE_list("branches", [], "With --stages: runs that each continue from the last stage.")
_METRICS = flags.DEFINE_list(
  "metrics", ["loss"], "metrics.jsonl columns (curves: --workdirs, or --sweep without --against)."
)
_SWEEP = flags.DEFINE_string("sweep", None, "A sweep's directory (launch/sweep.py --workdir) or its results.jsonl.")
_METRIC = flags.DEFINE_list("metric", ["eval_loss"], "Keys of the runs' final JSON line, on one axis (with --sweep).")
_AGAINST = flags.DEFINE_string(
  "against", None, "The override on the x axis (with --sweep; without it, --sweep draws its runs' curves of --metrics)."
)
_BY = flags.DEFINE_list("by", None, "Overrides that get a series each (with --sweep; default: the other axes).")
_BARS = flags.DEFINE_bool("bars", False, "Categorical --against values as grouped bars (default: points).")
_SMOOTH = flags.DEFINE_integer("smooth", 1, "Curves: a training column's trailing mean over this many logged points.")
_REFERENCE = flags.DEFINE_string("reference", "auto", "The unigram-entropy line: auto, none or a number (nats/token).")
_TITLE = flags.DEFINE_string("title", None, "The figure's title (default: from the metrics).")
_LOGY = flags.DEFINE_bool("logy", False, "Logarithmic y axis (curves).")
_OUT = flags.DEFINE_string("out", None, "The PNG to write.")


def reference(text: str) -> float | str | None:
  if text in ("auto", "none"):
    return None if text == "none" else text
  try:
    return float(text)
  except ValueError:
    raise app.UsageError(f"--reference={text!r}: 'auto', 'none' or a number (nats/token)") from None


def labelled_workdirs():
  runs = _WORKDIRS.value
  if _LABELS.value:
    if len(_LABELS.value) != len(runs):
      raise app.UsageError(f"--labels has {len(_LABELS.value)} names for {len(runs)} --workdirs")
    runs = dict(zip(_LABELS.value, runs))
  return runs


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if bool(_WORKDIRS.value) == bool(_SWEEP.value):
    raise app.UsageError("give either --workdirs (curves over steps) or --sweep (a sweep's final metric)")
  if (_STAGES.value or _BRANCHES.value) and not _WORKDIRS.value:
    raise app.UsageError("--stages and --branches go with --workdirs (the stages, in order)")
  curve_kw = dict(title=_TITLE.value, logy=_LOGY.value, smooth=_SMOOTH.value, reference=reference(_REFERENCE.value))
  if _SWEEP.value and not _AGAINST.value:
    fig = plots.curves(plots.sweep_runs(_SWEEP.value), _METRICS.value, **curve_kw)
  elif _SWEEP.value:
    fig = plots.sweep_plot(
      _SWEEP.value,
      _METRIC.value,
      _AGAINST.value,
      by=_BY.value,
      title=_TITLE.value,
      bars=_BARS.value,
      reference=curve_kw["reference"],
    )
  elif _STAGES.value or _BRANCHES.value:
    fig = plots.timeline(labelled_workdirs(), _METRICS.value, branches=_BRANCHES.value, **curve_kw)
  else:
    fig = plots.curves(labelled_workdirs(), _METRICS.value, **curve_kw)
  print(plots.save(fig, _OUT.value), flush=True)


if __name__ == "__main__":
  flags.mark_flag_as_required("out")
  cli.run(main)
