"""Hugging Face <-> Orbax checkpoints without holding the model, and a checkpoint's weights read onto a mesh.

  stream.hf_to_orbax(hf_dir, out_dir, config)    # HF (BF16/FP32 or FP8) -> <out_dir>/checkpoints/0 (launch/convert.py)
  stream.orbax_to_hf(workdir, out_dir)           # a run's (or a converted) checkpoint -> HF safetensors

The converted checkpoint is a workdir holding one step (0) whose "state" item has only the weights (`params` and
`rest`, no optimizer state) and whose "config" item records the run config it was laid out for: `train.init_from`,
`rl.init_from` and `launch/sample.py --workdir` take it as they take a training run's. It is Orbax's own format
(zarr3 arrays under the item and the `_METADATA` tree that Orbax reads), written array slice by array slice with
tensorstore: each HF tensor is read (FP8 dequantized), laid out as ours, cast and written to its slice of the
stacked array, then dropped, so peak memory is a few times the largest tensor, whatever the model. An array is
stored in one shard file per HF tensor (a layer's, or a layer and expert's, slice) and inside it in chunks of one
device's slice under the config's mesh, so a process reading its devices' slices reads only their chunks.
Everything is written under a temporary name and renamed when complete: a failure leaves no checkpoint.

glm_jax/sharding/checkpoint_arrays.py reads it (and any training checkpoint) onto a mesh, slice by slice.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np
import tensorstore as ts
import tokenizers
from flax import nnx

from glm_jax import paths
from glm_jax.convert import hf
from glm_jax.data.tokenizer import Tokenizer
from glm_jax.model.config import ModelConfig
from glm_jax.model.transformer import GlmMoeDsa
from glm_jax.sharding.checkpoint_arrays import METADATA, StateArrays, leaf_kind, orbax_name, read_slice, tree_keys
from glm_jax.sharding.mesh import MESH_AXES, checked_spec, entry_axes, logical_to_spec, mesh_shape
from glm_jax.tree_paths import path_str

STEP = 0  # the converted checkpoint's one step
TOKENIZER_FILE = "tokenizer.json"  # the release's tokenizer, carried with its weights both ways
MAX_TOKENIZER_BYTES = 256 << 20
# HF config.json fields that do not change the model (compared when a converted checkpoint meets a run config).
_BOOKKEEPING = ("dtype", "initializer_range", "architectures")


def rss_peak_bytes() -> int:
  """This process's peak resident memory so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------- HF -> Orbax


def _same_model(run: ModelConfig, found: ModelConfig, hf_dir: str) -> None:
  """Raises ValueError naming each field where the run config's model differs from the HF checkpoint's (fields
  that only say how it is stored or computed, such as dtypes, may differ)."""
  a, b = run.to_hf_dict(), found.to_hf_dict()
  diffs = [
    f"{k}: config {a.get(k)!r}, checkpoint {b.get(k)!r}"
    for k in sorted(set(a) | set(b))
    if k not in _BOOKKEEPING and a.get(k) != b.get(k)
  ]
  if diffs:
    raise ValueError(f"--config's model is not the one in {hf_dir}/config.json: " + "; ".join(diffs))


def layout_mesh(mesh_cfg: Mapping[str, int] | None, devices: int | None) -> dict[str, int] | None:
  """{axis: size} of the mesh the checkpoint is chunked for; a -1 axis takes `devices` (without it, 1)."""
  if mesh_cfg is None:
    return None
  sizes = {a: mesh_cfg.get(a, 1) for a in MESH_AXES}
  if devices is None:
    sizes = {a: 1 if s == -1 else s for a, s in sizes.items()}
    devices = int(np.prod(list(sizes.values())))
  return dict(zip(MESH_AXES, mesh_shape(sizes, devices)))


