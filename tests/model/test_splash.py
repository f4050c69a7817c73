"""The dense stage's splash attention (glm_jax/model/splash.py, routed by dsa.dense_causal_attend and MLA) against
the plain softmax over the reference mask, value and gradients, in Pallas interpret mode; the MLA layer with
attention_impl="pallas" against "reference" in the dense stage; the TPU program it compiles to."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model import splash
from glm_jax.model.config import ModelConfig
from glm_jax.model.layers import rope_angles
from glm_jax.model.mla import MLA, AttentionInputs
from pallas_kernels.visibility import Visibility
from tests.helpers import init_module
from tests.helpers import needs_libtpu

B, T, H, P, O = 2, 256, 2, 64, 32
SCALE = P**-0.5


def segments():
  """Two packed documents in the first sequence (100 + 156 tokens), one in the second."""
  return jnp.asarray([[1] * 100 + [2] * 156, [1] * T], jnp.int32)


def causal_same_segment(seg):
  """[B, T, T]: the lower triangle, within a document."""
  t = seg.shape[1]
  return jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])


def reference(q, k, v, seg):
  s = jnp.einsum("bthp,bshp->bhts", q, k, precision="highest") * SCALE
  mask = causal_same_segment(seg)
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshv->bthv", p, v, precision="highest")


def test_splash_equals_softmax_attention_forward_and_backward():
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.standard_normal((B, T, H, P)), jnp.float32) for _ in range(2))
  v, ct = (jnp.asarray(rng.standard_normal((B, T, H, O)), jnp.float32) for _ in range(2))
  seg = segments()

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2)))(q, k, v)

  vis = Visibility.self_attention(seg)
  got = value_and_grads(lambda q, k, v: splash.causal_attention(q, k, v, vis, sm_scale=SCALE, interpret=True))
  want = value_and_grads(lambda q, k, v: reference(q, k, v, seg))
  y = splash.causal_attention(q, k, v, vis, sm_scale=SCALE, interpret=True)
  np.testing.assert_allclose(np.asarray(y), np.asarray(reference(q, k, v, seg)), atol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5 * max(1.0, float(jnp.max(jnp.abs(w)))))


def test_block_size_that_does_not_fit_is_named():
  assert splash.block_size(4096) == 512 and splash.block_size(384) == 128 and not splash.fits(100)
  with pytest.raises(ValueError, match=r"seq_len=100 must be a multiple of one of the block sizes \(512, 256, 128\)"):
    splash.block_size(100)


@pytest.mark.slow  # Pallas interpret mode through the MLA layer, forward and backward
def test_mla_dense_stage_with_pallas_equals_reference():
  """glm5-like MLA without DSA (the dense stage), 128 tokens: attention_impl="pallas" runs splash in interpret mode
  on the CPU, "reference" the [T, S] softmax; same outputs and parameter gradients."""
  cfg = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=32,
    use_dsa=False,
  )
  t = 128
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, t, 64)), jnp.float32)
  seg = jnp.asarray([[1] * 40 + [2] * 88, [1] * t], jnp.int32)
  cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(t), (2, t)), cfg.qk_rope_head_dim, cfg.rope_theta)
  inp = AttentionInputs(cos=cos, sin=sin, visibility=Visibility.self_attention(seg), mask=causal_same_segment(seg))
  results = {}
  for impl in ("reference", "pallas"):
    graphdef, params = nnx.split(init_module(lambda: MLA(cfg.replace(attention_impl=impl), nnx.Rngs(0)), 2, 0.2))
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(x, inp)[0] ** 2)
    results[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (l_ref, g_ref), (l_pal, g_pal) = results["reference"], results["pallas"]
  np.testing.assert_allclose(float(l_pal), float(l_ref), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_pal), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4 * max(1.0, float(jnp.max(jnp.abs(b)))))


@needs_libtpu
@pytest.mark.slow  # a TPU compile of the train step
def test_dense_stage_compiles_splash_kernels_for_tpu():
  """The dense-stage train step with attention_impl="pallas", compiled for v5p: splash's kernels (forward and the
  fused backward) run the attention at each attention site (one dense layer, as every layer attends alike, and the
  MTP layer), and no [B, H, T, S] fp32 scores are left."""
  from glm_jax.configs import glm5_tiny
  from glm_jax.sharding.topology import tpu_topology_devices
  from glm_jax.train import aot

  config = glm5_tiny.get_config()
  config.data.batch_size, config.data.seq_len = 8, 256
  config.model.attention_impl = "pallas"
  config.train.dsa_stage = "dense"
  config.mesh.fsdp = 4
  # AdamW (the optimizer does not touch attention) and one dense layer (an MoE layer attends alike; its experts only
  # lengthen the compile).
  config.optimizer.name = "adamw"
  config.model.num_hidden_layers, config.model.first_k_dense_replace = 1, 1
  text = aot.compile_train_step(config, tpu_topology_devices("v5p:2x2x1")).compiled.as_text()
  calls = [
    m.group(1)
    for line in text.splitlines()
    if 'custom_call_target="tpu_custom_call"' in line
    for m in [re.match(r"\s*(?:ROOT )?%(splash_mha_[a-z]+)_", line)]
    if m
  ]  # named after the kernel
  assert set(calls) == {"splash_mha_fwd", "splash_mha_dkv"}, calls  # the fused backward computes dq with dkv
  assert len(calls) == 2 * 2, calls  # at the 2 sites
  assert not re.search(r"f32\[\d+,\d+,256,256\]", text)  # [B, H, T, S] scores
