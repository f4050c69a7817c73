"""Pallas TPU kernels: DSA's sparse MLA attention over indexer-selected keys, forward and backward.

Same interface and result as sparse_mla_attention_reference.py, in MLA's absorbed (MQA) form: q [B, T, H, D] per
head, kv [B, S, D] shared by all heads (D = kv_lora_rank + rope dim = 576 for GLM-5), the value kv[..., :v_dim],
indices [B, T, K] (-1 = skip):
  o[t, h] = sum_{s in idx[t]} softmax_s(sm_scale * q[t, h] . kv[s]) kv[s, :v_dim],   lse[t, h] = log sum_s exp(.)
An index outside [0, S) counts as -1; a query with no valid index gives o = 0 and lse = -inf. The indices of one
query must be distinct (a top-k's are): a key listed twice would be counted twice in the softmax, and its two
backward updates race. Nothing of size [T, S] or [T, K, D] exists: the indices ride in SMEM and drive one DMA per
selected kv row into VMEM; the backward (custom_vjp) adds dkv in place into an fp32 [B, S, D] accumulator in HBM.
bf16 kv travels as int32 words of two bf16 values; other dtypes, or odd v or D, run in fp32. The forward and
backward, the bf16 layout, traffic and FLOPs: docs/kernels.md, "The sparse attention kernel".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import check_block_sizes, check_ranks, resolve_interpret, round_up, vmem_limit

_NT = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # a [k, m] . b [k, n] -> [m, n]
_NN = (((1,), (0,)), ((), ()))  # a [m, k] . b [k, n] -> [m, n]


@dataclasses.dataclass(frozen=True)
class SparseAttentionBlockSizes:
  """Tile sizes; they change speed and VMEM, never the result.

  block_t: queries per grid step (a multiple of 8; T is padded up to a multiple of it).
  block_kv: selected keys gathered per inner step, one DMA each (a multiple of 8; K is padded up to a multiple).
  """

  block_t: int = 8
  block_kv: int = 128

  def __post_init__(self):
    for name in ("block_t", "block_kv"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8:
        raise ValueError(f"SparseAttentionBlockSizes.{name}={value!r}; must be a positive multiple of 8")


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How q and kv are laid out for the kernels (static)."""

  b: int
  t_len: int
  t_pad: int
  heads: int
  dim: int
  s_len: int
  kp: int  # K padded to a multiple of block_kv
  v_dim: int
  block_t: int
  block_kv: int
  packed: bool  # bf16 kv as int32 words holding (lo, hi) column pairs
  dtype: jnp.dtype  # the MXU operand dtype: bf16 or fp32

  @property
  def n_parts(self) -> int:
    return 2 if self.packed else 1

  @property
  def part_dim(self) -> int:
    return self.dim // self.n_parts

  @property
  def v_part(self) -> int:
    return self.v_dim // self.n_parts

  @property
  def precision(self) -> lax.Precision | None:
    """fp32 operands at full precision on the MXU (its default rounds them to bf16)."""
    return lax.Precision.HIGHEST if self.dtype == jnp.float32 else None

  def part_columns(self) -> list[np.ndarray]:
    """The original columns of each part, in order."""
    if not self.packed:
      return [np.arange(self.dim)]
    v, r = self.v_dim, self.dim - self.v_dim
    lo = np.concatenate([np.arange(0, v // 2), np.arange(v, v + r // 2)])
    hi = np.concatenate([np.arange(v // 2, v), np.arange(v + r // 2, self.dim)])
    return [lo, hi]


def _layout(q, kv, idx, v_dim, blocks: SparseAttentionBlockSizes) -> _Layout:
  b, t_len, heads, dim = q.shape
  dtype = jnp.promote_types(q.dtype, kv.dtype)
  packed = dtype == jnp.bfloat16 and dim % 2 == 0 and v_dim % 2 == 0
  block_kv = min(blocks.block_kv, round_up(idx.shape[-1], 8))
  block_t = min(blocks.block_t, round_up(t_len, 8))
  return _Layout(
    b=b,
    t_len=t_len,
    t_pad=round_up(t_len, block_t),
    heads=heads,
    dim=dim,
    s_len=kv.shape[1],
    kp=round_up(idx.shape[-1], block_kv),
    v_dim=v_dim,
    block_t=block_t,
    block_kv=block_kv,
    packed=packed,
    dtype=jnp.dtype(jnp.bfloat16 if packed else jnp.float32),
  )


def _pad_t(x, lay: _Layout, value=0):
  return jnp.pad(x, [(0, 0), (0, lay.t_pad - lay.t_len)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _take_columns(x: jax.Array, cols: np.ndarray) -> jax.Array:
  """x[..., cols] as a concatenation of static slices (one per run of consecutive columns), not a gather."""
  breaks = np.flatnonzero(np.diff(cols) != 1) + 1
  runs = np.split(cols, breaks)
  return (
    jnp.concatenate([x[..., r[0] : r[-1] + 1] for r in runs], axis=-1)
    if len(runs) > 1
    else (x[..., cols[0] : cols[-1] + 1])
  )


def _q_parts(q, lay: _Layout) -> list[jax.Array]:
  q = _pad_t(q.astype(lay.dtype), lay)
  return [q] if not lay.packed else [_take_columns(q, cols) for cols in lay.part_columns()]


def _kv_words(kv, lay: _Layout) -> jax.Array:
  """kv as the rows the kernels DMA: fp32 [B, S, D], or int32 [B, S, D/2] with lo in the low 16 bits."""
  if not lay.packed:
    return kv.astype(jnp.float32)
  lo, hi = (
    lax.bitcast_convert_type(_take_columns(kv.astype(jnp.bfloat16), cols), jnp.uint16).astype(jnp.uint32)
    for cols in lay.part_columns()
  )
  return lax.bitcast_convert_type(lo | (hi << 16), jnp.int32)


def _indices(idx, lay: _Layout) -> tuple[jax.Array, jax.Array]:
  """(for SMEM [B, T_pad, Kp], for VMEM the same as [B, T_pad, Kp / block_kv, block_kv]); -1 padding, and -1 for
  indices outside [0, S)."""
  idx = idx.astype(jnp.int32)
  idx = jnp.where((idx >= 0) & (idx < lay.s_len), idx, -1)
  idx = jnp.pad(idx, ((0, 0), (0, lay.t_pad - lay.t_len), (0, lay.kp - idx.shape[-1])), constant_values=-1)
  return idx, idx.reshape(lay.b, lay.t_pad, lay.kp // lay.block_kv, lay.block_kv)


# ----------------------------------------------------------------------------------------------------------------
# In-kernel pieces shared by the forward and the backward
# ----------------------------------------------------------------------------------------------------------------


def _start_gather(idx_ref, kv_hbm, kv_buf, sem, b, step, slot, lay: _Layout) -> None:
  """DMAs the kv rows of the `step`-th block of selected keys (step = t * (Kp / block_kv) + j over the grid step's
  queries t and key blocks j) into slot. An index of -1 fetches row 0 (finite data; its score is masked), so every
  slot row is written."""
  nkb = lay.kp // lay.block_kv
  t, base = lax.div(step, nkb), lax.rem(step, nkb) * lay.block_kv

  def row(r, carry):
    s = jnp.maximum(idx_ref[0, t, base + r], 0)
    pltpu.make_async_copy(kv_hbm.at[b, pl.ds(s, 1)], kv_buf.at[slot, pl.ds(r, 1)], sem.at[slot]).start()
    return carry

  lax.fori_loop(0, lay.block_kv, row, 0, unroll=min(8, lay.block_kv))


def _wait_gather(kv_buf, sem, slot) -> None:
  # A DMA semaphore counts bytes: one wait sized as the whole slot covers its block_kv row copies.
  pltpu.make_async_copy(kv_buf.at[slot], kv_buf.at[slot], sem.at[slot]).wait()


def _kv_parts(kv_buf, slot, lay: _Layout) -> list[jax.Array]:
  """The gathered block as MXU operands: [kv] (fp32) or [kv_lo, kv_hi] (bf16, unpacked exactly)."""
  w = kv_buf[slot]
  if not lay.packed:
    return [w]
  lo = lax.bitcast_convert_type(lax.shift_left(w, 16), jnp.float32)
  hi = lax.bitcast_convert_type(w & jnp.int32(-65536), jnp.float32)
  return [lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)]


def _dot(a, b, dims, precision):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _scores(q_refs, kvs, t, sm_scale, precision) -> jax.Array:
  """sm_scale * q_t . kv_blk^T: [H, block_kv] fp32."""
  s = None
  for q_ref, kv in zip(q_refs, kvs):
    part = _dot(q_ref[0, t], kv, _NT, precision)
    s = part if s is None else s + part
  return s * sm_scale


def _loop_blocks(lay: _Layout, body, idx_ref, kv_hbm, kv_buf, sem) -> None:
  """for t in the grid step's queries, j in key blocks: body(t, j, slot) with block (t, j)'s kv rows gathered into
  kv_buf[slot]; the gather of the next block is started before waiting for the current one."""
  nkb = lay.kp // lay.block_kv
  b = pl.program_id(0)

  def start(step, slot):
    _start_gather(idx_ref, kv_hbm, kv_buf, sem, b, step, slot, lay)

  def wait(slot):
    _wait_gather(kv_buf, sem, slot)

  start(0, 0)

  def query(t, carry):
    def block(j, carry):
      step = t * nkb + j
      slot = step % 2

      @pl.when(step + 1 < lay.block_t * nkb)
      def _prefetch():
        start(step + 1, 1 - slot)

      wait(slot)
      body(t, j, slot)
      return carry

    return lax.fori_loop(0, nkb, block, carry)

  lax.fori_loop(0, lay.block_t, query, 0)


def _col(row_1H: jax.Array) -> jax.Array:
  """[1, H] -> [H, 1]."""
  return row_1H.T


def _valid(valid_ref, t, j) -> jax.Array:
  """[1, block_kv] bool: which of block (t, j)'s selected keys are real (not -1)."""
  return valid_ref[0, t, pl.ds(j, 1), :] >= 0


def _probs(s, valid, lse_ref, t) -> jax.Array:
  """p = exp(s - lse) from the forward's lse, 0 at skipped keys: [H, block_kv] fp32."""
  lse = _col(lse_ref[0, pl.ds(t, 1), :])  # [H, 1]
  return jnp.where(valid, jnp.exp(s - jnp.where(jnp.isneginf(lse), 0.0, lse)), 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, lay: _Layout, sm_scale: float):
  n = lay.n_parts
  idx_ref, valid_ref = refs[:2]
  q_refs = refs[2 : 2 + n]
  kv_hbm, o_ref, lse_ref, kv_buf, sem, m_ref, l_ref, acc_ref = refs[2 + n :]
  nkb, vp = lay.kp // lay.block_kv, lay.v_part

  def body(t, j, slot):
    @pl.when(j == 0)
    def _init():
      m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
      l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
      acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    kvs = _kv_parts(kv_buf, slot, lay)
    s = jnp.where(_valid(valid_ref, t, j), _scores(q_refs, kvs, t, sm_scale, lay.precision), -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    m_ref[...] = m_new
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = p.astype(lay.dtype)
    for i, kv in enumerate(kvs):
      cols = slice(i * vp, (i + 1) * vp)
      acc_ref[:, cols] = alpha * acc_ref[:, cols] + _dot(pv, kv[:, :vp], _NN, lay.precision)

    @pl.when(j == nkb - 1)
    def _emit():
      total = l_ref[...]
      empty = total == 0
      o_ref[0, t] = (acc_ref[...] / jnp.where(empty, 1.0, total)).astype(o_ref.dtype)
      m_safe = jnp.where(jnp.isneginf(m_ref[...]), 0.0, m_ref[...])
      lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))  # [H, 1]
      lse_ref[0, pl.ds(t, 1), :] = lse.T

  _loop_blocks(lay, body, idx_ref, kv_hbm, kv_buf, sem)


def _common_specs(lay: _Layout):
  nkb = lay.kp // lay.block_kv
  return [
    pl.BlockSpec((1, lay.block_t, lay.kp), lambda b, i: (b, i, 0), memory_space=pltpu.SMEM),
    pl.BlockSpec((1, lay.block_t, nkb, lay.block_kv), lambda b, i: (b, i, 0, 0)),
  ]


def _per_query(lay: _Layout, width: int) -> pl.BlockSpec:
  return pl.BlockSpec((1, lay.block_t, lay.heads, width), lambda b, i: (b, i, 0, 0))


def _per_head(lay: _Layout) -> pl.BlockSpec:
  return pl.BlockSpec((1, lay.block_t, lay.heads), lambda b, i: (b, i, 0))


def _kv_buf_shape(lay: _Layout):
  return pltpu.VMEM((2, lay.block_kv, lay.dim // lay.n_parts), jnp.int32 if lay.packed else jnp.float32)


def _vmem_limit(lay: _Layout, extra_bytes: int) -> int:
  itemsize = lay.dtype.itemsize
  blocks = 2 * lay.block_t * (lay.heads * (lay.dim + 2 * lay.v_dim) * itemsize + 4 * lay.kp + 8 * lay.heads)
  scratch = 2 * lay.block_kv * lay.dim * 4 + lay.heads * (lay.v_dim + lay.dim + 256) * 4
  return vmem_limit(blocks + scratch + extra_bytes)


# Cost estimates (pl.CostEstimate: XLA sees nothing inside a Pallas kernel otherwise). Every kernel runs the same
# grid (B, T_pad / block_t) and, per grid step, all block_t * Kp / block_kv key blocks of its queries: every count
# below is per selected-key slot of the padded [B, T_pad, Kp] index array (padding slots hold -1 but still run
# their matmuls on a gathered row 0 and are masked), so the FLOPs and transcendentals are exact, not bounds.
# flops are the MXU products only (2 x result elements x contracted size), not the VPU's elementwise work.


def _slots(lay: _Layout) -> int:
  """Selected-key slots the grid visits: B * T_pad * Kp."""
  return lay.b * lay.t_pad * lay.kp


def _common_bytes(lay: _Layout) -> int:
  """HBM bytes every kernel moves the same way: the indices twice (the SMEM block and the VMEM validity block,
  [block_t, Kp] int32 each, once per grid step), q's parts once ([block_t, H, D] in all, MXU dtype), and the kv
  gather: one DMA of one row per slot, -1 slots included (they fetch row 0): D * 2 bytes a row packed (bf16 pairs
  in int32 words), D * 4 in fp32."""
  kv_row = lay.dim * (2 if lay.packed else 4)
  return 2 * _slots(lay) * 4 + lay.b * lay.t_pad * lay.heads * lay.dim * lay.dtype.itemsize + _slots(lay) * kv_row


def _forward_cost(lay: _Layout, out_dtype) -> pl.CostEstimate:
  """flops: per (query, key block) 2 * H * block_kv * (D + v): the scores q kv^T (D contracted) and p kv[:, :v]
  (block_kv contracted); in all 2 * B * T_pad * H * Kp * (D + v).
  transcendentals: per (query, key block) H * block_kv exps of the scores and H of the rescale factor alpha; per
  query H logs for lse: B * T_pad * H * (Kp + Kp / block_kv + 1).
  bytes_accessed: _common_bytes, plus the outputs written once per block: o [B, T_pad, H, v] in q's dtype and
  lse [B, T_pad, H] fp32."""
  per_query = lay.b * lay.t_pad * lay.heads
  nkb = lay.kp // lay.block_kv
  return pl.CostEstimate(
    flops=int(2 * _slots(lay) * lay.heads * (lay.dim + lay.v_dim)),
    transcendentals=int(per_query * (lay.kp + nkb + 1)),
    bytes_accessed=int(_common_bytes(lay) + per_query * (lay.v_dim * jnp.dtype(out_dtype).itemsize + 4)),
  )


def _forward(q, kv, idx, *, sm_scale, v_dim, blocks, interpret, out_dtype):
  lay = _layout(q, kv, idx, v_dim, blocks)
  idx_smem, idx_vmem = _indices(idx, lay)
  q_parts = _q_parts(q, lay)
  kernel = functools.partial(_fwd_kernel, lay=lay, sm_scale=float(sm_scale))
  o, lse = pl.pallas_call(
    kernel,
    grid=(lay.b, lay.t_pad // lay.block_t),
    in_specs=_common_specs(lay) + [_per_query(lay, lay.part_dim)] * lay.n_parts + [pl.BlockSpec(memory_space=pl.ANY)],
    out_specs=[_per_query(lay, v_dim), _per_head(lay)],
    out_shape=[
      jax.ShapeDtypeStruct((lay.b, lay.t_pad, lay.heads, v_dim), out_dtype),
      jax.ShapeDtypeStruct((lay.b, lay.t_pad, lay.heads), jnp.float32),
    ],
    scratch_shapes=[
      _kv_buf_shape(lay),
      pltpu.SemaphoreType.DMA((2,)),
      pltpu.VMEM((lay.heads, 1), jnp.float32),
      pltpu.VMEM((lay.heads, 1), jnp.float32),
      pltpu.VMEM((lay.heads, v_dim), jnp.float32),
    ],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=_vmem_limit(lay, 0)
    ),
    cost_estimate=_forward_cost(lay, out_dtype),
    interpret=interpret,
  )(idx_smem, idx_vmem, *q_parts, _kv_words(kv, lay))
  return o[:, : lay.t_len], lse[:, : lay.t_len]


# ----------------------------------------------------------------------------------------------------------------
# Head-summed probabilities of the selected keys (the sparse-stage indexer loss's target)
# ----------------------------------------------------------------------------------------------------------------


def _probs_kernel(*refs, lay: _Layout, sm_scale: float):
  n = lay.n_parts
  idx_ref, valid_ref = refs[:2]
  q_refs = refs[2 : 2 + n]
  lse_ref, kv_hbm, p_ref, kv_buf, sem = refs[2 + n :]

  def body(t, j, slot):
    kvs = _kv_parts(kv_buf, slot, lay)
    p = _probs(_scores(q_refs, kvs, t, sm_scale, lay.precision), _valid(valid_ref, t, j), lse_ref, t)
    p_ref[0, t, pl.ds(j, 1), :] = jnp.sum(p, axis=0, keepdims=True)

  _loop_blocks(lay, body, idx_ref, kv_hbm, kv_buf, sem)


def sparse_attention_head_probs(
  q_BTHD: jax.Array,
  kv_BSD: jax.Array,
  idx_BTK: jax.Array,
  lse_BTH: jax.Array,
  *,
  sm_scale: float,
  block_sizes: SparseAttentionBlockSizes | None = None,
  interpret=None,
) -> jax.Array:
  """sum_h p[t, h, k], p = exp(sm_scale * q[t, h] . kv[idx[t, k]] - lse[t, h]), the attention's probabilities of
  the selected keys summed over heads: [B, T, K] fp32, 0 where idx is skipped. A constant to autodiff (the
  sparse-stage indexer KL's target). lse from sparse_mla_attention; same inputs and rules otherwise."""
  interpret = resolve_interpret(interpret)
  q_BTHD, kv_BSD, lse_BTH = (lax.stop_gradient(x) for x in (q_BTHD, kv_BSD, lse_BTH))
  return _head_probs(
    q_BTHD,
    kv_BSD,
    idx_BTK,
    lse_BTH,
    sm_scale=float(sm_scale),
    blocks=block_sizes or SparseAttentionBlockSizes(),
    interpret=interpret,
  )


def _head_probs_cost(lay: _Layout) -> pl.CostEstimate:
  """flops: the scores only, 2 * H * block_kv * D per (query, key block): 2 * B * T_pad * H * Kp * D.
  transcendentals: one exp a score: B * T_pad * H * Kp.
  bytes_accessed: _common_bytes, plus lse [B, T_pad, H] fp32 read once, and the output [B, T_pad, Kp] fp32
  written once."""
  return pl.CostEstimate(
    flops=int(2 * _slots(lay) * lay.heads * lay.dim),
    transcendentals=int(_slots(lay) * lay.heads),
    bytes_accessed=int(_common_bytes(lay) + lay.b * lay.t_pad * lay.heads * 4 + _slots(lay) * 4),
  )


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "interpret"))
def _head_probs(q, kv, idx, lse, *, sm_scale, blocks, interpret):
  lay = _layout(q, kv, idx, q.shape[-1], blocks)
  idx_smem, idx_vmem = _indices(idx, lay)
  nkb = lay.kp // lay.block_kv
  kernel = functools.partial(_probs_kernel, lay=lay, sm_scale=sm_scale)
  p = pl.pallas_call(
    kernel,
    grid=(lay.b, lay.t_pad // lay.block_t),
    in_specs=_common_specs(lay)
    + [_per_query(lay, lay.part_dim)] * lay.n_parts
    + [_per_head(lay), pl.BlockSpec(memory_space=pl.ANY)],
    out_specs=pl.BlockSpec((1, lay.block_t, nkb, lay.block_kv), lambda b, i: (b, i, 0, 0)),
    out_shape=jax.ShapeDtypeStruct((lay.b, lay.t_pad, nkb, lay.block_kv), jnp.float32),
    scratch_shapes=[_kv_buf_shape(lay), pltpu.SemaphoreType.DMA((2,))],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=_vmem_limit(lay, 0)
    ),
    cost_estimate=_head_probs_cost(lay),
    interpret=interpret,
  )(idx_smem, idx_vmem, *_q_parts(q, lay), _pad_t(lse, lay, -jnp.inf), _kv_words(kv, lay))
  return p.reshape(lay.b, lay.t_pad, lay.kp)[:, : lay.t_len, : idx.shape[-1]]


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


def _bwd_kernel(*refs, lay: _Layout, sm_scale: float):
  n = lay.n_parts
  idx_ref, valid_ref = refs[:2]
  q_refs = refs[2 : 2 + n]
  rest = refs[2 + n :]
  if lay.packed:
    qfull_ref, rest = rest[0], rest[1:]
  else:
    qfull_ref = q_refs[0]
  do_ref, lse_ref, delta_ref, kv_hbm, _dkv_in, *rest = rest
  dq_refs, rest = rest[:n], rest[n:]
  dkv_hbm, kv_buf, sem, dkv_buf, rw_sem, *dq_accs = rest
  b = pl.program_id(0)
  nkb, vp, bkv = lay.kp // lay.block_kv, lay.v_part, lay.block_kv

  def body(t, j, slot):
    @pl.when(j == 0)
    def _init():
      for acc in dq_accs:
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    kvs = _kv_parts(kv_buf, slot, lay)
    p = _probs(_scores(q_refs, kvs, t, sm_scale, lay.precision), _valid(valid_ref, t, j), lse_ref, t)  # [H, bkv]
    do = do_ref[0, t]  # [H, v]
    dp = None
    for i, kv in enumerate(kvs):
      part = _dot(do[:, i * vp : (i + 1) * vp], kv[:, :vp], _NT, lay.precision)
      dp = part if dp is None else dp + part
    ds = p * (dp - _col(delta_ref[0, pl.ds(t, 1), :]))
    dsc = ds.astype(lay.dtype)
    for acc, kv in zip(dq_accs, kvs):
      acc[...] += sm_scale * _dot(dsc, kv, _NN, lay.precision)

    @pl.when(j == nkb - 1)
    def _emit_dq():
      for dq_ref, acc in zip(dq_refs, dq_accs):
        dq_ref[0, t] = acc[...].astype(dq_ref.dtype)

    # dkv rows of this block: key part for all D columns, value part for the first v
    dkv_blk = sm_scale * _dot(dsc, qfull_ref[0, t], _TN, lay.precision)  # [bkv, D]
    dkv_v = _dot(p.astype(lay.dtype), do, _TN, lay.precision)  # [bkv, v]

    # read-modify-write into the HBM accumulator, valid rows only (a -1 row must not touch row 0)
    def copy_rows(make_copy):
      def row(r, count):
        s_idx = idx_ref[0, t, j * bkv + r]

        @pl.when(s_idx >= 0)
        def _():
          make_copy(r, s_idx).start()

        return count + (s_idx >= 0).astype(jnp.int32)

      count = lax.fori_loop(0, bkv, row, 0, unroll=min(8, bkv))

      def wait(i, carry):
        make_copy(0, 0).wait()  # each row copy moves the same number of bytes
        return carry

      lax.fori_loop(0, count, wait, 0)

    copy_rows(
      lambda r, s_idx: pltpu.make_async_copy(dkv_hbm.at[b, pl.ds(s_idx, 1)], dkv_buf.at[pl.ds(r, 1)], rw_sem.at[0])
    )
    dkv_buf[...] += dkv_blk
    dkv_buf[:, : lay.v_dim] += dkv_v
    copy_rows(
      lambda r, s_idx: pltpu.make_async_copy(dkv_buf.at[pl.ds(r, 1)], dkv_hbm.at[b, pl.ds(s_idx, 1)], rw_sem.at[1])
    )

  _loop_blocks(lay, body, idx_ref, kv_hbm, kv_buf, sem)


def _backward_cost(lay: _Layout, q_dtype, k_len: int) -> pl.CostEstimate:
  """flops: per (query, key block) 2 * H * block_kv * (3 D + 2 v): the scores recomputed (D contracted), dp = do
  kv[:, :v]^T (v), dq += ds kv (block_kv contracted, D wide), dkv's key part ds^T q (H contracted, D wide) and
  value part p^T do (H contracted, v wide); in all 2 * B * T_pad * H * Kp * (3 D + 2 v).
  transcendentals: one exp a score (p from lse): B * T_pad * H * Kp.
  bytes_accessed: _common_bytes; the full q once more when packed (dkv's key part needs it unsplit); do
  [B, T_pad, H, v] (MXU dtype), lse and delta [B, T_pad, H] fp32, each read once; dq [B, T_pad, H, D] in q's dtype
  written once; and the dkv read-modify-write, one fp32 row of D read and written back per valid slot. The kernel
  skips it (pl.when) for -1 slots: the padding slots (t >= T, k >= K) never do it and are not counted; which of
  the B * T * K real slots are -1 is data, so all of them are counted (an upper bound, exact for a full top-k)."""
  per_query = lay.b * lay.t_pad * lay.heads
  itemsize = lay.dtype.itemsize
  q_full = per_query * lay.dim * itemsize if lay.packed else 0
  reads = q_full + per_query * (lay.v_dim * itemsize + 4 + 4)
  dq = per_query * lay.dim * jnp.dtype(q_dtype).itemsize
  dkv_rmw = 2 * lay.b * lay.t_len * k_len * lay.dim * 4
  return pl.CostEstimate(
    flops=int(2 * _slots(lay) * lay.heads * (3 * lay.dim + 2 * lay.v_dim)),
    transcendentals=int(_slots(lay) * lay.heads),
    bytes_accessed=int(_common_bytes(lay) + reads + dq + dkv_rmw),
  )


def _backward(q, kv, idx, o, lse, do, dlse, *, sm_scale, v_dim, blocks, interpret):
  lay = _layout(q, kv, idx, v_dim, blocks)
  idx_smem, idx_vmem = _indices(idx, lay)
  q_parts = _q_parts(q, lay)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  if dlse is not None:
    delta = delta - jnp.where(jnp.isneginf(lse), 0.0, dlse.astype(jnp.float32))
  args = [idx_smem, idx_vmem, *q_parts]
  in_specs = _common_specs(lay) + [_per_query(lay, lay.part_dim)] * lay.n_parts
  if lay.packed:
    args.append(_pad_t(q.astype(lay.dtype), lay))
    in_specs.append(_per_query(lay, lay.dim))
  args += [
    _pad_t(do.astype(lay.dtype), lay),
    _pad_t(lse, lay, -jnp.inf),
    _pad_t(delta, lay),
    _kv_words(kv, lay),
    jnp.zeros((lay.b, lay.s_len, lay.dim), jnp.float32),
  ]
  in_specs += [
    _per_query(lay, v_dim),
    _per_head(lay),
    _per_head(lay),
    pl.BlockSpec(memory_space=pl.ANY),
    pl.BlockSpec(memory_space=pl.ANY),
  ]
  kernel = functools.partial(_bwd_kernel, lay=lay, sm_scale=float(sm_scale))
  dq_shape = jax.ShapeDtypeStruct((lay.b, lay.t_pad, lay.heads, lay.part_dim), q.dtype)  # accumulated in fp32
  *dq_parts, dkv = pl.pallas_call(
    kernel,
    grid=(lay.b, lay.t_pad // lay.block_t),
    in_specs=in_specs,
    out_specs=[_per_query(lay, lay.part_dim)] * lay.n_parts + [pl.BlockSpec(memory_space=pl.ANY)],
    out_shape=[dq_shape] * lay.n_parts + [jax.ShapeDtypeStruct((lay.b, lay.s_len, lay.dim), jnp.float32)],
    input_output_aliases={len(args) - 1: lay.n_parts},
    scratch_shapes=[
      _kv_buf_shape(lay),
      pltpu.SemaphoreType.DMA((2,)),
      pltpu.VMEM((lay.block_kv, lay.dim), jnp.float32),
      pltpu.SemaphoreType.DMA((2,)),
    ]
    + [pltpu.VMEM((lay.heads, lay.part_dim), jnp.float32)] * lay.n_parts,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=_vmem_limit(lay, 2 * lay.block_kv * lay.dim * 4)
    ),
    cost_estimate=_backward_cost(lay, q.dtype, idx.shape[-1]),
    interpret=interpret,
  )(*args)
  dq = dq_parts[0]
  if lay.packed:  # [lo | hi] columns back to the original order
    dq = _take_columns(jnp.concatenate(dq_parts, axis=-1), np.argsort(np.concatenate(lay.part_columns())))
  return dq[:, : lay.t_len].astype(q.dtype), dkv.astype(kv.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attend(q, kv, idx, sm_scale, v_dim, blocks, interpret):
  return _forward(q, kv, idx, sm_scale=sm_scale, v_dim=v_dim, blocks=blocks, interpret=interpret, out_dtype=q.dtype)


def _attend_fwd(q, kv, idx, sm_scale, v_dim, blocks, interpret):
  o, lse = _attend(q, kv, idx, sm_scale, v_dim, blocks, interpret)
  return (o, lse), (q, kv, idx, o, lse)


def _attend_bwd(sm_scale, v_dim, blocks, interpret, res, cotangents):
  q, kv, idx, o, lse = res
  do, dlse = cotangents
  dq, dkv = _backward(q, kv, idx, o, lse, do, dlse, sm_scale=sm_scale, v_dim=v_dim, blocks=blocks, interpret=interpret)
  return dq, dkv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def sparse_mla_attention(
  q_BTHD: jax.Array,
  kv_BSD: jax.Array,
  idx_BTK: jax.Array,
  *,
  sm_scale: float,
  v_dim: int,
  block_sizes: SparseAttentionBlockSizes | None = None,
  interpret=None,
) -> tuple[jax.Array, jax.Array]:
  """Sparse attention of each query over its selected keys: (out [B, T, H, v_dim] in q's dtype, lse [B, T, H]
  fp32). Differentiable in q and kv (custom_vjp with Pallas backward kernels for dq and dkv).

  q [B, T, H, D], kv [B, S, D] (bf16 or fp32; fp32 accumulation), idx [B, T, K] integer; -1 or any index outside
  [0, S) is skipped; a query's indices must be distinct. interpret: None = compiled on TPU, Pallas interpret mode
  elsewhere; True, False or a pltpu.InterpretParams to force.
  """
  check_block_sizes("sparse_mla_attention", block_sizes, SparseAttentionBlockSizes)
  check_ranks(
    "sparse_mla_attention", q=(q_BTHD, "[B, T, H, D]"), kv=(kv_BSD, "[B, S, D]"), indices=(idx_BTK, "[B, T, K]")
  )
  b, t_len, _, dim = q_BTHD.shape
  if kv_BSD.shape[0] != b or kv_BSD.shape[2] != dim or idx_BTK.shape[:2] != (b, t_len):
    raise ValueError(
      f"sparse_mla_attention: q {q_BTHD.shape} needs kv [{b}, S, {dim}] and indices [{b}, {t_len}, "
      f"K]; got kv {kv_BSD.shape}, indices {idx_BTK.shape}"
    )
  if not jnp.issubdtype(idx_BTK.dtype, jnp.integer):
    raise TypeError(f"sparse_mla_attention: indices dtype {idx_BTK.dtype}; must be an integer type")
  if isinstance(v_dim, bool) or not isinstance(v_dim, (int, np.integer)) or not 0 < v_dim <= dim:
    raise ValueError(f"sparse_mla_attention: v_dim={v_dim!r}; must be an int in [1, D={dim}]")
  interpret = resolve_interpret(interpret)
  return _attend(
    q_BTHD, kv_BSD, idx_BTK, float(sm_scale), int(v_dim), block_sizes or SparseAttentionBlockSizes(), interpret
  )