def _device_slice(path: tuple, var, sizes: dict[str, int] | None) -> tuple[int, ...]:
  """One device's slice of a parameter under the mesh `sizes` (the whole array without one); a mesh that does
  not divide a sharded dimension is an error naming the parameter, the dimension and the axes."""
  axes, shape = (var.get_metadata().get("out_sharding") if sizes else None), tuple(var.shape)
  if axes is None:
    return shape
  mesh = _SizesMesh(sizes)
  spec = checked_spec(logical_to_spec(axes), shape, mesh, f"--config's mesh {sizes}: parameter {path_str(path)}")
  return tuple(d // math.prod(sizes[a] for a in entry_axes(e)) for d, e in zip(shape, spec))


class _SizesMesh:
  """What checked_spec reads of a mesh (its axis sizes), for a mesh of devices that are not here."""

  def __init__(self, sizes: dict[str, int]):
    self.shape = sizes


def _zarr3_spec(path: str, shape: tuple[int, ...], dtype, shard: tuple[int, ...], chunk: tuple[int, ...]) -> dict:
  codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 1}}]
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path},
    "create": True,
    "store_data_equal_to_fill_value": True,  # Orbax reads a missing chunk as an error, not as zeros
    "metadata": {
      "shape": list(shape),
      "data_type": np.dtype(dtype).name,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
      "codecs": [
        {
          "name": "sharding_indexed",
          "configuration": {
            "chunk_shape": list(chunk),
            "codecs": codecs,
            "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
          },
        }
      ],
    },
  }


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f)


def release_tokenizer(hf_dir: str, vocab_size: int) -> Tokenizer | None:
  """The release's tokenizer.json in hf_dir as our Tokenizer (roles it lacks added, as for any given file), or None
  when there is none. The file is untrusted: a regular file of at most MAX_TOKENIZER_BYTES that tokenizers reads,
  whose ids fit the model's vocab_size; else ValueError naming it."""
  path = os.path.join(hf_dir, TOKENIZER_FILE)
  if not os.path.lexists(path):
    return None
  with paths.open_regular(path) as f:
    raw = f.read(MAX_TOKENIZER_BYTES + 1)
  if len(raw) > MAX_TOKENIZER_BYTES:
    raise ValueError(f"{path}: over {MAX_TOKENIZER_BYTES >> 20} MiB; a tokenizer.json is a few MiB (GLM-5's: 20)")
  try:
    backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
  except Exception as e:  # tokenizers raises a bare Exception for a malformed file; bad UTF-8 is a ValueError
    raise ValueError(f"{path}: not a valid tokenizer.json ({str(e)[:200]})") from e
  in_file = backend.get_vocab_size(with_added_tokens=True)
  tokenizer = Tokenizer(backend, path)
  if tokenizer.vocab_size > vocab_size:
    added = f", with the {tokenizer.vocab_size - in_file} special tokens added that it lacks" * (
      tokenizer.vocab_size > in_file
    )
    raise ValueError(
      f"{path}: needs {tokenizer.vocab_size} ids{added}, but config.json's vocab_size={vocab_size}; the tokenizer "
      "is not this model's"
    )
  return tokenizer


def _write_step_files(step_dir: str, tree_metadata: dict, config_item: dict, tokenizer: dict | None = None) -> None:
  """The files beside the arrays that make step_dir an Orbax step of a CheckpointManager: the state item's
  `_METADATA` tree, the config item and, given a record, the tokenizer item (JsonCheckpointHandler's files), and
  the step's `_CHECKPOINT_METADATA`."""
  state_dir, config_dir = os.path.join(step_dir, "state"), os.path.join(step_dir, "config")
  _write_json(
    os.path.join(state_dir, METADATA),
    {
      "tree_metadata": tree_metadata,
      "use_ocdbt": False,
      "use_zarr3": True,
      "store_array_data_equal_to_fill_value": True,
      "custom_metadata": None,
    },
  )
  os.makedirs(config_dir, exist_ok=True)
  _write_json(os.path.join(config_dir, "metadata"), config_item)
  handlers = "orbax.checkpoint._src.handlers"
  items = {
    "config": f"{handlers}.json_checkpoint_handler.JsonCheckpointHandler",
    "state": f"{handlers}.standard_checkpoint_handler.StandardCheckpointHandler",
  }
  if tokenizer is not None:
    os.makedirs(os.path.join(step_dir, "tokenizer"))
    _write_json(os.path.join(step_dir, "tokenizer", "metadata"), tokenizer)
    items["tokenizer"] = items["config"]
  now = time.time_ns()
  _write_json(
    os.path.join(step_dir, "_CHECKPOINT_METADATA"),
    {
      "item_handlers": items,
      "metrics": {},
      "performance_metrics": {},
      "init_timestamp_nsecs": now,
      "commit_timestamp_nsecs": now,
      "custom_metadata": {},
    },
  )


