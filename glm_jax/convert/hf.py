"""Hugging Face interop for GlmMoeDsaForCausalLM checkpoints (config.json + safetensors).

  cfg, model = hf.load(path)        # single file or sharded with model.safetensors.index.json
  hf.save(cfg, model, path)         # the same format back, loadable by transformers

`write` is the one export (config.json, safetensors shards, the index, the fp32 score-correction bias, in a temporary
directory renamed when complete): `save` feeds it a model in memory, glm_jax/convert/stream.py's `orbax_to_hf` a
checkpoint's arrays slice by slice. Reading is tensor by tensor: routed experts per expert
(`mlp.experts.{e}.gate_proj.weight`, the release's and save_pretrained's layout, which `save` writes) or fused
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]); MTP layers at
`model.layers.{num_hidden_layers + k}` in DeepSeek-V3's layout (transformers ignores them; a checkpoint without them
loads with fresh MTP layers and a warning); FP8 (block-wise e4m3 with `weight_scale_inv`, glm_jax/convert/fp8.py)
dequantized as read. A HF directory is untrusted: `open_checkpoint` checks config.json's field types and counts
against the safetensors headers before anything is built, the index's entries must be plain names of regular files
in the directory, and safetensors_io validates every header; errors name the file, the field and the value. `load`
holds the whole model in host memory (tests, small models); the release goes through glm_jax/convert/stream.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax import paths
from glm_jax.convert import fp8, safetensors_io
from glm_jax.convert.safetensors_io import SafetensorsFile
from glm_jax.model.config import ModelConfig
from glm_jax.model.transformer import GlmMoeDsa, MTPLayer

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MODEL_TYPE = "glm_moe_dsa"  # config.json's model_type for GLM-5 (transformers' GlmMoeDsaConfig)
# Tensor dtypes read as numbers; anything else (ints, bools, fp8 without its scales) would load as wrong values.
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# Tensors a HF checkpoint may carry that hold nothing of the model (rope caches).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One HF tensor and where it lives in our state: the leaf's path and its index along stacked axes
  (layer, expert). kind: "plain" (same layout), "linear" (HF [out, in] <-> ours [in..., out...] with
  `n_in` leading input dims), "fused_gate_up" / "fused_down" (transformers' fused expert tensors)."""

  hf_name: str
  path: tuple[str | int, ...]
  index: tuple[int, ...] = ()
  kind: str = "plain"
  n_in: int = 1
  mtp: int | None = None  # which MTP layer the tensor belongs to, if any


def _layer_specs(
  cfg: ModelConfig,
  prefix: str,
  path: tuple,
  index: tuple,
  moe: bool,
  mtp: int | None,
  fused_experts: bool,
  indexer: bool = True,
) -> Iterator[TensorSpec]:
  def spec(hf_suffix, sub, kind="plain", n_in=1, expert=()):
    return TensorSpec(f"{prefix}.{hf_suffix}", path + sub, index + expert, kind, n_in, mtp)

  yield spec("input_layernorm.weight", ("input_layernorm", "weight"))
  yield spec("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"))
  for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
    yield spec(f"self_attn.{name}.weight", ("self_attn", name), "linear")
  yield spec("self_attn.o_proj.weight", ("self_attn", "o_proj"), "linear", n_in=2)  # ours [H, dv, D]
  for name in ("q_a_layernorm", "kv_a_layernorm"):
    yield spec(f"self_attn.{name}.weight", ("self_attn", name, "weight"))
  if indexer:  # an IndexShare "shared" layer has none in HF; its (unused) slice of our stack stays as it is
    for name in ("wq_b", "wk", "weights_proj"):
      yield spec(f"self_attn.indexer.{name}.weight", ("self_attn", "indexer", name), "linear")
    for name in ("weight", "bias"):
      yield spec(f"self_attn.indexer.k_norm.{name}", ("self_attn", "indexer", "k_norm", name))
  if not moe:
    for name in ("gate_proj", "up_proj", "down_proj"):
      yield spec(f"mlp.{name}.weight", ("mlp", name), "linear")
    return
  yield spec("mlp.gate.weight", ("mlp", "router"), "linear")
  yield spec("mlp.gate.e_score_correction_bias", ("mlp", "e_score_correction_bias"))
  if cfg.n_shared_experts:
    for name in ("gate_proj", "up_proj", "down_proj"):
      yield spec(f"mlp.shared_experts.{name}.weight", ("mlp", "shared_experts", name), "linear")
  if fused_experts:
    yield spec("mlp.experts.gate_up_proj", ("mlp",), "fused_gate_up")
    yield spec("mlp.experts.down_proj", ("mlp", "down_proj"), "fused_down")
    return
  for e in range(cfg.n_routed_experts):
    for name in ("gate_proj", "up_proj", "down_proj"):
      yield spec(f"mlp.experts.{e}.{name}.weight", ("mlp", name), "linear", expert=(e,))


