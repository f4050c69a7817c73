"""The Pallas lightning-indexer top-k (pallas_kernels/lightning_indexer.py) against its pure-jnp reference.

Most inputs are small integers (q, k, w in {-2..2}): every product and partial sum is an integer far below 2^24,
so the scores are exact in fp32 whatever order the kernel and the reference accumulate in, and bf16 holds the
inputs exactly. Indices must then be equal exactly, tie order included (integer scores tie often), and scores
bitwise, sign of zero included (lax.top_k ranks -0.0 below +0.0; see _assert_same). Interpret mode on CPU;
the TPU tests compile the kernel for v5p and v6e through libtpu's topology descriptions (skipped without libtpu).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import SingleDeviceSharding

from glm_jax.sharding.topology import compiled_memory, tpu_topology_devices
from pallas_kernels.visibility import Visibility
from pallas_kernels import lightning_indexer_reference as reference
from pallas_kernels.lightning_indexer import IndexerBlockSizes, lightning_indexer_topk
from tests.helpers import needs_libtpu


def _int_inputs(seed, b, t_len, s_len, heads, dim, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.integers(-2, 3, (b, t_len, heads, dim)), dtype)
  k = jnp.asarray(rng.integers(-2, 3, (b, s_len, dim)), dtype)
  w = jnp.asarray(rng.integers(-2, 3, (b, t_len, heads)), jnp.float32)
  return q, k, w


def _assert_same(got, want):
  (idx, val), (idx_ref, val_ref) = got, want
  # The kernel's exactly-zero scores are +0.0. The reference's are +0.0 too except where XLA:CPU's dot happens to
  # start a sum of -0.0 terms at the first term (some elements of some shapes, e.g. with H = 1), and lax.top_k
  # ranks -0.0 below +0.0: such data would test XLA's emitter, not the kernel, so the inputs here avoid it.
  zero_ref = np.asarray(val_ref) == 0
  assert not np.signbit(np.asarray(val_ref)[zero_ref]).any(), "reference emitted -0.0: pick other test data"
  assert idx.shape == idx_ref.shape and idx.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
  np.testing.assert_array_equal(np.asarray(val), np.asarray(val_ref))
  np.testing.assert_array_equal(np.signbit(np.asarray(val)), np.signbit(np.asarray(val_ref)))


@pytest.mark.parametrize(
  "b, t_len, s_len, topk, q_offset, causal, block_q, block_k, dtype",
  [
    (2, 40, 72, 10, 24, True, 128, 16, jnp.float32),  # T != S, q_offset, topk not a multiple of block_k < Kp
    (2, 40, 72, 20, 24, True, 128, 8, jnp.bfloat16),  # block_k 8: many tiles, merges into the Kp=32 buffer
    pytest.param(
      1,
      160,
      200,
      40,
      40,
      True,
      128,
      64,
      jnp.float32,  # two query blocks (T padded to 256), Kp=64 ==
      marks=pytest.mark.slow,
    ),  #                            block_k (interpret mode: slow tier)
    (1, 24, 300, 5, 276, True, 128, 32, jnp.bfloat16),  # decode-like: few queries at the end of a long cache
    pytest.param(
      2,
      32,
      48,
      6,
      0,
      False,
      128,
      64,
      jnp.float32,  # not causal; block_k > Kp, S padded to one 64-key
      marks=pytest.mark.slow,
    ),  #                          tile
  ],
)
def test_matches_reference(b, t_len, s_len, topk, q_offset, causal, block_q, block_k, dtype):
  q, k, w = _int_inputs(0, b, t_len, s_len, 3, 8, dtype)
  vis = Visibility(q_offset=q_offset, causal=causal)
  got = lightning_indexer_topk(q, k, w, topk=topk, visibility=vis, block_sizes=IndexerBlockSizes(block_q, block_k))
  _assert_same(got, reference.lightning_indexer_topk(q, k, w, topk=topk, visibility=vis))


def test_fewer_visible_keys_than_topk_gives_minus_one():
  q, k, w = _int_inputs(1, 1, 20, 16, 2, 8)
  idx, val = lightning_indexer_topk(q, k, w, topk=24, block_sizes=IndexerBlockSizes(128, 8))  # topk > S too
  _assert_same((idx, val), reference.lightning_indexer_topk(q, k, w, topk=24))
  visible = np.minimum(np.arange(20) + 1, 16)  # causal, q_offset 0: query t sees keys 0..t
  np.testing.assert_array_equal((np.asarray(idx[0]) >= 0).sum(-1), visible)
  assert np.isneginf(np.asarray(val[0, 3, 4:])).all() and (np.asarray(idx[0, 3, 4:]) == -1).all()
  np.testing.assert_array_equal(np.sort(np.asarray(idx[0, 3, :4])), np.arange(4))


def test_segment_ids():
  b, t_len = 2, 48
  q, k, w = _int_inputs(2, b, t_len, t_len, 3, 8)
  seg = jnp.asarray(np.sort(np.random.default_rng(3).integers(0, 4, (b, t_len)), axis=1))  # packed documents
  kw = {"topk": 12, "visibility": Visibility.self_attention(seg)}
  idx, val = lightning_indexer_topk(q, k, w, block_sizes=IndexerBlockSizes(128, 16), **kw)
  _assert_same((idx, val), reference.lightning_indexer_topk(q, k, w, **kw))
  idx_np, seg_np = np.asarray(idx), np.asarray(seg)
  for bi, t in [(0, 0), (0, t_len - 1), (1, t_len // 2)]:
    keys = idx_np[bi, t][idx_np[bi, t] >= 0]
    assert (seg_np[bi, keys] == seg_np[bi, t]).all() and (keys <= t).all()
    assert len(keys) == min(12, int(((seg_np[bi] == seg_np[bi, t]) & (np.arange(t_len) <= t)).sum()))


def test_exact_ties_go_to_the_lower_key_index():
  # Keys repeat with period 5 (k[s] = k[s % 5]), so every score appears several times: the order within a run of
  # equal scores must be ascending key index, across tiles too (block_k 8 does not divide the period).
  rng = np.random.default_rng(4)
  base = rng.integers(-2, 3, (1, 5, 8))
  k = jnp.asarray(np.tile(base, (1, 8, 1)), jnp.float32)  # S = 40
  q = jnp.asarray(rng.integers(-2, 3, (1, 16, 2, 8)), jnp.float32)
  w = jnp.asarray(rng.integers(1, 3, (1, 16, 2)), jnp.float32)
  everything = Visibility(causal=False)
  idx, val = lightning_indexer_topk(q, k, w, topk=24, visibility=everything, block_sizes=IndexerBlockSizes(128, 8))
  _assert_same((idx, val), reference.lightning_indexer_topk(q, k, w, topk=24, visibility=everything))
  idx_np, val_np = np.asarray(idx), np.asarray(val)
  assert (np.diff(val_np, axis=-1) <= 0).all()
  same = np.diff(val_np, axis=-1) == 0
  assert same.sum() > 100 and (np.diff(idx_np, axis=-1)[same] > 0).all()


@pytest.mark.parametrize("heads", [1, 2])
def test_zero_scores_are_positive_zero_and_tie_by_index(heads):
  # Keys with q.k <= 0 on every head score exactly zero, and with w < 0 every term is -0.0. The kernel returns
  # every zero score as +0.0, so they tie and go by key index. The oracle is the reference's formula with its
  # zeros made +0.0 too: the reference's own einsum returns -0.0 for all of them at heads=1 here, which its
  # lax.top_k then ranks below +0.0 (see the kernel docstring).
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.integers(-2, 3, (1, 32, heads, 8)), jnp.float32)
  k = jnp.asarray(rng.integers(-2, 3, (1, 32, 8)), jnp.float32)
  w = -jnp.ones((1, 32, heads), jnp.float32)  # every score is <= 0; most rows have several exact zeros
  vis = Visibility(causal=False)
  idx, val = lightning_indexer_topk(q, k, w, topk=16, visibility=vis, block_sizes=IndexerBlockSizes(128, 8))
  scores = reference.lightning_indexer_scores(q, k, w)
  val_ref, idx_ref = jax.lax.top_k(jnp.where(scores == 0, 0.0, scores), 16)  # no mask: causal=False, S=32
  _assert_same((idx, val), (idx_ref, val_ref))
  val_np, idx_np = np.asarray(val), np.asarray(idx)
  zero = val_np == 0
  assert zero.sum() > 32 and not np.signbit(val_np[zero]).any()
  for t in range(32):
    np.testing.assert_array_equal(idx_np[0, t][zero[0, t]], np.sort(idx_np[0, t][zero[0, t]]))


def test_random_bf16_inputs_and_determinism():
  # Continuous bf16 inputs (products exact in fp32, sums rounded): scores agree to fp32 rounding and, with this
  # seed, no two candidates lie within that rounding of each other, so the indices agree exactly.
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, 64, 4, 32)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, 96, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((2, 64, 4)) / 4, jnp.float32)
  blocks = IndexerBlockSizes(128, 32)
  vis = Visibility(q_offset=32)
  idx, val = lightning_indexer_topk(q, k, w, topk=20, visibility=vis, block_sizes=blocks)
  idx_ref, val_ref = reference.lightning_indexer_topk(q, k, w, topk=20, visibility=vis)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
  np.testing.assert_allclose(np.asarray(val), np.asarray(val_ref), rtol=1e-5, atol=1e-5)
  idx2, val2 = lightning_indexer_topk(q, k, w, topk=20, visibility=vis, block_sizes=blocks)
  assert np.array_equal(np.asarray(idx), np.asarray(idx2)) and np.asarray(val).tobytes() == np.asarray(val2).tobytes()


def test_tpu_interpret_mode():
  # Pallas's TPU interpreter: scratch and VMEM buffers start as NaN and out-of-bounds reads raise, so a kernel
  # that reads scratch it never wrote, or past a block, fails here even where the plain interpreter passes.
  q, k, w = _int_inputs(7, 1, 40, 72, 3, 8)
  seg = jnp.asarray(np.repeat([[0, 1, 2]], [10, 30, 32], axis=1))
  kw = {"topk": 12, "visibility": Visibility(q_offset=32, q_segment_ids=seg[:, 32:], kv_segment_ids=seg)}
  got = lightning_indexer_topk(q, k, w, block_sizes=IndexerBlockSizes(128, 16), interpret=pltpu.InterpretParams(), **kw)
  _assert_same(got, reference.lightning_indexer_topk(q, k, w, **kw))


def test_errors_name_the_field():
  q, k, w = _int_inputs(0, 1, 8, 8, 2, 8)
  with pytest.raises(ValueError, match=r"topk=0; must be a positive integer"):
    lightning_indexer_topk(q, k, w, topk=0)
  with pytest.raises(ValueError, match=r"block_k=24; must be a power of two"):
    IndexerBlockSizes(128, 24)
  with pytest.raises(ValueError, match=r"block_q=64 with T=200 queries.*multiple of 128"):
    q2, k2, w2 = _int_inputs(0, 1, 200, 8, 2, 8)
    lightning_indexer_topk(q2, k2, w2, topk=4, block_sizes=IndexerBlockSizes(64, 8))
  with pytest.raises(ValueError, match=r"give both q_segment_ids and kv_segment_ids"):
    lightning_indexer_topk(q, k, w, topk=4, visibility=Visibility(q_segment_ids=jnp.zeros((1, 8), jnp.int32)))
  with pytest.raises(ValueError, match=r"need.* k \[1, S, 8\]"):
    lightning_indexer_topk(q, k[..., :4], w, topk=4)
  with pytest.raises(TypeError, match=r"q_offset=2.5; must be an int or an integer scalar array"):
    lightning_indexer_topk(q, k, w, topk=4, visibility=Visibility(q_offset=2.5))


def test_traced_q_offset_one_compile_for_every_decode_position():
  # Decoding against a fixed-size cache: the position is a traced scalar (scalar-prefetched into the kernel), so
  # one compiled step serves every position; each equals the reference at that offset.
  q, k, w = _int_inputs(9, 2, 1, 40, 3, 8)
  step = jax.jit(
    lambda off: lightning_indexer_topk(
      q, k, w, topk=6, visibility=Visibility(q_offset=off), block_sizes=IndexerBlockSizes(128, 16)
    )
  )
  for pos in (0, 3, 17, 39):
    want = reference.lightning_indexer_topk(q, k, w, topk=6, visibility=Visibility(q_offset=pos))
    _assert_same(step(jnp.int32(pos)), want)
  assert step._cache_size() == 1


def test_scores_carry_no_gradient():
  q, k, w = _int_inputs(8, 1, 16, 16, 2, 8)

  def selected_score_sum(q, k, w):
    idx, val = lightning_indexer_topk(q, k, w, topk=4)
    return jnp.where(idx >= 0, val, 0.0).sum()

  grads = jax.grad(selected_score_sum, argnums=(0, 1, 2))(q, k, w)
  assert all(not np.asarray(g).any() for g in grads)


# --- TPU: the kernel compiles with Mosaic for real TPU generations (compile only, nothing runs) ----------------


@needs_libtpu
@pytest.mark.parametrize(
  "topology, t_len, s_len, block_q, dtype, segments",
  [
    ("v5p:2x2x1", 1024, 16384, 128, jnp.bfloat16, False),  # GLM-5's indexer: H_I=32, D_I=128, topk=2048
    ("v5p:2x2x1", 512, 8192, 256, jnp.float32, True),
    ("v6e:2x2", 1024, 16384, 128, jnp.bfloat16, False),
    ("v6e:2x2", 512, 8192, 256, jnp.bfloat16, True),
  ],
)
def test_compiles_for_tpu(topology, t_len, s_len, block_q, dtype, segments):
  device = tpu_topology_devices(topology)[0]
  sharding = SingleDeviceSharding(device)
  b, heads, dim, topk = 1, 32, 128, 2048
  shapes = [((b, t_len, heads, dim), dtype), ((b, s_len, dim), dtype), ((b, t_len, heads), jnp.float32)]
  if segments:
    shapes += [((b, t_len), jnp.int32), ((b, s_len), jnp.int32)]
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]

  def indexer(q, k, w, q_seg=None, kv_seg=None):
    return lightning_indexer_topk(
      q,
      k,
      w,
      topk=topk,
      visibility=Visibility(q_offset=s_len - t_len, q_segment_ids=q_seg, kv_segment_ids=kv_seg),
      block_sizes=IndexerBlockSizes(block_q, 2048),
      interpret=False,
    )

  start = time.perf_counter()
  compiled = jax.jit(indexer).lower(*args).compile()
  print(f"{topology} T={t_len} S={s_len} block_q={block_q}: compiled in {time.perf_counter() - start:.1f}s")
  assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel itself, not an interpreted emulation
  out = compiled.out_info
  assert out[0].shape == out[1].shape == (b, t_len, topk) and out[0].dtype == jnp.int32
  # HBM: the two outputs (+ XLA's tuple table) and as temporaries at most a transposed copy of q (v5p keeps one, v6e
  # none), the kv segment ids in the kernel's [S, 1] layout (int32, padded to 128 lanes: S * 512 bytes; libtpu
  # 0.0.50 materializes it) and small change; no [T, S] score array (that alone would be T*S*4 = 16 to 64 MiB here)
  mem = compiled_memory(compiled)
  out_bytes, q_bytes = 2 * b * t_len * topk * 4, b * t_len * heads * dim * jnp.dtype(dtype).itemsize
  kv_segment_bytes = b * s_len * 128 * 4 if segments else 0
  assert out_bytes <= mem["outputs"] <= out_bytes + 1024
  assert mem["temporaries"] <= q_bytes + kv_segment_bytes + (1 << 20)
