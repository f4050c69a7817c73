"""Weights handed to serving engines by directory, as SGLang's update_weights_from_disk takes them: what an RL trainer
writes for its rollout engines and what each of those engine processes loads at start and on POST /update_weights
(glm_jax/rl/rollout_server.py).

  <dir>/meta.json     {"version": ..., "model": the ModelConfig's fields, "tokenizer": {"kind": "char"} or a
                      Tokenizer record (glm_jax/data/tokenizer.py)}
  <dir>/weights.npz   every array of (params, rest), named by its path ("params/moe_layers/mlp/gate_proj", ...)

A directory is written whole under a temporary name and renamed into place, so a reader sees all of it or none.
`load_weights` checks the arrays against the model the meta names (every path, shape and dtype) and says which differ.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np
from flax import nnx

from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.tree_paths import path_names, path_str

META, ARRAYS = "meta.json", "weights.npz"


def _flat(kind: str, state) -> dict[str, np.ndarray]:
  return {f"{kind}/{path_str(path_names(p))}": np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def save_weights(directory: str, params, rest, model_cfg: ModelConfig, *, version: Any, tokenizer: dict) -> str:
  """Writes (params, rest) of a model of `model_cfg` to `directory` (replacing it), tagged `version`; `tokenizer`:
  {"kind": "char"} or a Tokenizer record."""
  tmp = f"{directory}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  host = jax.device_get((params, rest))
  np.savez(os.path.join(tmp, ARRAYS), **_flat("params", host[0]), **_flat("rest", host[1]))
  with open(os.path.join(tmp, META), "w") as f:
    json.dump({"version": version, "model": model_cfg.to_dict(), "tokenizer": tokenizer}, f)
  shutil.rmtree(directory, ignore_errors=True)
  os.replace(tmp, directory)
  return directory


def read_meta(directory: str) -> dict:
  path = os.path.join(directory, META)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"weights_path={directory!r}: no {META} there (glm_jax/serving/weights.py's layout)")
  with open(path) as f:
    return json.load(f)


def load_weights(directory: str, model_cfg: ModelConfig | None = None):
  """(meta, graphdef, params, rest) from `directory`, built as the model its meta names; with `model_cfg`, that
  model must be the same one (an engine keeps its model). Raises ValueError naming what does not match."""
  meta = read_meta(directory)
  cfg = ModelConfig.from_dict(meta["model"])
  if model_cfg is not None and cfg != model_cfg:
    diff = {k: (v, getattr(cfg, k)) for k, v in model_cfg.to_dict().items() if getattr(cfg, k) != v}
    raise ValueError(f"weights_path={directory!r} holds another model than the engine serves: {diff}")
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param, ...)
  with np.load(os.path.join(directory, ARRAYS)) as arrays:
    trees = []
    for kind, state in (("params", params), ("rest", rest)):
      flat = []
      for p, v in nnx.to_flat_state(state):
        name = f"{kind}/{path_str(path_names(p))}"
        if name not in arrays.files:
          raise ValueError(f"weights_path={directory!r}: no array {name!r}")
        a = arrays[name]
        want = v.get_value()
        if a.shape != want.shape or a.dtype != want.dtype:
          got, model = f"{a.dtype}{list(a.shape)}", f"{want.dtype}{list(want.shape)}"
          raise ValueError(f"weights_path={directory!r}: {name} is {got}, the model's {model}")
        flat.append((p, v.replace(value=jax.numpy.asarray(a))))
      trees.append(nnx.from_flat_state(flat))
  return meta, graphdef, trees[0], trees[1]
