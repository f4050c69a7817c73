"""The Pallas sparse MLA attention (pallas_kernels/sparse_mla_attention.py) against its pure-jnp reference.

The indices come from the reference lightning indexer run on random inputs (causal, with q_offset = S - T, so the
first queries see fewer than K keys and get -1 padding), which is how the model produces them. Forward (out, lse)
and backward (dq, dkv, and the lse cotangent) in interpret mode on CPU.

Tolerances. fp32: the kernel and the reference compute the same sums in another order (online softmax over
blocks), so they agree to a few fp32 ulps of the largest magnitude: atol = rtol = 1e-5. bf16: both round q, kv and
the probabilities fed to the value matmul to bf16 (8 significant bits) and the outputs to bf16, so each differs
from the exact result (the fp32 reference on the same bf16 inputs) by up to a few bf16 ulps (2^-8 relative); the
kernel must stay within 2^-6 of the largest magnitude of the exact result, and the test checks that the bf16
reference's own error is within a factor 32 of that bound, i.e. the bound is not loose. lse comes from fp32 scores
of exact bf16 products and gets the fp32 tolerance.
The TPU tests compile forward and backward with Mosaic for v5p and v6e through libtpu (skipped without libtpu).
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import SingleDeviceSharding

from glm_jax.sharding import hlo_cost
from glm_jax.sharding.topology import compiled_memory, tpu_topology_devices
from pallas_kernels.visibility import Visibility
from pallas_kernels import lightning_indexer_reference as indexer_reference
from pallas_kernels import sparse_mla_attention_reference as reference
from pallas_kernels.sparse_mla_attention import (
  SparseAttentionBlockSizes,
  sparse_attention_head_probs,
  sparse_mla_attention,
)
from tests.helpers import needs_libtpu

BF16_BOUND = 2.0**-6


def _inputs(seed, b, t_len, s_len, heads, dim, topk, dtype):
  """(q, kv, indices): indices from the reference indexer, causal with q_offset = S - T."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t_len, heads, dim)), dtype)
  kv = jnp.asarray(rng.normal(size=(b, s_len, dim)), dtype)
  qi, ki, wi = (
    jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in [(b, t_len, 2, 8), (b, s_len, 8), (b, t_len, 2)]
  )
  idx, _ = indexer_reference.lightning_indexer_topk(
    qi, ki, wi, topk=topk, visibility=Visibility(q_offset=s_len - t_len)
  )
  return q, kv, idx


def _loss(attend, q, kv, idx, sm_scale, v_dim):
  """A scalar touching every output: random weights on out, and on lse where it is finite (its cotangent path)."""
  o, lse = attend(q, kv, idx, sm_scale=sm_scale, v_dim=v_dim)
  rng = np.random.default_rng(123)
  w_o = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
  w_l = jnp.asarray(rng.normal(size=lse.shape), jnp.float32)
  return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse) * w_l)


def _value_and_grads(attend, q, kv, idx, sm_scale, v_dim):
  out = attend(q, kv, idx, sm_scale=sm_scale, v_dim=v_dim)
  grads = jax.grad(lambda q, kv: _loss(attend, q, kv, idx, sm_scale, v_dim), argnums=(0, 1))(q, kv)
  return [np.asarray(x, np.float32) for x in (*out, *grads)]


NAMES = ("out", "lse", "dq", "dkv")


