"""Pretraining losses against numpy and hand-written values: shifted targets over packed documents and padding,
cross entropy, LM / MTP losses, DSV3's sequence-wise balance loss, the expert-load entropy, the aux-loss-free
bias rule, and the DSA indexer KL with its gradients derived by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.model.mla import indexer_kl
from glm_jax.train import losses

# Two packed rows of 8: row 0 holds document 1 (3 tokens), document 2 (3 tokens) and 2 padding tokens;
# row 1 is one document.
IDS = np.array([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]], np.int32)
SEG = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]], np.int32)


def np_log_softmax(x, axis=-1):
  x = np.asarray(x, np.float64)
  m = np.max(x, axis=axis, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def np_mean_nll(logits, ids, seg, shift):
  """Mean -log p(x_{t+shift}) over t whose target lies in the row, in t's document, t not padding."""
  logp = np_log_softmax(logits)
  b, t = ids.shape
  total, n = 0.0, 0
  for i in range(b):
    for j in range(t - shift):
      if seg[i, j] != 0 and seg[i, j + shift] == seg[i, j]:
        total -= logp[i, j, ids[i, j + shift]]
        n += 1
  return total / n, n


# ---- shifted targets ------------------------------------------------------------------------------------------


def test_shifted_targets_shift_1():
  targets, valid = losses.shifted_targets(jnp.asarray(IDS), jnp.asarray(SEG), 1)
  np.testing.assert_array_equal(targets, [[11, 12, 13, 14, 15, 16, 17, 0], [21, 22, 23, 24, 25, 26, 27, 0]])
  # Row 0: t=2 -> t=3 crosses from document 1 into 2; t=5 -> 6 runs into padding; t=6 is padding;
  # t=7 has no next token in the row.
  np.testing.assert_array_equal(valid, [[1, 1, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])


def test_shifted_targets_shift_2():
  targets, valid = losses.shifted_targets(jnp.asarray(IDS), jnp.asarray(SEG), 2)
  np.testing.assert_array_equal(targets, [[12, 13, 14, 15, 16, 17, 0, 0], [22, 23, 24, 25, 26, 27, 0, 0]])
  np.testing.assert_array_equal(valid, [[1, 0, 0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]])


def test_shifted_targets_keep_only_the_masked_targets():
  """SFT: row 0's documents are prompt [10] + response [11, 12] and prompt [13, 14] + response [15]; row 1 is
  prompt [20, 21, 22] + response [23..27]. A prediction counts when its target is a response token."""
  mask = np.array([[0, 1, 1, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1]], np.int32)
  _, valid = losses.shifted_targets(jnp.asarray(IDS), jnp.asarray(SEG), 1, jnp.asarray(mask))
  np.testing.assert_array_equal(valid, [[1, 1, 0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]])
  _, valid = losses.shifted_targets(jnp.asarray(IDS), jnp.asarray(SEG), 2, jnp.asarray(mask))
  np.testing.assert_array_equal(valid, [[1, 0, 0, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0]])


# ---- cross entropy, LM and MTP losses -------------------------------------------------------------------------


def test_cross_entropy_vs_numpy():
  rng = np.random.default_rng(0)
  logits = 3 * rng.standard_normal((2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
  valid = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], bool)
  nll, count = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(valid))
  logp = np_log_softmax(logits)
  want = -sum(logp[i, j, targets[i, j]] for i in range(2) for j in range(5) if valid[i, j])
  assert float(count) == 7.0
  np.testing.assert_allclose(float(nll), want, rtol=1e-6)


@pytest.mark.parametrize("depths", [1, 2])
def test_lm_and_mtp_losses_vs_numpy(depths):
  rng = np.random.default_rng(1)
  v = 30
  ids = IDS % v
  logits = 2 * rng.standard_normal((2, 8, v)).astype(np.float32)
  mtp = 2 * rng.standard_normal((depths, 2, 8, v)).astype(np.float32)
  out = losses.lm_and_mtp_losses(
    jnp.asarray(logits), jnp.asarray(mtp), {"input_ids": jnp.asarray(ids), "segment_ids": jnp.asarray(SEG)}
  )
  lm, n = np_mean_nll(logits, ids, SEG, 1)
  # MTP depth k (0-based) predicts the token k + 2 ahead; the loss is the mean over depths.
  mtp_want = np.mean([np_mean_nll(mtp[k], ids, SEG, k + 2)[0] for k in range(depths)])
  assert n == 11 and float(out["tokens"]) == 11.0
  np.testing.assert_allclose(float(out["lm_loss"]), lm, rtol=1e-6)
  np.testing.assert_allclose(float(out["mtp_loss"]), mtp_want, rtol=1e-6)


def test_lm_loss_without_mtp_logits():
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((2, 8, 30)).astype(np.float32)
  out = losses.lm_and_mtp_losses(
    jnp.asarray(logits), None, {"input_ids": jnp.asarray(IDS % 30), "segment_ids": jnp.asarray(SEG)}
  )
  np.testing.assert_allclose(float(out["lm_loss"]), np_mean_nll(logits, IDS % 30, SEG, 1)[0], rtol=1e-6)
  assert float(out["mtp_loss"]) == 0.0


