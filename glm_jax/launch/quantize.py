r"""Post-training quantization: packs a run's latest checkpoint into a quantized model for the sampler and rollouts.

  bash scripts/with_env.sh python launch/quantize.py --workdir=workdirs/glm5_tiny --scheme=w4a8 \
      --out=workdirs/glm5_tiny_w4a8
  bash scripts/with_env.sh python launch/sample.py --packed=workdirs/glm5_tiny_w4a8 --prompt="In the beginning"

--workdir is any run's directory (pretraining, SFT, GRPO, distillation, a converted checkpoint: glm_jax/restore.py);
its config and tokenizer come from the checkpoint. --config (optional) gives the config instead, its model the run's
(without --workdir the run is workdirs/<config.name>); --config.x.y=v overrides without --config apply to the recorded
config.

Schemes (glm_jax/model/quantization.py): int4 (weight-only, groups of --group_size along the input; GLM-5's QAT
format, by default on the routed experts), int4_row (GLM-130B's per-row INT4 weight-only on the attention and
feed-forward weights), w8a8, w4a8 (the Ascend mix: W8A8 attention and dense MLPs, W4A8 MoE experts).
--scope overrides the scheme's default scope: groups ("routed_experts,attention") or "re:<regex on paths>".
The packed model records the config, the run's tokenizer and the quant section (the config's quant section, when it
has one, under the flags: an SFT run's QAT group size is the default). Prints one JSON line: the scheme, the packed
parameters, the weight bytes before and after.

--out must not exist, nor be inside the run's directory. The model is written inside <out>.partial, a directory
made with glm_jax/paths.py's marker (which names its writer), and renamed to <out> when complete; a <out>.partial
left by a run that died is ours and removed; one whose writer is alive, or anything else by that name, is left alone
and refused before any work.
"""

import json
import os
import sys

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli, paths, restore
from glm_jax.model.quantization import SCHEMES, check_quant_config, default_quant_config
from glm_jax.train.packed_checkpoint import save_packed

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "The run's configs/*.py file (default: the config the checkpoint recorded).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "The run's directory (any run, or a converted checkpoint; with --config: workdirs/<config.name>)."
)
_OUT = flags.DEFINE_string("out", None, "The packed model's directory (must not exist).")
_SCHEME = flags.DEFINE_enum("scheme", None, [s for s in SCHEMES if s != "none"], "The quantization scheme.")
_GROUP = flags.DEFINE_integer(
  "group_size",
  None,
  "int4's group along a weight's input (0: per output channel); default: the config's quant.group_size, else 128.",
)
_SCOPE = flags.DEFINE_string("scope", None, "Which weights: groups or re:<regex>; default: the scheme's scope.")


def quant_section(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config's quant section (or the defaults) with the flags over it, checked."""
  q = default_quant_config()
  if "quant" in config:
    q.update(config.quant.to_dict())
  q.scheme = _SCHEME.value
  if _GROUP.value is not None:
    q.group_size = _GROUP.value
  if _SCOPE.value is not None:
    q.scope = _SCOPE.value
  check_quant_config(q)
  return q


def checked_out(out: str, workdir: str) -> str:
  """--out, absolute, once it is known that it may be written (before any work): it does not exist, is not inside
  the run's directory, and <out>.partial is absent or ours (removed: a run that died before its rename)."""
  out = os.path.abspath(out)
  if os.path.lexists(out):
    raise FileExistsError(f"--out={out} exists; a packed model is written to a new directory")
  paths.check_apart("--out", out, paths.sources("--workdir", workdir))
  paths.clear_partial(out + ".partial", f"--out={out}")
  return out


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if config is not None:
    quant_section(config)  # the flags and the config's quant section, before the run is looked at
  workdir = _WORKDIR.value or (f"workdirs/{config.get('name', 'run')}" if config is not None else None)
  if workdir is None:
    raise ValueError("--workdir is required: give a run's directory")
  out = checked_out(_OUT.value, workdir)
  run = restore.load_run(workdir, config, check=quant_section)  # the recorded config's section, before any weight
  q = quant_section(run.config)
  meta = save_packed(
    out,
    run.params,
    run.rest,
    quant=q,
    config=run.config.to_dict(),
    tokenizer=run.tokenizer.record(),
    source={"workdir": workdir, "step": run.step},
  )
  print(
    json.dumps(
      {
        "scheme": q.scheme,
        "group_size": q.group_size,
        "scope": q.scope,
        "out": _OUT.value,
        "packed_params": len(meta["plan"]),
        "weight_bytes": meta["weight_bytes"],
        "unpacked_weight_bytes": meta["unpacked_weight_bytes"],
        "source_step": run.step,
      }
    ),
    flush=True,
  )


if __name__ == "__main__":
  flags.mark_flags_as_required(["out", "scheme"])
  sys.argv = restore.config_file_argv(
    sys.argv, os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded_config.py")
  )
  cli.run(main)
