"""MLA: MHA form == absorbed form, the DSA path against a numpy MLA with a "causal AND top-k" mask computed
from the module's own weights (docs/glm5_facts.md sections 2-3), and packed segments == separate sequences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model.config import ModelConfig
from glm_jax.model.layers import rope_angles
from pallas_kernels.visibility import Visibility
from glm_jax.model.mla import MLA, AttentionInputs
from glm_jax.model.transformer import GlmMoeDsa
from tests.helpers import TINY_MODEL, init_module

MLA_CFG = ModelConfig(
  vocab_size=32,
  hidden_size=16,
  num_attention_heads=2,
  num_key_value_heads=2,
  q_lora_rank=12,
  kv_lora_rank=10,
  qk_nope_head_dim=6,
  qk_rope_head_dim=4,
  v_head_dim=5,
  index_n_heads=3,
  index_head_dim=8,
  index_topk=3,
  rope_theta=100.0,
)


def make_mla(seed=0, **overrides):
  return init_module(lambda: MLA(MLA_CFG.replace(**overrides), nnx.Rngs(0)), seed, 0.3)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("form", "return_index_scores"))
def _mla_apply(graphdef, state, x, inp, form="mha", return_index_scores=False):
  return nnx.merge(graphdef, state)(x, inp, form=form, return_index_scores=return_index_scores)


def run_mla(mla, x, inp, **kw):
  """mla(x, inp, **kw), compiled once per (module structure, shapes)."""
  return _mla_apply(*nnx.split(mla), jnp.asarray(x), inp, **kw)


def mask_numpy(t_len, seg):
  """[B, T, T] causal and same-segment."""
  causal = np.tril(np.ones((t_len, t_len), bool))
  return causal[None] & (seg[:, :, None] == seg[:, None, :])


def inputs(positions, seg):
  cos, sin = rope_angles(jnp.asarray(positions), MLA_CFG.qk_rope_head_dim, MLA_CFG.rope_theta)
  seg = jnp.asarray(seg, jnp.int32)
  vis = Visibility.self_attention(seg)
  return AttentionInputs(cos=cos, sin=sin, visibility=vis, mask=jnp.asarray(mask_numpy(positions.shape[1], seg)))


def default_inputs(b, t):
  return inputs(np.tile(np.arange(t), (b, 1)), np.zeros((b, t), np.int32))


# ---- numpy MLA and indexer, from the equations ----------------------------------------------------------------


def p64(v):
  return np.asarray(v[...], np.float64)


def rms(x, g, eps):
  return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * g


def rope(x, pos, theta):
  """Interleaved pairs of the last axis of x [T, ..., d], rotated by pos[t] * theta^(-2i/d)."""
  d = x.shape[-1]
  ang = pos[:, None] * theta ** (-2.0 * np.arange(d // 2) / d)
  ang = ang.reshape(ang.shape[:1] + (1,) * (x.ndim - 2) + ang.shape[1:])
  out = np.empty_like(x)
  out[..., 0::2] = x[..., 0::2] * np.cos(ang) - x[..., 1::2] * np.sin(ang)
  out[..., 1::2] = x[..., 0::2] * np.sin(ang) + x[..., 1::2] * np.cos(ang)
  return out


def c_q_numpy(mla, x):
  c = mla.cfg
  return rms(x @ p64(mla.q_a_proj), p64(mla.q_a_layernorm.weight), c.mla_norm_eps)


def index_scores_numpy(mla, x, pos):
  """I[t, s] = sum_j w[t, j] relu(q_I[t, j] . k_I[s]) for one sequence x [T, D]."""
  c, ix = mla.cfg, mla.indexer
  r = c.qk_rope_head_dim
  q = np.einsum("tr,rhd->thd", c_q_numpy(mla, x), p64(ix.wq_b))
  q[..., :r] = rope(q[..., :r], pos, c.rope_theta)
  k = x @ p64(ix.wk)
  k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + c.index_norm_eps)
  k = k * p64(ix.k_norm.weight) + p64(ix.k_norm.bias)
  k[:, :r] = rope(k[:, :r], pos, c.rope_theta)
  w = x @ p64(ix.weights_proj) * c.index_n_heads**-0.5 * c.index_head_dim**-0.5
  return np.einsum("th,ths->ts", w, np.maximum(np.einsum("thd,sd->ths", q, k), 0.0))


def topk_mask_numpy(scores, visible, topk):
  """visible AND "s is among the topk highest visible scores of row t" (ties to the lower index)."""
  keep = np.zeros_like(visible)
  for t in range(scores.shape[0]):
    vis = np.flatnonzero(visible[t])
    keep[t, sorted(vis, key=lambda s: (-scores[t, s], s))[:topk]] = True
  return keep


def mla_numpy(mla, x, pos, mask):
  """MHA-form MLA for one sequence x [T, D] with an explicit [T, T] mask. Returns [T, D]."""
  c = mla.cfg
  dn, r, rk = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
  q = np.einsum("tr,rhk->thk", c_q_numpy(mla, x), p64(mla.q_b_proj))
  q_nope, q_rope = q[..., :dn], rope(q[..., dn:], pos, c.rope_theta)
  kv = x @ p64(mla.kv_a_proj_with_mqa)
  c_kv = rms(kv[:, :rk], p64(mla.kv_a_layernorm.weight), c.mla_norm_eps)
  k_rope = rope(kv[:, rk:], pos, c.rope_theta)  # one rope key for all heads
  kvb = np.einsum("sr,rhk->shk", c_kv, p64(mla.kv_b_proj))
  k_nope, v = kvb[..., :dn], kvb[..., dn:]
  s = (np.einsum("thk,shk->hts", q_nope, k_nope) + np.einsum("thk,sk->hts", q_rope, k_rope)) * (dn + r) ** -0.5
  s = np.where(mask[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("hts,shv->thv", p, v)
  return np.einsum("thv,hvd->td", o, p64(mla.o_proj))


def rand_x(seed, b, t, d=16):
  return np.random.default_rng(seed).standard_normal((b, t, d)).astype(np.float32)


# ---- tests -------------------------------------------------------------------------------------------------


def test_mha_form_equals_absorbed_form():
  mla = make_mla(use_dsa=False)
  x, inp = jnp.asarray(rand_x(1, 2, 7)), default_inputs(2, 7)
  graphdef, state = nnx.split(mla)

  @jax.jit
  def both_forms(state):
    m = nnx.merge(graphdef, state)
    _, q_nope, q_rope, ckv, k_rope = m.project(x, inp)
    return (m.mha(q_nope, q_rope, ckv, k_rope, inp.mask), m.absorbed_dense(q_nope, q_rope, ckv, k_rope, inp.mask))

  mha, absorbed = both_forms(state)
  np.testing.assert_allclose(np.asarray(mha), np.asarray(absorbed), rtol=1e-5, atol=1e-5)
  out_mha, _ = run_mla(mla, x, inp, form="mha")
  out_abs, _ = run_mla(mla, x, inp, form="absorbed")
  np.testing.assert_allclose(np.asarray(out_mha), np.asarray(out_abs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["mha", "absorbed"])
def test_dense_causal_matches_numpy(form):
  mla = make_mla(use_dsa=False)
  x = rand_x(2, 2, 6)
  out, aux = run_mla(mla, x, default_inputs(2, 6), form=form)
  pos, causal = np.arange(6), np.tril(np.ones((6, 6), bool))
  for b in range(2):
    np.testing.assert_allclose(
      np.asarray(out[b]), mla_numpy(mla, x[b].astype(np.float64), pos, causal), rtol=1e-4, atol=1e-5
    )
  assert "topk_indices" not in aux


def test_index_scores_match_numpy():
  mla = make_mla()
  x = rand_x(3, 1, 6)
  _, aux = run_mla(mla, x, default_inputs(1, 6), return_index_scores=True)
  want = index_scores_numpy(mla, x[0].astype(np.float64), np.arange(6))
  causal = np.tril(np.ones((6, 6), bool))
  got = np.asarray(aux["index_scores"][0])
  assert np.all(np.isneginf(got[~causal]))
  np.testing.assert_allclose(got[causal], want[causal], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("topk", [7, 10])  # topk == T selects every visible key; topk > T pads with -1
def test_forced_sparse_path_with_topk_ge_seq_len_equals_dense_causal(topk, monkeypatch):
  mla = make_mla(index_topk=topk)
  x, inp = rand_x(4, 2, 7), default_inputs(2, 7)
  assert not mla.dsa_active(7)
  dense, aux = run_mla(mla, x, inp)
  assert "topk_indices" not in aux
  monkeypatch.setattr(MLA, "dsa_active", lambda self, seq_len: True)  # run the sparse path anyway
  graphdef, state = nnx.split(mla)
  sparse, aux = jax.jit(lambda st: nnx.merge(graphdef, st)(jnp.asarray(x), inp))(state)  # a fresh trace
  assert aux["topk_indices"].shape == (2, 7, topk)
  np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), rtol=1e-5, atol=1e-5)
  causal = np.tril(np.ones((7, 7), bool))
  for b in range(2):
    np.testing.assert_allclose(
      np.asarray(sparse[b]), mla_numpy(mla, x[b].astype(np.float64), np.arange(7), causal), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("topk", [1, 3, 5])
def test_dsa_equals_dense_attention_masked_to_causal_topk(topk):
  mla = make_mla(index_topk=topk)
  t = 9
  x = rand_x(5, 2, t)
  out, aux = run_mla(mla, x, default_inputs(2, t))
  causal, pos = np.tril(np.ones((t, t), bool)), np.arange(t)
  for b in range(2):
    xb = x[b].astype(np.float64)
    keep = topk_mask_numpy(index_scores_numpy(mla, xb, pos), causal, topk)
    got_sets = [set(row[row >= 0].tolist()) for row in np.asarray(aux["topk_indices"][b])]
    assert got_sets == [set(np.flatnonzero(k).tolist()) for k in keep]
    np.testing.assert_allclose(np.asarray(out[b]), mla_numpy(mla, xb, pos, keep), rtol=1e-4, atol=1e-5)
    # The selection matters: plain causal attention gives something else.
    assert np.abs(mla_numpy(mla, xb, pos, causal) - mla_numpy(mla, xb, pos, keep)).max() > 1e-3


@pytest.mark.parametrize("topk", [3, 64])  # DSA active inside each segment / dense path
def test_packed_segments_equal_separate_sequences(topk):
  mla = make_mla(index_topk=topk)
  n = 6
  x = rand_x(6, 1, 2 * n)
  seg = np.array([[0] * n + [1] * n], np.int32)
  pos = np.array([list(range(n)) * 2])
  packed, _ = run_mla(mla, x, inputs(pos, seg))
  for k in range(2):
    alone, _ = run_mla(mla, x[:, k * n : (k + 1) * n], default_inputs(1, n))
    np.testing.assert_allclose(np.asarray(packed[:, k * n : (k + 1) * n]), np.asarray(alone), rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(0,))
def _model_apply(graphdef, state, ids, positions, segment_ids):
  out = nnx.merge(graphdef, state)(ids, positions=positions, segment_ids=segment_ids)
  return out.logits, out.mtp_logits


def test_model_packed_segments_equal_separate_sequences():
  cfg = TINY_MODEL.replace(vocab_size=48, num_hidden_layers=2)
  model = init_module(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)), 7, 0.3)
  graphdef, state = nnx.split(model)
  n = 6
  ids = np.random.default_rng(7).integers(0, 48, (1, 2 * n))

  def run(ids, pos, seg):
    return _model_apply(graphdef, state, jnp.asarray(ids), jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32))

  alone_pos, alone_seg = np.arange(n)[None], np.zeros((1, n))
  packed = run(ids, [list(range(n)) * 2], [[0] * n + [1] * n])
  first, second = run(ids[:, :n], alone_pos, alone_seg), run(ids[:, n:], alone_pos, alone_seg)
  np.testing.assert_allclose(np.asarray(packed[0][:, :n]), np.asarray(first[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(packed[0][:, n:]), np.asarray(second[0]), rtol=1e-5, atol=1e-5)
  # The last segment ends the row, so its MTP inputs (next-token embeddings, zero past the end) match too.
  np.testing.assert_allclose(np.asarray(packed[1][:, :, n:]), np.asarray(second[1]), rtol=1e-5, atol=1e-5)
  # Without segment ids the second document sees the first: the logits differ.
  unpacked = run(ids, [list(range(n)) * 2], np.zeros((1, 2 * n)))
  assert np.abs(np.asarray(unpacked[0][:, n:]) - np.asarray(second[0])).max() > 1e-4
