"""Context parallelism (glm_jax/model/context_parallel.py): the zig-zag layout, the size checks, and, on 8 simulated
CPU devices, the train step's loss and gradient with the sequence split over the context axis equal to one device in
the dense, warm-up and sparse stages (loss, indexer KL, every parameter's gradient, the indexer's selected keys).
(The training loop on a mesh with a context axis, its optimizer included, is tests/sharding/test_mesh.py's.)

The multi-device tests run in tests/test_multi_device.py's 8-device session."""

import contextlib
import re
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from glm_jax.configs import glm5_tiny
from glm_jax.model import GlmMoeDsa, context_parallel
from glm_jax.sharding.mesh import batch_sharding, make_mesh
from glm_jax.sharding.state import param_specs, tree_shardings
from glm_jax.sharding.topology import tpu_topology_devices
from glm_jax.train import step as step_lib
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.trainer import check_config
from tests import helpers
from tests.helpers import FAST_COMPILE, needs_libtpu

multi_device = helpers.multi_device(8)  # runs in tests/test_multi_device.py's session


def test_zigzag_gives_each_device_an_early_and_a_late_chunk():
  # c = 2, T = 8: chunks of 2 tokens [0 1] [2 3] [4 5] [6 7]; device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
  x = jnp.arange(8)[None]
  np.testing.assert_array_equal(context_parallel.to_zigzag(x, 2), [[0, 1, 6, 7, 2, 3, 4, 5]])
  # c = 4, T = 8, along another axis: device i holds tokens i and 7 - i.
  y = jnp.arange(16).reshape(2, 8).T[None]  # [1, 8, 2]
  np.testing.assert_array_equal(context_parallel.to_zigzag(y, 4, axis=1)[0, :, 0], [0, 7, 1, 6, 2, 5, 3, 4])
  for c, t in ((2, 8), (4, 8), (4, 24), (3, 12)):
    z = jax.random.normal(jax.random.key(c), (2, t, 3))
    np.testing.assert_array_equal(context_parallel.from_zigzag(context_parallel.to_zigzag(z, c), c), z)
  np.testing.assert_array_equal(context_parallel.to_zigzag(x, 1), x)  # no context axis: the identity


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(seq_len=36, c=4), r"seq_len=36 must divide into 2 x mesh.context = 8 equal chunks"),
    (
      dict(seq_len=64, c=4, attention_chunk=3),
      r"model.attention_chunk=3 must divide each device's chunk of seq_len / \(2 x mesh.context\) = 64 / 8 = 8",
    ),
    (
      dict(seq_len=131072, c=8, attention_impl="reference", use_dsa=True, index_topk=2048),
      r"attention_impl='reference' builds the indexer's \[T / c, T\] fp32 scores, 16384 x 131072 x 4 B = 8.0 GiB",
    ),
  ],
)
def test_sizes_context_parallelism_cannot_serve_are_named(kwargs, message):
  seq_len, c = kwargs.pop("seq_len"), kwargs.pop("c")
  cfg = types.SimpleNamespace(
    **{**dict(attention_chunk=0, attention_impl="pallas", use_dsa=False, index_topk=0), **kwargs}
  )
  with pytest.raises(ValueError, match=message):
    context_parallel.check(seq_len, c, cfg)
  context_parallel.check(seq_len, 1, cfg)  # no context axis: nothing to check


def test_the_trainer_names_context_sizes_before_any_work():
  config = glm5_tiny.get_config()
  config.mesh = ml_collections.ConfigDict(dict(fsdp=1, context=3))
  with pytest.raises(ValueError, match=r"seq_len=128 must divide into 2 x mesh.context = 6"):
    check_config(config)


