"""Meshes on 8 simulated CPU devices: a sharded train step equals one device, and a checkpoint saved on one
mesh restores onto another.

Simulated devices must be requested before jax starts, and every simulated device slows all other tests, so the
tests marked multi_device are skipped in a normal run (one device) and run in one process with 8 simulated devices
that tests/test_multi_device.py starts for every such test of the suite."""

import functools
import os
import tempfile
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from glm_jax.configs import glm5_tiny
from glm_jax.mesh_axes import MESH_AXES
from glm_jax.sharding.mesh import batch_sharding, entry_axes, logical_to_spec, make_mesh, mesh_shape, spec_for_mesh
from glm_jax.sharding.state import abstract_sharded, param_specs
from glm_jax.train import step as step_lib
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.trainer import abstract_train_state, create_train_state, train_state_factory
from pallas_kernels.visibility import Visibility
from tests import helpers
from tests.helpers import DEFAULT_COMPILE, FAST_COMPILE, NS_COEFFS, newton_schulz

multi_device = helpers.multi_device(8)  # runs in tests/test_multi_device.py's session


def test_mesh_shape_resolves_the_remaining_devices():
  assert mesh_shape({"fsdp": -1}, 8) == (1, 8, 1, 1, 1)  # data, fsdp, expert, context, tensor
  assert mesh_shape({"data": 2, "expert": -1, "tensor": 2}, 8) == (2, 1, 2, 1, 2)
  assert mesh_shape({"context": 4, "fsdp": -1}, 8) == (1, 2, 1, 4, 1)


@pytest.mark.parametrize(
  "cfg, message",
  [
    ({"data": 3}, r"multiplies to 3, but there are 8 devices"),
    ({"data": -1, "fsdp": -1}, r"more than one -1"),
    ({"data": 3, "fsdp": -1}, r"multiply to 3, which does not divide the 8 devices"),
    ({"tensor": 0}, r"mesh\.tensor=0 is invalid"),
  ],
)
def test_bad_mesh_names_the_sizes(cfg, message):
  with pytest.raises(ValueError, match=message):
    mesh_shape(cfg, 8)


def test_logical_rules():
  # the model dimension over fsdp and context; a mesh whose context axis has size 1 keeps fsdp alone
  assert logical_to_spec(("layers", "experts", "embed", "expert_mlp")) == P(
    None, "expert", ("fsdp", "context"), "tensor"
  )

  def on(**sizes):  # logical_to_spec(("embed", "vocab")) for a mesh of these sizes (the other axes of size 1)
    mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)
    return spec_for_mesh(logical_to_spec(("embed", "vocab")), mesh)

  assert on(fsdp=8) == P("fsdp", "tensor")
  assert on(fsdp=2, context=4) == P(("fsdp", "context"), "tensor")
  assert on(context=8) == P("context", "tensor")
  # on an expert-parallel mesh the dense weights are split over expert too (the experts' own weights keep expert
  # for their experts dimension, above)
  assert on(fsdp=4, expert=2) == P(("fsdp", "expert"), "tensor")
  assert on(fsdp=2, context=2, expert=2) == P(("fsdp", "context", "expert"), "tensor")
  assert logical_to_spec(("mlp", "heads")) == P("tensor", None)  # one mesh axis shards one dimension
  with pytest.raises(ValueError, match="logical axis 'nonsense' has no rule"):
    logical_to_spec(("nonsense",))


def tiny_config():
  """glm5_tiny at 32 tokens with two MoE layers and no dense layer: one stack of layers, one layer for a step to
  compile where a dense and a MoE stack are two. A dense layer's MLP has the logical axes of the MoE layers'
  shared expert, so every mesh lays it out, and Muon orthogonalizes it, as it does the shared expert; a dense layer
  under a mesh is in tests/sharding/test_context_parallel.py's dense case (its gradient beside two MoE layers) and
  in the sharded decoding and serving tests' models."""
  config = glm5_tiny.get_config()
  config.data.seq_len = 32
  config.model.num_hidden_layers, config.model.first_k_dense_replace = 2, 0
  config.optimizer.warmup_steps = 0  # the first step at the full learning rate (lr_init is 0): a non-zero update
  return config


def step_config():
  """tiny_config without the MTP layer, for the tests whose subject is the layout of a step on a mesh: its step
  compiles in about two thirds of the time. The MTP layer in a whole step on a mesh is the training loop's
  (test_train_and_evaluate_on_a_mesh_matches_one_device runs tiny_config itself); its attention and indexer KL
  under a context axis, the context-parallel warm-up's (tests/sharding/test_context_parallel.py). (AdamW, cheaper
  still, would divide every matrix's gradient entries by their own size in the first step, which turns rounding in
  near-zero entries into more than STEP_TOLERANCE of a step; Muon's matrices do not.)"""
  config = tiny_config()
  config.model.num_nextn_predict_layers = 0
  return config


