"""Which of GLM-5's weights a quantization scheme touches, and how: the `quant` config section, the plan it makes
for a model's parameters, and the two ways to apply a plan (glm_jax/quant/ has the quantizer they share).

  plan = quant_plan(params, config.quant)       {parameter path: Rule}; checked: scheme, scope, group sizes
  fake_quant_params(params, plan)               training (QAT): each planned weight fake-quantized, straight-through
  pack_params(params, plan)                     serving (PTQ, or after QAT): each planned weight a PackedWeight

Schemes (`quant.scheme`):
  none      nothing quantized
  int4      INT4 weight-only in groups of `quant.group_size` (128) along the input: GLM-5's QAT (report 2.4.3, slime's
            public recipe), by default on the routed experts only
  int4_row  INT4 weight-only, one scale per output channel (per row of the [out, in] torch weight): GLM-130B's
            INT4, by default on every matmul weight of the attention and the feed-forward layers
  w8a8      int8 weights (per output channel) times int8 activations (per token), integer dots: attention, dense and
            shared-expert MLPs and routed experts
  w4a8      the Ascend deployment's mix: W8A8 for the attention and the dense MLPs, int4 weights (per output
            channel) times int8 activations for the MoE experts, routed and shared
Never quantized, whatever the scope: embeddings, norms, biases, the router and its bias, the indexer's fp32
weights_proj (these are not matmul weights of the table below or are computed in fp32 by design); the indexer's
wq_b / wk, the MTP's eh_proj and the LM head are quantized only when a scope names them. kv_b_proj is
weight-only under w8a8 / w4a8: the decode path absorbs it into the query and the output (mla.py), where no
activation of its input exists to quantize.

Scopes (`quant.scope`, empty for the scheme's default): a comma-separated list of the groups
  routed_experts  shared_experts  dense_mlp  attention  indexer  mtp_proj  lm_head
or "re:<regex>" matched (re.search) against parameter paths such as "moe_layers/mlp/gate_proj".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import ml_collections

from glm_jax.quant.packed import PackedWeight, fake_quant_weight, pack_weight
from glm_jax.tree_paths import path_names, path_str

SCHEMES = ("none", "int4", "int4_row", "w8a8", "w4a8")
GROUPS = ("routed_experts", "shared_experts", "dense_mlp", "attention", "indexer", "mtp_proj", "lm_head")
DEFAULT_SCOPE = {
  "int4": ("routed_experts",),
  "int4_row": ("routed_experts", "shared_experts", "dense_mlp", "attention"),
  "w8a8": ("routed_experts", "shared_experts", "dense_mlp", "attention"),
  "w4a8": ("routed_experts", "shared_experts", "dense_mlp", "attention"),
}
WEIGHT_ONLY = ("int4", "int4_row")

# The matmul weights: (contracted axes, free axes) at the end of the parameter (glm_jax/quant/packed.py's layout).
_ATTENTION = {
  "q_a_proj": (1, 1),
  "q_b_proj": (1, 2),
  "kv_a_proj_with_mqa": (1, 1),
  "kv_b_proj": (1, 2),
  "o_proj": (2, 1),
}
_MLP = {"gate_proj": (1, 1), "up_proj": (1, 1), "down_proj": (1, 1)}
_INDEXER = {"wq_b": (1, 2), "wk": (1, 1)}


def default_quant_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.scheme = "none"
  c.group_size = 128  # int4's group along a weight's input; 0 = one scale per output channel
  c.scope = ""  # "" = the scheme's default scope; groups "routed_experts,attention" or "re:<regex on paths>"
  return c


@dataclasses.dataclass(frozen=True)
class Rule:
  bits: int
  group_size: int | None
  act_bits: int | None
  contracted_axes: int
  free_axes: int


def weight_group(names: tuple, all_paths: set[tuple]) -> tuple[str, tuple[int, int]] | None:
  """(group, layout) of a matmul weight named by its path, or None for anything else."""
  last = names[-1]
  parent = names[-2] if len(names) > 1 else None
  if last == "lm_head":
    return "lm_head", (1, 1)
  if last == "eh_proj":
    return "mtp_proj", (1, 1)
  if parent == "indexer" and last in _INDEXER:
    return "indexer", _INDEXER[last]
  if parent == "self_attn" and last in _ATTENTION:
    return "attention", _ATTENTION[last]
  if last in _MLP:
    if parent == "shared_experts":
      return "shared_experts", _MLP[last]
    if parent == "mlp":
      routed = names[:-1] + ("router",) in all_paths
      return ("routed_experts" if routed else "dense_mlp"), _MLP[last]
  return None


def _scheme_rule(scheme: str, group: str, last: str, group_size: int | None, layout: tuple[int, int]) -> Rule:
  if scheme == "int4":
    return Rule(4, group_size, None, *layout)
  if scheme == "int4_row":
    return Rule(4, None, None, *layout)
  act = None if last == "kv_b_proj" else 8
  bits = 4 if scheme == "w4a8" and group in ("routed_experts", "shared_experts") else 8
  return Rule(bits, None, act, *layout)


def check_quant_config(q: ml_collections.ConfigDict) -> None:
  """The section's own values (before any model exists): scheme, group size, scope spelling."""
  if q.scheme not in SCHEMES:
    raise ValueError(f"quant.scheme={q.scheme!r} is invalid; one of {list(SCHEMES)}")
  if not isinstance(q.group_size, int) or isinstance(q.group_size, bool) or q.group_size < 0:
    raise ValueError(
      f"quant.group_size={q.group_size!r} is invalid; a positive integer, or 0 for one scale per output channel"
    )
  if q.scope.startswith("re:"):
    try:
      re.compile(q.scope[3:])
    except re.error as e:
      raise ValueError(f"quant.scope={q.scope!r}: not a regular expression ({e})") from None
  elif q.scope:
    unknown = [g for g in q.scope.split(",") if g.strip() not in GROUPS]
    if unknown:
      raise ValueError(
        f"quant.scope={q.scope!r}: unknown group(s) {unknown}; groups are {list(GROUPS)}, or "
        "\"re:<regex>\" on parameter paths"
      )


