"""DSA's two steps, routed by `attention_impl`: the indexer's top-k selection and sparse attention over it; and
the dense stage's causal attention (`dense_causal_attend`: jax's splash kernel, glm_jax/model/splash.py).

  "reference": the pure-jnp oracles in pallas_kernels/*_reference.py (they build the indexer's [T, S] scores).
  "pallas":    the Pallas kernels (pallas_kernels/lightning_indexer.py, sparse_mla_attention.py): nothing [T, S].
               Compiled on TPU; on a CPU in Pallas interpret mode (slow, exact: how the tests run them); on any
               other backend (a GPU: no compiled variant yet) the reference runs instead. The choice is logged
               once per process. The backend is jax's default, or the one set by `target_platform` (ahead-of-time
               compilation for TPU devices from a CPU host, glm_jax/train/aot.py; glm_jax/model/platform.py).

Under a mesh (jax.set_mesh) the kernels run inside a shard_map: each device takes its slice of the batch (the
mesh's data / fsdp / expert axes) and, for the attention, of the heads (tensor; kv is shared by all heads, so its
gradient is summed over tensor by the shard_map's transpose). A Mosaic kernel is opaque to XLA's partitioner,
which would otherwise gather every operand whole onto each device. Sizes that do not divide run unsplit.

Both paths take a Visibility (pallas_kernels/visibility.py; its q_offset places the queries as the last T of S keys
in chunked prefill or decoding against a longer cache, an int or a traced scalar, so one compiled decode step serves
every position) and give the same indices, outputs and gradients. The kernels' top-k scores carry no gradient, so
where a loss needs the indexer's scores on the selected keys (the sparse-stage indexer KL), `selected_index_scores`
recomputes them with the reference formula on the selected keys only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec as P

from glm_jax.mesh_axes import BATCH_AXES, TENSOR
from glm_jax.model import splash
from glm_jax.model.platform import current_platform
from pallas_kernels import lightning_indexer, lightning_indexer_reference, sparse_mla_attention
from pallas_kernels import sparse_mla_attention_reference
from pallas_kernels.visibility import Visibility

_logged: set[str] = set()


def kernel_mode(impl: str) -> str:
  """How `impl` runs on the target backend: "reference", "compiled" or "interpret"."""
  if impl == "reference":
    return "reference"
  if impl != "pallas":
    raise ValueError(f"attention_impl={impl!r}; one of 'reference', 'pallas'")
  backend = current_platform()
  mode = {"tpu": "compiled", "cpu": "interpret"}.get(backend, "reference")
  if backend not in _logged:
    _logged.add(backend)
    if mode == "interpret":
      logging.info("attention_impl='pallas' on %s: the DSA kernels run in Pallas interpret mode (exact, slow)", backend)
    elif mode == "reference":
      logging.warning(
        "attention_impl='pallas' on %s: no compiled variant of the DSA kernels for this backend; "
        "running the pure-jnp reference instead",
        backend,
      )
  return mode


def split_axes(size: int, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of the current mesh (of size > 1) among `axes` to split a dimension of `size` over, or () when
  there is no mesh or their product does not divide it."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  # Axes already manual (inside a shard_map: context parallelism's, glm_jax/model/context_parallel.py) are
  # local here: the caller has split over them.
  names = tuple(a for a in axes if mesh.shape.get(a, 1) > 1 and a not in mesh.manual_axes)
  return names if names and size % math.prod(mesh.shape[a] for a in names) == 0 else ()


def _batch_axes(b: int) -> tuple[str, ...]:
  return split_axes(b, BATCH_AXES)


def _spec(batch: tuple[str, ...], *rest) -> P:
  return P(batch or None, *rest)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexShare:
  """A layer's part in GLM-5.2's IndexShare (model.indexer_types): `shared` (a traced bool scalar: the layers of a
  stack share one compiled body) and `prev_topk` [B, T, K], the previous full layer's selection."""

  shared: jax.Array
  prev_topk: jax.Array

  def select(self, own):
    """(indices, scores) of this layer: prev_topk and zero scores when shared, else own()'s; only one branch
    runs (lax.cond), so a shared layer's indexer does no scoring."""
    return jax.lax.cond(
      self.shared,
      lambda: (self.prev_topk, jnp.zeros(self.prev_topk.shape, jnp.float32)),
      lambda: tuple(x.astype(d) for x, d in zip(own(), (self.prev_topk.dtype, jnp.float32))),
    )


