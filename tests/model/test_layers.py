"""glm_jax.model.layers against numpy formulas written from the definitions (float64 references)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.layers import MLP, Embed, LayerNorm, RMSNorm, apply_rope, check_token_ids, rope_angles
from glm_jax.model.transformer import GlmMoeDsa

CFG = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=12)


def rand(rng, *shape, scale=1.0):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


# ---- norms -------------------------------------------------------------------------------------------------


def test_rmsnorm_matches_numpy():
  rng = np.random.default_rng(0)
  x, g = rand(rng, 2, 3, 16, scale=3.0), rand(rng, 16)
  norm = RMSNorm(16, 1e-5, CFG, nnx.Rngs(0))
  norm.weight[...] = jnp.asarray(g)
  x64 = x.astype(np.float64)
  want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-5) * g
  np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def test_rmsnorm_eps_matters_for_small_inputs():
  x = np.full((1, 4), 1e-3, np.float32)  # mean(x^2) = 1e-6, comparable to eps
  norm = RMSNorm(4, 1e-6, CFG, nnx.Rngs(0))
  np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), 1e-3 / np.sqrt(2e-6), rtol=1e-5)


def test_layernorm_matches_numpy():
  rng = np.random.default_rng(1)
  x, g, b = rand(rng, 2, 5, 16, scale=2.0) + 3.0, rand(rng, 16), rand(rng, 16)
  norm = LayerNorm(16, 1e-6, CFG, nnx.Rngs(0))
  norm.weight[...] = jnp.asarray(g)
  norm.bias[...] = jnp.asarray(b)
  x64 = x.astype(np.float64)
  mu = x64.mean(-1, keepdims=True)
  var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
  want = (x64 - mu) / np.sqrt(var + 1e-6) * g + b
  np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


# ---- rope --------------------------------------------------------------------------------------------------


def rope_numpy(x, positions, theta, interleave):
  """x [B, T, ..., d]: rotate pair i by angle pos * theta^(-2i/d). Pairs are (x[2i], x[2i+1]) when
  interleaved, (x[i], x[i + d/2]) for the half split."""
  x = x.astype(np.float64)
  out = np.empty_like(x)
  d = x.shape[-1]
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      for i in range(d // 2):
        ang = positions[b, t] * theta ** (-2.0 * i / d)
        c, s = np.cos(ang), np.sin(ang)
        i0, i1 = (2 * i, 2 * i + 1) if interleave else (i, i + d // 2)
        a, bb = x[b, t, ..., i0], x[b, t, ..., i1]
        out[b, t, ..., i0] = a * c - bb * s
        out[b, t, ..., i1] = a * s + bb * c
  return out


def jax_rope(x, positions, theta, interleave):
  cos, sin = rope_angles(jnp.asarray(positions), x.shape[-1], theta)
  return np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleave))


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 8), (2, 5, 3, 8)])  # [B, T, d] and [B, T, H, d]
def test_rope_matches_numpy_pair_rotation(interleave, shape):
  rng = np.random.default_rng(2)
  x = rand(rng, *shape)
  positions = np.array([[0, 1, 2, 3, 4], [7, 3, 30, 0, 11]])
  want = rope_numpy(x, positions, 1e4, interleave)
  np.testing.assert_allclose(jax_rope(x, positions, 1e4, interleave), want, rtol=1e-5, atol=1e-5)


def test_rope_interleaved_and_half_split_differ():
  x = rand(np.random.default_rng(3), 1, 1, 8)
  pos = np.array([[5]])
  assert not np.allclose(jax_rope(x, pos, 1e4, True), jax_rope(x, pos, 1e4, False), atol=1e-3)


def test_rope_position_zero_is_identity():
  x = rand(np.random.default_rng(4), 1, 3, 8)
  for interleave in (True, False):
    np.testing.assert_array_equal(jax_rope(x, np.zeros((1, 3), int), 1e4, interleave), x)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_dot_product_depends_only_on_position_difference(interleave):
  rng = np.random.default_rng(5)
  q, k = rand(rng, 1, 1, 16), rand(rng, 1, 1, 16)

  def score(m, n):
    qm = jax_rope(q, np.array([[m]]), 100.0, interleave)
    kn = jax_rope(k, np.array([[n]]), 100.0, interleave)
    return float(np.sum(qm.astype(np.float64) * kn))

  for m, n, shift in [(3, 1, 10), (7, 7, 4), (2, 9, 25)]:
    np.testing.assert_allclose(score(m, n), score(m + shift, n + shift), rtol=1e-4, atol=1e-5)
  assert abs(score(3, 1) - score(4, 1)) > 1e-3  # ... and does depend on it


# ---- embedding and token-id checks --------------------------------------------------------------------------


def test_embed_is_a_row_lookup_and_never_clamps():
  emb = Embed(CFG, nnx.Rngs(0))
  table = np.asarray(emb.embedding[...])
  ids = np.array([[0, 3, 10], [5, 5, 1]])
  np.testing.assert_array_equal(np.asarray(emb(jnp.asarray(ids))), table[ids])
  out = np.asarray(emb(jnp.array([[11, 12, 2]])))  # traced paths cannot raise: bad ids give NaN rows
  assert np.isnan(out[0, :2]).all()
  np.testing.assert_array_equal(out[0, 2], table[2])


def test_embed_negative_ids_give_nan_rows():
  out = np.asarray(Embed(CFG, nnx.Rngs(0))(jnp.array([[-1, -11]])))
  assert np.isnan(out).all()


@pytest.mark.parametrize("bad", [11, 12, 1000, -1, -7])
def test_check_token_ids_names_the_bad_id(bad):
  ids = jnp.array([[0, 3, bad, 2]])
  with pytest.raises(ValueError, match=rf"input_ids: token id {bad} is outside the vocabulary \[0, 11\)"):
    check_token_ids(ids, 11)


def test_check_token_ids_accepts_valid_ids_and_rejects_floats():
  check_token_ids(jnp.array([[0, 10]]), 11)  # no error
  with pytest.raises(ValueError, match="not an integer type"):
    check_token_ids(jnp.array([[0.0, 1.0]]), 11)


def test_check_token_ids_is_a_no_op_for_concrete_ids_inside_a_trace():
  ids = jnp.array([[1, 2, 3]])
  jax.jit(lambda: check_token_ids(ids, 10) or jnp.zeros(()))()


@pytest.mark.parametrize("bad", [64, 100, -1])
def test_model_call_rejects_out_of_vocab_ids(bad):
  cfg = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=16,
    moe_intermediate_size=8,
    num_hidden_layers=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    index_topk=4,
    index_n_heads=2,
    index_head_dim=8,
  )
  model = nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))  # the id check runs before any weight is read
  with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 64\)"):
    model(jnp.array([[1, 2, bad, 3]]))


# ---- MLP ---------------------------------------------------------------------------------------------------


def test_mlp_is_swiglu():
  rng = np.random.default_rng(6)
  mlp = MLP(CFG, 12, nnx.Rngs(0))
  g, u, d = rand(rng, 8, 12), rand(rng, 8, 12), rand(rng, 12, 8)
  mlp.gate_proj[...], mlp.up_proj[...], mlp.down_proj[...] = jnp.asarray(g), jnp.asarray(u), jnp.asarray(d)
  x = rand(rng, 2, 3, 8)
  a = x.astype(np.float64) @ g
  want = ((a / (1 + np.exp(-a))) * (x.astype(np.float64) @ u)) @ d
  np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
