"""Prefix-bidirectional visibility (GLM's blank infilling) in the lightning indexer's top-k: the kernel
(pallas_kernels/lightning_indexer.py) against the reference, and the Visibility's mask (pallas_kernels/visibility.py)
against a plain loop.

The rule: with q_prefix_end [B, T], key s is visible to query t when s <= max(t + q_offset, q_prefix_end[t] - 1)
and both lie in the same segment. In the kernel a prefix widens each query block's reach past its causal diagonal,
which decides both which key tiles are skipped and which key block the index maps fetch; the data below is chosen
so that prefixes reach key blocks past the diagonal (the tests assert it), so a kernel that skipped or fetched by
the causal diagonal alone would lose keys. Integer inputs (see test_lightning_indexer.py) make every score exact,
so indices and scores must be equal exactly. Interpret mode on CPU; the TPU test compiles through libtpu's
topology descriptions (skipped without libtpu).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from glm_jax.model import dsa
from glm_jax.sharding.mesh import make_mesh
from glm_jax.sharding.topology import tpu_topology_devices
from pallas_kernels import lightning_indexer_reference as reference
from pallas_kernels.lightning_indexer import IndexerBlockSizes, lightning_indexer_topk
from pallas_kernels.visibility import Visibility
from tests import helpers
from tests.helpers import needs_libtpu
from tests.pallas_kernels.test_lightning_indexer import _assert_same, _int_inputs


def _documents(rng, b, s_len, bounds):
  """Packed documents with a random bidirectional prefix each: (segment ids [B, S], prefix end per key [B, S]).

  bounds[bi]: the document starts of row bi after 0. Each document [start, end) gets a prefix end drawn from
  [start, end] (start: no prefix, end: the whole document bidirectional), as an absolute key position."""
  seg, end = np.zeros((b, s_len), np.int32), np.zeros((b, s_len), np.int32)
  for bi in range(b):
    edges = [0, *bounds[bi], s_len]
    for d, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
      seg[bi, lo:hi] = d
      end[bi, lo:hi] = rng.integers(lo, hi + 1)
  return seg, end


def _reach_past_diagonal(pe, q_offset, block_q, block_k):
  """[B, n_q] bool: the query block's widest prefix lies in a key block past the one holding its causal
  diagonal (where only the prefix-aware reach keeps the kernel from skipping it or fetching the wrong block)."""
  b, t_len = pe.shape
  n_q = -(-t_len // block_q)
  pe = np.pad(pe, ((0, 0), (0, n_q * block_q - t_len)))
  diag = (np.arange(n_q) + 1) * block_q - 1 + q_offset
  return (pe.reshape(b, n_q, block_q).max(-1) - 1) // block_k > diag[None] // block_k


def _loop_mask(t_len, s_len, q_offset, q_seg, kv_seg, pe):
  """The visibility rule, one (batch, query, key) at a time."""
  b = pe.shape[0]
  mask = np.zeros((b, t_len, s_len), bool)
  for bi in range(b):
    for t in range(t_len):
      for s in range(s_len):
        mask[bi, t, s] = s <= max(t + q_offset, pe[bi, t] - 1) and q_seg[bi, t] == kv_seg[bi, s]
  return mask


@pytest.mark.parametrize(
  "b, t_len, s_len, q_offset, bounds, topk, block_k",
  [
    # one query block (T=24 lanes) at positions 8..31 of 96 keys in 12 key blocks: its diagonal is key block 3
    (2, 24, 96, 8, [[20, 70], [50]], 10, 8),
    # two query blocks (T=160 padded to 256), diagonal of block 0 in key block 4 of 7; row 0's second document
    # reaches further from block 0 than row 1's does
    (2, 160, 224, 16, [[100, 220], [30, 150]], 20, 32),
  ],
)
def test_kernel_equals_reference_with_prefixes(b, t_len, s_len, q_offset, bounds, topk, block_k):
  kv_seg, end_S = _documents(np.random.default_rng(4), b, s_len, bounds)
  q_seg, pe = kv_seg[:, q_offset : q_offset + t_len], end_S[:, q_offset : q_offset + t_len]
  past = _reach_past_diagonal(pe, q_offset, 128 if t_len > 128 else t_len, block_k)
  assert past[0, 0] and not past[1, 0]  # the data exercises the prefix reach, per batch row
  q, k, w = _int_inputs(12, b, t_len, s_len, 3, 8)
  vis = Visibility(q_offset, jnp.asarray(q_seg), jnp.asarray(kv_seg), jnp.asarray(pe))
  kw = {"topk": topk, "visibility": vis}
  got = lightning_indexer_topk(q, k, w, block_sizes=IndexerBlockSizes(128, block_k), **kw)
  want = reference.lightning_indexer_topk(q, k, w, **kw)
  _assert_same(got, want)
  # the prefixes matter: some queries select keys after their own position, all of them inside their prefix
  idx = np.asarray(got[0])
  t_abs = np.arange(t_len)[None, :, None] + q_offset
  ahead = (idx > t_abs) & (idx >= 0)
  assert ahead.sum() > t_len and (idx < pe[:, :, None])[ahead].all()


def test_mask_equals_the_rule_in_a_loop():
  rng = np.random.default_rng(13)
  b, t_len, s_len, q_offset = 2, 9, 15, 4
  kv_seg = np.sort(rng.integers(0, 3, (b, s_len)), axis=1).astype(np.int32)
  q_seg = kv_seg[:, q_offset : q_offset + t_len]
  pe = rng.integers(-3, s_len + 4, (b, t_len)).astype(np.int32)  # negative and past S too
  kv_seg[0] = 0  # row 0: one document
  pe[0, :3] = [0, 6, 8]  # no prefix; query 1's own causal limit (t + q_offset + 1 = 6); one key past query 2's
  mask = Visibility(q_offset, jnp.asarray(q_seg), jnp.asarray(kv_seg), jnp.asarray(pe)).mask(t_len, s_len)
  want = _loop_mask(t_len, s_len, q_offset, q_seg, kv_seg, pe)
  np.testing.assert_array_equal(np.asarray(mask), want)
  causal = _loop_mask(t_len, s_len, q_offset, q_seg, kv_seg, np.zeros_like(pe))
  np.testing.assert_array_equal(want[0, :2], causal[0, :2])
  assert np.flatnonzero(want[0, 2] & ~causal[0, 2]).tolist() == [7]
  assert (want & ~causal).sum() > 10 and not want.all()


def test_no_prefix_all_zeros_and_causal_ends_are_the_causal_result():
  # q_prefix_end None, all zeros, or t + q_offset + 1 (each query's own causal limit) leave the mask causal. The
  # ends are data: one compile serves every value.
  b, t_len, s_len, q_offset = 2, 20, 48, 28
  q, k, w = _int_inputs(14, b, t_len, s_len, 2, 8)
  blocks = IndexerBlockSizes(128, 8)
  causal = Visibility(q_offset=q_offset)
  want = reference.lightning_indexer_topk(q, k, w, topk=12, visibility=causal)
  _assert_same(lightning_indexer_topk(q, k, w, topk=12, visibility=causal, block_sizes=blocks), want)
  with_prefix = lambda pe: Visibility(q_offset=q_offset, q_prefix_end=pe)  # noqa: E731
  step = jax.jit(lambda pe: lightning_indexer_topk(q, k, w, topk=12, visibility=with_prefix(pe), block_sizes=blocks))
  zeros = jnp.zeros((b, t_len), jnp.int32)
  own = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32) + q_offset + 1, (b, t_len))
  for pe in (zeros, own, zeros - 5):
    _assert_same(step(pe), want)
    _assert_same(reference.lightning_indexer_topk(q, k, w, topk=12, visibility=with_prefix(pe)), want)
  assert step._cache_size() == 1
  np.testing.assert_array_equal(
    np.asarray(with_prefix(own).mask(t_len, s_len)),
    np.asarray(jnp.broadcast_to(causal.mask(t_len, s_len), (b, t_len, s_len))),
  )


@pytest.mark.parametrize("fn", ["kernel", "reference", "mask"])
def test_errors_name_q_prefix_end(fn):
  q, k, w = _int_inputs(0, 2, 8, 12, 2, 8)
  call = {
    "kernel": lambda **kw: lightning_indexer_topk(q, k, w, topk=4, visibility=Visibility(**kw)),
    "reference": lambda **kw: reference.lightning_indexer_topk(q, k, w, topk=4, visibility=Visibility(**kw)),
    "mask": lambda **kw: Visibility(**kw).mask(8, 12),
  }[fn]
  with pytest.raises(ValueError, match=r"q_prefix_end shape \(2, 9\); want \[B, T\] = \[(2|B), 8\]"):
    call(q_prefix_end=jnp.zeros((2, 9), jnp.int32))
  with pytest.raises(ValueError, match=r"q_prefix_end shape \(8,\); want \[B, T\]"):
    call(q_prefix_end=jnp.zeros((8,), jnp.int32))
  with pytest.raises(ValueError, match=r"q_prefix_end dtype float32; want an integer dtype"):
    call(q_prefix_end=jnp.zeros((2, 8), jnp.float32))
  with pytest.raises(ValueError, match=r"q_prefix_end given with causal=False"):
    call(q_prefix_end=jnp.zeros((2, 8), jnp.int32), causal=False)


def _select_inputs():
  b, t_len, s_len, q_offset = 4, 16, 40, 24
  kv_seg, end_S = _documents(np.random.default_rng(5), b, s_len, [[10, 30], [25], [], [5, 20]])
  q, k, w = _int_inputs(15, b, t_len, s_len, 2, 8)
  vis = Visibility(q_offset, jnp.asarray(kv_seg[:, q_offset:]), jnp.asarray(kv_seg), jnp.asarray(end_S[:, q_offset:]))
  kw = {"topk": 8, "visibility": vis}
  return (q, k, w), kw


def test_select_topk_passes_the_prefix_to_the_kernel():
  # dsa.select_topk, attention_impl "pallas" (interpret mode here) and "reference": the same prefix-widened top-k
  args, kw = _select_inputs()
  want = reference.lightning_indexer_topk(*args, **kw)
  _assert_same(dsa.select_topk("pallas", *args, **kw), want)
  _assert_same(dsa.select_topk("reference", *args, **kw), want)
  no_prefix = dict(kw, visibility=dataclasses.replace(kw["visibility"], q_prefix_end=None))
  assert not np.array_equal(np.asarray(want[0]), np.asarray(reference.lightning_indexer_topk(*args, **no_prefix)[0]))


@helpers.multi_device(4)
def test_select_topk_with_a_prefix_under_a_mesh():
  # the kernel in select_topk's shard_map: the prefix ends are split over the batch with the other [B, T] inputs
  args, kw = _select_inputs()
  want = reference.lightning_indexer_topk(*args, **kw)
  mesh = make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:4])
  with jax.set_mesh(mesh):
    fn = jax.jit(lambda q, k, w, **kw: dsa.select_topk("pallas", q, k, w, **kw), static_argnames=("topk",))
    got = fn(*args, **kw)
    hlo = fn.lower(*args, **kw).as_text()
  assert "shard_map" in hlo or "sdy.manual_computation" in hlo
  _assert_same(got, want)


@needs_libtpu
def test_compiles_for_tpu_with_a_prefix():
  device = tpu_topology_devices("v5p:2x2x1")[0]
  sharding = SingleDeviceSharding(device)
  b, t_len, s_len, heads, dim, topk = 1, 512, 4096, 32, 128, 2048
  shapes = [
    ((b, t_len, heads, dim), jnp.bfloat16),
    ((b, s_len, dim), jnp.bfloat16),
    ((b, t_len, heads), jnp.float32),
    ((b, t_len), jnp.int32),
    ((b, s_len), jnp.int32),
    ((b, t_len), jnp.int32),
  ]
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]

  def indexer(q, k, w, q_seg, kv_seg, pe):
    return lightning_indexer_topk(
      q,
      k,
      w,
      topk=topk,
      visibility=Visibility(s_len - t_len, q_seg, kv_seg, pe),
      block_sizes=IndexerBlockSizes(128, 1024),
      interpret=False,
    )

  start = time.perf_counter()
  compiled = jax.jit(indexer).lower(*args).compile()
  print(f"v5p T={t_len} S={s_len} with a prefix: compiled in {time.perf_counter() - start:.1f}s")
  assert "tpu_custom_call" in compiled.as_text()
  out = compiled.out_info
  assert out[0].shape == out[1].shape == (b, t_len, topk) and out[0].dtype == jnp.int32
