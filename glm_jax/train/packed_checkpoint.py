"""A post-training quantized model on disk, for the sampler and the RL rollouts.

  <out>/weights/     Orbax: {"params": ..., "rest": ...}; a packed weight is stored as {"codes", "scales"}
                     (int4 codes two to a byte), every other array as it was trained
  <out>/packed.json  what the weights are: the quant section that made them and its plan (each packed
                     parameter's bits, group size, activation bits and layout), the model config (every field),
                     the run's config and tokenizer record, the source checkpoint, the weight bytes

`save_packed` writes everything under <out>.partial and renames it to <out> at the end, so a directory named
<out> is always complete (the .partial carries glm_jax/paths.py's marker: only such a one is removed, by the next
save); it refuses an <out> that exists. `load_packed` rebuilds the model the caller names (it
must be the recorded one), re-derives the plan from the recorded quant section and refuses a file whose plan
differs, or a caller that asks for another scheme, naming both. A distillation teacher's init_from may name one
(glm_jax/rl/warm_start.py): the teacher then scores in its quantized form.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from glm_jax import paths
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model.quantization import Rule, pack_params, quant_plan, weight_bytes
from glm_jax.quant import packed as packed_format
from glm_jax.quant.packed import PackedWeight
from glm_jax.train.checkpoint import config_differences
from glm_jax.tree_paths import path_str

FORMAT = packed_format.META_FORMAT
META = packed_format.META_FILE


@dataclasses.dataclass
class PackedModel:
  model_cfg: ModelConfig
  graphdef: Any
  params: Any  # nnx.State of Params, the planned ones holding PackedWeights
  rest: Any
  tokenizer: dict | None
  meta: dict


def _storage(pure: Any) -> Any:
  """A pure dict with each PackedWeight as {"codes", "scales"} (plain arrays for Orbax)."""
  return jax.tree.map(
    lambda x: {"codes": x.codes, "scales": x.scales} if isinstance(x, PackedWeight) else x,
    pure,
    is_leaf=lambda x: isinstance(x, PackedWeight),
  )


def _plan_json(plan: Mapping[tuple, Rule]) -> dict[str, dict]:
  return {path_str(k): dataclasses.asdict(v) for k, v in sorted(plan.items(), key=lambda kv: path_str(kv[0]))}


def save_packed(
  out_dir: str,
  params: Any,
  rest: Any,
  *,
  quant: ml_collections.ConfigDict,
  config: Mapping[str, Any],
  tokenizer: Mapping[str, Any] | None,
  source: Mapping[str, Any],
) -> dict:
  """Packs `params` (an nnx.State of Params) under `quant` and writes <out_dir>; returns the metadata written."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir):
    raise FileExistsError(f"--out={out_dir} exists; a packed model is written to a new directory")
  partial = out_dir + ".partial"
  paths.clear_partial(partial, f"--out={out_dir}")  # a save that died before its rename; anything else is refused
  plan = quant_plan(params, quant)
  packed = pack_params(params, plan)
  paths.make_partial(partial)
  tree = {"params": _storage(nnx.to_pure_dict(packed)), "rest": nnx.to_pure_dict(rest)}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(partial, "weights"), tree)
  model = ModelConfig.from_dict(config["model"]).to_dict()  # every field, defaults included
  meta = {
    "format": FORMAT,
    "quant": quant.to_dict(),
    "plan": _plan_json(plan),
    "model": json.loads(json.dumps(model)),
    "config": json.loads(json.dumps(dict(config))),
    "tokenizer": dict(tokenizer) if tokenizer else None,
    "source": dict(source),
    "weight_bytes": weight_bytes(packed),
    "unpacked_weight_bytes": weight_bytes(params),
  }
  with open(os.path.join(partial, META), "w") as f:
    json.dump(meta, f, indent=1)
  os.remove(os.path.join(partial, paths.PARTIAL_MARKER))
  os.rename(partial, out_dir)
  return meta


def read_meta(out_dir: str, *, need_tokenizer: bool = False) -> dict:
  """<out_dir>/packed.json, checked field by field (glm_jax/quant/packed.py's read_meta: each error names the file
  and the field); need_tokenizer: the caller decodes text, so the record must hold the tokenizer."""
  return packed_format.read_meta(out_dir, need_tokenizer=need_tokenizer)


def is_packed(directory: str) -> bool:
  """Whether `directory` holds a packed model (launch/quantize.py's output)."""
  return os.path.isfile(os.path.join(os.path.abspath(directory), META))


def load_packed(
  out_dir: str, model_cfg: ModelConfig, *, scheme: str | None = None, need_tokenizer: bool = False
) -> PackedModel:
  """The packed model of <out_dir> on this process's first device, built as `model_cfg` (which must be the recorded
  model, up to the fields that do not change its parameters: the DSA switch, the attention implementation, ...);
  `scheme`, when given, must be the recorded one (a packed model is not re-quantized on load)."""
  meta = read_meta(out_dir, need_tokenizer=need_tokenizer)
  recorded = ml_collections.ConfigDict(meta["quant"])
  if scheme is not None and scheme != recorded.scheme:
    raise ValueError(
      f"{out_dir} holds a model packed with scheme {recorded.scheme!r}, not {scheme!r}; pack the "
      f"run again with --scheme={scheme} or load it as {recorded.scheme!r}"
    )
  diffs = config_differences(
    {"model": meta["model"]}, {"model": model_cfg.to_dict()}, sections=("model",), train_fields=()
  )
  if diffs:
    raise ValueError(f"{out_dir} was packed from another model: " + "; ".join(diffs))
  model = nnx.eval_shape(lambda: GlmMoeDsa(model_cfg, nnx.Rngs(0)))
  graphdef, abstract_params, abstract_rest = nnx.split(model, nnx.Param, ...)
  plan = quant_plan(abstract_params, recorded)
  if _plan_json(plan) != meta["plan"]:
    raise ValueError(
      f"{out_dir}: its recorded plan does not match what scheme {recorded.scheme!r} makes of this "
      "model (written by another version?); pack it again"
    )
  abstract_packed = jax.eval_shape(lambda p: pack_params(p, plan), abstract_params)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = {"params": _storage(nnx.to_pure_dict(abstract_packed)), "rest": nnx.to_pure_dict(abstract_rest)}
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), target)
  with ocp.StandardCheckpointer() as ckptr:
    saved = ckptr.restore(os.path.join(os.path.abspath(out_dir), "weights"), target)

  def rebuild(abstract, stored):
    if isinstance(abstract, PackedWeight):
      return dataclasses.replace(abstract, codes=stored["codes"], scales=stored["scales"])
    return stored

  pure = jax.tree.map(
    rebuild, nnx.to_pure_dict(abstract_packed), saved["params"], is_leaf=lambda x: isinstance(x, PackedWeight)
  )
  params = abstract_packed
  nnx.replace_by_pure_dict(params, pure)
  rest = abstract_rest
  nnx.replace_by_pure_dict(rest, saved["rest"])
  return PackedModel(model_cfg, graphdef, params, rest, meta["tokenizer"], meta)
