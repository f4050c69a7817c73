"""attention_impl="pallas": the model's DSA through the Pallas kernels (interpret mode on CPU) equals the pure-jnp
reference path: logits, every parameter's gradient (the indexer's through the sparse-stage KL included), and
chunked prefill / decode against a longer cache (q_offset)."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model import dsa
from glm_jax.model.transformer import GlmMoeDsa
from pallas_kernels.visibility import Visibility
from tests.helpers import TINY_MODEL, init_module

B, T = 2, 24
CFG = TINY_MODEL.replace(
  num_hidden_layers=2, index_topk=6
)  # index_topk < T: DSA selects in every layer; the first 6 queries get -1 padding


def assert_close_scaled(got, want, err_msg=""):
  """fp32 gradients summed in another order (online softmax, per-block dkv, chunks): errors of a few ulps of the
  largest terms, so the absolute tolerance scales with the array's largest magnitude."""
  want = np.asarray(want)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=err_msg)


@functools.partial(jax.jit, static_argnums=(0,))
def _logits_kl_and_grads(graphdef, params, rest, ids, segment_ids, probe):
  def loss(params):
    out = nnx.merge(graphdef, params, rest)(ids, segment_ids=segment_ids, indexer_loss=True)
    kl = out.aux["indexer_kl"]
    return jnp.sum(out.logits * probe) + jnp.sum(out.mtp_logits[0] * probe) + jnp.sum(kl), (out.logits, kl)

  return jax.grad(loss, has_aux=True)(params)


def run(impl, ids, segment_ids, probe):
  model = init_module(lambda: GlmMoeDsa(CFG.replace(attention_impl=impl), nnx.Rngs(0)), 0)
  grads, (logits, kl) = _logits_kl_and_grads(*nnx.split(model, nnx.Param, ...), ids, segment_ids, probe)
  return logits, kl, grads


@pytest.mark.slow  # the whole model in interpret mode, with gradients
def test_tiny_model_logits_kl_and_gradients_equal_the_reference():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
  segment_ids = jnp.asarray([[0] * 9 + [1] * 15, [0] * T], jnp.int32)  # two packed documents, then one
  probe = jnp.asarray(rng.standard_normal((B, T, CFG.vocab_size)), jnp.float32)
  logits_ref, kl_ref, grads_ref = run("reference", ids, segment_ids, probe)
  logits, kl, grads = run("pallas", ids, segment_ids, probe)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(kl), np.asarray(kl_ref), rtol=1e-5, atol=1e-6)
  assert float(jnp.min(kl_ref)) > 0  # the sparse-stage KL is really computed
  flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
  flat = jax.tree.leaves(grads)
  assert len(flat) == len(flat_ref) > 20
  for (path, g_ref), g in zip(flat_ref, flat):
    assert_close_scaled(g, g_ref, jax.tree_util.keystr(path))
  indexer = [g for (path, g), _ in zip(flat_ref, flat) if "indexer" in jax.tree_util.keystr(path)]
  assert indexer and all(float(jnp.abs(g).max()) > 0 for g in indexer)  # the KL trains the indexer


# decode (slow tier: a second interpret-mode compile) and chunked prefill
@pytest.mark.parametrize("t_len, s_len", [pytest.param(1, 40, marks=pytest.mark.slow), (7, 40)])
def test_q_offset_against_a_longer_cache(t_len, s_len):
  rng = np.random.default_rng(1)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q_i, k_i, w_i = normal(B, t_len, 2, 8), normal(B, s_len, 8), normal(B, t_len, 2)
  q, kv = normal(B, t_len, 3, 12), normal(B, s_len, 12)
  out = {}
  for impl in ("reference", "pallas"):
    idx, vals = dsa.select_topk(impl, q_i, k_i, w_i, topk=16, visibility=Visibility(q_offset=s_len - t_len))
    out[impl] = (idx, vals, *dsa.attend(impl, q, kv, idx, sm_scale=0.3, v_dim=8))
  np.testing.assert_array_equal(np.asarray(out["pallas"][0]), np.asarray(out["reference"][0]))
  for got, want in zip(out["pallas"][1:], out["reference"][1:]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # the recomputed, differentiable scores of the selected keys are the top-k's scores
  np.testing.assert_allclose(
    np.asarray(dsa.selected_index_scores(q_i, k_i, w_i, out["pallas"][0])),
    np.asarray(out["reference"][1]),
    rtol=1e-5,
    atol=1e-5,
  )


def test_selected_index_scores_in_chunks_keep_values_and_gradients():
  rng = np.random.default_rng(2)
  q_i, k_i, w_i = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, 13, 2, 8), (B, 30, 8), (B, 13, 2)])
  vis = Visibility(q_offset=17)
  idx, vals = dsa.select_topk("reference", q_i, k_i, w_i, topk=9, visibility=vis)  # differentiable top-k values

  def total(fn, q, k, w):
    return jnp.sum(jnp.where(idx >= 0, fn(q, k, w), 0.0) ** 2)

  want = jax.grad(
    lambda q, k, w: total(lambda *a: dsa.select_topk("reference", *a, topk=9, visibility=vis)[1], q, k, w),
    argnums=(0, 1, 2),
  )(q_i, k_i, w_i)
  for chunk in (4, 512):  # 13 queries: four chunks (the last padded), or one
    scores = dsa.selected_index_scores(q_i, k_i, w_i, idx, chunk=chunk)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(vals), rtol=1e-5, atol=1e-5)
    got = jax.grad(
      lambda q, k, w: total(lambda *a: dsa.selected_index_scores(*a, idx, chunk=chunk), q, k, w), argnums=(0, 1, 2)
    )(q_i, k_i, w_i)
    for g, w in zip(got, want):
      assert_close_scaled(g, w)


def test_backend_without_a_compiled_kernel_falls_back_to_the_reference_and_says_so_once(monkeypatch, caplog):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(dsa, "_logged", set())
  with caplog.at_level(logging.INFO):
    modes = [dsa.kernel_mode("pallas") for _ in range(3)]
  assert modes == ["reference"] * 3
  warnings = [r for r in caplog.records if "no compiled variant" in r.getMessage()]
  assert len(warnings) == 1 and "on gpu" in warnings[0].getMessage()
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert dsa.kernel_mode("pallas") == "compiled" and dsa.kernel_mode("reference") == "reference"
  with pytest.raises(ValueError, match=r"attention_impl='flash'; one of 'reference', 'pallas'"):
    dsa.kernel_mode("flash")