def tensor_specs(cfg: ModelConfig, *, fused_experts: bool = False) -> list[TensorSpec]:
  """Every tensor of a GlmMoeDsaForCausalLM checkpoint for `cfg`, MTP layers included."""
  specs = [
    TensorSpec("model.embed_tokens.weight", ("embed_tokens", "embedding")),
    TensorSpec("model.norm.weight", ("norm", "weight")),
  ]
  if not cfg.tie_word_embeddings:
    specs.append(TensorSpec("lm_head.weight", ("lm_head",), kind="linear"))
  for i, shared in enumerate(cfg.shared_indexer_layers):
    moe = i >= cfg.num_dense_layers
    stack, j = ("moe_layers", i - cfg.num_dense_layers) if moe else ("dense_layers", i)
    specs += _layer_specs(cfg, f"model.layers.{i}", (stack,), (j,), moe, None, fused_experts, not shared)
  for k in range(cfg.num_nextn_predict_layers):
    i = cfg.num_hidden_layers + k
    p, base = f"model.layers.{i}", ("mtp", k)
    specs += [
      TensorSpec(f"{p}.enorm.weight", base + ("enorm", "weight"), mtp=k),
      TensorSpec(f"{p}.hnorm.weight", base + ("hnorm", "weight"), mtp=k),
      TensorSpec(f"{p}.eh_proj.weight", base + ("eh_proj",), kind="linear", mtp=k),
      TensorSpec(f"{p}.shared_head.norm.weight", base + ("shared_head_norm", "weight"), mtp=k),
    ]
    specs += _layer_specs(cfg, p, base + ("layer",), (), i >= cfg.first_k_dense_replace, k, fused_experts)
  return specs


def shared_copies(cfg: ModelConfig) -> dict[str, str]:
  """MTP tensors that the DeepSeek-V3 layout stores as copies of shared ones: {copy: original}."""
  head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
  out = {}
  for k in range(cfg.num_nextn_predict_layers):
    p = f"model.layers.{cfg.num_hidden_layers + k}"
    out[f"{p}.embed_tokens.weight"] = "model.embed_tokens.weight"
    out[f"{p}.shared_head.head.weight"] = head
  return out


def slice_shape(spec: TensorSpec, leaves: dict[tuple, jax.ShapeDtypeStruct]) -> tuple[int, ...]:
  if spec.kind == "fused_gate_up":
    return leaves[spec.path + ("gate_proj",)].shape[len(spec.index) :]
  return leaves[spec.path].shape[len(spec.index) :]


def hf_shape(spec: TensorSpec, ours: tuple[int, ...]) -> tuple[int, ...]:
  """The HF tensor's shape given the shape of our slice."""
  if spec.kind == "plain":
    return ours
  if spec.kind == "linear":
    return (math.prod(ours[spec.n_in :]), math.prod(ours[: spec.n_in]))
  if spec.kind == "fused_gate_up":  # ours [E, D, I] (gate and up alike) -> HF [E, 2I, D]
    return (ours[0], 2 * ours[2], ours[1])
  if spec.kind == "fused_down":  # ours [E, I, D] -> HF [E, D, I]
    return (ours[0], ours[2], ours[1])
  raise ValueError(f"unknown tensor kind {spec.kind!r}")