@multi_device
def test_indivisible_heads_are_named():
  config = tiny_config()
  make_state, _ = train_state_factory(config, model_config_for_stage(config))
  state = jax.eval_shape(make_state)  # the shapes and logical axes, nothing computed
  with pytest.raises(
    ValueError, match=r"parameter \S+: dimension of size 4 is sharded over mesh axis 'tensor' of size 8"
  ):
    param_specs(state.params, make_mesh({"tensor": 8}))


@pytest.fixture(scope="module")
def single_device_step():
  """step_config's initial train state and one train step of it on one device: a namespace of config, graphdef,
  optimizer, schedule, batch, init (the initial state, on the host), loss and params (after the step, on the
  host)."""
  config = step_config()
  rng = np.random.default_rng(0)
  batch = {
    "input_ids": jnp.asarray(rng.integers(0, 512, (8, 32)), jnp.int32),
    "segment_ids": jnp.asarray(np.repeat([[1] * 20 + [2] * 12], 8, axis=0), jnp.int32),
    "positions": jnp.asarray(np.repeat([list(range(20)) + list(range(12))], 8, axis=0), jnp.int32),
  }
  graphdef, state, optimizer, schedule = create_train_state(config, model_config_for_stage(config))
  init = jax.device_get(state)
  step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)
  new, metrics = step.lower(state, batch).compile(compiler_options=FAST_COMPILE)(state, batch)
  return types.SimpleNamespace(
    config=config,
    graphdef=graphdef,
    optimizer=optimizer,
    schedule=schedule,
    batch=batch,
    init=init,
    loss=float(metrics["loss"]),
    params=jax.device_get(new.params),
  )


def sharded_step(ref, mesh):
  """(state, step) on `mesh`: the one-device initial state put in its sharded layout (the shardings that
  AbstractTrainState.fresh gives it, from abstract_sharded) and the train step jitted for that layout."""
  make_state, _ = train_state_factory(ref.config, model_config_for_stage(ref.config))
  _, shardings = abstract_sharded(make_state, lambda s: s.params, mesh)
  step = step_lib.make_train_step(
    ref.graphdef,
    ref.optimizer,
    ref.schedule,
    ref.config.train,
    state_shardings=shardings,
    batch_sharding=batch_sharding(mesh),
  )
  return jax.device_put(ref.init, shardings), step


# Every axis: data x fsdp x tensor, and expert parallelism together with fsdp and tensor. (An axis alone or at 4
# adds a compile of the whole step and no layout the two do not already exercise.)
MESHES = [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 2, "tensor": 2, "expert": 2}]
# Updated parameters agree to this fraction of the learning rate (see test_sharded_step_equals_one_device).
STEP_TOLERANCE = 1e-2


