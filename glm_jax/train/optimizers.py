"""Optimizers for pretraining: AdamW, or Muon for the hidden matrices with GLM-5's "Muon Split".

GLM-5 (G5 appendix A, as GLM-4.5) trains with Muon: momentum 0.95 (Nesterov), 5 Newton-Schulz steps, the
orthogonalized update rescaled so its RMS matches AdamW's (0.2, Moonlight), and W_UQ, W_UK, W_UV
orthogonalized per head. Each parameter gets one of three labels (`leaf_plan`):

  muon    hidden matrices: attention projections (the indexer's too), dense MLP, shared and routed experts,
          MTP eh_proj. Leading stacked axes (layers, experts) and, with muon_split, heads are batch axes:
          every 2-D matrix is orthogonalized on its own.
  adamw   the embedding, lm_head, the router and every 1-D leaf (norm weights, the indexer's k_norm bias);
          everything when name == "adamw".
  frozen  leaves `trainable` rules out: the update is exactly (negative) zero and no state is kept.

  O = NS5(m^)                       m^ = Nesterov momentum of the gradient, NS5 = 5 quintic Newton-Schulz steps
  u = -lr_t (rms sqrt(max(fan_in, fan_out)) O + wd W)          (optax.contrib consistent_rms; Moonlight, 2502.16982)
An exactly orthogonal fan_in x fan_out matrix has RMS 1/sqrt(max(fan_in, fan_out)), so u's RMS would be
lr_t * muon_update_rms. The quintic (3.4445, -4.7750, 2.0315) does not converge to 1 (its singular values land
in about [0.68, 1.14] for well-conditioned matrices), so RMS(u) = lr_t * muon_update_rms * (quadratic mean of
O's singular values) ~ 0.8-0.95 x lr_t * muon_update_rms.

Weight decay (decoupled, lr_t * wd * W, as optax and PyTorch): every matrix (lm_head and router included),
never the embedding (a row moves only when its token occurs, so decay would shrink rare tokens) nor 1-D leaves.
Muon's pieces are optax.contrib's (scale_by_muon, scale_by_shape); not its `muon` alias, whose Adam half takes
Nesterov and eps from the Muon settings and which has no frozen label. What optax cannot express is splitting
kv_b_proj's last axis into W_UK and W_UV: `_split_heads` cuts the tree before Muon and concatenates after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from optax.contrib import MuonDimensionNumbers as Dims
from optax.contrib._muon import scale_by_shape  # consistent_rms; optax 0.2.8 does not re-export it

Names = tuple[Any, ...]  # a leaf's path as plain keys, e.g. ("moe_layers", "self_attn", "kv_b_proj")

NAMES = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant")
STACKED = ("dense_layers", "moe_layers")  # top-level subtrees whose leaves carry a leading "layers" axis
ADAMW_MATRICES = ("embedding", "lm_head", "router")  # matrices AdamW keeps under Muon
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")  # [E, in, out] under an MoE "mlp"


def default_optimizer_config() -> ml_collections.ConfigDict:
  """Every field `make_optimizer` reads. GLM-5 publishes the optimizer, momentum, NS steps, update RMS, split
  and the LR range (2e-4 -> 4e-5); warmup/decay lengths, betas and weight decay are not published."""
  c = ml_collections.ConfigDict()
  c.name = "muon"  # "adamw" | "muon"
  c.lr = 2e-4  # peak learning rate, shared by the Muon and AdamW groups (the RMS matching makes that sane)
  c.lr_init = 0.0  # learning rate at step 0; warmup goes linearly from here to lr
  c.lr_end = 4e-5  # after decay_steps of decay (ignored by "constant")
  c.warmup_steps = 2000
  c.decay_steps = 100_000  # steps of decay after the warmup; then lr_end for ever
  c.schedule = "cosine"  # "cosine" | "linear" | "constant" (after the warmup)
  c.b1 = 0.9  # AdamW
  c.b2 = 0.95
  c.eps = 1e-8
  c.weight_decay = 0.1  # decoupled, multiplied by the learning rate; mask in the module docstring
  c.muon_momentum = 0.95
  c.muon_nesterov = True
  c.muon_ns_steps = 5
  c.muon_ns_coeffs = (3.4445, -4.7750, 2.0315)  # the quintic of Keller Jordan / Moonlight / optax
  c.muon_update_rms = 0.2  # RMS target of the orthogonalized update; None: optax's sqrt(max(1, out/in))
  c.muon_split = True  # W_UQ per head; W_UK and W_UV per head, separately
  c.mu_dtype = ml_collections.config_dict.placeholder(str)  # moment dtype; None: the parameter's dtype
  return c


def _checked(opt_cfg: Mapping[str, Any] | None) -> ml_collections.ConfigDict:
  """opt_cfg over the defaults; unknown fields and bad values raise."""
  cfg = default_optimizer_config()
  given = dict(opt_cfg.items()) if opt_cfg is not None else {}
  unknown = sorted(set(given) - set(cfg.keys()))
  if unknown:
    raise ValueError(f"optimizer config: unknown field(s) {unknown}; valid fields: {sorted(cfg.keys())}")
  for k, v in given.items():
    cfg[k] = tuple(v) if k == "muon_ns_coeffs" else v
  checks = (
      ("name", cfg.name in NAMES, f"one of {NAMES}"),
      ("schedule", cfg.schedule in SCHEDULES, f"one of {SCHEDULES}"),
      ("lr", cfg.lr > 0, "> 0"),
      ("lr_init", cfg.lr_init >= 0, ">= 0"),
      ("lr_end", cfg.lr_end >= 0, ">= 0"),
      ("warmup_steps", int(cfg.warmup_steps) == cfg.warmup_steps and cfg.warmup_steps >= 0, "an int >= 0"),
      ("decay_steps", int(cfg.decay_steps) == cfg.decay_steps and cfg.decay_steps > 0, "an int > 0"),
      ("weight_decay", cfg.weight_decay >= 0, ">= 0"),
      ("muon_momentum", 0 <= cfg.muon_momentum < 1, "in [0, 1)"),
      ("muon_ns_steps", int(cfg.muon_ns_steps) == cfg.muon_ns_steps and cfg.muon_ns_steps >= 1, "an int >= 1"),
      ("muon_ns_coeffs", len(cfg.muon_ns_coeffs) == 3, "three numbers (a, b, c)"),
      ("muon_update_rms", cfg.muon_update_rms is None or cfg.muon_update_rms > 0, "None or > 0"),
  )
  for field, ok, valid in checks:
    if not ok:
      raise ValueError(f"optimizer config: {field}={cfg[field]!r}; expected {valid}")
  return cfg


def learning_rate_schedule(opt_cfg: Mapping[str, Any] | None) -> optax.Schedule:
  """Linear warmup lr_init -> lr over warmup_steps (step warmup_steps is the first at lr), then
  cosine: lr_end + (lr - lr_end) (1 + cos(pi s / decay_steps)) / 2,  linear: lr + (lr_end - lr) s / decay_steps,
  or constant lr, with s = step - warmup_steps clipped to decay_steps."""
  cfg = _checked(opt_cfg)
  if cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, int(cfg.decay_steps), alpha=cfg.lr_end / cfg.lr)
  elif cfg.schedule == "linear":
    decay = optax.linear_schedule(cfg.lr, cfg.lr_end, int(cfg.decay_steps))
  else:
    decay = optax.constant_schedule(cfg.lr)
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(cfg.lr_init, cfg.lr, int(cfg.warmup_steps))
  return optax.join_schedules([warmup, decay], [int(cfg.warmup_steps)])


def path_names(path) -> Names:
  """A jax key path as plain keys; the `.value` step into an nnx.Variable is dropped, so an nnx.State of
  Params and its pure-dict form give the same names."""
  out = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        out.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      out.append(k.key)
    else:
      out.append(str(k))
  return tuple(out)


class LeafPlan(NamedTuple):
  """How one parameter is optimized. muon_dims: Muon's matrix layout (one per part when split)."""
  label: str  # "muon" | "adamw" | "frozen"
  weight_decay: bool
  muon_dims: tuple[Dims, ...] = ()
  split_sizes: tuple[int, ...] = ()  # the last axis cut into these parts before Muon (kv_b_proj: W_UK, W_UV)


