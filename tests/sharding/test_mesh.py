"""Meshes on 8 simulated CPU devices (tests/conftest.py): a sharded train step equals one device, and a
checkpoint saved on one mesh restores onto another."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from configs import glm5_tiny
from glm_jax.sharding.mesh import batch_sharding, logical_to_spec, make_mesh, mesh_shape
from glm_jax.sharding.state import create_sharded, param_specs
from glm_jax.train import step as step_lib
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.trainer import create_train_state, model_config_for_stage

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: tests/conftest.py")


def test_mesh_shape_resolves_the_remaining_devices():
  assert mesh_shape({"fsdp": -1}, 8) == (1, 8, 1, 1)
  assert mesh_shape({"data": 2, "expert": -1, "tensor": 2}, 8) == (2, 1, 2, 2)


@pytest.mark.parametrize("cfg, message", [
    ({"data": 3}, r"multiplies to 3, but there are 8 devices"),
    ({"data": -1, "fsdp": -1}, r"more than one -1"),
    ({"data": 3, "fsdp": -1}, r"multiply to 3, which does not divide the 8 devices"),
    ({"tensor": 0}, r"mesh\.tensor=0 is invalid"),
])
def test_bad_mesh_names_the_sizes(cfg, message):
  with pytest.raises(ValueError, match=message):
    mesh_shape(cfg, 8)


def test_logical_rules():
  assert logical_to_spec(("layers", "experts", "embed", "expert_mlp")) == P(None, "expert", "fsdp", "tensor")
  assert logical_to_spec(("embed", "vocab")) == P("fsdp", "tensor")
  assert logical_to_spec(("mlp", "heads")) == P("tensor", None)  # one mesh axis shards one dimension
  with pytest.raises(ValueError, match="logical axis 'nonsense' has no rule"):
    logical_to_spec(("nonsense",))


def tiny_config():
  config = glm5_tiny.get_config()
  config.data.seq_len = 32
  return config


def test_indivisible_heads_are_named():
  config = tiny_config()
  _, state, _, _ = create_train_state(config, model_config_for_stage(config))
  with pytest.raises(ValueError, match=r"parameter \S+: dimension of size 4 is sharded over mesh axis 'tensor' of size 8"):
    param_specs(state.params, make_mesh({"tensor": 8}))


@pytest.fixture(scope="module")
def single_device_step():
  """One train step of the tiny model on one device: (config, batch, loss, updated params)."""
  config = tiny_config()
  rng = np.random.default_rng(0)
  batch = {"input_ids": jnp.asarray(rng.integers(0, 512, (8, 32)), jnp.int32),
           "segment_ids": jnp.asarray(np.repeat([[1] * 20 + [2] * 12], 8, axis=0), jnp.int32),
           "positions": jnp.asarray(np.repeat([list(range(20)) + list(range(12))], 8, axis=0), jnp.int32)}
  graphdef, state, optimizer, schedule = create_train_state(config, model_config_for_stage(config))
  new, metrics = step_lib.make_train_step(graphdef, optimizer, schedule, config.train)(state, batch)
  return config, batch, float(metrics["loss"]), jax.device_get(new.params)


def sharded(config, mesh):
  model_cfg = model_config_for_stage(config)
  graphdef, _, optimizer, schedule = create_train_state(config, model_cfg)
  state, shardings = create_sharded(lambda: create_train_state(config, model_cfg)[1], lambda s: s.params, mesh)
  step = step_lib.make_train_step(graphdef, optimizer, schedule, config.train, state_shardings=shardings,
                                  batch_sharding=batch_sharding(mesh))
  return state, shardings, step


@pytest.mark.parametrize("mesh_cfg", [{"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 4, "tensor": 2}])
def test_sharded_step_equals_one_device(single_device_step, mesh_cfg):
  config, batch, loss, params = single_device_step
  mesh = make_mesh(mesh_cfg)
  state, shardings, step = sharded(config, mesh)
  gate = state.params["moe_layers"]["mlp"]["gate_proj"][...]
  assert gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (
      gate.shape[0], gate.shape[1], gate.shape[2] // mesh.shape["fsdp"], gate.shape[3] // mesh.shape["tensor"])
  with jax.set_mesh(mesh):
    new, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-6)
  for a, b in zip(jax.tree.leaves(jax.device_get(new.params)), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_checkpoint_restores_onto_another_mesh(tmp_path):
  config = tiny_config()
  state_a, _, _ = sharded(config, make_mesh({"fsdp": 4, "tensor": 2}))
  ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=False)
  ckpt.manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state_a)))
  ckpt.wait()
  mesh_b = make_mesh({"data": 2, "tensor": 4})
  target, shardings_b, _ = sharded(config, mesh_b)
  restored = Checkpointer(str(tmp_path), read_only=True).restore(0, target)
  gate = restored.params["moe_layers"]["mlp"]["gate_proj"][...]
  assert gate.sharding.mesh.shape == mesh_b.shape and gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
  for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(jax.device_get(state_a))):
    np.testing.assert_array_equal(a, b)
