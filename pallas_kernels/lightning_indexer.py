"""Pallas TPU kernel: DSA lightning-indexer scores fused with an exact, deterministic streaming top-k.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])                                     (DS32 Eq. 1)
Same interface and the same output, bit for bit in the indices, as lightning_indexer_reference.py: the `topk`
best visible keys per query in descending score order, ties to the lower key index, index -1 / score -inf where
fewer than topk keys are visible. Scores are ordered by the IEEE total order, as lax.top_k orders them (-0.0 below
+0.0; a NaN score would rank above +inf), with a score of exactly zero always +0.0 (in the reference too), so the
order among zero scores is by key index alone. Visibility: the rule of pallas_kernels/visibility.py (causal from
q_offset, segments, GLM's prefix ends), as in the reference. Grid (batch, query block, key block), the key axis
sequential; the top-k is a bitonic sorting network, never a [T, S] array. Kp = topk rounded up to a power of two
(>= 8); the wrapper drops the extra rows. The algorithm, its cost and memory: docs/kernels.md, "The indexer kernel".
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
from pallas_kernels.visibility import Visibility

_INT32_MAX = np.iinfo(np.int32).max
# The order key of -inf: int32 bits of -inf with the 31 low bits flipped (see _order_key).
_NEG_INF_KEY = int(np.array(-np.inf, np.float32).view(np.int32) ^ np.int32(0x7FFFFFFF))
_NEG_ZERO_KEY = -1  # the order key of -0.0 (that of +0.0 is 0)


@dataclasses.dataclass(frozen=True)
class IndexerBlockSizes:
  """Tile sizes; they change speed and VMEM, never the result.

  block_q: queries per grid step, laid on lanes: a multiple of 128, or at least T (one block of all queries).
  block_k: keys per grid step = the size of the tile sorted at once: a power of two >= 8. Capped at S rounded
    up to a power of two. Per key, the network is cheapest at block_k = Kp (topk rounded up to a power of 2).
  """

  block_q: int = 128
  block_k: int = 2048

  def __post_init__(self):
    if self.block_q <= 0 or (self.block_q % 8):
      raise ValueError(
        f"IndexerBlockSizes.block_q={self.block_q}; must be a positive multiple of 8 "
        "(a multiple of 128 unless one block holds all queries)"
      )
    if self.block_k < 8 or (self.block_k & (self.block_k - 1)):
      raise ValueError(f"IndexerBlockSizes.block_k={self.block_k}; must be a power of two >= 8")


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _order_key(x_f32: jax.Array) -> jax.Array:
  """fp32 -> int32 whose signed order is the IEEE total order (-nan < -inf < ... < -0 < +0 < ... < +inf < nan).
  Negative floats get their 31 low bits flipped; the map is its own inverse on int32 bit patterns."""
  bits = lax.bitcast_convert_type(x_f32, jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _key_to_f32(key: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def _better(ka, ia, kb, ib):
  """a ranks before b: higher key, or the same key and a lower key index."""
  return (ka > kb) | ((ka == kb) & (ia < ib))


# ----------------------------------------------------------------------------------------------------------------
# Bitonic network on a (key_ref, idx_ref) region of n rows [base, base + n), each lane sorted independently.
# A pass with pair distance d compare-exchanges rows p and p + d for every p with bit d clear. Its direction:
# with a stage size sz, the pair at p ends best-first when ((p & sz) == 0) == best_first (bitonic sort stages);
# with sz None, best-first exactly when best_first (bitonic merge of a bitonic sequence).
# ----------------------------------------------------------------------------------------------------------------


def _far_pass(k_ref, i_ref, base: int, n: int, d: int, sz: int | None, best_first: bool, c: int) -> None:
  """One pass with d >= c: the partners of a c-row chunk at lo are the c rows at lo + d."""
  log_per_group = (d // c).bit_length() - 1

  def body(j, carry):
    g = j >> log_per_group
    lo = g * (2 * d) + (j - (g << log_per_group)) * c
    rows_a = pl.ds(pl.multiple_of(base + lo, c), c)
    rows_b = pl.ds(pl.multiple_of(base + lo + d, c), c)
    ka, ia, kb, ib = k_ref[rows_a], i_ref[rows_a], k_ref[rows_b], i_ref[rows_b]
    a_wins = _better(ka, ia, kb, ib)
    if sz is None:
      swap = ~a_wins if best_first else a_wins
    else:  # the whole chunk lies in one sz-block (c <= d < sz): one direction, as a lane-broadcast vector
      desc = (((lo & sz) == 0) == best_first).astype(jnp.int32)
      swap = a_wins ^ (jnp.full(a_wins.shape, desc, jnp.int32) != 0)
    k_ref[rows_a] = jnp.where(swap, kb, ka)
    k_ref[rows_b] = jnp.where(swap, ka, kb)
    i_ref[rows_a] = jnp.where(swap, ib, ia)
    i_ref[rows_b] = jnp.where(swap, ia, ib)
    return carry

  lax.fori_loop(0, n // (2 * c), body, 0)


def _near_passes(k_ref, i_ref, base: int, n: int, ds: list[int], sz: int | None, best_first: bool, c: int) -> None:
  """The passes d in ds (all < c) of one stage, fused: each c-row chunk is loaded once, exchanged in vregs with
  partners from sublane rolls, stored once."""
  lanes = k_ref.shape[1]
  row = lax.broadcasted_iota(jnp.int32, (c, lanes), 0)
  # Per d, loop invariants: which roll holds the partner row p ^ d, whether the row is the pair's upper one, and
  # want_win: the row keeps the better of the pair iff it is the lower row of a best-first pair or the upper row
  # of a worst-first one.
  plan = []
  for d in ds:
    from_first = pltpu.roll(row, d, 0) == (row ^ d)  # robust to the roll direction convention
    upper = (row & d) != 0
    if sz is None:
      want_win = ~upper if best_first else upper
    elif sz < c:
      want_win = upper ^ (((row & sz) == 0) if best_first else ((row & sz) != 0))
    else:
      want_win = None  # one direction per chunk, known in the loop
    plan.append((d, from_first, upper, want_win))

  def body(j, carry):
    off = pl.multiple_of(j * c, c)
    rows = pl.ds(pl.multiple_of(base + off, c), c)
    key, idx = k_ref[rows], i_ref[rows]
    for d, from_first, upper, want_win in plan:
      pkey = jnp.where(from_first, pltpu.roll(key, d, 0), pltpu.roll(key, c - d, 0))
      pidx = jnp.where(from_first, pltpu.roll(idx, d, 0), pltpu.roll(idx, c - d, 0))
      me_wins = _better(key, idx, pkey, pidx)
      if want_win is None:
        desc = (((off & sz) == 0) == best_first).astype(jnp.int32)
        want_win = upper ^ (jnp.full(upper.shape, desc, jnp.int32) != 0)
      keep = ~(me_wins ^ want_win)
      key = jnp.where(keep, key, pkey)
      idx = jnp.where(keep, idx, pidx)
    k_ref[rows] = key
    i_ref[rows] = idx
    return carry

  lax.fori_loop(0, n // c, body, 0)


def _stage(k_ref, i_ref, base: int, n: int, d_top: int, sz: int | None, best_first: bool, c: int) -> None:
  """Passes d = d_top, d_top / 2, ..., 1."""
  c = min(c, n)
  d = d_top
  while d >= c:
    _far_pass(k_ref, i_ref, base, n, d, sz, best_first, c)
    d //= 2
  if d >= 1:
    _near_passes(k_ref, i_ref, base, n, [d >> e for e in range(d.bit_length())], sz, best_first, c)


def _bitonic_sort(k_ref, i_ref, base: int, n: int, best_first: bool, c: int) -> None:
  """Sorts rows [base, base + n) of every lane; n a power of two. log2(n) stages, n*log2(n)*(log2(n)+1)/4
  compare-exchanges per lane."""
  sz = 2
  while sz <= n:
    _stage(k_ref, i_ref, base, n, sz // 2, sz, best_first, c)
    sz *= 2


def _bitonic_merge(k_ref, i_ref, base: int, n: int, best_first: bool, c: int) -> None:
  """Sorts a bitonic region (monotone up then down, or down then up): n*log2(n)/2 compare-exchanges per lane."""
  if n > 1:
    _stage(k_ref, i_ref, base, n, n // 2, None, best_first, c)


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


def _indexer_topk_kernel(
  *refs,
  num_heads: int,
  block_q: int,
  block_k: int,
  kp: int,
  s_len: int,
  causal: bool,
  has_segments: bool,
  has_prefix: bool,
  chunk: int,
  score_chunk: int,
  precision: lax.Precision | None,
):
  # scalar prefetch, in SMEM: [q_offset] or, with a prefix, [q_offset, reach of (batch 0, query block 0), ...]
  off_ref, q_ref, k_ref, w_ref, *refs = refs
  qseg_ref = kvseg_ref = pe_ref = None
  if has_segments:
    qseg_ref, kvseg_ref, *refs = refs
  if has_prefix:
    pe_ref, *refs = refs
  oidx_ref, oval_ref, acc_ref, ck_ref, ci_ref, rk_ref, ri_ref = refs
  q_offset = off_ref[0]
  qi, kj = pl.program_id(1), pl.program_id(2)
  t0, s0 = qi * block_q, kj * block_k

  @pl.when(kj == 0)
  def _init():
    rk_ref[...] = jnp.full(rk_ref.shape, _NEG_INF_KEY, jnp.int32)
    ri_ref[...] = jnp.full(ri_ref.shape, _INT32_MAX, jnp.int32)

  # The tile is needed unless the causal mask (widened by any prefix) hides all of it from every query of the block.
  if not causal:
    needed = kj >= 0
  elif has_prefix:
    needed = s0 <= off_ref[1 + pl.program_id(0) * pl.num_programs(1) + qi]
  else:
    needed = s0 <= t0 + (block_q - 1) + q_offset

  @pl.when(needed)
  def _tile():
    # 1. scores: acc[s, t] = sum_h w[t, h] * relu(k[s] . q[t, h])                            (DS32 Eq. 1)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def head(h, carry):
      q_DT = q_ref[0, h]
      w_1T = w_ref[0, pl.ds(h, 1), :]

      def rows_chunk(r, carry):
        rows = pl.ds(pl.multiple_of(r * score_chunk, score_chunk), score_chunk)
        qk_ST = jnp.dot(k_ref[0, rows, :], q_DT, preferred_element_type=jnp.float32, precision=precision)
        acc_ref[rows] += w_1T * jnp.maximum(qk_ST, 0.0)
        return carry

      return lax.fori_loop(0, block_k // score_chunk, rows_chunk, carry)

    lax.fori_loop(0, num_heads, head, 0)

    # 1b. mask, map to order keys, fill the tile buffers; track each lane's best tile key
    def mask_chunk(r, tile_max):
      rows = pl.ds(pl.multiple_of(r * score_chunk, score_chunk), score_chunk)
      shape = (score_chunk, block_q)
      s_idx = s0 + r * score_chunk + lax.broadcasted_iota(jnp.int32, shape, 0)
      visible = s_idx < s_len
      if causal:
        below = s_idx <= t0 + q_offset + lax.broadcasted_iota(jnp.int32, shape, 1)
        if has_prefix:
          below |= s_idx < pe_ref[0]  # [rows, Tb] < [1, Tb]: inside the query's bidirectional prefix
        visible &= below
      if has_segments:
        visible &= kvseg_ref[0, rows, :] == qseg_ref[0]  # [rows, 1] == [1, Tb]
      key = _order_key(acc_ref[rows])
      key = jnp.where(visible, jnp.where(key == _NEG_ZERO_KEY, 0, key), _NEG_INF_KEY)  # -0.0 -> +0.0
      ck_ref[rows] = key
      ci_ref[rows] = s_idx
      return jnp.maximum(tile_max, jnp.max(key, axis=0, keepdims=True))

    tile_max = lax.fori_loop(0, block_k // score_chunk, mask_chunk, jnp.full((1, block_q), _NEG_INF_KEY, jnp.int32))

    # 2. merge only when some lane has a tile key that can enter its running top-k
    worst = rk_ref[kp - 1 : kp, :]
    enters = jnp.max(jnp.where(tile_max >= worst, 1, 0)) > 0

    @pl.when(enters)
    def _merge():
      # 3. sort the tile worst-first; better-of against the running buffer's worst m; re-sort best-first
      _bitonic_sort(ck_ref, ci_ref, 0, block_k, False, chunk)
      m = min(block_k, kp)
      c = min(chunk, m)

      def better_of(r, carry):
        rows_r = pl.ds(pl.multiple_of(kp - m + r * c, c), c)
        rows_c = pl.ds(pl.multiple_of(block_k - m + r * c, c), c)
        kr, ir, kc, ic = rk_ref[rows_r], ri_ref[rows_r], ck_ref[rows_c], ci_ref[rows_c]
        tile_wins = _better(kc, ic, kr, ir)
        rk_ref[rows_r] = jnp.where(tile_wins, kc, kr)
        ri_ref[rows_r] = jnp.where(tile_wins, ic, ir)
        return carry

      lax.fori_loop(0, m // c, better_of, 0)
      if m == kp:
        _bitonic_merge(rk_ref, ri_ref, 0, kp, True, chunk)
      else:  # [best-first head | bitonic tail]: sort the tail worst-first, the whole is then bitonic
        _bitonic_merge(rk_ref, ri_ref, kp - m, m, False, chunk)
        _bitonic_merge(rk_ref, ri_ref, 0, kp, True, chunk)

  # 4. emit: [Kp, Tb] -> [Tb, Kp], -inf rows get index -1
  @pl.when(kj == pl.num_programs(2) - 1)
  def _emit():
    width = min(kp, 128)
    for c0 in range(0, kp, width):
      key = rk_ref[c0 : c0 + width, :]
      idx = jnp.where(key == _NEG_INF_KEY, -1, ri_ref[c0 : c0 + width, :])
      oidx_ref[0, :, c0 : c0 + width] = idx.T
      oval_ref[0, :, c0 : c0 + width] = _key_to_f32(key).T


def _resolve_blocks(block_sizes: IndexerBlockSizes | None, t_len: int, s_len: int) -> tuple[int, int]:
  bs = block_sizes or IndexerBlockSizes()
  if t_len <= bs.block_q:
    block_q = round_up(t_len, 8)
  elif bs.block_q % 128:
    raise ValueError(
      f"IndexerBlockSizes.block_q={bs.block_q} with T={t_len} queries: queries lie on the 128 "
      f"lanes, so a block smaller than T must be a multiple of 128 (or block_q >= {t_len})"
    )
  else:
    block_q = bs.block_q
  block_k = min(bs.block_k, max(8, _next_pow2(s_len)))
  return block_q, block_k


def _chunk_rows(block_q: int) -> int:
  """Rows per vreg-resident chunk in the network: about 4 vregs (4096 words) per array."""
  return max(8, min(32, 4096 // max(block_q, 128)))


def lightning_indexer_topk(
  q_BTHD: jax.Array,
  k_BSD: jax.Array,
  w_BTH: jax.Array,
  *,
  topk: int,
  visibility: Visibility | None = None,
  block_sizes: IndexerBlockSizes | None = None,
  interpret=None,
) -> tuple[jax.Array, jax.Array]:
  """Top-`topk` keys per query by lightning-indexer score: (indices [B, T, topk] int32, scores [B, T, topk] fp32),
  descending score, ties to the lower key index, -1 / -inf where fewer than topk keys are visible.

  q [B, T, H, D] and k [B, S, D] in bf16 or fp32 (products accumulated in fp32), w [B, T, H]. Which keys each
  query sees: `visibility` (pallas_kernels/visibility.py; None: causal, no segments, q_offset 0). Its q_offset may be
  a traced int scalar, e.g. a decode position: it is a runtime argument of the kernel, so one compile serves every
  offset.
  interpret: None = compiled on TPU, Pallas interpret mode elsewhere; True, False or a pltpu.InterpretParams to
  force.
  No gradient: the inputs pass through stop_gradient, so the scores are constants to autodiff; where a loss needs
  their gradient, recompute them on the selected indices with the reference formula.
  """
  if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk <= 0:
    raise ValueError(f"lightning_indexer_topk: topk={topk!r}; must be a positive integer")
  check_block_sizes("lightning_indexer_topk", block_sizes, IndexerBlockSizes)
  check_ranks("lightning_indexer_topk", q=(q_BTHD, "[B, T, H, D]"), k=(k_BSD, "[B, S, D]"), w=(w_BTH, "[B, T, H]"))
  b, t_len, num_heads, dim = q_BTHD.shape
  s_len = k_BSD.shape[1]
  if k_BSD.shape != (b, s_len, dim) or w_BTH.shape != (b, t_len, num_heads):
    raise ValueError(
      f"lightning_indexer_topk: q {q_BTHD.shape} needs k [{b}, S, {dim}] and w [{b}, {t_len}, "
      f"{num_heads}]; got k {k_BSD.shape}, w {w_BTH.shape}"
    )
  vis = (visibility or Visibility()).check("lightning_indexer_topk", b, t_len, s_len)
  interpret = resolve_interpret(interpret)
  q_BTHD, k_BSD, w_BTH = (lax.stop_gradient(x) for x in (q_BTHD, k_BSD, w_BTH))
  vis = dataclasses.replace(vis, q_offset=jnp.asarray(vis.offset, jnp.int32))  # a runtime scalar: one compile
  return _indexer_topk(q_BTHD, k_BSD, w_BTH, vis, topk=int(topk), block_sizes=block_sizes, interpret=interpret)


def _indexer_cost(
  *,
  b: int,
  t_pad: int,
  s_pad: int,
  num_heads: int,
  dim: int,
  kp: int,
  block_q: int,
  block_k: int,
  itemsize: int,
  has_segments: bool,
  has_prefix: bool,
) -> pl.CostEstimate:
  """What the grid (b, n_q = t_pad / block_q, n_k = s_pad / block_k) statically runs, for XLA's cost model.

  flops: the MXU products only, 2 * H * D * block_q * block_k per tile (one [block_k, D] @ [D, block_q] a head),
    for every tile the grid visits, padded queries and keys included: 2 * b * H * D * t_pad * s_pad. The causal
    skip (pl.when on s0 <= t0 + block_q - 1 + q_offset, or on the block's reach with a prefix) depends on q_offset
    and the prefix ends, runtime values, so it is not subtracted: an upper bound for causal calls (exact for
    non-causal ones). Not counted: the VPU's relu / scale / add of the scores and the bitonic network's integer
    compare-exchanges (not FLOPs of a product; the network is data-dependent too: it runs only for tiles with a
    key that enters the running top-k).
  transcendentals: none.
  bytes_accessed (HBM): each input block once per grid step at which its block index changes, the key axis
    innermost: q [H, D, block_q] (itemsize) and w [H, block_q] fp32 (and the query segment ids and prefix ends,
    int32 each) once per (batch, query block), i.e. once in all; the key block [block_k, D] (and its segment ids,
    int32) at every step when n_k > 1 (b * n_q * s_pad rows), once per batch element when n_k == 1 (its index
    never changes). Causal index maps repeat the last needed key block past the diagonal, which skips those
    copies, but where the diagonal (or a prefix's reach) lies depends on q_offset (and the prefix ends): counted
    as if every key block were needed (upper bound). The two outputs [block_q, Kp] (int32 and fp32) written once
    per (batch, query block). Plus the scalar prefetch: q_offset, 4 bytes, and with a prefix each (batch, query
    block)'s reach, 4 * b * n_q bytes more.
  """
  n_q, n_k = t_pad // block_q, s_pad // block_k
  key_fetches = b * (n_q * n_k if n_k > 1 else 1)
  flops = 2 * b * num_heads * dim * t_pad * s_pad
  q_w = b * t_pad * (num_heads * dim * itemsize + num_heads * 4 + 4 * (int(has_segments) + int(has_prefix)))
  keys = key_fetches * block_k * (dim * itemsize + (4 if has_segments else 0))
  outputs = 2 * b * t_pad * kp * 4
  scalars = 4 * (1 + (b * n_q if has_prefix else 0))
  return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(q_w + keys + outputs + scalars))


@functools.partial(jax.jit, static_argnames=("topk", "block_sizes", "interpret"))
def _indexer_topk(q_BTHD, k_BSD, w_BTH, vis: Visibility, *, topk, block_sizes, interpret):
  b, t_len, num_heads, dim = q_BTHD.shape
  s_len = k_BSD.shape[1]
  causal, q_prefix_end = vis.causal, vis.q_prefix_end
  q_segment_ids, kv_segment_ids = vis.q_segment_ids, vis.kv_segment_ids
  q_offset_1 = vis.q_offset.reshape(1)
  has_segments = q_segment_ids is not None
  has_prefix = q_prefix_end is not None
  kp = max(8, _next_pow2(topk))
  block_q, block_k = _resolve_blocks(block_sizes, t_len, s_len)
  t_pad, s_pad = round_up(t_len, block_q), round_up(s_len, block_k)
  chunk = _chunk_rows(block_q)
  score_chunk = min(block_k, 256)

  dtype = jnp.promote_types(q_BTHD.dtype, k_BSD.dtype)
  dtype = dtype if dtype in (jnp.bfloat16, jnp.float32) else jnp.float32
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  # Queries on lanes: q as [B, H, D, T] (a plain NN matmul per head), w as [B, H, T].
  q_BHDT = jnp.pad(q_BTHD.astype(dtype), ((0, 0), (0, t_pad - t_len), (0, 0), (0, 0))).transpose(0, 2, 3, 1)
  w_BHT = jnp.pad(w_BTH.astype(jnp.float32), ((0, 0), (0, t_pad - t_len), (0, 0))).transpose(0, 2, 1)
  k_BSD = jnp.pad(k_BSD.astype(dtype), ((0, 0), (0, s_pad - s_len), (0, 0)))

  n_q, n_k = t_pad // block_q, s_pad // block_k
  scalars = q_offset_1
  if has_prefix:
    # Ends clipped to [0, S] (before int32, so no unsigned end wraps): the same mask, keys lying in [0, S), and
    # end - 1 cannot wrap around. Padded queries get 0 (causal). A query block's reach: its last query's causal
    # limit or its widest prefix, - 1.
    pe_BT = q_prefix_end
    if jnp.iinfo(pe_BT.dtype).max > s_len:
      pe_BT = jnp.minimum(pe_BT, s_len)
    pe_BT = jnp.pad(jnp.maximum(pe_BT.astype(jnp.int32), 0), ((0, 0), (0, t_pad - t_len)))
    diag_Q = jnp.arange(1, n_q + 1, dtype=jnp.int32) * block_q - 1 + q_offset_1[0]
    reach_BQ = jnp.maximum(diag_Q[None, :], pe_BT.reshape(b, n_q, block_q).max(axis=-1) - 1)
    scalars = jnp.concatenate([q_offset_1, reach_BQ.reshape(b * n_q)])  # SMEM [1 + B * n_q]

  # Index maps get the program ids (bi, i, j) and the scalar-prefetched SMEM ref as their last argument.
  if causal:  # key blocks past the reach repeat the last needed block: Pallas skips the copy

    def k_block(bi, i, j, sc_ref):  # lax.div: no floor_divide (it lowers through sign, which needs a TPU attached)
      reach = sc_ref[1 + bi * n_q + i] if has_prefix else (i + 1) * block_q - 1 + sc_ref[0]
      last = lax.div(jnp.maximum(reach, 0), block_k)
      return jnp.minimum(jnp.minimum(j, last), n_k - 1)
  else:

    def k_block(bi, i, j, sc_ref):
      return j

  in_specs = [
    pl.BlockSpec((1, num_heads, dim, block_q), lambda bi, i, j, sc: (bi, 0, 0, i)),
    pl.BlockSpec((1, block_k, dim), lambda bi, i, j, sc: (bi, k_block(bi, i, j, sc), 0)),
    pl.BlockSpec((1, num_heads, block_q), lambda bi, i, j, sc: (bi, 0, i)),
  ]
  args = [q_BHDT, k_BSD, w_BHT]
  if has_segments:
    qseg_B1T = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, t_pad - t_len)))[:, None, :]
    kvseg_BS1 = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, s_pad - s_len)))[:, :, None]
    in_specs += [
      pl.BlockSpec((1, 1, block_q), lambda bi, i, j, sc: (bi, 0, i)),
      pl.BlockSpec((1, block_k, 1), lambda bi, i, j, sc: (bi, k_block(bi, i, j, sc), 0)),
    ]
    args += [qseg_B1T, kvseg_BS1]
  if has_prefix:
    in_specs.append(pl.BlockSpec((1, 1, block_q), lambda bi, i, j, sc: (bi, 0, i)))
    args.append(pe_BT[:, None, :])
  out_spec = pl.BlockSpec((1, block_q, kp), lambda bi, i, j, sc: (bi, i, 0))

  itemsize = jnp.dtype(dtype).itemsize
  vmem_bytes = (
    2 * (num_heads * dim * block_q + block_k * dim) * itemsize
    + 2 * num_heads * block_q * 4
    + 2 * 2 * block_q * kp * 4
    + 3 * block_k * block_q * 4
    + 2 * kp * block_q * 4
    + (2 * block_k * 128 * 4 if has_segments else 0)  # [block_k, 1] kv segment ids: 128 lanes wide
    + 2 * 8 * block_q * 4 * (int(has_segments) + int(has_prefix))
  )  # [1, block_q] blocks: 8 sublanes
  kernel = functools.partial(
    _indexer_topk_kernel,
    num_heads=num_heads,
    block_q=block_q,
    block_k=block_k,
    kp=kp,
    s_len=s_len,
    causal=causal,
    has_segments=has_segments,
    has_prefix=has_prefix,
    chunk=chunk,
    score_chunk=score_chunk,
    precision=precision,
  )
  idx_BTK, val_BTK = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, n_q, n_k),
      in_specs=in_specs,
      out_specs=[out_spec, out_spec],
      scratch_shapes=[
        pltpu.VMEM((block_k, block_q), jnp.float32),  # score accumulator
        pltpu.VMEM((block_k, block_q), jnp.int32),  # tile keys
        pltpu.VMEM((block_k, block_q), jnp.int32),  # tile key indices
        pltpu.VMEM((kp, block_q), jnp.int32),  # running top-k keys, best first
        pltpu.VMEM((kp, block_q), jnp.int32),
      ],
    ),  # running top-k key indices
    out_shape=[jax.ShapeDtypeStruct((b, t_pad, kp), jnp.int32), jax.ShapeDtypeStruct((b, t_pad, kp), jnp.float32)],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit(vmem_bytes)
    ),
    cost_estimate=_indexer_cost(
      b=b,
      t_pad=t_pad,
      s_pad=s_pad,
      num_heads=num_heads,
      dim=dim,
      kp=kp,
      block_q=block_q,
      block_k=block_k,
      itemsize=itemsize,
      has_segments=has_segments,
      has_prefix=has_prefix,
    ),
    interpret=interpret,
  )(scalars, *args)
  return idx_BTK[:, :t_len, :topk], val_BTK[:, :t_len, :topk]