# ---- balance loss, load entropy, bias update ------------------------------------------------------------------


def routed(rng, n_layers, batch, tokens, n_experts, top_k):
  """Counts [L, B, E] from random top-k choices per token, and P [L, B, E] = mean_t s_i / sum_j s_j."""
  counts = np.zeros((n_layers, batch, n_experts), np.int32)
  for l in range(n_layers):
    for b in range(batch):
      for _ in range(tokens):
        counts[l, b, rng.choice(n_experts, top_k, replace=False)] += 1
  s = rng.uniform(0.05, 1.0, (n_layers, batch, tokens, n_experts))
  probs = np.mean(s / s.sum(-1, keepdims=True), axis=2)
  return counts, probs.astype(np.float32)


def test_sequence_balance_loss_vs_dsv3_formula():
  rng = np.random.default_rng(3)
  n_layers, batch, tokens, n_experts, top_k = 2, 3, 6, 5, 2
  counts, probs = routed(rng, n_layers, batch, tokens, n_experts, top_k)
  # DSV3 eq. 17-20: per sequence f_i = E / (K T) * count_i, P_i given; L = sum_i f_i P_i; mean over (l, b).
  f = n_experts / (top_k * tokens) * counts.astype(np.float64)
  want = np.mean(np.sum(f * probs, axis=-1))
  got = losses.sequence_balance_loss(jnp.asarray(counts), jnp.asarray(probs), top_k)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_sequence_balance_loss_is_one_when_uniform():
  n_experts, top_k, tokens = 4, 2, 6  # every expert gets K T / E = 3 selections, every P_i = 1/E
  counts = np.full((2, 3, n_experts), top_k * tokens // n_experts, np.int32)
  probs = np.full((2, 3, n_experts), 1.0 / n_experts, np.float32)
  assert float(losses.sequence_balance_loss(jnp.asarray(counts), jnp.asarray(probs), top_k)) == 1.0


def test_expert_load_entropy_vs_numpy():
  counts = np.array(
    [[[3, 0, 1, 4], [2, 0, 5, 1]], [[1, 1, 1, 1], [7, 0, 0, 1]]], np.int32
  )  # [L=2, B=2, E=4], expert 1 idle in layer 0
  load = counts.sum(1).astype(np.float64)
  share = load / load.sum(-1, keepdims=True)
  want = [-sum(p * math.log(p) for p in row if p > 0) for row in share]
  np.testing.assert_allclose(losses.expert_load_entropy(jnp.asarray(counts)), want, rtol=1e-6)


def test_expert_load_entropy_uniform_is_log_e():
  counts = np.full((3, 2, 8), 5, np.int32)
  np.testing.assert_allclose(losses.expert_load_entropy(jnp.asarray(counts)), [math.log(8)] * 3, rtol=1e-6)


def test_expert_bias_update_sign_rule():
  rate = 0.01
  bias = np.array([[0.1, 0.2, -0.3, 0.0], [0.5, -0.5, 0.25, 1.0]], np.float32)
  # Loads summed over the batch: layer 0 [5, 3, 4, 4] (mean 4), layer 1 [2, 6, 2, 6] (mean 4).
  counts = np.array([[[2, 1, 4, 0], [3, 2, 0, 4]], [[1, 3, 2, 6], [1, 3, 0, 0]]], np.int32)
  got = np.asarray(losses.expert_bias_update(jnp.asarray(bias), jnp.asarray(counts), rate))
  # Over-loaded: down by rate; under-loaded: up by rate; exactly at the mean: unchanged (bitwise).
  want = np.array([[0.09, 0.21, -0.3, 0.0], [0.51, -0.51, 0.26, 0.99]])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[0, 2] == bias[0, 2] and got[0, 3] == bias[0, 3]


# ---- the indexer KL -------------------------------------------------------------------------------------------


def kl_case(seed=4, b=2, t=3, s=6):
  rng = np.random.default_rng(seed)
  p = rng.uniform(0.0, 2.0, (b, t, s)).astype(np.float32)
  p[0, 1, 2] = 0.0  # a valid key with zero attention: contributes nothing
  scores = 2 * rng.standard_normal((b, t, s)).astype(np.float32)
  valid = rng.uniform(size=(b, t, s)) < 0.7
  valid[..., 0] = True  # every row sees at least one key with p > 0
  return p, scores, valid


def np_kl_parts(p, scores, valid):
  """(p L1-normalized over the valid keys, softmax of the scores over the valid keys), float64."""
  p = np.where(valid, p.astype(np.float64), 0.0)
  p = p / p.sum(-1, keepdims=True)
  s = np.where(valid, scores.astype(np.float64), -np.inf)
  q = np.exp(s - s.max(-1, keepdims=True))
  return p, q / q.sum(-1, keepdims=True)


def test_indexer_kl_vs_numpy():
  p, scores, valid = kl_case()
  pn, q = np_kl_parts(p, scores, valid)
  terms = np.where(pn > 0, pn * (np.log(np.where(pn > 0, pn, 1.0)) - np.log(np.where(q > 0, q, 1.0))), 0.0)
  want = np.mean(terms.sum(-1))
  got = indexer_kl(jnp.asarray(p), jnp.asarray(scores), jnp.asarray(valid))
  assert want > 0.1
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_indexer_kl_zero_at_target():
  p, scores, valid = kl_case(seed=5)
  p = p + 0.5  # every valid key with p > 0, so log p is finite
  pn, _ = np_kl_parts(p, scores, valid)
  # Scores whose softmax over the valid keys is p: log p + any per-row constant; invalid keys arbitrary.
  matched = np.where(valid, np.log(np.where(valid, pn, 1.0)) + 3.0, scores).astype(np.float32)
  got = indexer_kl(jnp.asarray(p), jnp.asarray(matched), jnp.asarray(valid))
  assert abs(float(got)) < 1e-6


def test_indexer_kl_gradients():
  p, scores, valid = kl_case(seed=6)
  pn, q = np_kl_parts(p, scores, valid)
  b, t, _ = p.shape
  g_p, g_s = jax.grad(indexer_kl, argnums=(0, 1))(jnp.asarray(p), jnp.asarray(scores), jnp.asarray(valid))
  # The target is a constant (stop_gradient).
  np.testing.assert_array_equal(g_p, np.zeros_like(p))
  # d/ds_j sum_i p_i (log p_i - log q_i) = q_j sum_i p_i - p_j = q_j - p_j (p sums to 1); mean over B*T rows.
  want = np.where(valid, (q - pn) / (b * t), 0.0)
  np.testing.assert_allclose(g_s, want, rtol=1e-5, atol=1e-7)


# ---- explicit targets (GLM's blank infilling) -------------------------------------------------------------------
# One document: part A = [10, [MASK], 13, [MASK]] (prefix 4), part B = <sop> 11 12 | <sop> 14 with targets
# 11 12 <eop> | 14 <eop> ([MASK] = 2, <sop> = 4, <eop> = 5); row 1 is padding.
GLM_IDS = np.array([[10, 2, 13, 2, 4, 11, 12, 4, 14], [0] * 9])
GLM_TARGETS = np.array([[0, 0, 0, 0, 11, 12, 5, 14, 5], [0] * 9])
GLM_MASK = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * 9])
GLM_SEG = np.array([[1] * 9, [0] * 9])
GLM_BLOCKS = np.array([[0, 0, 0, 0, 1, 2, 3, 1, 2], [0] * 9])


