r"""Converts between Hugging Face checkpoints (zai-org's releases, BF16 or FP8) and this codebase's Orbax ones,
one tensor at a time, so host memory stays a few times the largest tensor whatever the model's size.

  bash scripts/with_env.sh python launch/convert.py --hf_dir=/data/GLM-5 --out_dir=/ckpt/glm5 \
      --config=configs/glm5_744b.py
  bash scripts/with_env.sh python launch/train.py --config=configs/glm5_744b.py --config.train.init_from=/ckpt/glm5 ...
  bash scripts/with_env.sh python launch/sample.py --workdir=/ckpt/tiny --prompt="In the beginning"
  bash scripts/with_env.sh python launch/convert.py --to_hf --workdir=workdirs/glm5_tiny --out_dir=/export/glm5_tiny

HF -> Orbax (glm_jax/convert/stream.py): --out_dir becomes a workdir with one weights-only step (0), the weights
laid out for --config's model and mesh (a -1 mesh axis takes --devices; each array is chunked by one device's
slice, so each host of the pod reads only its own). train.init_from, rl.init_from and launch/sample.py --workdir
load it, each process reading only its devices' slices. Without --config the model is config.json's and the
arrays are unchunked. FP8 checkpoints (block-wise e4m3 with weight_scale_inv) are dequantized to the config's
param_dtype. MTP layers missing from the checkpoint (transformers does not save them) are initialized. The
release's tokenizer.json, when there is one, is recorded in the step as a training run records its tokenizer.

Orbax -> HF (--to_hf): the latest step of --workdir (a training run's or a converted one; --step for another) as
config.json and safetensors shards (--max_shard_gb, per-expert layout, MTP layers included) in --dtype, and the
step's recorded tokenizer as tokenizer.json.

Both write under a temporary name and rename at the end: a failure leaves no checkpoint. --out_dir must be apart
from what is read (--hf_dir and every file read through it, or --workdir): not it, not a directory above it, not
inside it, so that --overwrite, which replaces --out_dir whole, can never delete an input. The conversion holds
--out_dir's lock (glm_jax/train/lifecycle.py): a training run or another conversion on it refuses, and so does this
one while they run. The HF directory is
untrusted: config.json's counts are checked against the safetensors headers before anything is built from them,
and the headers and the index are validated (glm_jax/convert/hf.py open_checkpoint). Prints one JSON line:
tensors, bytes, the largest tensor, seconds, peak resident memory.
"""

from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli, strict_json
from glm_jax.convert import stream
from glm_jax.train import lifecycle

_HF_DIR = flags.DEFINE_string("hf_dir", None, "A Hugging Face GLM-5 directory (config.json + safetensors) to read.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to write (must not exist or be empty, unless --overwrite).")
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "The run config the checkpoint is for (its model must be the checkpoint's; its mesh chunks the arrays).",
  lock_config=True,
)
_DEVICES = flags.DEFINE_integer("devices", None, "Devices of the target slice, for a -1 axis of --config's mesh.")
_TO_HF = flags.DEFINE_bool("to_hf", False, "Orbax -> HF: write --workdir's checkpoint as a HF directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "With --to_hf: the run (or converted) directory to read.")
_STEP = flags.DEFINE_integer("step", None, "With --to_hf: the step to export (default: the latest).")
_DTYPE = flags.DEFINE_string("dtype", None, "With --to_hf: the tensors' dtype (default: the model's param_dtype).")
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "With --to_hf: the largest safetensors file, in GiB.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out_dir (only once the new one is complete).")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if _OUT_DIR.value is None:
    raise ValueError("--out_dir is required")
  progress = lambda message: logging.warning("%s", message)  # noqa: E731 - shown at the default verbosity
  with lifecycle.workdir_lock(_OUT_DIR.value, "conversion"):  # no other run writes --out_dir meanwhile
    report = _convert(progress)
  report["peak_rss_bytes"] = stream.rss_peak_bytes()
  print(strict_json.dumps(report), flush=True)


def _convert(progress) -> dict:
  if _TO_HF.value:
    if _WORKDIR.value is None or _HF_DIR.value is not None:
      raise ValueError("--to_hf reads --workdir (not --hf_dir) and writes --out_dir")
    if _MAX_SHARD_GB.value <= 0:
      raise ValueError(f"--max_shard_gb={_MAX_SHARD_GB.value} is invalid; a positive size in GiB")
    report = stream.orbax_to_hf(
      _WORKDIR.value,
      _OUT_DIR.value,
      step=_STEP.value,
      dtype=_DTYPE.value,
      max_shard_bytes=int(_MAX_SHARD_GB.value * 2**30),
      overwrite=_OVERWRITE.value,
      progress=progress,
    )
  else:
    if _HF_DIR.value is None:
      raise ValueError("--hf_dir is required (or --to_hf with --workdir)")
    if _DEVICES.value is not None and _DEVICES.value < 1:
      raise ValueError(f"--devices={_DEVICES.value} is invalid; a positive number of devices")
    report = stream.hf_to_orbax(
      _HF_DIR.value,
      _OUT_DIR.value,
      _CONFIG.value,
      devices=_DEVICES.value,
      overwrite=_OVERWRITE.value,
      progress=progress,
    )
  return report


if __name__ == "__main__":
  cli.run(main)
