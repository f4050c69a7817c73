"""The LM / MTP head and cross-entropy a chunk of tokens at a time (train.loss_chunk): the same loss, gradient and
argmax as the whole [B, T, V] logits, and no such array in the compiled step."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.configs import glm5_tiny
from glm_jax.train import losses
from glm_jax.train import step as step_lib
from glm_jax.train.trainer import check_config
from tests.train.test_step import build, compile_fast, make_batch, model_config, to_device


def plain_nll(x, w, targets, valid):
  """The unchunked formula in plain jnp: sum over valid t of logsumexp(x_t W) - (x_t W)[target_t]."""
  logits = jnp.einsum("btd,dv->btv", x, w)
  nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(valid, nll, 0.0))


@pytest.mark.parametrize("chunk", [0, 1, 3, 4, 12])
def test_chunked_cross_entropy_equals_the_whole_logits(chunk):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 12, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 30)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 30, (2, 12)), jnp.int32)
  valid = jnp.asarray(rng.random((2, 12)) < 0.7)
  head = lambda w: lambda h: jnp.einsum("btd,dv->btv", h, w)  # noqa: E731

  def chunked(x, w):
    nll, count, pred = losses.chunked_cross_entropy(head(w), x, targets, valid, chunk, with_argmax=True)
    return nll, (count, pred)

  (nll, (count, pred)), (gx, gw) = jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True)(x, w)
  want, (want_gx, want_gw) = jax.value_and_grad(plain_nll, argnums=(0, 1))(x, w, targets, valid)
  np.testing.assert_allclose(nll, want, rtol=1e-6)
  assert float(count) == float(np.sum(np.asarray(valid)))
  np.testing.assert_array_equal(pred, np.argmax(np.einsum("btd,dv->btv", x, w), axis=-1))
  np.testing.assert_allclose(gx, want_gx, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gw, want_gw, rtol=1e-5, atol=1e-6)


def test_a_chunk_that_does_not_divide_is_named():
  x = jnp.zeros((1, 12, 4))
  with pytest.raises(ValueError, match=r"train.loss_chunk=5 does not divide the sequence length 12"):
    losses.chunked_cross_entropy(lambda h: h, x, jnp.zeros((1, 12), jnp.int32), jnp.ones((1, 12), bool), 5)
  config = glm5_tiny.get_config()
  config.data.seq_len = 64
  config.train.loss_chunk = 48
  with pytest.raises(ValueError, match=r"train.loss_chunk=48 is invalid; must divide data.seq_len=64"):
    check_config(config)
  config.train.loss_chunk = -1
  with pytest.raises(ValueError, match=r"train.loss_chunk=-1 is invalid"):
    check_config(config)


@pytest.fixture(scope="module")
def tiny():
  graphdef, params, rest = build(model_config(use_dsa=False))  # glm5_tiny with its MTP layer, V = 512
  return types.SimpleNamespace(graphdef=graphdef, params=to_device(params), rest=rest, batch=to_device(make_batch()))


def loss_and_grads(tiny, chunk):
  def fn(params, batch):
    cfg = types.SimpleNamespace(
      mtp_loss_weight=0.3, balance_loss_weight=1e-4, indexer_loss_weight=1.0, loss_chunk=chunk
    )
    return jax.value_and_grad(step_lib._forward_losses, argnums=1, has_aux=True)(
      tiny.graphdef, params, tiny.rest, batch, "dense", cfg
    )

  return compile_fast(jax.jit(fn), tiny.params, tiny.batch)


@pytest.mark.slow  # two compiles of the tiny model's gradient
def test_the_step_loss_and_gradient_with_chunks_equal_the_whole_logits(tiny):
  """The dense stage's loss (LM + MTP + balance) and its gradient of every parameter, chunked (4 tokens of the
  16 at a time) and not; and the chunked program holds no [B, T, V] fp32 array while the plain one does."""
  plain, chunked = loss_and_grads(tiny, 0), loss_and_grads(tiny, 4)
  (loss, (m, _)), grads = plain(tiny.params, tiny.batch)
  (loss_c, (m_c, _)), grads_c = chunked(tiny.params, tiny.batch)
  np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
  for key in ("lm_loss", "mtp_loss", "tokens"):
    np.testing.assert_allclose(m_c[key], m[key], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
  whole = "f32[4,16,512]"  # [B, T, V] logits
  assert whole in plain.as_text()
  assert whole not in chunked.as_text() and "f32[4,4,512]" in chunked.as_text()


@pytest.mark.slow  # three compiles of the tiny model
def test_the_eval_step_with_chunks_equals_the_whole_logits():
  """make_eval_step's NLL, token count and span exact-match (a blank-infilling batch) with loss_chunk 4 and 0."""
  graphdef, params, rest = build(model_config(use_dsa=False, rope_2d=True))
  rng = np.random.default_rng(1)
  batch = make_batch()
  batch["targets"] = rng.integers(0, 512, batch["input_ids"].shape).astype(np.int32)
  batch["loss_mask"] = (rng.random(batch["input_ids"].shape) < 0.6).astype(np.int32)
  batch["block_positions"] = np.tile(np.array([0, 0, 0, 1, 2, 3, 1, 2, 0, 0, 1, 2, 3, 4, 1, 2], np.int32), (4, 1))
  # one span per row whose targets are the model's own argmax, so spans_exact is not trivially 0
  logits = np.asarray(
    jax.jit(
      lambda p, b: nnx.merge(graphdef, p, rest)(b["input_ids"], **step_lib.model_inputs(b), compute_mtp=False).logits
    )(to_device(params), to_device(batch))
  )
  batch["targets"][:, 3:6] = logits[:, 3:6].argmax(-1)
  batch["loss_mask"][:, 3:6] = 1
  batch = to_device(batch)
  plain = step_lib.make_eval_step(graphdef)(params, rest, batch)
  chunked = step_lib.make_eval_step(graphdef, loss_chunk=4)(params, rest, batch)
  assert float(plain["spans_exact"]) >= 1
  for key in ("nll", "tokens", "spans", "spans_exact"):
    np.testing.assert_allclose(chunked[key], plain[key], rtol=1e-6)
  # the plain formula for the NLL, from the full logits
  valid = np.asarray(batch["loss_mask"]).astype(bool) & (np.asarray(batch["segment_ids"]) != 0)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(plain["nll"], np.sum(np.where(valid, lse - picked, 0.0)), rtol=1e-5)
