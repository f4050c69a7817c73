r"""Peak resident memory and wall time of launch/convert.py against hf.load, on a random GLM-5-shaped checkpoint.

  bash scripts/with_env.sh python experiments/bench_convert.py --workdir=/tmp/bench_convert --gb=2.2

Writes a random BF16 HF checkpoint in the release's layout (per-expert tensors, the MTP layer, sharded at 1 GiB)
of at least --gb GiB, one tensor at a time, then runs, each in its own process so each peak is its own:
  convert   launch/convert.py --hf_dir --out_dir (HF -> Orbax, streaming)
  export    launch/convert.py --to_hf (that Orbax checkpoint -> HF, streaming)
  hf.load   today's loader, which builds the whole model in host memory
and prints one JSON line per run (peak RSS, seconds, MB/s of checkpoint read) and a table against the size of
the largest tensor. The baseline line is a process that only imports jax and the converter (its RSS is the floor).
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from absl import app, flags
from flax import nnx

from glm_jax.convert import hf, safetensors_io
from glm_jax.model import GlmMoeDsa, ModelConfig

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_convert", "Scratch directory (replaced).")
_GB = flags.DEFINE_float("gb", 2.2, "At least this many GiB of BF16 weights.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def model_config(n_experts: int) -> ModelConfig:
  return ModelConfig(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=4096,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=512,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=n_experts,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    index_topk=256,
    index_n_heads=8,
    index_head_dim=64,
    param_dtype="bfloat16",
    dtype="bfloat16",
  )


def tensor_list(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
  leaves = {p: v for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))))}
  specs = hf.tensor_specs(cfg)
  out = [(s.hf_name, hf.hf_shape(s, hf.slice_shape(s, leaves))) for s in specs]
  shapes = dict(out)
  return out + [(copy, shapes[original]) for copy, original in hf.shared_copies(cfg).items()]


def write_checkpoint(path: str, cfg: ModelConfig) -> dict:
  os.makedirs(path)
  tensors = tensor_list(cfg)
  rng = np.random.default_rng(0)
  bf16 = np.dtype(safetensors_io.DTYPES["BF16"])
  shards = hf.shard_groups([(name, bf16, shape) for name, shape in tensors], lambda e: math.prod(e[2]) * 2, GiB)
  shape_of = dict(tensors)

  def produce(name):
    value = rng.standard_normal(shape_of[name], np.float32) * 0.02
    return np.ones(shape_of[name], np.float32) if name.endswith("norm.weight") else value

  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors_io.write(os.path.join(path, fname), shard, produce, metadata={"format": "pt"})
    weight_map.update({n: fname for n, _, _ in shard})
  with open(os.path.join(path, hf.INDEX_FILE), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f)
  sizes = [math.prod(s) * 2 for _, s in tensors]
  return {"tensors": len(tensors), "bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "files": len(shards)}


LOAD = """
import json, sys, time
from glm_jax.convert import hf, stream
t0 = time.perf_counter()
if sys.argv[1] != "baseline":
  cfg, model = hf.load(sys.argv[1])
print(json.dumps({"seconds": round(time.perf_counter() - t0, 2), "peak_rss_bytes": stream.rss_peak_bytes()}))
"""


def run(args: list[str]) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  out["wall_seconds"] = round(time.perf_counter() - t0, 2)
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  root = _WORKDIR.value
  shutil.rmtree(root, ignore_errors=True)
  n_experts = 8
  while sum(math.prod(s) * 2 for _, s in tensor_list(model_config(n_experts))) < _GB.value * GiB:
    n_experts += 8
  cfg = model_config(n_experts)
  t0 = time.perf_counter()
  info = write_checkpoint(os.path.join(root, "hf"), cfg)
  info.update(n_routed_experts=n_experts, write_seconds=round(time.perf_counter() - t0, 1))
  print(json.dumps({"checkpoint": info}), flush=True)
  results = {
    "baseline (imports only)": run(["-c", LOAD, "baseline"]),
    "convert (HF -> Orbax)": run(["launch/convert.py", f"--hf_dir={root}/hf", f"--out_dir={root}/orbax"]),
    "export (Orbax -> HF)": run(
      ["launch/convert.py", "--to_hf", f"--workdir={root}/orbax", f"--out_dir={root}/back", "--max_shard_gb=1"]
    ),
    "hf.load (today)": run(["-c", LOAD, f"{root}/hf"]),
  }
  print(
    f"checkpoint: {info['bytes'] / GiB:.2f} GiB BF16 in {info['files']} files, {info['tensors']} tensors, "
    f"largest {info['largest_tensor_bytes'] / 2**20:.0f} MiB"
  )
  print(f"{'run':26s} {'peak RSS GiB':>12s} {'x largest':>10s} {'seconds':>8s} {'MB/s read':>10s}")
  for name, r in results.items():
    rss, secs = r["peak_rss_bytes"], r["seconds"]
    rate = info["bytes"] / 1e6 / secs if "baseline" not in name else float("nan")
    print(f"{name:26s} {rss / GiB:12.2f} {rss / info['largest_tensor_bytes']:10.1f} {secs:8.1f} {rate:10.1f}")
    print(json.dumps({"run": name, **r}), flush=True)


if __name__ == "__main__":
  app.run(main)
