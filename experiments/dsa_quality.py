r"""Does DSA keep quality? Dense attention against GLM-5's warm-up + sparse training, at 2,048-token rows.

  bash scripts/with_env.sh python experiments/dsa_quality.py \
      --workdir=runs/dsa_quality  # an hour or more on a 2-core CPU

glm5_tiny's `long` variant (2,048-token rows of the embedded corpus, whose documents are Bible chapters of
about 1,000-3,000 tokens) trains in GLM-5's order:
  1. dense    --dense_steps of dense attention from scratch;
  2. warmup   --warmup_steps training only the indexer (KL to the dense attention), from 1;
  3. then, each from 2 for --steps (fresh optimizer and data, the same for every branch):
       dense        dense attention (the baseline: what the model reaches without DSA)
       sparse_k     DSA's sparse stage with index_topk = k for each k of --topk: each query attends to the k
                    keys its indexer picks, the indexer trained by the KL on its selection.
Every stage is a run directory under --workdir (rerunning resumes or skips finished stages). The held-out loss
of each branch (in the attention it was trained with, on the held-out chapters) goes to --results as JSON; the loss
curves of every stage, on one step axis with the branches continuing from the warm-up, to --figure, and the branches
alone (their training and held-out losses) to --branch_figure.
"""

import json
import os
import time

from absl import app, flags

from glm_jax.configs import glm5_tiny
from glm_jax import cli, plots
from glm_jax.train.trainer import train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "runs/dsa_quality", "Where the stages' run directories go.")
_DENSE_STEPS = flags.DEFINE_integer("dense_steps", 150, "Steps of the dense stage from scratch.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 40, "Steps of the indexer warm-up.")
_STEPS = flags.DEFINE_integer("steps", 100, "Steps of each branch (dense, sparse at each top-k).")
_TOPK = flags.DEFINE_list("topk", ["64", "128", "256"], "index_topk of the sparse branches.")
_BATCH = flags.DEFINE_integer("batch_size", 2, "Rows of --seq_len tokens a step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Tokens a row (glm5_tiny's long variant: 2,048).")
_SEED = flags.DEFINE_integer("seed", 0, "train.seed of every stage (the dense stage's initialization, the data order).")
_RESULTS = flags.DEFINE_string("results", "", "The JSON of the figures (default: <workdir>/results.json).")
_FIGURE = flags.DEFINE_string("figure", "", "Every stage on one step axis (PNG; default: <workdir>/dsa_quality.png).")
_BRANCH_FIGURE = flags.DEFINE_string(
  "branch_figure", "", "The branches alone (PNG; default: <workdir>/dsa_quality_branches.png)."
)


def stage_config(stage: str, steps: int, init_from: str = "", topk: int | None = None):
  config = glm5_tiny.get_config("long")
  config.data.batch_size = _BATCH.value
  config.data.seq_len = _SEQ_LEN.value
  config.train.seed = _SEED.value
  config.train.dsa_stage = stage
  config.train.steps = steps
  config.train.init_from = init_from
  config.train.log_every = 5
  config.train.eval_every = steps
  config.train.checkpoint_every = steps
  config.train.tensorboard = False
  config.optimizer.warmup_steps = max(1, steps // 10)
  config.optimizer.decay_steps = steps - config.optimizer.warmup_steps
  if topk is not None:
    config.model.index_topk = topk
  return config


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  topks = [int(k) for k in _TOPK.value]
  root = _WORKDIR.value
  t0 = time.perf_counter()
  stage_wall = {}

  def run(name, config):
    t = time.perf_counter()
    out = train_and_evaluate(config, os.path.join(root, name))
    stage_wall[name] = round(time.perf_counter() - t, 1)  # a stage finished earlier only restores: seconds
    return out

  dense_dir, warmup_dir = os.path.join(root, "dense"), os.path.join(root, "warmup")
  run("dense", stage_config("dense", _DENSE_STEPS.value))
  warm = run("warmup", stage_config("warmup", _WARMUP_STEPS.value, dense_dir))
  branches = {"dense": run("branch_dense", stage_config("dense", _STEPS.value, warmup_dir))}
  for k in topks:
    branches[f"sparse_{k}"] = run(f"branch_sparse_{k}", stage_config("sparse", _STEPS.value, warmup_dir, k))
  wall = time.perf_counter() - t0
  rows = plots.read_metrics(warmup_dir)
  kl = [r["indexer_kl"] for r in rows if r.get("indexer_kl") is not None]
  summary = {
    "seq_len": _SEQ_LEN.value,
    "seed": _SEED.value,
    "batch_size": _BATCH.value,
    "dense_steps": _DENSE_STEPS.value,
    "warmup_steps": _WARMUP_STEPS.value,
    "branch_steps": _STEPS.value,
    "warmup_indexer_kl": {"first": kl[0], "last": kl[-1]} if kl else None,
    "warmup_eval_loss": warm["eval_loss"],
    "eval_loss": {name: s["eval_loss"] for name, s in branches.items()},
    "eval_loss_minus_dense": {name: s["eval_loss"] - branches["dense"]["eval_loss"] for name, s in branches.items()},
    "unigram_entropy": warm["unigram_entropy"],
    "wall_s_this_invocation": round(wall, 1),
    "stage_wall_s": stage_wall,
  }
  branch_dirs = {name: os.path.join(root, f"branch_{name}") for name in branches}
  stages = {"dense (from scratch)": dense_dir, "warm-up": warmup_dir}
  metrics, entropy = ["lm_loss", "eval_loss"], warm["unigram_entropy"]
  fig = plots.timeline(stages, metrics, branches=branch_dirs, smooth=3, reference=entropy, width=6.5)
  plots.save(fig, _FIGURE.value or os.path.join(_WORKDIR.value, "dsa_quality.png"))
  # the branches alone, where their differences (a percent of the loss) show: the same step axis, held-out points
  _, offsets, _ = plots.chain(stages, branch_dirs)
  title = f"dense vs DSA after {_WARMUP_STEPS.value} warm-up steps, {_SEQ_LEN.value:,}-token rows"
  fig = plots.curves(branch_dirs, metrics, smooth=3, reference=entropy, offsets=offsets, width=6.5, title=title)
  plots.save(fig, _BRANCH_FIGURE.value or os.path.join(_WORKDIR.value, "dsa_quality_branches.png"))
  # the results last: reproduce.py takes a seed whose results exist for done
  results_path = _RESULTS.value or os.path.join(_WORKDIR.value, "results.json")
  os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
  with open(results_path, "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  cli.run(main)
