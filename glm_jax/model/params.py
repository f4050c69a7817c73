"""Parameter counts from abstract shapes (nothing is allocated)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.transformer import GlmMoeDsa
from glm_jax.tree_paths import path_names


def abstract_model(cfg: ModelConfig) -> GlmMoeDsa:
  """The model with ShapeDtypeStructs in place of arrays."""
  return nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))


def param_counts(model_config: ModelConfig | Mapping[str, Any]) -> dict[str, int]:
  """{"total": parameters of the main model (embedding and head included, MTP excluded),
  "active": those one token uses (num_experts_per_tok of n_routed_experts in each MoE layer),
  "mtp": the MTP layers' own parameters (they share the embedding and head)}. The expert-bias buffers
  are not parameters and are not counted."""
  cfg = model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_dict(model_config)
  params = nnx.state(abstract_model(cfg), nnx.Param)
  total = mtp = routed = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = path_names(path)
    n = math.prod(leaf.shape)
    if names[0] == "mtp":
      mtp += n
      continue
    total += n
    if names[0] == "moe_layers" and names[2] in ("gate_proj", "up_proj", "down_proj") and names[1] == "mlp":
      routed += n
  inactive = routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
  return {"total": total, "active": total - inactive, "mtp": mtp}