def _muon_layout(names: Names, shapes: Mapping[Names, tuple[int, ...]], core: tuple[int, ...], split: bool
                 ) -> tuple[tuple[Dims, ...], tuple[int, ...]]:
  """Reduction (input) and output axes, counted from the end so stacked axes are batch axes."""
  last = names[-1]
  if last == "o_proj":  # [H, v, D]: one [H*v, D] matrix
    return (Dims((-3, -2), -1),), ()
  if last == "q_b_proj" and split:  # [R, H, qk]: W_UQ_h = [R, qk] per head
    return (Dims(-3, -1),), ()
  if last == "kv_b_proj" and split:  # [R, H, dn + dv]: W_UK_h [R, dn] and W_UV_h [R, dv] per head
    return (Dims(-3, -1), Dims(-3, -1)), _kv_split(names, shapes)
  if last in ("q_b_proj", "kv_b_proj", "wq_b"):  # [R, H, k]: one [R, H*k] matrix
    return (Dims(-3, (-2, -1)),), ()
  if len(core) == 2 or (len(core) == 3 and last in EXPERT_MATRICES):  # [in, out], or [E, in, out]
    return (Dims(-2, -1),), ()
  raise ValueError(f"parameter {'/'.join(map(str, names))}: shape {core} has no Muon layout; add one to "
                   "glm_jax/train/optimizers.py:_muon_layout or keep it under AdamW")