def hf_to_orbax(
  hf_dir: str,
  out_dir: str,
  config: ml_collections.ConfigDict | None = None,
  *,
  devices: int | None = None,
  overwrite: bool = False,
  seed: int = 0,
  progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Converts a HF GlmMoeDsaForCausalLM directory (BF16/FP32, or FP8 with block scales; single file or sharded)
  into a weights-only Orbax checkpoint at <out_dir>/checkpoints/0, one tensor at a time.

  config: the run config the checkpoint is for. Its model must be the checkpoint's (compared field by field;
  dtypes may differ: arrays are stored in its model.param_dtype) and its mesh (a -1 axis taking `devices`) sets the
  chunking. Without it, the model is config.json's, stored in its dtype, and each array is one chunk a tensor.
  MTP layers the checkpoint lacks are initialized (hf.load does the same). The release's tokenizer.json, when
  hf_dir has one, is recorded with the step (release_tokenizer), as training records its tokenizer: restore_run and
  launch/sample.py decode with it, and orbax_to_hf writes it back. Returns a report: tensors, bytes read and
  written, the largest tensor's bytes, the tokenizer recorded (its path or None), seconds."""
  t0 = time.perf_counter()
  source = hf.open_checkpoint(hf_dir)  # config.json checked against the files' headers before anything is built
  found, block, reader = source.cfg, source.block, source.reader
  if config is not None:
    cfg = ModelConfig.from_dict(config.model)
    _same_model(cfg, found, hf_dir)
    config_item, sizes = config.to_dict(), layout_mesh(config.get("mesh"), devices)
  else:  # stored as the checkpoint stores them (config.json's dtype), not in ModelConfig's default float32
    stored = source.config_json.get("dtype") or source.config_json.get("torch_dtype") or found.param_dtype
    cfg = found.replace(param_dtype=stored if stored in ("bfloat16", "float16", "float32") else found.param_dtype)
    config_item, sizes = {"model": cfg.to_dict()}, None
  config_item = json.loads(json.dumps(config_item))
  config_item["converted_from"] = {"hf_dir": os.path.abspath(hf_dir), "fp8_block": block}
  tokenizer = release_tokenizer(hf_dir, found.vocab_size)
  read = [*source.files, *([tokenizer.name] if tokenizer else [])]
  out_dir = hf.checked_out_dir(out_dir, overwrite, sources=paths.sources("--hf_dir", hf_dir, read))
  specs, leaves, mtp_present = hf.checked_specs(hf_dir, cfg, reader, seed)
  kind_of = {p: leaf_kind(v) for p, v in leaves.items()}
  stacked = {}  # leaf -> how many leading (layer, expert) dims one HF tensor indexes
  for s in specs:
    for p in hf.to_ours_paths(s):
      stacked[p] = len(s.index)

  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.converting-", dir=os.path.dirname(out_dir))
  try:
    step_dir = os.path.join(tmp, "checkpoints", str(STEP))
    state_dir = os.path.join(step_dir, "state")
    os.makedirs(state_dir)
    stores, covered, tree_metadata = {}, {}, {}
    for p, v in leaves.items():
      n = stacked.get(p, 0)
      shard = (1,) * n + tuple(v.shape[n:])
      chunk = tuple(min(a, b) for a, b in zip(shard, _device_slice(p, v, sizes)))
      name = orbax_name(kind_of[p], p)
      stores[p] = ts.open(_zarr3_spec(os.path.join(state_dir, name), tuple(v.shape), v.dtype, shard, chunk)).result()
      covered[p] = np.zeros(v.shape[:n], bool)
      keys = tree_keys(kind_of[p], p)
      tree_metadata[str(keys)] = {
        "key_metadata": [{"key": k, "key_type": 2} for k in keys],
        "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(shard)},
      }

    def put(p, index, value):
      stores[p][index].write(np.asarray(value, leaves[p].dtype)).result()
      covered[p][index] = True

    bytes_read = largest = 0
    for i, s in enumerate(sorted(specs, key=lambda s: reader.offset(s.hf_name))):
      nbytes = reader.nbytes(s.hf_name)
      bytes_read, largest = bytes_read + nbytes, max(largest, nbytes)
      value = reader.get(s.hf_name, np.float32)
      for p, part in hf.to_ours(s, value, hf.slice_shape(s, leaves)).items():
        put(p, s.index, part)
      del value
      if progress and (i + 1) % 100 == 0:
        progress(f"{i + 1}/{len(specs)} tensors, {bytes_read / 2**30:.2f} GiB read")
    for k, present in mtp_present.items():
      if not present:  # transformers does not save MTP layers
        progress and progress(f"no MTP tensors for model.layers.{cfg.num_hidden_layers + k}: initialized")
        for p, v in nnx.to_flat_state(nnx.state(hf.fresh_mtp_layer(cfg, k, seed))):
          put(("mtp", k, *p), (), v.get_value())
    for p, done in covered.items():  # slices no HF tensor holds: the unused indexers of shared-indexer layers
      for index in zip(*np.nonzero(~done)) if done.ndim else ([()] if not done else []):
        put(p, tuple(int(i) for i in index), np.zeros(leaves[p].shape[len(index) :], np.float32))
    _write_step_files(step_dir, tree_metadata, config_item, tokenizer.record() if tokenizer else None)
    hf.commit(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    reader.close()
  written = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in leaves.values())
  return {
    "hf_dir": os.path.abspath(hf_dir),
    "out_dir": out_dir,
    "fp8_block": block,
    "tensors": len(specs),
    "bytes_read": bytes_read,
    "bytes_written": written,
    "largest_tensor_bytes": largest,
    "mesh": sizes,
    "tokenizer": tokenizer.name if tokenizer else None,
    "seconds": round(time.perf_counter() - t0, 2),
  }