def to_ours(spec: TensorSpec, t: np.ndarray, ours: tuple[int, ...]) -> dict[tuple, np.ndarray]:
  """{leaf path: our slice} for one HF tensor."""
  if spec.kind == "plain":
    return {spec.path: t}
  if spec.kind == "linear":
    return {spec.path: t.T.reshape(ours)}
  if spec.kind == "fused_gate_up":
    i = ours[2]
    return {
      spec.path + ("gate_proj",): t[:, :i].transpose(0, 2, 1),
      spec.path + ("up_proj",): t[:, i:].transpose(0, 2, 1),
    }
  if spec.kind == "fused_down":
    return {spec.path: t.transpose(0, 2, 1)}
  raise ValueError(f"unknown tensor kind {spec.kind!r}")


def to_ours_paths(spec: TensorSpec) -> tuple[tuple, ...]:
  """The leaves one HF tensor writes (to_ours' keys)."""
  if spec.kind == "fused_gate_up":
    return (spec.path + ("gate_proj",), spec.path + ("up_proj",))
  return (spec.path,)


def to_hf(spec: TensorSpec, ours: np.ndarray) -> np.ndarray:
  """The HF tensor for one of our slices (plain and linear kinds; `save` writes per-expert tensors)."""
  if spec.kind == "plain":
    return ours
  if spec.kind == "linear":
    return ours.reshape(math.prod(ours.shape[: spec.n_in]), -1).T
  raise ValueError(f"to_hf: kind {spec.kind!r} is read-only")


def _read_json(path: str) -> Any:
  """A metadata file's JSON (paths.read_json: a regular file, bounded, strict; errors name it)."""
  return paths.read_json(path)