def select_topk(
  impl: str,
  q_BTJZ: jax.Array,
  k_BSZ: jax.Array,
  w_BTJ: jax.Array,
  *,
  topk: int,
  visibility: Visibility,
) -> tuple[jax.Array, jax.Array]:
  """The top-`topk` visible keys per query (`visibility`, pallas_kernels/visibility.py): (indices [B, T, topk]
  int32, scores [B, T, topk] fp32), -1 / -inf where fewer are visible. The scores carry the indexer's gradient on
  the reference path only."""
  mode = kernel_mode(impl)
  if mode == "reference":
    return lightning_indexer_reference.lightning_indexer_topk(q_BTJZ, k_BSZ, w_BTJ, topk=topk, visibility=visibility)
  kernel = functools.partial(lightning_indexer.lightning_indexer_topk, topk=topk, interpret=mode == "interpret")
  batch = _batch_axes(q_BTJZ.shape[0])
  if not batch:
    return kernel(q_BTJZ, k_BSZ, w_BTJ, visibility=visibility)
  # The [B, T] / [B, S] arrays of the visibility are split over the batch like q; q_offset is the same everywhere.
  arrays = visibility.arrays()
  args = [q_BTJZ, k_BSZ, w_BTJ, *arrays.values()]
  specs = [_spec(batch, None, None, None), _spec(batch, None, None), _spec(batch)] + [_spec(batch)] * len(arrays)

  def local(q, k, w, *rest):
    return kernel(q, k, w, visibility=visibility.with_arrays(dict(zip(arrays, rest))))

  return jax.shard_map(local, in_specs=tuple(specs), out_specs=(_spec(batch), _spec(batch)), check_vma=False)(*args)


def attend(
  impl: str, q_BTHA: jax.Array, kv_BSA: jax.Array, idx_BTK: jax.Array, *, sm_scale: float, v_dim: int
) -> tuple[jax.Array, jax.Array]:
  """Sparse absorbed-MQA attention over the selected keys: (out [B, T, H, v_dim], lse [B, T, H] fp32)."""
  mode = kernel_mode(impl)
  if mode == "reference":
    return sparse_mla_attention_reference.sparse_mla_attention(q_BTHA, kv_BSA, idx_BTK, sm_scale=sm_scale, v_dim=v_dim)
  kernel = functools.partial(
    sparse_mla_attention.sparse_mla_attention, sm_scale=sm_scale, v_dim=v_dim, interpret=mode == "interpret"
  )
  batch = _batch_axes(q_BTHA.shape[0])
  heads = split_axes(q_BTHA.shape[2], (TENSOR,)) or None
  if not batch and not heads:
    return kernel(q_BTHA, kv_BSA, idx_BTK)
  return jax.shard_map(
    kernel,
    in_specs=(_spec(batch, None, heads, None), _spec(batch), _spec(batch)),
    out_specs=(_spec(batch, None, heads, None), _spec(batch, None, heads)),
    check_vma=False,
  )(q_BTHA, kv_BSA, idx_BTK)


def dense_causal_attend(
  q_BTHP: jax.Array,
  k_BTHP: jax.Array,
  v_BTHO: jax.Array,
  visibility: Visibility,
  *,
  sm_scale: float,
  interpret: bool,
) -> jax.Array:
  """The dense stage's causal MHA with the splash kernel (glm_jax/model/splash.py): o [B, T, H, O]; batch and heads
  split over the mesh as for `attend`. For attention_impl "pallas" where kernel_mode is not "reference", and a
  visibility splash's static mask expresses (`Visibility.is_static_causal`; a ValueError otherwise)."""
  kernel = functools.partial(splash.causal_attention, sm_scale=sm_scale, interpret=interpret)
  batch = _batch_axes(q_BTHP.shape[0])
  heads = split_axes(q_BTHP.shape[2], (TENSOR,)) or None
  if not batch and not heads:
    return kernel(q_BTHP, k_BTHP, v_BTHO, visibility)
  arrays = visibility.arrays()  # split over the batch like q

  def local(q, k, v, *rest):
    return kernel(q, k, v, visibility.with_arrays(dict(zip(arrays, rest))))

  qkv = _spec(batch, None, heads, None)
  specs = (qkv, qkv, qkv, *[_spec(batch)] * len(arrays))
  return jax.shard_map(local, in_specs=specs, out_specs=qkv, check_vma=False)(q_BTHP, k_BTHP, v_BTHO, *arrays.values())