@multi_device
@pytest.mark.parametrize("mesh_cfg", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_sharded_step_equals_one_device(single_device_step, mesh_cfg):
  """From the same initial state, one train step sharded over the mesh (its parameters laid out by their logical
  axes) gives the loss and the updated parameters of the step on one device. (That AbstractTrainState.fresh builds
  an initial state in place on a mesh is checked in test_checkpoint_restores_onto_another_mesh and, through the
  trainer, test_train_and_evaluate_on_a_mesh_matches_one_device.)"""
  ref = single_device_step
  mesh = make_mesh(mesh_cfg)
  state, step = sharded_step(ref, mesh)
  gate = state.params["moe_layers"]["mlp"]["gate_proj"][...]
  assert gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (  # [layers, experts, embed, expert_mlp]
    gate.shape[0],
    gate.shape[1] // mesh.shape["expert"],
    gate.shape[2] // mesh.shape["fsdp"],
    gate.shape[3] // mesh.shape["tensor"],
  )
  batch = jax.device_put(ref.batch, batch_sharding(mesh))
  with jax.set_mesh(mesh):
    compiled = step.lower(state, batch).compile(compiler_options=FAST_COMPILE)
    hlo = compiled.as_text()
    new, metrics = compiled(state, batch)
  # Expert parallelism exchanges tokens with all-to-all. (XLA may also reshard with all-to-all elsewhere.)
  if mesh.shape["expert"] > 1:
    assert "all-to-all" in hlo
  assert float(metrics["loss"]) == pytest.approx(ref.loss, rel=1e-6)
  for a, b in zip(jax.tree.leaves(jax.device_get(new.params)), jax.tree.leaves(ref.params)):
    # To 1% of one step (lr 3e-3): the first Adam step divides each gradient entry by its own size, which turns
    # reduction-order rounding in a near-zero entry into up to ~0.25% of the step here.
    np.testing.assert_allclose(a, b, atol=STEP_TOLERANCE * ref.config.optimizer.lr, rtol=1e-5)


# The training loop's mesh (test_train_and_evaluate_on_a_mesh_matches_one_device), on which
# test_checkpoint_restores_onto_another_mesh creates the same state with the same programs.
LOOP_MESH = {"data": 1, "fsdp": 2, "expert": 2, "context": 2}


@multi_device
def test_checkpoint_restores_onto_another_mesh(tmp_path):
  """AbstractTrainState.fresh builds the initial state directly in its layout on a mesh that shards over fsdp, expert
  and context (it equals the state fresh() makes on one device); a checkpoint of it restores onto a mesh that
  shards over data and tensor instead, array for array. (tiny_config on the training loop's mesh: both creations are
  test_train_and_evaluate_on_a_mesh_matches_one_device's programs, compiled once.)"""
  config = tiny_config()
  model_cfg = model_config_for_stage(config)
  state_a = abstract_train_state(config, model_cfg, make_mesh(LOOP_MESH)).fresh()
  one = abstract_train_state(config, model_cfg).fresh()
  assert len(one.params["moe_layers"]["mlp"]["gate_proj"][...].sharding.device_set) == 1
  for a, b in zip(jax.tree.leaves(jax.device_get(state_a)), jax.tree.leaves(jax.device_get(one))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # one program sharded or not: rounding apart
  gate_a = state_a.params["moe_layers"]["mlp"]["gate_proj"][...]
  assert gate_a.sharding.spec == P(None, "expert", ("fsdp", "context"), "tensor")  # made in place, in its layout
  with Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=False) as ckpt:
    ckpt.manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state_a)))
  mesh_b = make_mesh({"data": 2, "tensor": 4})
  # The restore target: shapes, dtypes and mesh_b's shardings (all Checkpointer.restore reads of a state).
  target, _ = abstract_sharded(
    train_state_factory(config, model_config_for_stage(config))[0], lambda s: s.params, mesh_b
  )
  with Checkpointer(str(tmp_path), read_only=True) as ckpt:
    restored = ckpt.restore(0, target)
  gate = restored.params["moe_layers"]["mlp"]["gate_proj"][...]
  assert gate.sharding.mesh.shape == mesh_b.shape and gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
  for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(jax.device_get(state_a))):
    np.testing.assert_array_equal(a, b)


def tiny_loop(workdir, data_cache_dir, mesh=None):
  """tiny_config's training loop, 3 steps of 8 rows (global batches, eval, checkpoint) under `mesh` (a mesh
  section; None: no mesh section, the unsharded path on device 0): (summary, the logged losses)."""
  import json

  import ml_collections

  from glm_jax.train.trainer import train_and_evaluate

  config = tiny_config()
  config.data.batch_size, config.data.eval_batches, config.data.cache_dir = 8, 1, data_cache_dir
  for k, v in dict(steps=3, log_every=1, eval_every=100, checkpoint_every=3, tensorboard=False).items():
    config.train[k] = v
  if mesh:
    config.mesh = ml_collections.ConfigDict(mesh)
  else:
    del config["mesh"]
  summary = train_and_evaluate(config, str(workdir))
  with open(os.path.join(str(workdir), "metrics.jsonl")) as f:
    return summary, [r["loss"] for r in map(json.loads, f) if "loss" in r]


@functools.cache
def one_device_loop(data_cache_dir):
  """tiny_loop on one device, run once for every test that compares a mesh's loop with it."""
  return tiny_loop(tempfile.mkdtemp(prefix="one_device_loop-"), data_cache_dir)