def stage_config(stage: str, *, moe_only: bool = False):
  """glm5_tiny at 64 tokens in `stage`; moe_only: one stack of two MoE layers, no dense layer."""
  config = glm5_tiny.get_config()
  config.data.seq_len = 64
  config.train.dsa_stage = stage
  # Dense attention a block of 8 queries at a time (glm_jax/model/blockwise.py) on one device as on the mesh, whose
  # dense attention always runs that way; the sparse stage through the DSA kernels (interpret mode), as on TPU.
  config.model.attention_chunk = 8
  config.model.attention_impl = "pallas" if stage == "sparse" else "reference"
  if stage != "warmup":
    # No MTP layer: the dense and sparse gradients compile in about three quarters of the time. The warm-up keeps it
    # (one more attention site under the context axis, with its own indexer KL), as does test_mesh.py's training
    # loop on a context mesh.
    config.model.num_nextn_predict_layers = 0
  if moe_only:
    config.model.num_hidden_layers, config.model.first_k_dense_replace = 2, 0
  return config


def two_documents(b: int, t: int) -> dict:
  """Random tokens, two packed documents a row (the boundary inside a zig-zag chunk), positions restarting."""
  rng = np.random.default_rng(0)
  cut = 5 * t // 8 - 3
  return {
    "input_ids": jnp.asarray(rng.integers(0, 512, (b, t)), jnp.int32),
    "segment_ids": jnp.asarray(np.repeat([[1] * cut + [2] * (t - cut)], b, axis=0), jnp.int32),
    "positions": jnp.asarray(np.repeat([list(range(cut)) + list(range(t - cut))], b, axis=0), jnp.int32),
  }


def loss_and_grads(config, graphdef, params, rest, batch, mesh=None):
  """The train step's loss function of config's stage (step._forward_losses: LM, MTP, balance and indexer KL as the
  stage weighs them) and its gradient of every parameter, compiled for the arrays given (on `mesh` when one is
  given, its MoE exchanging over the mesh's expert axis): (compiled, ((loss, (metrics, expert counts)), gradients))."""

  def fn(params, rest, batch):
    return jax.value_and_grad(step_lib._forward_losses, argnums=1, has_aux=True)(
      graphdef, params, rest, batch, config.train.dsa_stage, config.train
    )

  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    compiled = jax.jit(fn).lower(params, rest, batch).compile(compiler_options=FAST_COMPILE)
    return compiled, compiled(params, rest, batch)


@pytest.fixture(scope="module")
def one_device():
  """{stage: namespace of config, graphdef, params and rest (on the host), batch, and the loss, metrics and
  gradients (on the host) of the stage's loss on one device}. The dense stage's model is glm5_tiny's three layers
  (a dense one, then two MoE); the warm-up's and the sparse stage's are two MoE layers (moe_only): a MoE layer
  attends as a dense one does, a dense layer's MLP under the context axis is the dense case's, and one stack of
  layers compiles the attention (the sparse stage's DSA kernels, in interpret mode, above all) once where two
  stacks compile it twice."""
  out = {}
  for stage in ("dense", "warmup", "sparse"):
    config = stage_config(stage, moe_only=stage != "dense")
    cfg = model_config_for_stage(config)
    graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(config.train.seed)), nnx.Param, ...)
    params, rest = jax.device_get((params, rest))
    batch = two_documents(4, config.data.seq_len)
    _, ((loss, (metrics, _)), grads) = loss_and_grads(config, graphdef, params, rest, batch)
    out[stage] = types.SimpleNamespace(
      config=config,
      graphdef=graphdef,
      params=params,
      rest=rest,
      batch=batch,
      loss=float(loss),
      metrics=jax.device_get(metrics),
      grads=jax.device_get(grads),
    )
  return out