def _short(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _weight_map(path: str, index_path: str) -> dict[str, str]:
  """{tensor: shard path} of an index file, checked: {"weight_map": {tensor name: shard}} (and an optional
  "metadata" object), each shard a plain file name (no directory part, so never outside `path`) of a regular file
  in `path` (a symlink to one is followed: the Hugging Face cache links a snapshot's files to its blobs)."""
  index = _read_json(index_path)
  if not isinstance(index, dict):
    raise ValueError(f"{index_path}: expected a JSON object, found {type(index).__name__}")
  if not isinstance(index.get("metadata", {}), dict):
    raise ValueError(f"{index_path}: metadata={_short(index['metadata'])} is invalid; an object")
  weight_map = index.get("weight_map")
  if not isinstance(weight_map, dict):
    found = "no 'weight_map'" if weight_map is None else f"weight_map={_short(weight_map)} is invalid"
    raise ValueError(f"{index_path}: {found}; expected an object {{tensor name: shard file name}}")
  out, kinds = {}, {}
  for name, fname in weight_map.items():
    field = f"weight_map[{name!r}]={_short(fname)}"
    if not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname or "\\" in fname or "\0" in fname:
      raise ValueError(
        f"{index_path}: {field} is invalid; the name of a shard file in {path} (a string, with no directory part)"
      )
    if fname not in kinds:
      try:
        kinds[fname] = paths.kind_of(os.stat(os.path.join(path, fname)).st_mode)
      except FileNotFoundError:
        kinds[fname] = None
    if kinds[fname] is None:
      raise FileNotFoundError(f"{index_path} names shard {fname}, which is not in {path}")
    if kinds[fname] != "a regular file":
      raise ValueError(f"{index_path}: {field} is {kinds[fname]}, not a regular file")
    out[name] = os.path.join(path, fname)
  return out


class Reader:
  """Tensor-by-tensor access to a single or sharded safetensors checkpoint. Every file's header is read on
  construction, so a truncated or corrupt file is named before any tensor is; the index is checked
  (_weight_map). fp8_block: the (rows, cols) block of an FP8 checkpoint's scales (fp8.block_size); its e4m3
  weights are dequantized on reading. `sources`: the files read (the index, then the shards)."""

  def __init__(self, path: str, fp8_block: tuple[int, int] | None = None):
    index_path, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
    self.fp8_block = fp8_block
    if os.path.lexists(index_path):
      file_of = _weight_map(path, index_path)
      self.sources = [index_path, *sorted(set(file_of.values()))]
    elif os.path.lexists(single):
      file_of, self.sources = None, [single]
    else:
      raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._files = {fname: SafetensorsFile(fname) for fname in self.sources if fname != index_path}
    if file_of is None:
      file_of = {name: single for name in self._files[single].names()}
    for name, fname in file_of.items():
      if name not in self._files[fname]:
        raise ValueError(f"{index_path} places tensor {name} in {os.path.basename(fname)}, which does not hold it")
    self.file_of = file_of

  def names(self) -> set[str]:
    """The tensors, without the FP8 scales (read with their weights)."""
    return {
      n for n in self.file_of if not (n.endswith(fp8.SCALE_SUFFIX) and n.removesuffix(fp8.SCALE_SUFFIX) in self.file_of)
    }

  def shape(self, name: str) -> tuple[int, ...]:
    return self._files[self.file_of[name]].shape(name)

  def offset(self, name: str) -> tuple[str, int]:
    """(file, byte offset) of a tensor: the order that reads the checkpoint front to back."""
    fname = self.file_of[name]
    return fname, self._files[fname].offset(name)

  def nbytes(self, name: str) -> int:
    """The tensor's stored bytes (an FP8 weight's scales included)."""
    f = self._files[self.file_of[name]]
    n = math.prod(f.shape(name)) * safetensors_io.DTYPES[f.dtype(name)].itemsize
    scale = name + fp8.SCALE_SUFFIX
    return n + (self.nbytes(scale) if f.dtype(name) in fp8.FP8_DTYPES and scale in self.file_of else 0)

  def get(self, name: str, dtype) -> np.ndarray:
    """The tensor as a new array of `dtype`; an FP8 weight is dequantized with its block scales."""
    fname = self.file_of[name]
    f = self._files[fname]
    found = f.dtype(name)
    if found in fp8.FP8_DTYPES:
      scale = name + fp8.SCALE_SUFFIX
      if self.fp8_block is None:
        raise ValueError(
          f"{fname}: tensor {name} has dtype {found}, but config.json has no quantization_config "
          "(an FP8 checkpoint's config names its block size)"
        )
      if scale not in self.file_of:
        raise ValueError(f"{fname}: tensor {name} has dtype {found} but no {scale} (its block scales)")
      scale_file = self._files[self.file_of[scale]]
      if scale_file.dtype(scale) not in _FLOAT_DTYPES:
        raise ValueError(
          f"{self.file_of[scale]}: tensor {scale} has dtype {scale_file.dtype(scale)}; expected one "
          f"of {', '.join(_FLOAT_DTYPES)}"
        )
      return fp8.dequantize(f.read(name), scale_file.read(scale), self.fp8_block, name).astype(dtype, copy=False)
    if found not in _FLOAT_DTYPES:
      raise ValueError(f"{fname}: tensor {name} has dtype {found}; expected one of {', '.join(_FLOAT_DTYPES)}")
    return np.array(f.read(name), dtype)

  def close(self):
    self._files.clear()


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_strs(v: Any) -> bool:
  return isinstance(v, list) and all(isinstance(x, str) for x in v)


# What each config.json field read here may hold (ModelConfig's fields by their annotation, then the HF fields that
# from_hf_dict translates): (test, what is valid).
_TYPES = {
  "int": (_is_int, "an integer"),
  "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
  "bool": (lambda v: isinstance(v, bool), "true or false"),
  "str": (lambda v: isinstance(v, str), "a string"),
  "int | None": (lambda v: v is None or _is_int(v), "an integer or null"),
  "tuple[str, ...] | None": (lambda v: v is None or isinstance(v, str) or _is_strs(v), "a list of strings or null"),
}
_HF_TYPES = {
  "eos_token_id": (
    lambda v: v is None or _is_int(v) or (isinstance(v, list) and v != [] and all(_is_int(x) for x in v)),
    "an integer, a non-empty list of integers, or null",
  ),
  "rope_parameters": (lambda v: v is None or isinstance(v, dict), "an object or null"),
  "mlp_layer_types": (lambda v: v is None or _is_strs(v), "a list of strings or null"),
  "index_topk_pattern": (lambda v: v is None or isinstance(v, str) or _is_strs(v), "a string of 'F' and 'S', or null"),
  "index_topk_freq": (_is_int, "an integer"),
  "index_skip_topk_offset": (_is_int, "an integer"),
}
_UNCHECKED_LAYERS = 10_000  # a directory without weights: its config is read (for its errors) up to this many layers
_LAYER_NAME = re.compile(r"model\.layers\.(\d{1,9})\.")
_EXPERT_NAME = re.compile(r"model\.layers\.\d{1,9}\.mlp\.experts\.(\d{1,9})\.")


def _check_types(hf_dict: dict, cfg_path: str) -> None:
  """Each field read from config.json holds a value of its type (an integer where a count is, ...), else
  ValueError naming the file, the field, its value and what is valid."""
  fields = {f.name: _TYPES[f.type] for f in dataclasses.fields(ModelConfig)}
  for key, value in hf_dict.items():
    test, valid = _HF_TYPES.get(key) or fields.get(key) or (None, "")
    if test is not None and not test(value):
      raise ValueError(f"{cfg_path}: {key}={_short(value)} is invalid; {valid}")
  rope = hf_dict.get("rope_parameters") or {}
  theta = rope.get("rope_theta", 1.0)
  if isinstance(theta, bool) or not isinstance(theta, (int, float)):
    raise ValueError(f"{cfg_path}: rope_parameters.rope_theta={_short(theta)} is invalid; a number")


def check_counts(hf_dict: dict, cfg_path: str, reader: Reader) -> None:
  """config.json's counts of layers, MTP layers and routed experts against the tensors the files' headers hold,
  before anything is built from them (ModelConfig's per-layer tuples, one spec a tensor, the abstract model): a
  count the files cannot back is a ValueError naming the field, its value and what the files hold. After it, what
  is built is bounded by the headers, not by the config's claims (every other size is a tensor's shape, compared
  with the header's by checked_specs before anything is allocated)."""
  defaults = ModelConfig.defaults()

  def count(key):
    return hf_dict.get(key, defaults[key])

  n, m = count("num_hidden_layers"), count("num_nextn_predict_layers")
  dense, experts_claimed = count("first_k_dense_replace"), count("n_routed_experts")
  layers, experts, fused = set(), set(), 0
  for name in reader.file_of:
    if hit := _LAYER_NAME.match(name):
      layers.add(int(hit.group(1)))
    if hit := _EXPERT_NAME.match(name):
      experts.add(int(hit.group(1)))
    elif name.endswith("mlp.experts.gate_up_proj") and reader.shape(name):
      fused = max(fused, reader.shape(name)[0])
  if n > len(layers):
    raise ValueError(
      f"{cfg_path}: num_hidden_layers={n}, but the safetensors files hold {len(layers)} layers "
      "(model.layers.<i>.*); every decoder layer must be there"
    )
  held = len([i for i in layers if n <= i < n + m])
  if m - held > n:  # a missing MTP layer is initialized: no more of them than the decoder layers the files hold
    raise ValueError(
      f"{cfg_path}: num_nextn_predict_layers={m}, but the safetensors files hold {held} MTP layers "
      f"(model.layers.{n}.* on); the {m - held} missing would be initialized, and at most num_hidden_layers={n} are"
    )
  if n + m > dense and experts_claimed > max(len(experts), fused):
    raise ValueError(
      f"{cfg_path}: n_routed_experts={experts_claimed}, but the safetensors files hold "
      f"{max(len(experts), fused)} routed experts (model.layers.<i>.mlp.experts.<e>.*)"
    )


@dataclasses.dataclass
class Checkpoint:
  """A HF directory open for reading (open_checkpoint): its config, the block of an FP8 checkpoint's scales, the
  tensors' reader, config.json as stored, and every file read."""

  path: str
  cfg: ModelConfig
  block: tuple[int, int] | None
  reader: Reader
  config_json: dict

  @property
  def files(self) -> list[str]:
    return [os.path.join(self.path, "config.json"), *self.reader.sources]


def open_checkpoint(path: str, **overrides: Any) -> Checkpoint:
  """A HF directory's config.json and safetensors headers, read and checked against each other before anything is
  built from the config (check_counts): a config.json that is not GLM-5's (model_type), quantized otherwise than
  block-wise FP8, with a field of the wrong type or with counts its files do not hold is refused by name, as is a
  corrupt file. `overrides` replace ModelConfig fields."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.lexists(cfg_path):
    raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
  hf_dict = _read_json(cfg_path)
  if not isinstance(hf_dict, dict):
    raise ValueError(f"{cfg_path}: expected a JSON object, found {type(hf_dict).__name__}")
  model_type = hf_dict.get("model_type")
  if model_type != MODEL_TYPE:
    found = "model_type is missing" if model_type is None else f"model_type={_short(model_type)}"
    raise ValueError(f"{cfg_path}: {found}; expected {MODEL_TYPE!r} (a GLM-5 checkpoint)")
  block = fp8.block_size(hf_dict.get("quantization_config"), cfg_path)
  fields = {k: v for k, v in hf_dict.items() if k != "quantization_config"}
  _check_types(fields, cfg_path)
  try:
    reader = Reader(path, block)
  except FileNotFoundError:
    # No weights to check the counts against: config.json's own errors still come first where finding them is cheap
    # (ModelConfig builds per-layer tuples).
    if fields.get("num_hidden_layers", 0) <= _UNCHECKED_LAYERS:
      _model_config(fields, cfg_path, overrides)
    raise
  check_counts(fields, cfg_path, reader)
  return Checkpoint(path, _model_config(fields, cfg_path, overrides), block, reader, hf_dict)


def _model_config(fields: dict, cfg_path: str, overrides: dict) -> ModelConfig:
  try:
    return ModelConfig.from_hf_dict(fields, **overrides)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{cfg_path}: {str(e).removeprefix('config.json: ')}") from e


def read_config(path: str, **overrides: Any) -> tuple[ModelConfig, tuple[int, int] | None]:
  """(ModelConfig, FP8 block or None) of a HF directory (open_checkpoint: config.json checked against the files'
  headers)."""
  source = open_checkpoint(path, **overrides)
  source.reader.close()
  return source.cfg, source.block


def load_config(path: str, **overrides: Any) -> ModelConfig:
  """The ModelConfig of a HF directory's config.json (see read_config)."""
  return read_config(path, **overrides)[0]


def checked_specs(
  path: str, cfg: ModelConfig, reader: Reader, seed: int = 0
) -> tuple[list[TensorSpec], dict[tuple, Any], dict[int, bool]]:
  """(the specs of the tensors present, the model's abstract leaves {path: variable}, {MTP layer: present}) for a
  HF directory, after checking its tensors against `cfg` without reading any: an unexpected, missing or wrongly
  shaped tensor raises ValueError naming it (with both shapes). MTP layers may be absent as a whole."""
  names = reader.names()
  fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
  specs = tensor_specs(cfg, fused_experts=fused)
  abstract = nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(seed))))
  leaves = {p: v for p, v in nnx.to_flat_state(abstract)}
  expected = {s.hf_name for s in specs} | set(shared_copies(cfg))
  unexpected = sorted(n for n in names - expected if not n.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    raise ValueError(
      f"{path}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
      f"for this config ({len(unexpected)} in all)"
    )
  mtp_present = {k: any(s.hf_name in names for s in specs if s.mtp == k) for k in range(cfg.num_nextn_predict_layers)}
  missing = [s for s in specs if s.hf_name not in names and (s.mtp is None or mtp_present[s.mtp])]
  if missing:
    s = missing[0]
    raise ValueError(
      f"{path}: missing tensor {s.hf_name} (expected shape "
      f"{list(hf_shape(s, slice_shape(s, leaves)))}); {len(missing)} missing in all"
    )
  present = [s for s in specs if s.hf_name in names]
  for s in present:
    want, found = hf_shape(s, slice_shape(s, leaves)), reader.shape(s.hf_name)
    if tuple(found) != tuple(want):
      raise ValueError(f"{path}: tensor {s.hf_name} has shape {list(found)}, expected {list(want)}")
  return present, leaves, mtp_present


def fresh_mtp_layer(cfg: ModelConfig, k: int, seed: int) -> MTPLayer:
  """MTP layer k as initialized when a checkpoint lacks it (transformers does not save MTP layers)."""
  return MTPLayer(cfg, cfg.num_hidden_layers + k, nnx.Rngs(seed + 1 + k))


def load(path: str, *, seed: int = 0, **overrides: Any) -> tuple[ModelConfig, GlmMoeDsa]:
  """Reads a HF GlmMoeDsaForCausalLM directory (BF16, FP32 or block-wise FP8). `overrides` replace ModelConfig
  fields (dtype, use_dsa, ...). A missing, unexpected or wrongly shaped tensor raises ValueError naming it with
  both shapes; a truncated or corrupt file, a tensor that cannot be read and a config.json that is not GLM-5's
  raise ValueError naming the file (and the tensor). Nothing in `path` is written."""
  source = open_checkpoint(path, **overrides)
  cfg, reader = source.cfg, source.reader
  try:
    specs, leaves, mtp_present = checked_specs(path, cfg, reader, seed)
    arrays = {p: np.zeros(v.shape, v.dtype) for p, v in leaves.items() if p[0] != "mtp" or mtp_present[p[1]]}
    for s in specs:
      ours = slice_shape(s, leaves)
      for leaf_path, value in to_ours(s, reader.get(s.hf_name, np.float32), ours).items():
        arrays[leaf_path][s.index] = value
  finally:
    reader.close()

  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(seed))))
  for p, v in leaves.items():
    if p in arrays:
      v.set_value(jnp.asarray(arrays[p], v.dtype))
  model = nnx.merge(graphdef, nnx.from_flat_state(list(leaves.items())))
  for k, present in mtp_present.items():
    if not present:
      log.warning(
        "%s: no MTP tensors for model.layers.%d; MTP layer %d is freshly initialized",
        path,
        cfg.num_hidden_layers + k,
        k,
      )
      model.mtp[k] = fresh_mtp_layer(cfg, k, seed)
  return cfg, model


