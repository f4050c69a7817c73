r"""Runs a sweep: the product of config overrides, each point a launch/train.py run in its own directory.

  bash scripts/with_env.sh python launch/sweep.py --config=configs/glm5_tiny.py --workdir=runs/lr_mtp \
      --sweep="optimizer.lr=1e-3,3e-3;model.num_nextn_predict_layers=0,1" --config.train.steps=200
  bash scripts/with_env.sh python launch/sweep.py --config=configs/glm5_tiny.py --workdir=runs/topk \
      --sweep="model.index_topk=16,32" \
      --config.train.dsa_stage=sparse --config.train.init_from=runs/warmup
  bash scripts/with_env.sh python launch/sweep.py --config=configs/glm5_tiny.py:long --workdir=runs/mtp \
      --sweep="model.num_nextn_predict_layers=0,1" --parallel=2

`;` separates the axes of the product, `,` the values of one axis; every --config.* flag applies to every run
(glm_jax/sweep.py has the details). Before the first run, every point's config is parsed as launch/train.py
would parse it and checked, so an unknown field, a malformed value list or an undefined config variant fails at
once with one line naming it. So does an axis that changes nothing in the runs' stage (model.index_topk in the
default dense DSA stage: the line names the field, the stage and the override that makes it matter);
--allow_unused_axes sweeps it anyway, with a warning. Each finished run prints its wall time and final metrics, and
its final JSON line lands in DIR/results.jsonl with its overrides; rerunning the same command skips the finished
runs and resumes the rest. Plot the results with launch/plot.py:

  bash scripts/with_env.sh python launch/plot.py --sweep=runs/lr_mtp --metric=eval_loss --against=optimizer.lr \
      --out=lr.png

--parallel=N runs N processes at a time (each one uses all the cores it finds: on a small CPU machine 1 is
fastest). Exit code 1 when a run failed (its error line is printed; the rerun retries it).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from glm_jax import cli, sweep

# A config flag, so the shared --config.* overrides are parsed (and refused when unknown) as launch/train.py would.
_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "A configs/*.py file, optionally with a variant: configs/glm5_tiny.py:long.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's directory: a run directory a point, results.jsonl.")
_SWEEP = flags.DEFINE_string("sweep", None, "Axes 'field=v1,v2;field2=w1,w2' (the product is swept).")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Runs at a time.")
_ALLOW_UNUSED = flags.DEFINE_bool(
  "allow_unused_axes", False, "Sweep an axis the runs ignore in their stage (a warning instead of an error)."
)


def shared_overrides(argv: list[str]) -> list[str]:
  """The --config.<field>=<value> flags of the command line, passed on to every run."""
  out = []
  for arg in argv[1:]:
    if arg.startswith("--config."):
      if "=" not in arg:
        raise app.UsageError(f"{arg}: write overrides as --config.<section>.<field>=<value>")
      out.append(arg)
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  shared = shared_overrides(sys.argv)  # passed on, as written, to every run
  try:
    axes = sweep.parse_spec(_SWEEP.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  config_arg = config_flags.get_config_filename(flags.FLAGS["config"])  # the path as given, with its :variant
  rows, failed = sweep.run_sweep(
    config_arg, _WORKDIR.value, axes, shared, parallel=_PARALLEL.value, allow_unused_axes=_ALLOW_UNUSED.value
  )
  print(
    f"[sweep] {len(rows)} of {len(sweep.points(axes))} runs finished; results in {_WORKDIR.value}/{sweep.RESULTS_FILE}",
    flush=True,
  )
  if failed:
    cli.fail(f"{len(failed)} run(s) failed: {failed} (rerun the same command to retry them)")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "sweep"])
  cli.run(main)