MESHES = [{"fsdp": 2, "context": 4}, {"fsdp": 2, "expert": 2, "context": 2}]
# (stage, mesh): the warm-up and sparse stages on the mesh with every axis but tensor (the batch over fsdp x expert,
# the MoE's all-to-all with the tokens split over context too, c = 2: a device's 16-token chunks are two blocks of
# attention_chunk = 8 queries each), and the dense stage at c = 4 (8 zig-zag chunks, one block a chunk, the batch over
# fsdp alone, the keys' all-gather and its reduce-scatter over 4 devices). Each case compiles the model's forward and
# backward, so the other three of the 3 x 2 product are left out, their code paths run by these: dense at c = 2 by
# warmup at c = 2 (the same blockwise attention under the context axis, with the KL besides) and by test_mesh.py's
# test_train_and_evaluate_on_a_mesh_matches_one_device (the dense stage's loop on this very mesh); warmup at c = 4 by
# warmup at c = 2 (c is a number in it) and dense at c = 4 (the c = 4 layout); sparse at c = 4 by sparse at c = 2
# (the same branch of context_parallel.attention: the top-k a chunk, the sparse kernels, head_probs and the KL,
# forward and backward) and, forward at c = 4, by test_selected_keys_equal_one_device_with_index_share.
CASES = [("dense", MESHES[0]), ("warmup", MESHES[1]), ("sparse", MESHES[1])]
# A gradient agrees with the one-device one to a fraction of its leaf's largest entry: the two sum in other orders
# (the tokens' contributions over the context and batch axes, the gathered keys' over their chunks). Measured: the
# model's gradients to about 8e-7 of their leaf's largest entry; the indexer's, gradients of the KL, whose O(1) terms
# cancel to its ~1e-5 size (as the warm-up's loss below), to about 9e-6. Each bound is about ten times its measure;
# a missing or misplaced chunk moves a gradient by a part of its size.
GRAD_TOLERANCE = {"model": 1e-5, "indexer": 1e-4}


@multi_device
@pytest.mark.parametrize(
  "stage, mesh_cfg", CASES, ids=[f"{s}-" + "x".join(f"{k}{v}" for k, v in m.items()) for s, m in CASES]
)
def test_context_parallel_gradient_equals_one_device(one_device, stage, mesh_cfg):
  """The train step's loss with each sequence split over the context axis (zig-zag chunks, keys gathered, kernels on
  each device's queries), its parameters in their training layout, gives the one-device loss, indexer KL and
  gradient of every parameter. (What the optimizer makes of the gradient on a mesh is test_mesh.py's: one sharded
  step in test_sharded_step_equals_one_device, Muon's whole matrices on a context mesh in
  test_muon_orthogonalizes_whole_matrices_on_any_mesh, and whole steps on an fsdp x expert x context mesh in
  test_train_and_evaluate_on_a_mesh_matches_one_device; the warm-up's frozen parameters, a label per leaf that no
  mesh changes, tests/train/test_optimizers.py's.)"""
  ref = one_device[stage]
  mesh = make_mesh(mesh_cfg)
  weights = (ref.params, ref.rest)
  params, rest = jax.device_put(weights, tree_shardings(weights, param_specs(ref.params, mesh), mesh))  # the state's
  batch = jax.device_put(ref.batch, batch_sharding(mesh))
  assert batch["input_ids"].sharding.spec[1] == "context"
  compiled, ((loss, (metrics, _)), grads) = loss_and_grads(ref.config, ref.graphdef, params, rest, batch, mesh)
  assert "all-gather" in compiled.as_text()  # the keys, gathered over the context axis
  # (The warm-up's loss is the indexer KL alone, ~6e-5 here: a sum of O(1) terms that cancel, so to 1e-8 absolute.)
  assert float(loss) == pytest.approx(ref.loss, rel=2e-6, abs=1e-8)
  if stage != "dense":
    assert float(metrics["indexer_kl"]) == pytest.approx(float(ref.metrics["indexer_kl"]), rel=2e-6, abs=1e-8)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(grads)), jax.tree.leaves(ref.grads)):
    scale = float(np.max(np.abs(b)))  # 0 for the leaves the stage gives no gradient: then exactly 0 on the mesh too
    name = jax.tree_util.keystr(path)
    tolerance = GRAD_TOLERANCE["indexer" if "indexer" in name else "model"]
    np.testing.assert_allclose(a, b, rtol=0, atol=tolerance * scale, err_msg=name)


