"""DeepNorm as GLM-130B uses it (model.norm_style = "deepnorm"): Post-LN layers with a scaled residual, and a
Xavier-normal initialisation scaled down on the sublayers that write into the residual stream.

  x' = Norm(x);  h = Norm(alpha * x' + Attn(x'));  out = alpha * h + FFN(h)     (glm_jax/model/transformer.py)
  alpha = (2N)^(1/2),  beta = (2N)^(-1/2),  N = num_hidden_layers

so that, with the next layer's input norm, x_{l+1} = Norm(alpha x_l + f(x_l)) (the GLM-130B paper's form; the
final norm closes the last layer). Initialisation: every matrix of the attention and FFN sublayers is drawn from
Xavier normal, std = gain * sqrt(2 / (fan_in + fan_out)), gain beta on the FFN (dense MLP, routed and shared
experts: gate, up, down), on v_proj and on out_proj, gain 1 elsewhere. These are GLM-130B's constants;
DeepNet's own decoder-only ones differ (alpha = (2N)^(1/4), beta = (8N)^(-1/4)) and are not what GLM-130B ran.

Where GLM-5's MLA has no plain v_proj: the value comes from the normalized latent through W_UV (the value columns
of kv_b_proj), so W_UV is v_proj (fan_in kv_lora_rank, fan_out heads * v_head_dim); its key columns W_UK and the
down projections (q_a, q_b, kv_a) take gain 1; o_proj is out_proj (fan_in heads * v_head_dim). The norms are the
model's RMSNorm, not GLM-130B's LayerNorm. The embedding, the head, the router, the MTP projection and the
indexer keep the model's default initialisation (normal(0, initializer_range)): DeepNorm's analysis covers the
residual sublayers only. Stacked axes (layers, experts) are not fans: each matrix of a stack is drawn on its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.tree_paths import path_names

_STACK_AXES = ("layers", "experts")  # logical axis names that number matrices rather than index their entries
_FFN = ("gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def alpha(cfg: ModelConfig) -> float:
  """The residual scale (2N)^(1/2)."""
  return (2 * cfg.num_hidden_layers) ** 0.5


def beta(cfg: ModelConfig) -> float:
  """The initialisation gain (2N)^(-1/2) of the FFN, v_proj and out_proj."""
  return (2 * cfg.num_hidden_layers) ** -0.5


def xavier_std(fan_in: int, fan_out: int, gain: float) -> float:
  return gain * math.sqrt(2.0 / (fan_in + fan_out))


def init_rules(
  names: tuple[str, ...], axes: tuple[str | None, ...], shape: tuple[int, ...], cfg: ModelConfig
) -> list[tuple[slice, int, int, float]] | None:
  """How DeepNorm draws the parameter at path `names` (its logical `axes`, its `shape`): a list of (a slice of its
  last axis, fan_in, fan_out, gain), one entry per logical matrix in it; None when it keeps the default
  initialisation."""
  if names[-1] not in _FFN + _ATTENTION or "indexer" in names or names[0] not in ("dense_layers", "moe_layers", "mtp"):
    return None
  stack = 0
  while stack < len(axes) and axes[stack] in _STACK_AXES:
    stack += 1
  dims = shape[stack:]
  if names[-1] in _FFN:
    return [(slice(None), dims[0], math.prod(dims[1:]), beta(cfg))]
  if names[-1] == "o_proj":  # [H, v_head_dim, D]
    return [(slice(None), dims[0] * dims[1], dims[2], beta(cfg))]
  if names[-1] == "kv_b_proj":  # [R, H, nope + v]: W_UK then W_UV
    r, h, dn = dims[0], dims[1], cfg.qk_nope_head_dim
    return [(slice(0, dn), r, h * dn, 1.0), (slice(dn, None), r, h * cfg.v_head_dim, beta(cfg))]
  return [(slice(None), dims[0], math.prod(dims[1:]), 1.0)]  # q_a, q_b, kv_a: [in, out...]


def init_weights(model: nnx.Module, rngs: nnx.Rngs) -> None:
  """Redraws, in place, the attention and FFN matrices of a freshly built model as `init_rules` says."""
  cfg = model.cfg
  state = nnx.state(model, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    names = path_names(path)
    value = var[...]
    rules = init_rules(names, tuple(var.get_metadata().get("out_sharding") or ()), value.shape, cfg)
    if rules is None:
      continue
    new = value
    for cols, fan_in, fan_out, gain in rules:
      part = new[..., cols]
      draw = jax.random.normal(rngs.params(), part.shape, jnp.float32) * xavier_std(fan_in, fan_out, gain)
      new = new.at[..., cols].set(draw.astype(value.dtype))
    var[...] = new
  nnx.update(model, state)
