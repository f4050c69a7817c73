r"""GLM-130B's two stabilisers at a learning rate high enough to spike: DeepNorm vs Pre-LN, with and without
embedding gradient shrink (EGS, alpha = 0.1).

  bash scripts/with_env.sh python experiments/glm_stability.py --workdir=runs/glm_stability \
      --lr=1e-2  # four runs, ~10 min on 2 cores

Four runs of configs/glm130b_tiny.py (blank infilling) that differ only in model.norm_style and
train.embedding_grad_shrink, with AdamW at --lr, no gradient clipping and no spike guard (the step would otherwise
skip the spikes this measures). Prints each run's largest loss jump (loss[t] - min(loss[:t]) over logged steps),
the number of steps whose loss is over 1.5x the best so far, and the final held-out loss; writes the loss curves
to --figure and the rows to --results.
"""

import json
import os

import numpy as np
from absl import app, flags

from glm_jax.configs import glm130b_tiny
from glm_jax import cli, plots
from glm_jax.train.trainer import train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "runs/glm_stability", "Where the runs go.")
_LR = flags.DEFINE_float("lr", 1e-2, "AdamW's peak learning rate (after 20 warm-up steps, then constant).")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of each run.")
_SEED = flags.DEFINE_integer("seed", 0, "train.seed of every run (the initialization, the data order).")
_FIGURE = flags.DEFINE_string("figure", "", "The loss curves (default: <workdir>/glm_stability.png).")
_RESULTS = flags.DEFINE_string("results", "", "JSON lines of the runs (default: <workdir>/results.jsonl).")

RUNS = {  # label -> (norm_style, embedding_grad_shrink)
  "Pre-LN": ("prenorm", 1.0),
  "Pre-LN + EGS": ("prenorm", 0.1),
  "DeepNorm": ("deepnorm", 1.0),
  "DeepNorm + EGS": ("deepnorm", 0.1),
}


def config_for(norm_style: str, egs: float):
  config = glm130b_tiny.get_config()
  config.model.norm_style = norm_style
  config.train.embedding_grad_shrink = egs
  config.train.steps = _STEPS.value
  config.train.seed = _SEED.value
  config.train.log_every = 1
  config.train.eval_every = config.train.checkpoint_every = _STEPS.value
  config.train.grad_clip_norm = 0.0
  config.train.spike_factor = 0.0
  config.train.max_consecutive_skips = 0
  config.optimizer.name = "adamw"
  config.optimizer.lr = _LR.value
  config.optimizer.warmup_steps = min(20, max(_STEPS.value // 10, 1))  # 20 at 300 steps
  config.optimizer.schedule = "constant"
  return config


def spikes(losses: list[float]) -> dict:
  best, jump, over = np.inf, 0.0, 0
  for loss in losses:
    if np.isfinite(loss):
      jump = max(jump, loss - best) if np.isfinite(best) else jump
      over += int(np.isfinite(best) and loss > 1.5 * best)
      best = min(best, loss)
  return {
    "max_jump": round(float(jump), 4),
    "steps_over_1.5x_best": over,
    "non_finite": int(sum(not np.isfinite(x) for x in losses)),
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdirs, rows = {}, []
  for label, (norm_style, egs) in RUNS.items():
    workdir = os.path.join(_WORKDIR.value, f"{norm_style}_egs{egs}")
    workdirs[label] = workdir
    summary = train_and_evaluate(config_for(norm_style, egs), workdir)
    losses = [float("nan") if r.get("loss") is None else r["loss"] for r in plots.read_metrics(workdir) if "loss" in r]
    rows.append(
      {
        "run": label,
        "lr": _LR.value,
        "eval_loss": summary["eval_loss"],
        "eval_span_exact": summary.get("eval_span_exact"),
        **spikes(losses),
      }
    )
  figure = _FIGURE.value or os.path.join(_WORKDIR.value, "glm_stability.png")
  plots.save(plots.curves(workdirs, "loss", title=f"glm130b_tiny, AdamW lr {_LR.value:g}, no clipping"), figure)
  results_path = _RESULTS.value or os.path.join(_WORKDIR.value, "results.jsonl")
  os.makedirs(os.path.dirname(results_path) or ".", exist_ok=True)
  with open(results_path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  for row in rows:
    print(json.dumps(row))


if __name__ == "__main__":
  cli.run(main)
