"""MoE routing (sigmoid, bias-corrected top-k, optional group limit) and the dropless MoE block, against numpy
(docs/glm5_facts.md section 4)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.moe import MoE, route

CFG = ModelConfig(
  vocab_size=32,
  hidden_size=16,
  moe_intermediate_size=8,
  n_routed_experts=8,
  num_experts_per_tok=2,
  n_shared_experts=1,
  routed_scaling_factor=2.5,
  norm_topk_prob=True,
)


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def route_numpy(logits, bias, cfg):
  """One token: (weights [K], expert ids [K]) by the GLM-5 / DeepSeek-V3 rule."""
  s = sigmoid(logits.astype(np.float64))
  choice = s + bias
  if cfg.n_group > 1:
    groups = choice.reshape(cfg.n_group, -1)
    group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)  # sum of the top-2 biased scores of each group
    kept = np.argsort(-group_score, kind="stable")[: cfg.topk_group]
    allowed = np.zeros_like(groups, bool)
    allowed[kept] = True
    choice = np.where(allowed.reshape(-1), choice, -np.inf)
  idx = np.argsort(-choice, kind="stable")[: cfg.num_experts_per_tok]
  w = s[idx]  # the unbiased affinities: the bias steers selection only
  if cfg.norm_topk_prob:
    w = w / w.sum()
  return w * cfg.routed_scaling_factor, idx


def run_route(logits, bias, cfg):
  w, idx, s = route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
  return np.asarray(w), np.asarray(idx), np.asarray(s)


@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 2), (1, 1, 5), (4, 2, 3), (4, 1, 2), (2, 1, 4)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_numpy(n_group, topk_group, k, norm):
  cfg = CFG.replace(n_group=n_group, topk_group=topk_group, num_experts_per_tok=k, norm_topk_prob=norm)
  rng = np.random.default_rng(n_group * 10 + k)
  logits = 2 * rng.standard_normal((12, 8))
  bias = 0.3 * rng.standard_normal(8)
  w, idx, s = run_route(logits, bias, cfg)
  np.testing.assert_allclose(s, sigmoid(logits), rtol=1e-6)
  for n in range(12):
    want_w, want_idx = route_numpy(logits[n], bias, cfg)
    np.testing.assert_array_equal(idx[n], want_idx)
    np.testing.assert_allclose(w[n], want_w, rtol=1e-5)
  if norm:
    np.testing.assert_allclose(w.sum(-1), cfg.routed_scaling_factor, rtol=1e-5)


def test_bias_flips_the_selection_but_not_the_weight_formula():
  cfg = CFG.replace(n_routed_experts=4, num_experts_per_tok=2)
  logits = np.array([[2.0, 0.0, -1.0, 1.0]])
  s = [1 / (1 + math.exp(-v)) for v in logits[0]]
  # No bias: the two largest affinities, experts 0 and 3.
  w, idx, _ = run_route(logits, np.zeros(4), cfg)
  np.testing.assert_array_equal(idx[0], [0, 3])
  np.testing.assert_allclose(w[0], [2.5 * s[0] / (s[0] + s[3]), 2.5 * s[3] / (s[0] + s[3])], rtol=1e-6)
  # A big bias on expert 2 (s = 0.27 + 1.0 > s_0 = 0.88) pulls it in; its weight is still its unbiased s.
  w, idx, _ = run_route(logits, np.array([0.0, 0.0, 1.0, 0.0]), cfg)
  np.testing.assert_array_equal(idx[0], [2, 0])
  np.testing.assert_allclose(w[0], [2.5 * s[2] / (s[0] + s[2]), 2.5 * s[0] / (s[0] + s[2])], rtol=1e-6)
  # Without normalization the weight is exactly scaling_factor * s.
  w, idx, _ = run_route(logits, np.array([0.0, 0.0, 1.0, 0.0]), cfg.replace(norm_topk_prob=False))
  np.testing.assert_allclose(w[0], [2.5 * s[2], 2.5 * s[0]], rtol=1e-6)


def test_group_limit_by_hand():
  # Groups {0, 1} and {2, 3}. Group 0 scores s(3) + s(-3) = 1.0 exactly, group 1 s(2.5) + s(2) = 1.80:
  # with one group kept the picks are 2 and 3, although expert 0 has the highest affinity.
  cfg = CFG.replace(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)
  logits = np.array([[3.0, -3.0, 2.5, 2.0]])
  s2, s3 = 1 / (1 + math.exp(-2.5)), 1 / (1 + math.exp(-2.0))
  w, idx, _ = run_route(logits, np.zeros(4), cfg)
  np.testing.assert_array_equal(idx[0], [2, 3])
  np.testing.assert_allclose(w[0], [2.5 * s2 / (s2 + s3), 2.5 * s3 / (s2 + s3)], rtol=1e-6)
  _, idx, _ = run_route(logits, np.zeros(4), cfg.replace(n_group=1, topk_group=1))
  np.testing.assert_array_equal(idx[0], [0, 2])


# ---- the MoE block ---------------------------------------------------------------------------------------------


def init_module(ctor, seed, scale):
  """Builds a module abstractly and fills every variable from numpy: N(0, scale^2)."""
  graphdef, state = nnx.split(nnx.eval_shape(ctor))
  rng = np.random.default_rng(seed)
  return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype), state))


def make_moe(cfg, seed=0):
  return init_module(lambda: MoE(cfg, nnx.Rngs(0)), seed, 0.3)


def run_moe(moe, x):
  graphdef, state = nnx.split(moe)
  return jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))(state, jnp.asarray(x))


def swiglu(x, gate, up, down):
  a = x @ gate
  return (a * sigmoid(a) * (x @ up)) @ down


@pytest.mark.parametrize(
  "overrides",
  [
    {},
    {"norm_topk_prob": False, "num_experts_per_tok": 3},
    {"n_group": 4, "topk_group": 2},
    {"n_shared_experts": 0},
    {"moe_capacity_factor": 0.5},
    {"moe_capacity_factor": 1.25},
  ],
)
def test_moe_matches_per_token_loop(overrides):
  """With a capacity factor c the 10 tokens are one dispatch group: each expert takes its first
  ceil(c * 10 * K / E) (token, slot) pairs in token order and the rest are dropped (and counted)."""
  cfg = CFG.replace(**overrides)
  moe = make_moe(cfg)
  x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32)
  y, stats = run_moe(moe, x)

  p = {n: np.asarray(getattr(moe, n)[...], np.float64) for n in ("router", "gate_proj", "up_proj", "down_proj")}
  bias = np.asarray(moe.e_score_correction_bias[...], np.float64)
  assert np.abs(bias).max() > 0.1  # a real bias is in play
  want_y = np.zeros((2, 5, 16))
  want_counts = np.zeros((2, 8), int)
  want_probs = np.zeros((2, 8))
  cap = math.ceil(cfg.moe_capacity_factor * 10 * cfg.num_experts_per_tok / 8) if cfg.moe_capacity_factor else 10**9
  taken, dropped = np.zeros(8, int), 0
  for b in range(2):
    for t in range(5):
      xt = x[b, t].astype(np.float64)
      logits = xt @ p["router"]
      w, idx = route_numpy(logits, bias, cfg)
      for wk, e in zip(w, idx):
        want_counts[b, e] += 1
        if taken[e] == cap:
          dropped += 1
          continue
        taken[e] += 1
        want_y[b, t] += wk * swiglu(xt, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
      if cfg.n_shared_experts:
        sh = moe.shared_experts
        want_y[b, t] += swiglu(xt, *(np.asarray(v[...], np.float64) for v in (sh.gate_proj, sh.up_proj, sh.down_proj)))
      s = sigmoid(logits)
      want_probs[b] += s / s.sum() / 5
  np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats["expert_counts"]), want_counts)
  np.testing.assert_allclose(np.asarray(stats["expert_probs"]), want_probs, rtol=1e-5)
  assert want_counts.sum() == 2 * 5 * cfg.num_experts_per_tok
  if cfg.moe_capacity_factor:
    assert dropped > 0 and int(stats["expert_dropped"]) == dropped, (dropped, stats["expert_dropped"])
  else:
    assert "expert_dropped" not in stats


@pytest.mark.parametrize("factor", [0.1, 1 / 3 - 1e-3, -1.0, True, "1.0"])
def test_capacity_factor_below_one_over_k_is_named(factor):
  with pytest.raises(
    ValueError,
    match=r"moe_capacity_factor=.* is invalid; 0 \(dropless\) or a number >= "
    r"1 / num_experts_per_tok = 0.3333",
  ):
    CFG.replace(num_experts_per_tok=3, moe_capacity_factor=factor)


def test_gradient_reaches_only_selected_experts_and_never_the_bias():
  cfg = CFG.replace(num_experts_per_tok=1)
  moe = make_moe(cfg, seed=3)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 3, 16)), jnp.float32)
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
  assert "e_score_correction_bias" not in params and "e_score_correction_bias" in rest
  assert not isinstance(moe.e_score_correction_bias, nnx.Param)

  def loss(params):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y * jnp.arange(16.0))

  grads = jax.jit(jax.grad(loss))(params)
  assert "e_score_correction_bias" not in grads
  _, stats = run_moe(moe, x)
  selected = np.asarray(stats["expert_counts"][0]) > 0
  assert 1 <= selected.sum() <= 3 < 8
  for name in ("gate_proj", "up_proj", "down_proj"):
    g = np.asarray(grads[name][...])
    assert np.all(g[~selected] == 0.0), name
    assert np.all(np.abs(g[selected]).reshape(selected.sum(), -1).max(-1) > 0), name
  assert np.abs(np.asarray(grads["router"][...])).max() > 0

  # Even when differentiated explicitly, the gate weights do not depend on the bias (selection is discrete).
  logits = jnp.asarray(np.random.default_rng(5).standard_normal((4, 8)), jnp.float32)
  g_bias = jax.grad(lambda b: jnp.sum(route(logits, b, CFG)[0] * jnp.arange(1.0, 3.0)))(jnp.full((8,), 0.1))
  np.testing.assert_array_equal(np.asarray(g_bias), np.zeros(8))