def quant_plan(params: Any, q: ml_collections.ConfigDict) -> dict[tuple, Rule]:
  """{path names: Rule} for the weights `q` quantizes in `params` (an nnx.State of Params or its pure dict, with
  arrays or ShapeDtypeStructs). Raises ValueError for a bad scheme or scope, a scope that matches no weight, or a
  group size that does not divide a planned weight's input, naming the parameter."""
  check_quant_config(q)
  if q.scheme == "none":
    return {}
  leaves = {path_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  paths = set(leaves)
  pattern = re.compile(q.scope[3:]) if q.scope.startswith("re:") else None
  groups = set(g.strip() for g in q.scope.split(",")) if q.scope and not pattern else set(DEFAULT_SCOPE[q.scheme])
  group_size = q.group_size or None
  plan, matched_other = {}, []
  for names, x in leaves.items():
    found = weight_group(names, paths)
    if pattern is not None:
      if not pattern.search(path_str(names)):
        continue
      if found is None:
        matched_other.append(path_str(names))
        continue
    elif found is None or found[0] not in groups:
      continue
    group, layout = found
    rule = _scheme_rule(q.scheme, group, names[-1], group_size, layout)
    _check_fits(names, x.shape, rule)
    plan[names] = rule
  if pattern is not None and matched_other:
    raise ValueError(
      f"quant.scope={q.scope!r} matches {matched_other}, which are not matmul weights (embeddings, "
      "norms, biases, the router and the indexer's weights_proj stay unquantized)"
    )
  if not plan:
    raise ValueError(
      f"quant.scope={q.scope or ','.join(groups)!r} matches no parameter of this model under scheme "
      f"{q.scheme!r}; its matmul weights are "
      f"{sorted(path_str(n) for n in paths if weight_group(n, paths))}"
    )
  return plan


def _check_fits(names: tuple, shape: tuple, rule: Rule) -> None:
  lead = len(shape) - rule.contracted_axes - rule.free_axes
  k = 1
  for d in shape[lead : lead + rule.contracted_axes]:
    k *= d
  if rule.group_size is not None and k % rule.group_size:
    raise ValueError(
      f"quant.group_size={rule.group_size} does not divide {path_str(names)}'s input of {k} "
      f"(shape {tuple(shape)}); use a divisor of {k}, or 0 for one scale per output channel"
    )
  if rule.bits == 4 and shape[-1] % 2:
    raise ValueError(f"{path_str(names)}: int4 codes go two to a byte along the last axis, of odd size {shape[-1]}")


def _apply(params: Any, plan: dict[tuple, Rule], fn) -> Any:
  def one(path, x):
    rule = plan.get(path_names(path))
    return x if rule is None else fn(x, rule)

  return jax.tree_util.tree_map_with_path(one, params)


def fake_quant_params(params: Any, plan: dict[tuple, Rule]) -> Any:
  """params with each planned weight fake-quantized (its packed values in the forward, the straight-through
  gradient in the backward). Only weight-only rules: activations are not fake-quantized in training."""

  def one(x, rule: Rule):
    if rule.act_bits is not None:
      raise ValueError(
        "quantization-aware training takes a weight-only scheme "
        f"({list(WEIGHT_ONLY)}); W8A8 / W4A8 are post-training schemes"
      )
    return fake_quant_weight(
      x, bits=rule.bits, group_size=rule.group_size, contracted_axes=rule.contracted_axes, free_axes=rule.free_axes
    )

  return _apply(params, plan, one)


def pack_params(params: Any, plan: dict[tuple, Rule]) -> Any:
  """params with each planned weight replaced by its PackedWeight."""
  return _apply(
    params,
    plan,
    lambda x, r: pack_weight(
      x,
      bits=r.bits,
      group_size=r.group_size,
      contracted_axes=r.contracted_axes,
      free_axes=r.free_axes,
      act_bits=r.act_bits,
    ),
  )


def weight_bytes(params: Any) -> int:
  """Bytes of the parameters as stored: packed weights' codes and scales, every other array as it is."""
  total = 0
  for x in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, PackedWeight)):
    total += x.nbytes if isinstance(x, PackedWeight) else x.size * x.dtype.itemsize
  return total
