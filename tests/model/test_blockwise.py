"""Dense attention and the DSA warm-up's indexer KL a block of queries at a time (model.attention_chunk,
glm_jax/model/blockwise.py) against the whole-matrix formula in plain jnp, values and gradients; and the model's
warm-up forward with and without blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model import blockwise
from pallas_kernels.visibility import Visibility
from tests.train.test_step import build, make_batch, model_config, to_device

B, T, H, A, R, HI, DI = 2, 12, 3, 10, 6, 2, 4
SCALE = 0.4


def whole(q, kv, q_i, k_i, w_i, seg, prefix_end):
  """Every score at once: [B, H, T, S] attention, its head sum against the indexer's softmax, row by row."""
  t = np.arange(T)
  visible = (t[None, :] <= t[:, None])[None] | (t[None, None, :] < prefix_end[:, :, None])
  visible = visible & (seg[:, :, None] == seg[:, None, :])
  s = jnp.einsum("bthl,bsl->bhts", q, kv) * SCALE
  s = jnp.where(visible[:, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("bhts,bsr->bthr", p, kv[..., :R])
  target = jax.lax.stop_gradient(jnp.sum(p, axis=1))
  target = target / jnp.sum(target, axis=-1, keepdims=True)
  scores = jnp.einsum("bth,bths->bts", w_i, jax.nn.relu(jnp.einsum("bthd,bsd->bths", q_i, k_i)))
  log_q = jax.nn.log_softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
  kl = jnp.sum(
    jnp.where(visible & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_q), 0.0), axis=-1
  )
  return out, jnp.mean(kl)


def inputs():
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  seg = np.array([[1] * 7 + [2] * 5, [1] * 12], np.int32)  # two documents in row 0
  prefix_end = np.array([[3] * 7 + [9] * 5, [5] * 12], np.int32)  # GLM's prefixes: bidirectional up to there
  return (
    (normal(B, T, H, A), normal(B, T, A), normal(B, T, HI, DI), normal(B, T, DI), normal(B, T, HI)),
    seg,
    prefix_end,
  )


@pytest.mark.parametrize("chunk", [1, 4])  # one row a block (the most steps), and a block of several
def test_blocks_equal_the_whole_matrix_values_and_gradients(chunk):
  arrays, seg, prefix_end = inputs()
  probe = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, R)), jnp.float32)

  def blocked(q, kv, q_i, k_i, w_i):
    out, kl = blockwise.latent_attention_and_kl(
      q,
      kv,
      (q_i, k_i, w_i),
      sm_scale=SCALE,
      v_dim=R,
      chunk=chunk,
      visibility=Visibility.self_attention(jnp.asarray(seg), jnp.asarray(prefix_end)),
      out_dtype=jnp.float32,
    )
    kl = jnp.mean(kl)  # per query row -> the loss's mean
    return jnp.sum(out * probe) + kl, (out, kl)

  def plain(*arrays):
    out, kl = whole(*arrays, seg, prefix_end)
    return jnp.sum(out * probe) + kl, (out, kl)

  (_, (out, kl)), grads = jax.value_and_grad(blocked, argnums=range(5), has_aux=True)(*arrays)
  (_, (want_out, want_kl)), want_grads = jax.value_and_grad(plain, argnums=range(5), has_aux=True)(*arrays)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(kl, want_kl, rtol=1e-5)
  for g, w, name in zip(grads, want_grads, ("q", "kv", "q_i", "k_i", "w_i")):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=name)


def test_a_chunk_that_does_not_divide_is_named():
  (q, kv, *_), seg, _ = inputs()
  with pytest.raises(ValueError, match=r"model.attention_chunk=5 does not divide the 12 query rows"):
    blockwise.latent_attention_and_kl(
      q,
      kv,
      None,
      sm_scale=SCALE,
      v_dim=R,
      chunk=5,
      visibility=Visibility.self_attention(jnp.asarray(seg)),
      out_dtype=jnp.float32,
    )


@pytest.mark.slow  # two compiles of the tiny model's forward and KL gradient
def test_the_warmup_forward_in_blocks_equals_the_whole():
  """glm5_tiny (dense attention, the warm-up's indexer loss, its MTP layer): logits, the per-layer KL and the KL's
  gradient of every parameter with attention_chunk 4 equal those with 0 (the whole [B, H, T, S] in MHA form)."""
  batch = to_device(make_batch())
  results = []
  for chunk in (0, 4):
    graphdef, params, rest = build(model_config(use_dsa=False, attention_chunk=chunk))

    def fn(params):
      out = nnx.merge(graphdef, params, rest)(
        batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"], indexer_loss=True
      )
      return jnp.mean(out.aux["indexer_kl"]), out

    (kl, out), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(to_device(params))
    results.append((out.logits, out.aux["indexer_kl"], grads))
  (logits, kl, grads), (logits_c, kl_c, grads_c) = results
  # the blocks attend in the absorbed form, the whole in the MHA form: test_mla's 1e-5 between the two forms, here
  # through four attention layers (three and MTP's) with N(0, 0.3^2) weights
  np.testing.assert_allclose(logits_c, logits, rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(kl_c, kl, rtol=1e-5)
  assert float(jnp.min(kl)) > 1e-3  # a real KL, not ~0
  for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
