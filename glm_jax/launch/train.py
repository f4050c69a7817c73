r"""Trains GLM-5 from a config; resumes from --workdir's latest checkpoint. config.trainer picks the loop:
"pretrain" (the default; glm_jax/train/trainer.py), "sft" (the same loop on prompt/response data, the loss on the
responses; with config.quant, INT4 quantization-aware training), "grpo" or "distill" (post-training,
glm_jax/rl/trainer.py).

  bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py     # the embedded corpus, on CPU
  bash scripts/with_env.sh python launch/train.py --config=configs/sft_tiny.py      # SFT, INT4 QAT on the experts
  bash scripts/with_env.sh python launch/train.py --config=configs/grpo_tiny.py     # GRPO + IcePop, 1-digit addition
  bash scripts/with_env.sh python launch/train.py --config=configs/distill_tiny.py  # distillation, two teachers
  bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py --workdir=/tmp/run1 \
      --config.train.steps=50 --config.optimizer.lr=3e-3 --config.train.dsa_stage=warmup

Any config field can be overridden as --config.<section>.<field>=value; an unknown field is an error.

Several hosts (glm_jax/train/distributed.py): run the same command on every host. On a Cloud TPU pod slice
  gcloud compute tpus tpu-vm ssh NAME --worker=all \
      --command="cd glm-jax && bash scripts/with_env.sh python launch/train.py \
      --distributed=on --config=configs/glm5_744b.py --config.data.path=/mnt/shared/shards \
      --workdir=/mnt/shared/run"
(--distributed=on: jax.distributed.initialize finds the slice's hosts itself; the default, auto, does so
only when environment variables name a multi-process job). Elsewhere give the coordinator explicitly, e.g.
two processes on one machine:
  bash scripts/with_env.sh python launch/train.py --config=... --coordinator_address=localhost:12345 \
      --num_processes=2 --process_id=0
  bash scripts/with_env.sh python launch/train.py --config=... --coordinator_address=localhost:12345 \
      --num_processes=2 --process_id=1
Every process reads its own rows of each global batch and writes its part of each checkpoint; process 0
writes the metrics and prints the JSON line.
Metrics go to <workdir>/metrics.jsonl and <workdir>/tensorboard, checkpoints to <workdir>/checkpoints.
The run ends by printing one JSON line: eval_loss and unigram_entropy (nats per token), step, and more (for
grpo / distill: the greedy eval_accuracy at the start and the end, the last reward_mean or teacher_kl). JSON is
strict: a non-finite number is null and the row's "nonfinite" list names it (glm_jax/strict_json.py).
A bad flag, config value or path, an unreadable checkpoint or a diverging run (train.max_consecutive_skips
skipped steps in a row, or a final eval_loss or train_loss that is not finite, after the JSON line) ends the run
with one line, `error: ...`, and a non-zero exit code; GLM_JAX_TRACEBACK=1 shows the traceback (glm_jax/cli.py).
"""

import math

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from glm_jax import cli, strict_json
from glm_jax.rl import config as rl_config, trainer as rl_trainer
from glm_jax.train import distributed
from glm_jax.train.guards import Diverged
from glm_jax.train.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: workdirs/<config name>).")
_DISTRIBUTED = flags.DEFINE_enum(
  "distributed",
  "auto",
  distributed.MODES,
  "jax.distributed.initialize: auto (when the environment names a multi-process "
  "job, or the three flags below are given), on, off.",
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process runs).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-process runs).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO; -v 0 brings it back
  try:
    distributed.maybe_initialize(
      _DISTRIBUTED.value,
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  config = _CONFIG.value
  workdir = _WORKDIR.value or f"workdirs/{config.get('name', 'run')}"
  kind = config.get("trainer", "pretrain")
  if kind in ("pretrain", "sft"):  # SFT is the pretraining loop on prompt/response data, loss on the responses
    summary = train_and_evaluate(config, workdir)
  elif kind in ("grpo", "distill"):
    summary = rl_trainer.run(config, workdir)
  else:
    raise app.UsageError(f"config.trainer={kind!r} is invalid; one of {rl_config.TRAINERS}")
  if jax.process_index() == 0:
    print(strict_json.dumps(summary), flush=True)
  bad = [k for k in ("eval_loss", "train_loss") if isinstance(summary.get(k), float) and not math.isfinite(summary[k])]
  if bad:  # the run ended diverged (with fewer skipped steps in a row than train.max_consecutive_skips)
    raise Diverged(
      f"the run ended with a non-finite {' and '.join(bad)} (step {summary['step']}, "
      f"{summary['skipped_steps']} steps skipped in all); see {workdir}/metrics.jsonl"
    )


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