@multi_device
def test_selected_keys_equal_one_device_with_index_share(one_device):
  """The sparse stage's forward under the context axis (c = 4), with IndexShare: layer 1 of 3 reusing layer 0's
  selection (indexer_types FSF). Every layer's top-k keys (natural-order positions; layers 0 and 2 select their own)
  and the logits on the context-parallel mesh are the one-device ones. (One model for both checks: a layer that
  selects is the same code with or without a sharing layer after it.) The model is the dense stage's, glm5_tiny's
  three layers: the stage changes how the model attends, not its parameters."""
  ref = one_device["dense"]
  config = stage_config("sparse")
  cfg = model_config_for_stage(config).replace(indexer_types="FSF")
  model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))), ref.params, ref.rest)

  @jax.jit
  def forward(batch):
    out = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    return out.logits, out.aux["topk_indices"]

  logits, idx = forward(ref.batch)
  assert idx.shape[-1] == config.model.index_topk and bool(jnp.any(idx[..., -1] >= 0))  # top-k did select
  np.testing.assert_array_equal(np.asarray(idx[1]), np.asarray(idx[0]))  # layer 1 attends over layer 0's keys
  assert not np.array_equal(np.asarray(idx[2]), np.asarray(idx[0]))
  mesh = make_mesh(MESHES[0])
  with jax.set_mesh(mesh):
    got_logits, got_idx = forward(jax.device_put(ref.batch, batch_sharding(mesh)))
  np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(idx))
  np.testing.assert_allclose(np.asarray(got_logits), np.asarray(logits), atol=1e-5, rtol=1e-5)


@needs_libtpu
@pytest.mark.slow  # two TPU compiles of a 4K-token train step
@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_the_long_context_tpu_step_holds_no_sequence_by_sequence_array(stage):
  """glm5_tiny's train step at 4,096 tokens, compiled for v5p:2x2x1 with the sequence over a context axis of 4 (the
  128K configs' recipe: the DSA kernels, blockwise warm-up attention and KL, the chunked loss, offloaded layer
  inputs): no array in the TPU program has two dimensions as long as one of a device's two zig-zag chunks of the
  sequence (512 tokens; every model dimension is shorter, with the vocabulary cut to 256), where one device's
  [T, S] mask, scores or KL target would have two, and the layer inputs sit in host memory (S(5) buffers). One MoE
  layer: the dense layers attend the same way."""
  from glm_jax.train import aot

  t, c = 4096, 4
  config = glm5_tiny.get_config()
  config.data.seq_len, config.data.batch_size = t, 1
  config.mesh = ml_collections.ConfigDict(dict(fsdp=1, context=c))
  config.train.dsa_stage, config.train.loss_chunk = stage, 1024
  config.model.update(attention_impl="pallas", attention_chunk=256, remat_policy="offload_layer_inputs")
  config.model.vocab_size = 256  # every model dimension below the chunk: only the sequence's are as long
  # Neither the optimizer, the MTP layer (one more attention site like the layers') nor a second layer holds a
  # sequence dimension of its own: AdamW, no MTP layer and one MoE layer compile the step in less than half the time.
  config.optimizer.name, config.model.num_nextn_predict_layers = "adamw", 0
  config.model.num_hidden_layers, config.model.first_k_dense_replace = 1, 0
  step = aot.compile_train_step(config, tpu_topology_devices("v5p:2x2x1"))
  assert step.error is None, step.error
  hlo = step.compiled.as_text()
  piece = t // (2 * c)
  shapes = {s for s in re.findall(r"\b[a-z]+[0-9]*\[([0-9,]+)\]", hlo)}
  long_dims = {s for s in shapes if sum(int(d) >= piece for d in s.split(",") if d) >= 2}
  assert not long_dims, sorted(long_dims)[:10]
  assert any(int(d) >= piece for s in shapes for d in s.split(",") if d)  # the sequence is there, in one dimension
  assert re.search(r"\{[^}]*S\(5\)\}", hlo)  # host-memory buffers: the offloaded layer inputs
