"""Sparse MLA attention (absorbed form over indexer-selected keys) against a numpy per-query loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_mla_attention_reference import sparse_mla_attention

SCALE = 0.3


def sparse_attention_numpy(q, kv, idx, sm_scale, v_dim):
  """For each (b, t, h): gather kv rows idx[b, t] (skipping -1), softmax(sm_scale * q . kv_s), sum p_s kv_s[:v_dim]."""
  b_len, t_len, h_len, _ = q.shape
  out = np.zeros((b_len, t_len, h_len, v_dim))
  lse = np.full((b_len, t_len, h_len), -np.inf)
  for b in range(b_len):
    for t in range(t_len):
      sel = [s for s in idx[b, t] if s >= 0]
      if not sel:
        continue
      rows = kv[b, sel].astype(np.float64)  # [K, D]
      for h in range(h_len):
        logits = sm_scale * rows @ q[b, t, h].astype(np.float64)
        m = logits.max()
        p = np.exp(logits - m)
        out[b, t, h] = (p / p.sum()) @ rows[:, :v_dim]
        lse[b, t, h] = m + np.log(p.sum())
  return out, lse


def random_indices(rng, b, t, s, k, n_invalid):
  """Distinct keys per query; the last n_invalid slots of each row set to -1."""
  idx = np.stack([np.stack([rng.permutation(s)[:k] for _ in range(t)]) for _ in range(b)])
  if n_invalid:
    idx[..., k - n_invalid :] = -1
  return idx.astype(np.int32)


@functools.partial(jax.jit, static_argnames=("v_dim",))
def _attend(q, kv, idx, v_dim):
  return sparse_mla_attention(q, kv, idx, sm_scale=SCALE, v_dim=v_dim)


def run(q, kv, idx, v_dim):
  out, lse = _attend(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), v_dim=v_dim)
  return np.asarray(out), np.asarray(lse)


@pytest.mark.parametrize("k,n_invalid", [(1, 0), (4, 0), (5, 2), (9, 0)])
def test_matches_per_query_loop(k, n_invalid):
  rng = np.random.default_rng(k + n_invalid)
  q = rng.standard_normal((2, 4, 3, 10)).astype(np.float32)
  kv = rng.standard_normal((2, 9, 10)).astype(np.float32)
  idx = random_indices(rng, 2, 4, 9, k, n_invalid)
  out, lse = run(q, kv, idx, v_dim=6)
  want_out, want_lse = sparse_attention_numpy(q, kv, idx, SCALE, 6)
  assert out.shape == (2, 4, 3, 6) and lse.shape == (2, 4, 3)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_rows_with_no_valid_index_give_zeros_and_neg_inf_lse():
  rng = np.random.default_rng(10)
  q = rng.standard_normal((1, 3, 2, 8)).astype(np.float32)
  kv = rng.standard_normal((1, 5, 8)).astype(np.float32)
  idx = np.array([[[-1, -1, -1], [2, -1, 0], [-1, -1, -1]]], np.int32)
  out, lse = run(q, kv, idx, v_dim=4)
  assert np.all(out[0, [0, 2]] == 0.0) and np.all(np.isneginf(lse[0, [0, 2]]))
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[0, 1]))
  want_out, want_lse = sparse_attention_numpy(q, kv, idx, SCALE, 4)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse[0, 1], want_lse[0, 1], rtol=1e-5)


def test_lse_is_log_sum_exp_of_selected_scores_by_hand():
  # One query, one head: q . kv_s = s for the selected keys 1 and 3, so lse = log(e^{1 SCALE} + e^{3 SCALE}).
  q = np.array([[[[1.0, 0.0]]]], np.float32)
  kv = np.array([[[0.0, 5.0], [1.0, 7.0], [2.0, 9.0], [3.0, 11.0]]], np.float32)
  out, lse = run(q, kv, np.array([[[3, 1]]], np.int32), v_dim=2)
  p1, p3 = np.exp(1 * SCALE), np.exp(3 * SCALE)
  np.testing.assert_allclose(lse[0, 0, 0], np.log(p1 + p3), rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 0], (p1 * kv[0, 1] + p3 * kv[0, 3]) / (p1 + p3), rtol=1e-6)


def test_order_of_indices_does_not_matter():
  rng = np.random.default_rng(11)
  q = rng.standard_normal((1, 2, 2, 6)).astype(np.float32)
  kv = rng.standard_normal((1, 7, 6)).astype(np.float32)
  idx = random_indices(rng, 1, 2, 7, 5, 1)
  perm = np.array([3, 0, 4, 1, 2])
  a, b = run(q, kv, idx, 6), run(q, kv, idx[..., perm], 6)
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(a[1], b[1], rtol=1e-6)