def save(
  cfg: ModelConfig,
  model: GlmMoeDsa,
  path: str,
  *,
  max_shard_bytes: int = 5 * 2**30,
  dtype: str | None = None,
  overwrite: bool = False,
) -> dict[str, Any]:
  """Writes `model` as a HF checkpoint directory (`write`'s format). An existing non-empty `path` is replaced only
  with overwrite=True; a failure leaves it as it was."""
  cfg.to_hf_dict()  # refuses, before the model's values are read, a model glm_moe_dsa cannot express
  leaves = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model))}
  return write(
    cfg,
    path,
    leaves,
    lambda s: np.asarray(leaves[s.path][s.index] if s.index else leaves[s.path]),
    dtype=dtype,
    max_shard_bytes=max_shard_bytes,
    overwrite=overwrite,
    arg="path",
  )


def checked_out_dir(
  out_dir: str, overwrite: bool, arg: str = "--out_dir", sources: Sequence[tuple[str, str]] = ()
) -> str:
  """out_dir, absolute, once it is known that it may be written: apart from every input in `sources` ((how to name
  it, its path): out_dir may not be, contain or be inside one, paths.check_apart, a ValueError), empty or absent (or
  overwrite) with a writable parent (created if need be); else FileExistsError / PermissionError naming it as `arg`
  (a flag, or an argument of a function)."""
  out_dir = os.path.abspath(out_dir)
  paths.check_apart(arg, out_dir, sources)
  content = os.path.isdir(out_dir) and [n for n in os.listdir(out_dir) if n != paths.LOCK_NAME]  # the lock: ours
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or content) and not overwrite:
    how = "choose another or pass --overwrite" if arg.startswith("--") else "pass overwrite=True to replace it"
    raise FileExistsError(f"{arg}={out_dir} exists and is not empty; {how}")
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  if not os.access(parent, os.W_OK):
    raise PermissionError(f"{arg}={out_dir}: {parent} is not writable")
  return out_dir