@multi_device
def test_train_and_evaluate_on_a_mesh_matches_one_device(tmp_path, data_cache_dir):
  """The whole loop (sharded state, global batches split by row and by sequence, expert and context parallelism,
  eval, checkpoint) on an fsdp x expert x context mesh logs the losses of the single-device loop. (Tensor
  parallelism changes no part of the loop: its steps are test_sharded_step_equals_one_device's.)"""
  single, losses_1 = one_device_loop(data_cache_dir)
  meshed, losses_8 = tiny_loop(tmp_path, data_cache_dir, LOOP_MESH)
  np.testing.assert_allclose(losses_8, losses_1, rtol=1e-5)
  assert meshed["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)


@multi_device
@pytest.mark.parametrize(
  "mesh_cfg, axes, shape",
  [
    # experts over `expert`, the model dimension over fsdp (all-to-all), the width over tensor (all-to-all)
    ({"fsdp": 2, "expert": 2, "tensor": 2}, ("layers", "experts", "embed", "expert_mlp"), (3, 4, 16, 12)),
    # the model dimension over fsdp x expert, `data` holding replicas, 3 matrices over 4 of them
    ({"data": 2, "fsdp": 2, "expert": 2}, ("layers", "embed", "mlp"), (3, 16, 24)),
    # split heads: a leaf sharded only on a batch axis (heads over tensor), layers padded to the fsdp group
    ({"fsdp": 4, "tensor": 2}, ("layers", "q_lora", "heads", "qk_head_dim"), (3, 8, 4, 6)),
    # the model dimension over three axes, fsdp x context x expert
    ({"fsdp": 2, "expert": 2, "context": 2}, ("layers", "embed", "mlp"), (3, 16, 24)),
  ],
)
def test_muon_orthogonalizes_whole_matrices_on_any_mesh(mesh_cfg, axes, shape):
  """muon.orthogonalize under a mesh (shard_map, all-to-alls, replicas) equals a plain-jnp Newton-Schulz of each
  matrix on one device."""
  from optax.contrib import MuonDimensionNumbers as Dims

  from glm_jax.train.muon import orthogonalize
  from glm_jax.train.param_plan import MuonLayout

  dims = Dims(-3, -1) if "heads" in axes else Dims(-2, -1)
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
  coeffs = jnp.asarray(NS_COEFFS)
  want = np.zeros(shape, np.float32)  # each matrix on its own: the last two axes or, per head, x[l, :, h, :]
  if "heads" in axes:
    for l, h in np.ndindex(shape[0], shape[2]):
      want[l, :, h, :] = newton_schulz(x[l, :, h, :])
  else:
    for lead in np.ndindex(shape[:-2]):
      want[lead] = newton_schulz(x[lead])
  mesh = make_mesh(mesh_cfg, jax.devices()[:8])
  spec = logical_to_spec(axes)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    # atol 2e-6 holds for XLA:CPU's default compilation (tests/helpers.py: DEFAULT_COMPILE)
    fn = jax.jit(lambda a: orthogonalize(a, MuonLayout(dims, axes), coeffs, 5), compiler_options=DEFAULT_COMPILE)
    got = fn(xs)
    hlo = fn.lower(xs).as_text()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
  assert got.sharding.is_equivalent_to(xs.sharding, x.ndim)  # back in the parameter's layout
  # Matrices gathered whole by all-to-alls over the axes sharding them; a dimension over several axes on XLA:CPU by
  # an all-gather and a slice (muon._exchange).
  several = any(len(entry_axes(e)) > 1 for e in spec_for_mesh(spec, mesh))
  assert ("all_gather" if several else "all_to_all") in hlo


@multi_device
def test_pallas_dsa_on_a_mesh_equals_the_reference_on_one_device():
  """attention_impl="pallas" under a mesh (the kernels in a shard_map over batch and heads): the top-k, the
  attention's gradients of q and kv (kv's summed over the head shards) and the head-summed probabilities equal the
  reference on one device."""
  from glm_jax.model import dsa

  b, t_len, s_len, heads = 4, 12, 20, 4
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q_i, k_i, w_i = normal(b, t_len, 2, 8), normal(b, s_len, 8), normal(b, t_len, 2)
  q, kv, probe = normal(b, t_len, heads, 12), normal(b, s_len, 12), normal(b, t_len, heads, 8)
  seg = jnp.asarray(np.repeat([[0, 1]], [8, 12], axis=1).repeat(b, 0), jnp.int32)

  def loss(impl, q, kv, q_i, k_i, w_i):
    vis = Visibility(q_offset=s_len - t_len, q_segment_ids=seg[:, -t_len:], kv_segment_ids=seg)
    idx, _ = dsa.select_topk(impl, q_i, k_i, w_i, topk=5, visibility=vis)
    out, lse = dsa.attend(impl, q, kv, idx, sm_scale=0.3, v_dim=8)
    p = dsa.head_probs(impl, q, kv, idx, lse, sm_scale=0.3)  # the indexer KL's target, summed over head shards
    return jnp.sum(out * probe) + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse)), (idx, p)

  grad = lambda impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1), has_aux=True))  # noqa: E731
  (dq_ref, dkv_ref), (idx_ref, p_ref) = grad("reference")(q, kv, q_i, k_i, w_i)
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])  # batch over data x fsdp, heads over tensor
  with jax.set_mesh(mesh):
    batch = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert")))
    args = [jax.device_put(x, batch) for x in (q, kv, q_i, k_i, w_i)]
    fn = grad("pallas")
    (dq, dkv), (idx, p) = fn(*args)
    hlo = fn.lower(*args).as_text()
  assert "shard_map" in hlo or "sdy.manual_computation" in hlo
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
  np.testing.assert_allclose(np.asarray(p), np.asarray(p_ref), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dkv), np.asarray(dkv_ref), rtol=1e-5, atol=1e-5)