# ------------------------------------------------------------------------------------------------- Orbax -> HF


def _latest_step_dir(workdir: str, step: int | None) -> tuple[str, int]:
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  found = os.listdir(directory) if os.path.isdir(directory) else []
  steps = sorted(int(d) for d in found if d.isascii() and d.isdigit() and len(d) < 19)
  if not steps:
    raise FileNotFoundError(f"--workdir={workdir}: no checkpoint in {directory}")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(f"--step={step}: {directory} has steps {steps}")
  return os.path.join(directory, str(step)), step


def saved_model_config(step_dir: str) -> ModelConfig:
  """The model config recorded with a checkpoint step (its config item: a JSON object with a "model" object of
  ModelConfig fields); anything else is a ValueError naming the file and what is wrong."""
  path = os.path.join(step_dir, "config", "metadata")
  try:
    item = paths.read_json(path)
  except OSError as e:
    raise ValueError(f"{path}: no readable model config ({e})") from e
  model = item.get("model") if isinstance(item, dict) else None
  if not isinstance(model, dict):
    raise ValueError(f"{path}: no readable model config (expected a JSON object with a 'model' object)")
  try:
    return ModelConfig.from_dict(model)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{path}: {e}") from e


_MTP_KEY = re.compile(r"\('params', 'mtp', '(\d{1,9})'")