def head_probs(
  impl: str, q_BTHA: jax.Array, kv_BSA: jax.Array, idx_BTK: jax.Array, lse_BTH: jax.Array, *, sm_scale: float
) -> jax.Array:
  """The sparse attention's probabilities of the selected keys summed over heads: [B, T, K] fp32 (the
  sparse-stage indexer KL's target; a constant to autodiff on the kernel path)."""
  mode = kernel_mode(impl)
  if mode == "reference":
    return sparse_mla_attention_reference.sparse_attention_head_probs(
      q_BTHA, kv_BSA, idx_BTK, lse_BTH, sm_scale=sm_scale
    )
  kernel = functools.partial(
    sparse_mla_attention.sparse_attention_head_probs, sm_scale=sm_scale, interpret=mode == "interpret"
  )
  batch = _batch_axes(q_BTHA.shape[0])
  heads = split_axes(q_BTHA.shape[2], (TENSOR,))
  if not batch and not heads:
    return kernel(q_BTHA, kv_BSA, idx_BTK, lse_BTH)

  def local(q, kv, idx, lse):  # a partial sum over this device's heads, summed over the head shards
    p = kernel(q, kv, idx, lse)
    return jax.lax.psum(p, heads) if heads else p

  return jax.shard_map(
    local,
    in_specs=(_spec(batch, None, heads or None, None), _spec(batch), _spec(batch), _spec(batch, None, heads or None)),
    out_specs=_spec(batch),
    check_vma=False,
  )(q_BTHA, kv_BSA, idx_BTK, lse_BTH)


def selected_index_scores(
  q_BTJZ: jax.Array, k_BSZ: jax.Array, w_BTJ: jax.Array, idx_BTK: jax.Array, *, chunk: int = 512
) -> jax.Array:
  """The indexer's scores of the selected keys, differentiable: [B, T, K] fp32, -inf where idx is -1.
  I[t, k] = sum_h w[t, h] relu(q[t, h] . k[idx[t, k]])                                  (DS32 Eq. 1)
  Over chunks of `chunk` queries, each rematerialized in the backward pass: the gathered keys take
  O(chunk * K * D_I) memory at a time, never O(T * K * D_I) (nor O(T * S))."""
  b, t_len = q_BTJZ.shape[:2]
  if t_len <= chunk:
    return _selected_scores(q_BTJZ, k_BSZ, w_BTJ, idx_BTK)
  n = -(-t_len // chunk)

  def split(x):  # [B, T, ...] -> [n, B, chunk, ...], T padded
    x = jnp.pad(x, [(0, 0), (0, n * chunk - t_len)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

  scores = jax.lax.map(
    jax.checkpoint(lambda a: _selected_scores(a[0], k_BSZ, a[1], a[2])), (split(q_BTJZ), split(w_BTJ), split(idx_BTK))
  )
  return jnp.moveaxis(scores, 0, 1).reshape(b, n * chunk, -1)[:, :t_len]


def _selected_scores(q_BTJZ, k_BSZ, w_BTJ, idx_BTK):
  k_BTKZ = sparse_mla_attention_reference.gather_kv(k_BSZ, idx_BTK)
  qk_BTJK = jnp.einsum("bthd,btkd->bthk", q_BTJZ.astype(jnp.float32), k_BTKZ.astype(jnp.float32))
  scores_BTK = jnp.einsum("bthk,bth->btk", jax.nn.relu(qk_BTJK), w_BTJ.astype(jnp.float32))
  return jnp.where(idx_BTK >= 0, scores_BTK, -jnp.inf)