@pytest.mark.parametrize(
  "b, t_len, s_len, heads, dim, v_dim, topk, block_t, block_kv, dtype",
  [
    (2, 20, 40, 4, 40, 32, 12, 8, 8, jnp.float32),  # T != S (q_offset 20), topk not a multiple of block_kv
    pytest.param(
      1,
      24,
      24,
      3,
      24,
      16,
      16,
      8,
      8,
      jnp.float32,  # T == S: the first 15 queries see fewer than topk
      marks=pytest.mark.slow,
    ),  #                          keys (interpret mode: slow tier)
    pytest.param(
      1,
      9,
      64,
      2,
      20,
      14,
      24,
      16,
      16,
      jnp.bfloat16,  # bf16 (kv packed two to a word), decode-like: few queries at the end of a longer cache, T
      marks=pytest.mark.slow,  # padded to block_t
    ),
    pytest.param(
      1,
      16,
      32,
      2,
      18,
      11,
      8,
      8,
      8,
      jnp.bfloat16,  # odd v_dim: bf16 runs through the fp32 layout
      marks=pytest.mark.slow,
    ),
  ],
)
def test_matches_reference(b, t_len, s_len, heads, dim, v_dim, topk, block_t, block_kv, dtype):
  q, kv, idx = _inputs(0, b, t_len, s_len, heads, dim, topk, dtype)
  blocks = SparseAttentionBlockSizes(block_t, block_kv)
  kernel = lambda *a, **kw: sparse_mla_attention(*a, block_sizes=blocks, **kw)  # noqa: E731
  got = _value_and_grads(kernel, q, kv, idx, 0.3, v_dim)
  want = _value_and_grads(reference.sparse_mla_attention, q, kv, idx, 0.3, v_dim)
  assert got[0].shape == (b, t_len, heads, v_dim) and got[1].shape == (b, t_len, heads)
  np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
  if dtype == jnp.float32:
    for name, g, w in zip(NAMES, got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    return
  exact = _value_and_grads(
    reference.sparse_mla_attention, q.astype(jnp.float32), kv.astype(jnp.float32), idx, 0.3, v_dim
  )
  # lse: fp32 scores of bf16 inputs, exact products accumulated in fp32 by both: the fp32 tolerance
  np.testing.assert_allclose(got[1], exact[1], rtol=1e-5, atol=1e-5, err_msg="lse")
  for name, g, w, x in zip(NAMES, got, want, exact):
    if name == "lse":
      continue
    finite = np.isfinite(x)
    bound = BF16_BOUND * np.abs(x[finite]).max()
    kernel_err, reference_err = np.abs(g - x)[finite].max(), np.abs(w - x)[finite].max()
    print(f"{name}: kernel {kernel_err:.3g}, bf16 reference {reference_err:.3g}, bound {bound:.3g}")
    assert kernel_err <= bound, f"{name}: kernel differs from the exact result by {kernel_err} > {bound}"
    assert reference_err > bound / 32, f"{name}: the bf16 reference is far more accurate ({reference_err})"


@pytest.mark.slow  # interpret mode, about 4 s
def test_empty_rows_and_out_of_range_indices():
  q, kv, idx = _inputs(1, 1, 16, 16, 2, 24, 8, jnp.float32)
  idx = np.array(idx)
  idx[0, 5] = -1  # a query with no valid index
  idx[0, 9, :3] = [16, 99, -7]  # outside [0, S): skipped like -1
  idx = jnp.asarray(idx)
  kernel = lambda *a, **kw: sparse_mla_attention(*a, block_sizes=SparseAttentionBlockSizes(8, 8), **kw)  # noqa
  out, lse, dq, dkv = _value_and_grads(kernel, q, kv, idx, 0.5, 16)
  assert not out[0, 5].any() and np.isneginf(lse[0, 5]).all() and not dq[0, 5].any()
  want = _value_and_grads(reference.sparse_mla_attention, q, kv, idx, 0.5, 16)
  for name, g, w in zip(NAMES, (out, lse, dq, dkv), want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
  # the out-of-range entries change nothing: the same as writing -1 there
  idx_m1 = idx.at[0, 9, :3].set(-1)
  np.testing.assert_array_equal(out, np.asarray(kernel(q, kv, idx_m1, sm_scale=0.5, v_dim=16)[0]))


@pytest.mark.slow  # the TPU interpreter
def test_tpu_interpret_mode():
  # Pallas's TPU interpreter: VMEM scratch starts as NaN and a DMA lands only when it is waited for, so a row read
  # before its copy completes, a dkv read-modify-write that overtakes the previous block's write, or a missing wait
  # gives wrong numbers here even where the plain interpreter passes.
  q, kv, idx = _inputs(2, 1, 24, 32, 2, 24, 16, jnp.float32)
  # neighbouring queries share most of their keys: dkv rows get many read-modify-writes in a row
  idx = jnp.broadcast_to(idx[:, -1:], idx.shape).at[:, ::3, ::2].set(-1)
  kernel = lambda *a, **kw: sparse_mla_attention(  # noqa: E731
    *a, block_sizes=SparseAttentionBlockSizes(8, 8), interpret=pltpu.InterpretParams(), **kw
  )
  got = _value_and_grads(kernel, q, kv, idx, 0.4, 16)
  plain = _value_and_grads(
    lambda *a, **kw: sparse_mla_attention(*a, block_sizes=SparseAttentionBlockSizes(8, 8), interpret=True, **kw),
    q,
    kv,
    idx,
    0.4,
    16,
  )
  want = _value_and_grads(reference.sparse_mla_attention, q, kv, idx, 0.4, 16)
  for name, g, p, w in zip(NAMES, got, plain, want):
    np.testing.assert_array_equal(g, p, err_msg=name)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_probs(dtype):
  """sum_h exp(s - lse) over the selected keys: the kernel against the reference formula, and (fp32) each query's
  row sums to the number of heads with a valid key, since every head's probabilities sum to one."""
  q, kv, idx = _inputs(3, 2, 20, 40, 3, 40, 12, dtype)
  _, lse = reference.sparse_mla_attention(q, kv, idx, sm_scale=0.3, v_dim=32)
  got = sparse_attention_head_probs(q, kv, idx, lse, sm_scale=0.3, block_sizes=SparseAttentionBlockSizes(8, 8))
  want = reference.sparse_attention_head_probs(q, kv, idx, lse, sm_scale=0.3)
  assert got.shape == idx.shape and got.dtype == jnp.float32
  assert not np.asarray(got)[np.asarray(idx) < 0].any()
  # bf16: the same bf16 inputs and fp32 scores in both, so the fp32 tolerance holds
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got).sum(-1), 3.0, rtol=1e-5)
  assert not np.asarray(jax.grad(lambda q: sparse_attention_head_probs(q, kv, idx, lse, sm_scale=0.3).sum())(q)).any()