def _check_mtp_layers(cfg: ModelConfig, arrays: StateArrays, step_dir: str) -> None:
  """The recorded MTP depth against the MTP layers the state holds, before a module is built for each."""
  held = {int(m.group(1)) for key in arrays.keys if (m := _MTP_KEY.match(key))}
  if cfg.num_nextn_predict_layers > len(held):
    raise ValueError(
      f"{os.path.join(step_dir, 'config', 'metadata')}: model.num_nextn_predict_layers="
      f"{cfg.num_nextn_predict_layers}, but {os.path.join(step_dir, 'state')} holds {len(held)} MTP layers"
    )


def _recorded_tokenizer_json(step_dir: str) -> str | None:
  """The tokenizer JSON the step records (a training run's tokenizer, or a converted release's), or None."""
  path = os.path.join(step_dir, "tokenizer", "metadata")
  if not os.path.lexists(path):
    return None
  record = paths.read_json(path)
  if not isinstance(record, dict) or not isinstance(record.get("json"), str):
    raise ValueError(f"{path}: expected a tokenizer record, an object with the tokenizer's JSON under 'json'")
  return record["json"]


def orbax_to_hf(
  workdir: str,
  out_dir: str,
  *,
  step: int | None = None,
  dtype: str | None = None,
  max_shard_bytes: int = 5 * 2**30,
  overwrite: bool = False,
  progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Writes a checkpoint's weights (a training run's or a converted one; its latest step by default) as a HF
  GlmMoeDsaForCausalLM directory, as hf.write writes one (in `dtype`, default the model's param_dtype, in shards of
  at most max_shard_bytes), with the step's recorded tokenizer as tokenizer.json when it records one. Each tensor is
  read as its slice of the stored array and written straight into its shard, so memory holds one tensor at a
  time."""
  t0 = time.perf_counter()
  step_dir, step = _latest_step_dir(workdir, step)
  sources = paths.sources("--workdir", workdir)
  hf.checked_out_dir(out_dir, overwrite, sources=sources)
  cfg = saved_model_config(step_dir)
  state_dir = os.path.join(step_dir, "state")
  paths.read_json(os.path.join(state_dir, METADATA))  # a regular file of JSON, before StateArrays reads it
  arrays = StateArrays(state_dir)
  _check_mtp_layers(cfg, arrays, step_dir)
  tokenizer = _recorded_tokenizer_json(step_dir)
  leaves = {p: v for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))))}
  kind_of = {p: leaf_kind(v) for p, v in leaves.items()}
  opened: dict[tuple, ts.TensorStore] = {}

  def stored(p):
    if p not in opened:
      if not arrays.has(kind_of[p], p):
        raise ValueError(f"{step_dir}: no array at {path_str(p)} for this model")
      opened[p] = arrays.open(kind_of[p], p)
      if tuple(opened[p].shape) != tuple(leaves[p].shape):
        raise ValueError(
          f"{step_dir}: {path_str(p)} has shape {list(opened[p].shape)}, the model expects {list(leaves[p].shape)}"
        )
    return opened[p]

  for p in leaves:  # the recorded model's sizes against the arrays' (stacked layers, experts) before hf.write's
    stored(p)  # one spec a tensor is built from them
  cfg.to_hf_dict()  # refuses, before any weight is read, a model glm_moe_dsa cannot express
  report = hf.write(
    cfg,
    out_dir,
    leaves,
    lambda s: read_slice(stored(s.path), s.index, np.float32),
    dtype=dtype,
    max_shard_bytes=max_shard_bytes,
    overwrite=overwrite,
    progress=progress,
    sources=sources,
    extra_files={TOKENIZER_FILE: tokenizer} if tokenizer is not None else {},
  )
  return {"workdir": os.path.abspath(workdir), "step": step, **report, "seconds": round(time.perf_counter() - t0, 2)}