def _glm_batch():
  return {
    "input_ids": jnp.asarray(GLM_IDS),
    "targets": jnp.asarray(GLM_TARGETS),
    "loss_mask": jnp.asarray(GLM_MASK),
    "segment_ids": jnp.asarray(GLM_SEG),
    "block_positions": jnp.asarray(GLM_BLOCKS),
  }


@pytest.mark.parametrize(
  "depth, want_valid, want_targets",
  [
    (0, [0, 0, 0, 0, 1, 1, 1, 1, 1], {4: 11, 5: 12, 6: 5, 7: 14, 8: 5}),
    # depth 1 at t predicts targets[t + 1] when input t + 1 is targets[t]: not at 6 (the next input is a <sop>)
    (1, [0, 0, 0, 0, 1, 1, 0, 1, 0], {4: 12, 5: 5, 7: 5}),
    (2, [0, 0, 0, 0, 1, 0, 0, 0, 0], {4: 5}),
  ],
)
def test_explicit_targets_by_hand(depth, want_valid, want_targets):
  targets, valid = losses.prediction_targets(_glm_batch(), depth)
  np.testing.assert_array_equal(np.asarray(valid[0]), np.asarray(want_valid, bool))
  assert not np.asarray(valid[1]).any()
  assert {t: int(targets[0, t]) for t in np.flatnonzero(want_valid)} == want_targets


def test_exact_spans_by_hand():
  """Span 1 (positions 4-6) predicted right everywhere, span 2 (7-8) wrong at its <eop>: 2 spans, 1 exact."""
  predicted = GLM_TARGETS.copy()
  predicted[0, 8] = 7
  predicted[0, :4] = 9  # predictions where nothing counts do not matter
  targets, valid = losses.prediction_targets(_glm_batch(), 0)
  out = losses.exact_spans(jnp.asarray(predicted), targets, valid, jnp.asarray(GLM_BLOCKS))
  assert (float(out["spans"]), float(out["spans_exact"])) == (2.0, 1.0)
  predicted[0, 8] = 5
  out = losses.exact_spans(jnp.asarray(predicted), targets, valid, jnp.asarray(GLM_BLOCKS))
  assert (float(out["spans"]), float(out["spans_exact"])) == (2.0, 2.0)
