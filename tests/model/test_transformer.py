"""The decoder: scanned stacks == a per-layer python loop, the MTP equations written out by hand, the tied head,
remat policies, and the dense / MoE split at its extremes."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model.layers import rope_angles
from pallas_kernels.visibility import Visibility
from glm_jax.model.mla import AttentionInputs
from glm_jax.model.transformer import GlmMoeDsa
from tests.helpers import TINY_MODEL, fp32_ulps, init_module

B, T = 2, 8
CFG = TINY_MODEL  # index_topk < T: DSA really selects in every layer


def make_model(cfg, seed=0):
  return init_module(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)), seed)


def token_ids(seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T)), jnp.int32)


# ---- the model written out layer by layer ---------------------------------------------------------------------


def rms(x, g, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g


def layers_of(stack):
  """The stack's layers as separate modules: slice i of every stacked parameter."""
  if stack is None:
    return []
  graphdef, state = nnx.split(stack)
  n = jax.tree.leaves(state)[0].shape[0]
  return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(n)]


def manual(model, ids):
  """(logits, mtp_logits) from the model's own decoder layers, applied one at a time, and hand-written
  embedding, final norm, head and MTP equations."""
  cfg = model.cfg
  eps = cfg.rms_norm_eps
  b, t = ids.shape
  cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(t), (b, t)), cfg.qk_rope_head_dim, cfg.rope_theta)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  inp = AttentionInputs(cos=cos, sin=sin, visibility=Visibility(), mask=causal)
  table = model.embed_tokens.embedding[...]
  w_head = table.T if cfg.tie_word_embeddings else model.lm_head[...]

  emb = table[ids]
  h = emb
  for layer in layers_of(model.dense_layers) + layers_of(model.moe_layers):
    h, _ = layer(h, inp)
  logits = rms(h, model.norm.weight[...], eps) @ w_head

  mtp_logits = []
  for mtp in model.mtp:  # depth 1: h_i (before the final norm) and the embedding of token i+1
    emb_next = jnp.concatenate([emb[:, 1:], jnp.zeros_like(emb[:, :1])], axis=1)
    x = jnp.concatenate([rms(emb_next, mtp.enorm.weight[...], eps), rms(h, mtp.hnorm.weight[...], eps)], axis=-1)
    h, _ = mtp.layer(x @ mtp.eh_proj[...], inp)
    mtp_logits.append(rms(h, mtp.shared_head_norm.weight[...], eps) @ w_head)
  return logits, (jnp.stack(mtp_logits) if mtp_logits else None)


@functools.partial(jax.jit, static_argnums=(0,))
def _model_and_manual(graphdef, state, ids):
  model = nnx.merge(graphdef, state)
  out = model(ids)
  return (out.logits, out.mtp_logits, out.aux), manual(model, ids)


def model_and_manual(model, ids):
  """((logits, mtp_logits, aux) of model(ids), (logits, mtp_logits) of `manual`), compiled together."""
  return _model_and_manual(*nnx.split(model), ids)


def assert_close(a, b, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# ---- tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides",
  [
    {},  # 1 dense + 2 MoE layers, one MTP layer
    {"first_k_dense_replace": 0, "num_hidden_layers": 2},  # MoE only
    {
      "first_k_dense_replace": 2,
      "num_hidden_layers": 2,  # dense only (the MTP layer is still MoE),
      "tie_word_embeddings": True,
    },  # and the embedding doubles as the head
  ],
)
def test_model_equals_layer_by_layer_loop_with_hand_written_mtp(overrides):
  cfg = CFG.replace(**overrides)
  model = make_model(cfg)
  ids = token_ids()
  (logits, mtp_logits, aux), (want_logits, want_mtp) = model_and_manual(model, ids)
  assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
  assert mtp_logits.shape == (1, B, T, cfg.vocab_size)
  assert_close(logits, want_logits)
  assert_close(mtp_logits, want_mtp)
  # Per-layer statistics are stacked over the layers that have them.
  assert aux["topk_indices"].shape == (cfg.num_hidden_layers, B, T, cfg.index_topk)
  if cfg.num_moe_layers:
    assert aux["expert_counts"].shape == (cfg.num_moe_layers, B, cfg.n_routed_experts)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]).sum(-1), T * cfg.num_experts_per_tok)
  else:
    assert "expert_counts" not in aux
  assert aux["mtp0_expert_counts"].shape == (B, cfg.n_routed_experts)
  assert (model.lm_head is None) == cfg.tie_word_embeddings


def test_stack_layers_are_distinct():
  # The per-layer loop only proves something if the stacked layers differ from one another.
  layers = layers_of(make_model(CFG).moe_layers)
  assert len(layers) == 2
  assert np.abs(np.asarray(layers[0].mlp.router[...]) - np.asarray(layers[1].mlp.router[...])).max() > 0.1


@functools.partial(jax.jit, static_argnums=(0,))
def _logits_and_grads(graphdef, params, rest, ids, probe):
  def loss(params):
    logits = nnx.merge(graphdef, params, rest)(ids).logits
    return jnp.sum(logits * probe), logits

  return jax.grad(loss, has_aux=True)(params)


def logits_and_grads(cfg, ids, probe):
  grads, logits = _logits_and_grads(*nnx.split(make_model(cfg), nnx.Param, ...), ids, probe)
  return logits, grads


@pytest.mark.slow  # the model with gradients compiled with and without remat
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_policies_give_the_same_logits_and_gradients(policy):
  # One scanned stack of two MoE layers; dense attention (index_topk = T) keeps the compiles shorter.
  cfg = CFG.replace(num_hidden_layers=2, first_k_dense_replace=0, num_nextn_predict_layers=0, index_topk=T)
  ids = token_ids()
  probe = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, cfg.vocab_size)), jnp.float32)
  logits_ref, grads_ref = logits_and_grads(cfg, ids, probe)  # remat_policy "none"
  logits, grads = logits_and_grads(cfg.replace(remat_policy=policy), ids, probe)
  # The forward is the same program with checkpoints around the layers: equal up to XLA fusing it differently
  # (bit-equal on CPU; 3 ulps apart on an H100 under "dots").
  assert_close(logits, logits_ref, rtol=0, atol=fp32_ulps(logits_ref, 16))
  flat_ref, flat = jax.tree.leaves(grads_ref), jax.tree.leaves(grads)
  assert len(flat) == len(flat_ref) > 10
  # The same float32 products summed in the order each program's fusions take: a reordered sum moves by ulps of its
  # terms' scale (the array's largest gradient), not of an element that cancels to near zero. Valid compilations
  # differ by up to 16 such ulps (CPU, XLA level 0 against 3), remat against none on an H100 by up to 7.5 (where
  # rtol 1e-5 failed); a backward recomputing from bf16-rounded layer inputs moves them by up to 4.7e4.
  for g, g_ref in zip(flat, flat_ref):
    assert_close(g, g_ref, rtol=0, atol=fp32_ulps(g_ref, 64))
  assert sum(float(jnp.abs(g).max()) > 0 for g in flat) > len(flat) // 2  # gradients are not trivially zero
  # ... and the policy really wraps the scanned layer in a checkpoint (the remat primitive), "none" does not.
  for remat_policy, wrapped in (("none", False), (policy, True)):
    graphdef, state = nnx.split(make_model(cfg.replace(remat_policy=remat_policy)))
    jaxpr = str(jax.make_jaxpr(lambda st, ids: nnx.merge(graphdef, st)(ids).logits)(state, ids))
    assert bool(re.search(r"= remat\w*\[", jaxpr)) == wrapped
