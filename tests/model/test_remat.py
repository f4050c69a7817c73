"""model.remat_policy "offload_layer_inputs": the layers are recomputed in the backward pass from their inputs, which
wait in host memory; the gradient is the one without remat, and the residuals really leave the device (in the
jaxpr on CPU, and as host-memory-space S(5) buffers in the program compiled for a TPU topology)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from glm_jax.configs import glm5_tiny
from glm_jax.model import ModelConfig
from glm_jax.model.transformer import GlmMoeDsa
from glm_jax.sharding.topology import tpu_topology_devices
from tests.train.test_step import build
from tests.helpers import fp32_ulps, needs_libtpu

B, T = 2, 16


def config(policy: str) -> ModelConfig:
  return ModelConfig.from_dict(glm5_tiny.get_config().model).replace(
    remat_policy=policy, use_dsa=False, num_hidden_layers=3, first_k_dense_replace=1, num_nextn_predict_layers=0
  )


def loss_fn(graphdef, rest):
  def loss(params, ids):
    return jnp.mean(nnx.merge(graphdef, params, rest)(ids).logits ** 2)

  return loss


@pytest.mark.slow  # two compiles of the gradient
def test_offloaded_remat_gives_the_gradient_without_remat_and_puts_the_layer_inputs_on_the_host():
  cfg = config("offload_layer_inputs")
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
  grads = {}
  for policy in ("none", "offload_layer_inputs"):
    graphdef, params, rest = build(config(policy))  # the same weights for both (numpy-filled)
    grad = jax.grad(loss_fn(graphdef, rest))
    grads[policy] = jax.jit(grad)(params, ids)
  jaxpr = str(jax.make_jaxpr(grad)(params, ids))
  # Remat changes which program computes the gradient, not the arithmetic: the same float32 products, summed in
  # whatever order the compiled fusions take (bit-equal here at the suite's XLA level 0; a GPU recomputes in another
  # order). A reordered float32 sum moves by a few ulps of its terms' magnitude, not of the result, so an element
  # that cancels to near zero can be off by 1e-5 relative and more: the bound is in ulps of the array's largest
  # gradient, which is of the terms' scale. Two valid compilations of this gradient (XLA level 0 against level 3 on
  # CPU) differ by up to 33 such ulps, and an H100's remat against no remat by up to 21 (where rtol 1e-5 failed 5
  # of the 41 arrays); the bound is 64, 7.6e-6 of the largest. A remat bug moves them far more: a backward that
  # recomputes from the layer inputs rounded to bf16 by up to 7.5e4 of these ulps, one that recomputes from inputs
  # 1e-5 (relative) off by up to 207.
  flat = jax.tree_util.tree_flatten_with_path(grads["none"])[0]
  for (path, want), got in zip(flat, jax.tree.leaves(grads["offload_layer_inputs"])):
    np.testing.assert_allclose(got, want, rtol=0, atol=fp32_ulps(want, 64), err_msg=jax.tree_util.keystr(path))
  d = cfg.hidden_size
  host = set(re.findall(r"f32<host>\[([0-9,]+)\]", jaxpr))
  # each stack's inputs, one [B, T, D] a layer, stacked by the layer scan
  assert {f"{cfg.num_dense_layers},{B},{T},{d}", f"{cfg.num_moe_layers},{B},{T},{d}"} <= host


@needs_libtpu
@pytest.mark.slow  # two TPU compiles of the gradient
def test_the_tpu_program_keeps_the_layer_inputs_in_host_memory():
  """The gradient compiled for v5p:2x2x1 (batch over 4 chips): with the offload policy the stacked layer inputs
  [L, B/4, T, D] are buffers in host memory space S(5); with plain full remat nothing is."""
  devices = tpu_topology_devices("v5p:2x2x1")
  mesh = jax.make_mesh((4,), ("data",), devices=devices, axis_types=(AxisType.Auto,))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  host_buffers = {}
  for policy in ("full", "offload_layer_inputs"):
    cfg = config(policy)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param, ...)
    params, rest = (
      jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), t) for t in (params, rest)
    )
    ids = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=rows)
    hlo = jax.jit(jax.grad(lambda p, r, i: loss_fn(graphdef, r)(p, i))).lower(params, rest, ids).compile().as_text()
    host_buffers[policy] = set(re.findall(r"f32\[([0-9,]+)\]\{[^}]*S\(5\)\}", hlo))
  cfg = config("full")
  assert host_buffers["full"] == set()
  assert f"{cfg.num_moe_layers},2,64,{cfg.hidden_size}" in host_buffers["offload_layer_inputs"]
