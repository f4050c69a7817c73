"""DSA's lightning indexer: scores (DS32 Eq. 1) and the deterministic causal top-k, against numpy loops.

Top-k tests use small integer q, k, w so every score is exact in float32: ties are frequent and the
reference comparison is exact, which pins the tie-break (lower key index first).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.indexer import Indexer
from glm_jax.model.layers import rope_angles
from pallas_kernels.visibility import Visibility
from pallas_kernels.lightning_indexer_reference import lightning_indexer_scores, lightning_indexer_topk


def scores_numpy(q, k, w):
  """I[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s])."""
  b_len, t_len, h_len, _ = q.shape
  out = np.zeros((b_len, t_len, k.shape[1]))
  for b in range(b_len):
    for t in range(t_len):
      for s in range(k.shape[1]):
        out[b, t, s] = sum(
          w[b, t, h] * max(0.0, float(np.dot(q[b, t, h].astype(np.float64), k[b, s]))) for h in range(h_len)
        )
  return out


def topk_numpy(scores, topk, causal=True, q_offset=0, q_seg=None, kv_seg=None):
  """Indices [B, T, topk] of the highest visible scores, ties to the lower index, -1 padded; and the scores."""
  b_len, t_len, s_len = scores.shape
  idx = np.full((b_len, t_len, topk), -1, np.int64)
  val = np.full((b_len, t_len, topk), -np.inf)
  for b in range(b_len):
    for t in range(t_len):
      visible = [
        s for s in range(s_len) if (not causal or s <= t + q_offset) and (q_seg is None or q_seg[b, t] == kv_seg[b, s])
      ]
      chosen = sorted(visible, key=lambda s: (-scores[b, t, s], s))[:topk]
      idx[b, t, : len(chosen)] = chosen
      val[b, t, : len(chosen)] = scores[b, t, chosen]
  return idx, val


def int_inputs(seed, b, t, s, h=3, d=4):
  rng = np.random.default_rng(seed)
  q = rng.integers(-2, 3, (b, t, h, d)).astype(np.float32)
  k = rng.integers(-2, 3, (b, s, d)).astype(np.float32)
  w = rng.integers(0, 3, (b, t, h)).astype(np.float32)
  return q, k, w


def run_topk(q, k, w, topk, **visibility):
  vis = Visibility(**visibility)
  idx, val = lightning_indexer_topk(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), topk=topk, visibility=vis)
  return np.asarray(idx), np.asarray(val)


def test_scores_match_triple_loop():
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((2, 5, 3, 8)).astype(np.float32), rng.standard_normal((2, 7, 8)).astype(np.float32)
  w = rng.standard_normal((2, 5, 3)).astype(np.float32)
  got = lightning_indexer_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(got), scores_numpy(q, k, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topk", [1, 3, 6, 9, 20])  # 9 = S, 20 > S
def test_topk_causal_matches_numpy(topk):
  q, k, w = int_inputs(1, 2, 9, 9)
  want_idx, want_val = topk_numpy(scores_numpy(q, k, w), topk)
  idx, val = run_topk(q, k, w, topk=topk)
  assert idx.shape == (2, 9, topk) and idx.dtype == np.int32
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(val, want_val)


def test_topk_non_causal_matches_numpy():
  q, k, w = int_inputs(2, 1, 4, 6)
  idx, _ = run_topk(q, k, w, topk=4, causal=False)
  np.testing.assert_array_equal(idx, topk_numpy(scores_numpy(q, k, w), 4, causal=False)[0])


def test_topk_with_segment_ids_matches_numpy():
  q, k, w = int_inputs(3, 2, 10, 10)
  seg = np.array([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]], np.int32)
  idx, _ = run_topk(q, k, w, topk=3, q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
  np.testing.assert_array_equal(idx, topk_numpy(scores_numpy(q, k, w), 3, q_seg=seg, kv_seg=seg)[0])
  # First token of each segment sees only itself: one index, then -1.
  np.testing.assert_array_equal(idx[0, 4], [4, -1, -1])
  np.testing.assert_array_equal(idx[0, 7], [7, -1, -1])


def test_topk_with_q_offset_and_t_shorter_than_s():
  q, k, w = int_inputs(4, 2, 3, 8)  # the last 3 queries of an 8-token sequence
  idx, val = run_topk(q, k, w, topk=4, q_offset=5)
  want_idx, want_val = topk_numpy(scores_numpy(q, k, w), 4, q_offset=5)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(val, want_val)
  assert (idx <= np.arange(3)[None, :, None] + 5).all()


def test_ties_go_to_the_lower_index():
  # Every key is identical, so every visible score ties: the picks are keys 0, 1, 2, ... in order.
  q = np.ones((1, 6, 2, 4), np.float32)
  k = np.ones((1, 6, 4), np.float32)
  w = np.ones((1, 6, 2), np.float32)
  idx, _ = run_topk(q, k, w, topk=3)
  np.testing.assert_array_equal(idx[0], [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]])
  # A tie between keys 1 and 4 above key 0: 1 comes before 4.
  k = np.zeros((1, 6, 4), np.float32)
  k[0, [1, 4]] = 2.0
  k[0, 0] = 1.0
  idx, _ = run_topk(q, k, w, topk=3)
  np.testing.assert_array_equal(idx[0, 5], [1, 4, 0])


def test_relu_zeroes_negative_head_scores():
  # q . k < 0 for head 0 and > 0 for head 1: only head 1 counts.
  q = np.array([[[[-1.0, 0.0], [0.0, 1.0]]]], np.float32)  # [1, 1, 2, 2]
  k = np.array([[[1.0, 3.0]]], np.float32)
  w = np.array([[[5.0, 2.0]]], np.float32)
  assert float(lightning_indexer_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))[0, 0, 0]) == 6.0


def test_two_runs_are_identical():
  q, k, w = int_inputs(5, 2, 16, 16, h=4, d=8)
  a, b = run_topk(q, k, w, topk=5), run_topk(q, k, w, topk=5)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("topk", [0, -3])
def test_topk_must_be_positive(topk):
  q, k, w = int_inputs(6, 1, 2, 2)
  with pytest.raises(ValueError, match=f"topk={topk}"):
    run_topk(q, k, w, topk=topk)


# ---- the Indexer module (glm_jax/model/indexer.py) ----------------------------------------------------------


def rope_interleaved_numpy(x, positions, theta):
  """Rotates pairs (x[2i], x[2i+1]) of the last axis of x [T, ..., d] by positions[t] * theta^(-2i/d)."""
  d = x.shape[-1]
  ang = positions[:, None] * theta ** (-2.0 * np.arange(d // 2) / d)  # [T, d/2]
  ang = ang.reshape(ang.shape[:1] + (1,) * (x.ndim - 2) + ang.shape[1:])
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
  out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
  return out


def test_indexer_module_matches_numpy_formula():
  cfg = ModelConfig(
    vocab_size=16,
    hidden_size=12,
    q_lora_rank=10,
    qk_rope_head_dim=4,
    index_n_heads=3,
    index_head_dim=8,
    index_norm_eps=1e-6,
    rope_theta=100.0,
  )
  rng = np.random.default_rng(7)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Indexer(cfg, nnx.Rngs(0))))  # every weight, norm scale
  state = jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype), state)  # and bias random
  ix = nnx.merge(graphdef, state)
  x = rng.standard_normal((1, 5, 12)).astype(np.float32)
  cq = rng.standard_normal((1, 5, 10)).astype(np.float32)
  pos = np.array([3, 4, 5, 0, 1])
  cos, sin = rope_angles(jnp.asarray(pos[None]), 4, 100.0)
  apply = jax.jit(lambda st, *args: nnx.merge(graphdef, st)(*args))
  q, k, w = (np.asarray(a) for a in apply(state, jnp.asarray(x), jnp.asarray(cq), cos, sin))

  p = {n: np.asarray(getattr(ix, n)[...], np.float64) for n in ("wq_b", "wk", "weights_proj")}
  q_want = np.einsum("tr,rhd->thd", cq[0].astype(np.float64), p["wq_b"])
  q_want[..., :4] = rope_interleaved_numpy(q_want[..., :4], pos, 100.0)
  kk = x[0].astype(np.float64) @ p["wk"]
  kk = (kk - kk.mean(-1, keepdims=True)) / np.sqrt(kk.var(-1, keepdims=True) + 1e-6)
  kk = kk * np.asarray(ix.k_norm.weight[...]) + np.asarray(ix.k_norm.bias[...])
  kk[:, :4] = rope_interleaved_numpy(kk[:, :4], pos, 100.0)
  w_want = x[0].astype(np.float64) @ p["weights_proj"] * 3**-0.5 * 8**-0.5
  np.testing.assert_allclose(q[0], q_want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(k[0], kk, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(w[0], w_want, rtol=1e-5, atol=1e-5)