def commit(tmp: str, out_dir: str) -> None:
  """Replaces out_dir by the complete tmp (the last step of a write: before it, out_dir is as it was). The lock of
  the writer holding out_dir (paths.LOCK_NAME) moves into the new one, so no other writer can take it meanwhile."""
  lock = os.path.join(out_dir, paths.LOCK_NAME)
  if os.path.isfile(lock):
    os.replace(lock, os.path.join(tmp, paths.LOCK_NAME))
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir) if os.path.isdir(out_dir) else os.remove(out_dir)
  os.replace(tmp, out_dir)


def write(
  cfg: ModelConfig,
  out_dir: str,
  leaves: Mapping[tuple, Any],
  tensor: Callable[[TensorSpec], np.ndarray],
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 5 * 2**30,
  overwrite: bool = False,
  progress: Callable[[str], None] | None = None,
  arg: str = "--out_dir",
  sources: Sequence[tuple[str, str]] = (),
  extra_files: Mapping[str, str] | None = None,
) -> dict[str, Any]:
  """The one HF export: config.json and safetensors (sharded, with model.safetensors.index.json, past
  max_shard_bytes), per-expert layout, MTP layers at model.layers.{num_hidden_layers + k}, in `dtype` (default:
  the model's param_dtype; the experts' score-correction bias stays float32). leaves: our parameters' shapes
  ({path: array or ShapeDtypeStruct}); tensor(spec): the spec's slice of our parameter, as float. Each tensor is
  asked for once, as its shard is written (safetensors_io.write), so memory holds one at a time. Written under a
  temporary name beside out_dir and renamed when complete: a failure leaves out_dir as it was. arg: how errors
  name out_dir; sources: the inputs it must stay apart from (checked_out_dir); extra_files: {name: text} written
  beside them (the tokenizer.json)."""
  cfg.to_hf_dict()  # refuses, before anything is written, a model glm_moe_dsa cannot express
  out_dtype = np.dtype(dtype or cfg.param_dtype)
  out_dir = checked_out_dir(out_dir, overwrite, arg, sources)
  specs = {s.hf_name: s for s in tensor_specs(cfg)}
  copies = shared_copies(cfg)
  entries = []  # (name, dtype, shape), in file order
  for name, s in list(specs.items()) + [(c, specs[o]) for c, o in copies.items()]:
    keep = np.dtype(np.float32) if name.endswith("e_score_correction_bias") else out_dtype
    entries.append((name, keep, hf_shape(s, slice_shape(s, leaves))))

  def produce(name):
    s = specs[copies.get(name, name)]
    return to_hf(s, np.asarray(tensor(s), np.float32))

  shards = shard_groups(entries, lambda e: int(np.prod(e[2])) * e[1].itemsize, max_shard_bytes)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.exporting-", dir=os.path.dirname(out_dir))
  try:
    weight_map, total, done = {}, 0, 0
    for i, shard in enumerate(shards):
      fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      total += safetensors_io.write(os.path.join(tmp, fname), shard, produce, metadata={"format": "pt"})
      weight_map.update({name: fname for name, _, _ in shard})
      done += len(shard)
      progress and progress(f"{fname}: {done}/{len(entries)} tensors")
    if len(shards) > 1:
      with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg.to_hf_dict(), f, indent=2)
    for name, text in (extra_files or {}).items():
      with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
        f.write(text)
    commit(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {"out_dir": out_dir, "tensors": len(entries), "files": len(shards), "bytes_written": total}


def shard_groups(items: list, nbytes: Callable[[Any], int], max_shard_bytes: int) -> list[list]:
  """`items` in order, cut into files of at most max_shard_bytes (a larger item gets a file of its own)."""
  groups, size = [[]], 0
  for item in items:
    n = nbytes(item)
    if groups[-1] and size + n > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(item)
    size += n
  return groups
