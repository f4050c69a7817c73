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
Muon's pieces are optax.contrib's (its Newton-Schulz, scale_by_shape); not its `muon` alias, whose Adam half takes
Nesterov and eps from the Muon settings and which has no frozen label. What optax cannot express:
- splitting kv_b_proj's last axis into W_UK and W_UV: `_split_heads` cuts the tree before Muon and concatenates
  after;
- orthogonalizing on a mesh: see `scale_by_muon` (optax's momentum and Newton-Schulz, with the matrices spread
  over the devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims
from optax.contrib import MuonState

# optax 0.2.8 does not re-export these: scale_by_shape (consistent_rms) and its Newton-Schulz.
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape

from glm_jax.sharding.mesh import logical_to_spec

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
  logical_axes: tuple | None = None  # the parameter's logical axis names: its layout on a mesh (`orthogonalize`)


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
  logical = _logical_axes(params)
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
      plan[names] = LeafPlan("muon", decay, dims, sizes, logical.get(names))
  return plan


def _logical_axes(params) -> dict[Names, tuple]:
  """{path names: logical axis names} of the leaves that carry them (nnx Params' out_sharding metadata)."""
  out = {}
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for path, leaf in leaves:
    if isinstance(leaf, nnx.Variable):
      axes = leaf.get_metadata().get("out_sharding")
      if axes is not None:
        out[path_names(path)] = tuple(axes)
  return out


def _as_tuple(a) -> tuple[int, ...]:
  return tuple(a) if isinstance(a, (tuple, list)) else (a,)


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


def _muon_dims_fn(plan: dict[Names, LeafPlan], layouts: bool = False) -> Callable:
  """A tree of Dims shaped like the (split) updates (optax's weight_dimension_numbers), or of MuonLayouts."""

  def dims_of(path, x):
    lp = _lookup(plan, path)
    dims = tuple(MuonLayout(d, lp.logical_axes) for d in lp.muon_dims) if layouts else lp.muon_dims
    return _Parts(dims) if isinstance(x, _Parts) else dims[0]

  def fn(tree):
    return jax.tree_util.tree_map_with_path(dims_of, tree, is_leaf=lambda x: isinstance(x, _Parts))

  return fn


@dataclasses.dataclass(frozen=True)
class MuonLayout:
  """How `orthogonalize` sees one leaf: its matrix layout and its parameter's logical axes (None: unknown)."""
  dims: Dims
  logical_axes: tuple | None = None


def _newton_schulz(x: jax.Array, n_matrix_in: int, ns_coeffs: jax.Array, ns_steps: int, eps: float) -> jax.Array:
  """optax's Newton-Schulz on x [batch, *in axes, *out axes] (the first n_matrix_in axes after batch are in)."""
  shape = x.shape
  m = math.prod(shape[1:1 + n_matrix_in])
  flat = x.reshape(shape[0], m, -1)
  return orthogonalize_via_newton_schulz(flat, ns_coeffs, ns_steps, eps=eps, dimension_numbers=Dims(1, 2)
                                         ).reshape(shape)


def _split_over_replicas(x: jax.Array, replicas: tuple[str, ...], fn: Callable) -> jax.Array:
  """fn(x) (row-wise over axis 0) inside a shard_map where the devices along `replicas` all hold the same x:
  each computes ceil(rows / n) rows and a psum assembles them (no padding to n rows, so a leaf of 3 matrices on
  512 replicas stays 3 matrices). Slices are clamped to stay in bounds; rows another device owns are zeroed."""
  n = math.prod(jax.lax.axis_size(a) for a in replicas)
  rows = x.shape[0]
  chunk = -(-rows // n)
  r = jax.lax.axis_index(replicas)
  start = jnp.minimum(r * chunk, rows - chunk)
  y = fn(jax.lax.dynamic_slice_in_dim(x, start, chunk, 0))
  owned = (start + jnp.arange(chunk)) >= r * chunk
  y = jnp.where(owned.reshape((chunk,) + (1,) * (y.ndim - 1)), y, jnp.zeros_like(y))
  out = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((rows,) + y.shape[1:], y.dtype), y, start, 0)
  return jax.lax.psum(out, replicas)


def orthogonalize(x: jax.Array, layout: MuonLayout, ns_coeffs: jax.Array, ns_steps: int, eps: float = 1e-8
                  ) -> jax.Array:
  """optax's Newton-Schulz orthogonalization of every matrix of x; on a mesh, each device does whole matrices.

  optax reshapes a leaf to [batch, in, out] (stacked layers, experts and split heads merged into one batch axis)
  and vmaps Newton-Schulz over it. Under a mesh that loses the parameter's sharding (experts split over
  `expert` are no block of a layers-major merged axis), and XLA, left to itself, computes every Gram matrix
  X X^T on every device with a sharded contraction (for glm5_744b's routed experts f32[75 * 256, 2048, 2048] a
  chip, 322 GB) or, given a batch-sharded target, reshards through a full all-gather of the leaf (24 GiB a MoE
  layer pair). So, under a mesh with more than one device and a known parameter layout, a shard_map does it
  explicitly. On each device, with the local block [batch_l, *in_l, *out_l]:
    1. pad batch_l with zero matrices (Newton-Schulz maps them to zero) to a multiple of the number of devices
       over which the matrix dimensions are split (fsdp on the model dimension, tensor on a width);
    2. per mesh axis sharding a matrix dimension, an all-to-all that splits the batch and gathers that
       dimension: the device now holds batch_l / (those axes' sizes) whole matrices;
    3. the devices along mesh axes that do not shard the leaf at all (replicas: e.g. expert for attention
       weights) hold the same matrices: each orthogonalizes its share and a psum assembles them;
    4. the all-to-alls in reverse put every matrix back in the parameter's layout.
  The arithmetic per matrix is optax's, so the result is the same on any mesh (and on one device).
  """
  dims = layout.dims
  ndim = x.ndim
  matrix_in = tuple(a % ndim for a in _as_tuple(dims.reduction_axis))
  matrix_out = tuple(a % ndim for a in _as_tuple(dims.output_axis))
  batch_axes = tuple(i for i in range(ndim) if i not in matrix_in + matrix_out)
  order = batch_axes + matrix_in + matrix_out
  inverse = tuple(sorted(range(ndim), key=lambda i: order[i]))
  n_in = len(matrix_in)

  def local_orthogonalize(xl: jax.Array, matrix_sharding: tuple = (), replicas: tuple = ()) -> jax.Array:
    xl = xl.transpose(order)
    batch_shape = xl.shape[:len(batch_axes)]
    b = math.prod(batch_shape)
    xl = xl.reshape((b,) + xl.shape[len(batch_axes):])
    group = math.prod(mesh.shape[a] for _, axes in matrix_sharding for a in axes)
    xl = jnp.pad(xl, ((0, -b % group),) + ((0, 0),) * (xl.ndim - 1))
    for pos, axes in matrix_sharding:  # batch split, matrix dimension gathered
      xl = jax.lax.all_to_all(xl, axes, 0, pos, tiled=True)
    if replicas:
      y = _split_over_replicas(xl, replicas, lambda part: _newton_schulz(part, n_in, ns_coeffs, ns_steps, eps))
    else:
      y = _newton_schulz(xl, n_in, ns_coeffs, ns_steps, eps)
    for pos, axes in reversed(matrix_sharding):
      y = jax.lax.all_to_all(y, axes, pos, 0, tiled=True)
    return y[:b].reshape(batch_shape + y.shape[1:]).transpose(inverse)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or layout.logical_axes is None or len(layout.logical_axes) != ndim:
    return local_orthogonalize(x)
  spec = logical_to_spec(layout.logical_axes)
  spec = P(*(a if a in mesh.axis_names and d % mesh.shape[a] == 0 else None for a, d in zip(spec, x.shape)))
  used = {a for a in spec if a is not None}
  matrix_sharding = tuple((1 + order[len(batch_axes):].index(i), (spec[i],))
                          for i in matrix_in + matrix_out if spec[i] is not None and mesh.shape[spec[i]] > 1)
  replicas = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
  fn = functools.partial(local_orthogonalize, matrix_sharding=matrix_sharding, replicas=replicas)
  return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


def scale_by_muon(ns_coeffs: tuple[float, float, float], ns_steps: int, beta: float, nesterov: bool,
                  layouts: Callable, mu_dtype=None, eps: float = 1e-8) -> optax.GradientTransformation:
  """Muon's direction: optax.contrib.scale_by_muon's momentum (bias-corrected, Nesterov) and Newton-Schulz
  (Frobenius preconditioning), with `orthogonalize` placing the matrices on the mesh. State: optax's MuonState.
  layouts(updates): a tree of MuonLayout shaped like the updates."""

  def init_fn(params):
    return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                     ns_coeffs=jnp.asarray(ns_coeffs))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:  # beta * m_hat(t + 1) + (1 - beta) * g_hat(t), as optax
      mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                            optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    out = jax.tree.map(lambda x, lay: orthogonalize(x, lay, state.ns_coeffs, ns_steps, eps), mu_hat,
                       layouts(updates))
    return out, MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs)

  return optax.GradientTransformation(init_fn, update_fn)


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
      scale_by_muon(ns_coeffs=tuple(cfg.muon_ns_coeffs), ns_steps=int(cfg.muon_ns_steps), beta=cfg.muon_momentum,
                    nesterov=cfg.muon_nesterov, layouts=_muon_dims_fn(plan, layouts=True), mu_dtype=mu_dtype),
      scale_by_shape(weight_dimension_numbers=dims, consistent_rms=cfg.muon_update_rms))
  muon = optax.chain(
      _split_heads(orthogonalize, plan),
      optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
      optax.scale_by_learning_rate(schedule))
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=decay_mask, mu_dtype=mu_dtype)
  return optax.partition({"muon": muon, "adamw": adamw, "frozen": zero_updates()}, labels)