def test_errors_name_the_field():
  q, kv, idx = _inputs(0, 1, 8, 8, 2, 16, 4, jnp.float32)
  with pytest.raises(ValueError, match=r"block_kv=12; must be a positive multiple of 8"):
    SparseAttentionBlockSizes(8, 12)
  with pytest.raises(ValueError, match=r"v_dim=17; must be an int in \[1, D=16\]"):
    sparse_mla_attention(q, kv, idx, sm_scale=1.0, v_dim=17)
  with pytest.raises(ValueError, match=r"needs kv \[1, S, 16\]"):
    sparse_mla_attention(q, kv[..., :8], idx, sm_scale=1.0, v_dim=8)
  with pytest.raises(TypeError, match=r"indices dtype float32; must be an integer"):
    sparse_mla_attention(q, kv, idx.astype(jnp.float32), sm_scale=1.0, v_dim=8)
  with pytest.raises(TypeError, match=r"block_sizes=\(8, 8\); want a SparseAttentionBlockSizes"):
    sparse_mla_attention(q, kv, idx, sm_scale=1.0, v_dim=8, block_sizes=(8, 8))


# --- TPU: forward and backward compile with Mosaic (compile only, nothing runs) ----------------------------------


def _compile_fwd_bwd(topology, dtype, t_len, s_len, topk):
  """GLM-5's absorbed attention: H = 64, D = 512 + 64, v = 512."""
  sharding = SingleDeviceSharding(tpu_topology_devices(topology)[0])
  heads, dim, v_dim = 64, 576, 512
  args = [
    jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    for shape, dt in [((1, t_len, heads, dim), dtype), ((1, s_len, dim), dtype), ((1, t_len, topk), jnp.int32)]
  ]

  def fwd_bwd(q, kv, idx):
    (o, lse), vjp = jax.vjp(
      lambda q, kv: sparse_mla_attention(q, kv, idx, sm_scale=0.1, v_dim=v_dim, interpret=False), q, kv
    )
    probs = sparse_attention_head_probs(q, kv, idx, lse, sm_scale=0.1, interpret=False)
    return o, vjp((o, jnp.zeros_like(lse))), probs

  start = time.perf_counter()
  compiled = jax.jit(fwd_bwd).lower(*args).compile()
  print(f"{topology} {jnp.dtype(dtype).name} T={t_len} S={s_len} K={topk}: {time.perf_counter() - start:.1f}s")
  return compiled


@needs_libtpu
@pytest.mark.slow  # Mosaic compiles for TPU
@pytest.mark.parametrize(
  "topology, dtype", [("v5p:2x2x1", jnp.bfloat16), ("v6e:2x2", jnp.bfloat16), ("v5p:2x2x1", jnp.float32)]
)
def test_compiles_for_tpu(topology, dtype):
  t_len, s_len = 256, 4096
  topks = (1024, 2048) if topology.startswith("v5p") and dtype == jnp.bfloat16 else (2048,)
  compiled = {k: _compile_fwd_bwd(topology, dtype, t_len, s_len, k) for k in topks}
  for topk, c in compiled.items():
    text = c.as_text()
    assert text.count("tpu_custom_call") >= 3  # forward, backward, head probs: not an interpreted emulation
    out, (dq, dkv), probs = c.out_info
    assert probs.shape == (1, t_len, topk) and probs.dtype == jnp.float32
    assert dq.shape == (1, t_len, 64, 576) and dkv.shape == (1, s_len, 576) and out.shape == (1, t_len, 64, 512)
  if len(compiled) == 1:
    return
  # The selected rows are never gathered: gathering them, as the reference does, makes a [T, K, D] array (T * K * D
  # = 302M elements at K = 2048, 604 MB in bf16), and no array of the programs has even a quarter of that many
  # elements. Memory grows with K by the index arrays (T * 1024 int32 a copy: the argument, the kernels' SMEM and
  # VMEM views) and by where XLA:TPU places its prefetches, far less than the gathered rows would add (T * 1024 * D *
  # itemsize bytes): at most an eighth of it (libtpu 0.0.50.1: 18.8 MB against 302 MB).
  for topk, c in compiled.items():
    elements = [math.prod(dims) for _, dims in hlo_cost.array_shapes(c.as_text())]
    assert max(elements) < t_len * topk * 576 // 4
  temps = {k: compiled_memory(c)["temporaries"] + compiled_memory(c)["arguments"] for k, c in compiled.items()}
  growth = temps[2048] - temps[1024]
  gathered = t_len * 1024 * 576 * 2
  assert growth <= gathered // 8, f"{growth} bytes for 1024 more keys; gathering them would add {gathered}"
  assert growth < t_len * 1024 * 576 * jnp.dtype(dtype).itemsize / 16