def _kv_split(names: Names, shapes: Mapping[Names, tuple[int, ...]]) -> tuple[int, int]:
  """(qk_nope_head_dim, v_head_dim) from the sibling shapes: qk_rope = kv_a_proj_with_mqa's last axis minus
  kv_lora_rank, qk_nope = q_b_proj's last axis minus qk_rope."""
  attn = names[:-1]
  need = (attn + ("kv_a_proj_with_mqa",), attn + ("kv_a_layernorm", "weight"), attn + ("q_b_proj",))
  missing = [n for n in need if n not in shapes]
  if missing:
    raise ValueError(f"muon_split: cannot read qk_nope_head_dim for {'/'.join(map(str, names))}; missing "
                     f"{['/'.join(map(str, n)) for n in missing]} (set muon_split=False to orthogonalize it whole)")
  rope = shapes[need[0]][-1] - shapes[need[1]][-1]
  nope = shapes[need[2]][-1] - rope
  width = shapes[names][-1]
  if not 0 < nope < width:
    raise ValueError(f"muon_split: {'/'.join(map(str, names))} last axis {width} cannot split at "
                     f"qk_nope_head_dim={nope}")
  return nope, width - nope


def _trainable_flags(trainable, params, names_list: list[Names]) -> dict[Names, bool]:
  if trainable is None:
    return {n: True for n in names_list}
  if callable(trainable):
    return {n: bool(trainable(n)) for n in names_list}
  flags = {path_names(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(trainable)}
  missing = [n for n in names_list if n not in flags]
  if missing:
    raise ValueError(f"trainable: no flag for {['/'.join(map(str, n)) for n in missing[:5]]}"
                     f"{' ...' if len(missing) > 5 else ''}; pass a bool tree shaped like params or a "
                     "predicate on path names")
  return {n: flags[n] for n in names_list}


def leaf_plan(opt_cfg: Mapping[str, Any] | None, params, *, trainable=None) -> dict[Names, LeafPlan]:
  """{path names: LeafPlan} for every leaf of `params` (an nnx.State of Params or its pure dict; arrays or
  ShapeDtypeStructs). trainable: None (all), a bool tree shaped like params, or a predicate on path names,
  e.g. `lambda names: "indexer" in names`."""
  cfg = _checked(opt_cfg)
  leaves = [(path_names(p), tuple(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(params)]
  shapes = dict(leaves)
  flags = _trainable_flags(trainable, params, [n for n, _ in leaves])
  plan = {}
  for names, shape in leaves:
    core = shape[1:] if names[0] in STACKED else shape
    decay = len(core) >= 2 and names[-1] != "embedding"
    if not flags[names]:
      plan[names] = LeafPlan("frozen", False)
    elif cfg.name == "adamw" or len(core) < 2 or names[-1] in ADAMW_MATRICES:
      plan[names] = LeafPlan("adamw", decay)
    else:
      dims, sizes = _muon_layout(names, shapes, core, cfg.muon_split)
      plan[names] = LeafPlan("muon", decay, dims, sizes)
  return plan


def _lookup(plan: dict[Names, LeafPlan], path) -> LeafPlan:
  names = path_names(path)
  if names not in plan:
    raise ValueError(f"optimizer: parameter {'/'.join(map(str, names))} was not in the params tree the "
                     "optimizer was built for")
  return plan[names]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Parts:
  """One leaf cut along its last axis (a pytree node, so optax treats each part as its own leaf)."""
  parts: tuple


def _split_heads(inner: optax.GradientTransformation, plan: dict[Names, LeafPlan]) -> optax.GradientTransformation:
  """Runs `inner` on the tree with each leaf whose plan has split_sizes replaced by its parts along the last
  axis, and concatenates the parts of the resulting updates back."""

  def split(tree):
    def cut(path, x):
      sizes = _lookup(plan, path).split_sizes
      if not sizes:
        return x
      bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
      return _Parts(tuple(jnp.split(x, bounds, axis=-1)))
    return jax.tree_util.tree_map_with_path(cut, tree)

  def merge(tree):
    return jax.tree.map(lambda x: jnp.concatenate(x.parts, axis=-1) if isinstance(x, _Parts) else x, tree,
                        is_leaf=lambda x: isinstance(x, _Parts))

  def init_fn(params):
    return inner.init(split(params))

  def update_fn(updates, state, params=None):
    new, state = inner.update(split(updates), state, None if params is None else split(params))
    return merge(new), state

  return optax.GradientTransformation(init_fn, update_fn)


def _muon_dims_fn(plan: dict[Names, LeafPlan]) -> Callable:
  """The weight_dimension_numbers callable for optax.contrib: a tree of Dims shaped like the (split) updates."""

  def dims_of(path, x):
    dims = _lookup(plan, path).muon_dims
    return _Parts(dims) if isinstance(x, _Parts) else dims[0]

  def fn(tree):
    return jax.tree_util.tree_map_with_path(dims_of, tree, is_leaf=lambda x: isinstance(x, _Parts))

  return fn


def zero_updates() -> optax.GradientTransformation:
  """Frozen leaves: updates of -0.0 and no state. p + (-0.0) == p bitwise for every p (+0.0 would turn a
  -0.0 parameter into +0.0), so optax.apply_updates leaves frozen parameters bitwise unchanged."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates), state))


def make_optimizer(opt_cfg: Mapping[str, Any] | None, params, *, trainable=None) -> optax.GradientTransformation:
  """The pretraining optimizer for `params` (an nnx.State of Params or its pure dict; shapes are enough).
  It takes gradients (clipped by the trainer) and returns updates for optax.apply_updates; init and update
  accept the params tree in either form. Labels, layouts and decay per leaf: `leaf_plan`."""
  cfg = _checked(opt_cfg)
  plan = leaf_plan(cfg, params, trainable=trainable)
  schedule = learning_rate_schedule(cfg)
  mu_dtype = None if cfg.mu_dtype is None else jnp.dtype(cfg.mu_dtype)

  def labels(tree):
    return jax.tree_util.tree_map_with_path(lambda p, _: _lookup(plan, p).label, tree)

  def decay_mask(tree):
    return jax.tree_util.tree_map_with_path(lambda p, _: _lookup(plan, p).weight_decay, tree)

  dims = _muon_dims_fn(plan)
  orthogonalize = optax.chain(
      optax.contrib.scale_by_muon(ns_coeffs=tuple(cfg.muon_ns_coeffs), ns_steps=int(cfg.muon_ns_steps),
                                  beta=cfg.muon_momentum, mu_dtype=mu_dtype, nesterov=cfg.muon_nesterov,
                                  weight_dimension_numbers=dims),
      scale_by_shape(weight_dimension_numbers=dims, consistent_rms=cfg.muon_update_rms))
  muon = optax.chain(
      _split_heads(orthogonalize, plan),
      optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
      optax.scale_by_learning_rate(schedule))
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=decay_mask, mu_dtype=mu_dtype)
  return optax.partition({"muon": muon, "adamw": adamw, "frozen": zero_updates()}, labels)
