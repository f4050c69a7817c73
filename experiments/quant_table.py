r"""Quantization on a trained glm5_tiny: held-out loss and weight bytes in fp32, after post-training quantization
(INT4 in groups, GLM-130B's per-row INT4, W8A8, W4A8) and after INT4 quantization-aware SFT.

  bash scripts/with_env.sh python experiments/quant_table.py --workdir=runs/quant        # ~15 minutes on a 2-core CPU

GLM-5's order (report 2.4.3: QAT in the SFT stage):
  1. base        glm5_tiny pretrained on the embedded corpus (configs/glm5_tiny.py, 600 steps: --base_steps)
  2. sft         configs/sft_tiny.py without QAT from 1 (verse reference -> verse text, loss on the response)
  3. qat_<name>  the same SFT from 1 with QAT of each scheme of --qat
Then every model's held-out SFT loss (nats per response token) is measured with its weights as served: the fp32
SFT model as it is and packed under each PTQ scheme, each QAT model packed under its own scheme (which computes
its training forward bit for bit). Rows go to --results (JSON lines), the table is printed. --seed is every run's
train.seed; experiments/reproduce.py runs it once a seed.
"""

import json
import os
import time
import types

import jax
from absl import app, flags

from glm_jax.configs import glm5_tiny, sft_tiny
from glm_jax import cli
from glm_jax import data as data_lib
from glm_jax.model.quantization import pack_params, quant_plan, weight_bytes
from glm_jax.train import step as step_lib
from glm_jax.train.trainer import evaluate, restore_run, train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "runs/quant", "Where the runs go.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 200, "SFT steps (with and without QAT).")
_BASE_STEPS = flags.DEFINE_integer("base_steps", 600, "Pretraining steps of the base (glm5_tiny's).")
_SEED = flags.DEFINE_integer("seed", 0, "train.seed of every run (the initialization, the data order).")
_RESULTS = flags.DEFINE_string("results", "", "JSON lines of the table (default: <workdir>/results.jsonl).")

# (row name, scheme, group size, scope): the post-training schemes applied to the fp32 SFT model.
PTQ = [
  ("int4_g32_experts", "int4", 32, "routed_experts"),  # GLM-5's QAT format (groups of 128 there)
  ("int4_g32_all", "int4", 32, "routed_experts,shared_experts,dense_mlp,attention"),
  ("int4_row_all", "int4_row", 0, ""),  # GLM-130B: per-row INT4 on every linear layer
  ("w8a8", "w8a8", 0, ""),
  ("w4a8", "w4a8", 0, ""),  # the Ascend mix
]
QAT = [row for row in PTQ if row[1] in ("int4", "int4_row")]


def with_steps(config, steps: int):
  """config trained `steps` steps (--seed's), evaluated and saved at the end, its schedule fitted to them."""
  config.train.steps = config.train.eval_every = config.train.checkpoint_every = steps
  config.train.seed = _SEED.value
  config.train.tensorboard = False
  config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, steps // 2)
  config.optimizer.decay_steps = steps - config.optimizer.warmup_steps
  return config


def sft_config(init_from: str, scheme: str = "none", group_size: int = 32, scope: str = ""):
  config = with_steps(sft_tiny.get_config(), _SFT_STEPS.value)
  config.train.init_from = init_from
  config.quant.scheme, config.quant.group_size, config.quant.scope = scheme, group_size, scope
  return config


def served_loss(config, workdir: str, scheme: str, group_size: int, scope: str) -> dict:
  """Held-out SFT loss of workdir's model packed under (scheme, group size, scope), and its weight bytes."""
  run = restore_run(config, workdir)
  params = run.state.params
  q = config.quant.copy_and_resolve_references()
  q.scheme, q.group_size, q.scope = scheme, group_size, scope
  if scheme != "none":
    params = pack_params(params, quant_plan(params, q))
  batches = data_lib.make_eval_batches(config.data, run.tokenizer)
  loss = evaluate(
    step_lib.make_eval_step(run.graphdef), types.SimpleNamespace(params=params, rest=run.state.rest), batches
  )
  return {"eval_loss": loss, "weight_bytes": weight_bytes(params)}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  root = _WORKDIR.value
  t0 = time.perf_counter()
  base = os.path.join(root, "base")
  base_config = glm5_tiny.get_config()
  if _BASE_STEPS.value != base_config.train.steps:
    base_config = with_steps(base_config, _BASE_STEPS.value)
  base_config.train.seed = _SEED.value
  base_config.train.tensorboard = False
  train_and_evaluate(base_config, base)
  sft_dir = os.path.join(root, "sft")
  train_and_evaluate(sft_config(base), sft_dir)
  rows = [dict(model="sft fp32", served="fp32", **served_loss(sft_config(base), sft_dir, "none", 0, ""))]
  for name, scheme, group, scope in PTQ:
    rows.append(
      dict(model="sft fp32", served=f"PTQ {name}", **served_loss(sft_config(base), sft_dir, scheme, group, scope))
    )
  for name, scheme, group, scope in QAT:
    config = sft_config(base, scheme, group, scope)
    qat_dir = os.path.join(root, f"qat_{name}")
    train_and_evaluate(config, qat_dir)
    rows.append(
      dict(model=f"sft QAT {name}", served=f"packed {name}", **served_loss(config, qat_dir, scheme, group, scope))
    )
  fp32 = rows[0]["eval_loss"]
  results_path = _RESULTS.value or os.path.join(_WORKDIR.value, "results.jsonl")
  os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
  with open(results_path, "w") as f:
    for row in rows:
      row["minus_fp32"] = row["eval_loss"] - fp32
      f.write(json.dumps(row) + "\n")
  print(f"{'model':26} {'served as':24} {'held-out loss':>13} {'- fp32':>8} {'weight bytes':>13}")
  for r in rows:
    print(f"{r['model']:26} {r['served']:24} {r['eval_loss']:13.4f} {r['minus_fp32']:+8.4f} {r['weight_bytes']:13,d}")
  print(f"wall {time.perf_counter() - t0:.0f} s; devices {jax.devices()}")


if __name__ == "__main__":
  cli.run(main)
