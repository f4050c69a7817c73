"""Ahead-of-time compilation for TPU topologies on a CPU-only machine (glm_jax/sharding/topology.py).

The compile tests need libtpu (the tpu extra: pip install "glm-jax[tpu]") and are skipped, with that hint, without it.
Every number asserted is hand-computed from the shapes and shardings."""

import os
import re
import tomllib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from glm_jax.sharding import topology
from glm_jax.sharding.topology import (
  HBM_USABLE_BYTES,
  compiled_flops,
  compiled_memory,
  generation_of,
  parse_topology,
  tpu_topology_devices,
)
from tests.helpers import ROOT, needs_libtpu

MiB = 1 << 20


def _mesh(devices, shape, names):
  return jax.make_mesh(shape, names, devices=devices, axis_types=(AxisType.Auto,) * len(shape))


def test_topology_names():
  assert parse_topology("v5p-1024").name == "v5p:8x8x8"  # accelerator types count TensorCores on v4/v5p
  assert parse_topology("v5p:8x8x8").num_chips == 512
  assert parse_topology("v4-8").name == "v4:2x2x1"
  assert parse_topology("v5litepod-256").name == parse_topology("v5e-256").name == "v5e:16x16"  # chips on v5e/v6e
  assert parse_topology("v6e-256").num_chips == 256


@pytest.mark.parametrize(
  "name, message",
  [
    ("v7p:2x2x1", r"(?s)unknown TPU topology 'v7p:2x2x1'\.\nKnown TPU topologies:\n.*v5p-1024 \(v5p:8x8x8\)"),
    ("v5p-7", r"unknown TPU topology 'v5p-7'"),
    ("v5p:8x8", r"v5p has a 3-D chip grid, got 8x8"),
    ("v6e:32x32", r"1024 chips, more than the largest v6e slice \(256 chips\)"),
  ],
)
def test_unknown_topology_names_the_known_ones(name, message):
  with pytest.raises(ValueError, match=message):
    tpu_topology_devices(name)


def test_missing_libtpu_says_what_to_install(monkeypatch):
  """The hint names the tpu extra and the libtpu release it pins (pyproject.toml's, which jax's own extra names too:
  jax pins 0.0.N.*, we pin 0.0.N.M)."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    (pin,) = tomllib.load(f)["project"]["optional-dependencies"]["tpu"]
  release = ".".join(pin.split("==")[1].split(".")[:3])
  monkeypatch.setattr(topology, "libtpu_installed", lambda: False)
  with pytest.raises(
    ModuleNotFoundError,
    match=r"TPU topology 'v5p:2x2x1' needs libtpu.*pip install \"glm-jax\[tpu\]\".*pip install "
    + re.escape(f"'libtpu=={release}"),
  ):
    tpu_topology_devices("v5p:2x2x1")


@needs_libtpu
@pytest.mark.parametrize(
  "name, chips, kind",
  [
    ("v5p:2x2x1", 4, "TPU v5"),
    ("v5p-1024", 512, "TPU v5"),
    ("v5p:16x16x24", 6144, "TPU v5"),
    ("v4:2x2x1", 4, "TPU v4"),  # megacore: one device per chip, not per TensorCore
    ("v5e:2x2", 4, "TPU v5 lite"),
    ("v5e:1x1", 1, "TPU v5 lite"),
    ("v6e:16x16", 256, "TPU v6 lite"),
  ],
)
def test_one_compile_only_device_per_chip(name, chips, kind):
  devices = tpu_topology_devices(name)
  assert len(devices) == chips == parse_topology(name).num_chips
  assert {d.platform for d in devices} == {"tpu"} and {d.device_kind for d in devices} == {kind}
  assert len({d.id for d in devices}) == chips
  assert jax.devices()[0].platform == "cpu"  # the default backend is untouched


@needs_libtpu
def test_multislice_devices():
  devices = tpu_topology_devices("v5p:2x2x1", num_slices=2)
  assert len(devices) == 8 and sorted({d.slice_index for d in devices}) == [0, 1]


@needs_libtpu
@pytest.mark.parametrize("name", ["v5p:2x2x1", "v6e:2x2", "v5e:2x2", "v4:2x2x1"])
def test_sharded_matmul_memory_and_flops_per_chip(name):
  """[M,K] @ [K,N] fp32 on a 2x2 mesh: x split over rows on "x", w over columns on "y", out over both."""
  devices = tpu_topology_devices(name)
  mesh = _mesh(devices, (2, 2), ("x", "y"))
  m, k, n = 1024, 2048, 512
  x = jax.ShapeDtypeStruct((m, k), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
  w = jax.ShapeDtypeStruct((k, n), jnp.float32, sharding=NamedSharding(mesh, P(None, "y")))
  compiled = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("x", "y"))).lower(x, w).compile()
  assert compiled.input_shardings[0][0].mesh.devices.flat[0].platform == "tpu"

  mem = compiled_memory(compiled)
  assert mem["arguments"] == (m * k // 2 + k * n // 2) * 4 == 6 * MiB  # each operand is split 2 ways
  assert mem["outputs"] == m * n // 4 * 4 == MiB / 2  # split 4 ways
  assert mem["aliased"] == 0 and mem["generated_code"] > 0
  assert mem["total"] == mem["arguments"] + mem["outputs"] + mem["temporaries"] + mem["generated_code"]
  assert all(isinstance(v, int) for v in mem.values())
  # cost_analysis is the per-chip program: (m/2 x k) @ (k x n/2), no contraction split, so exactly 2mkn/4.
  assert compiled_flops(compiled) == 2 * m * k * n / 4


@needs_libtpu
def test_donated_array_sharded_four_ways():
  """A [1024, 1024] fp32 array split 4 ways is 1 MiB per chip; donated, the output reuses it."""
  mesh = _mesh(tpu_topology_devices("v6e:2x2"), (2, 2), ("x", "y"))
  a = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("x", "y")))
  mem = compiled_memory(jax.jit(lambda a: a * 2, donate_argnums=0).lower(a).compile())
  assert mem["arguments"] == mem["outputs"] == mem["aliased"] == MiB
  assert mem["total"] == MiB + mem["temporaries"] + mem["generated_code"]


@needs_libtpu
def test_512_chip_compile():
  devices = tpu_topology_devices("v5p:8x8x8")
  mesh = _mesh(devices, (64, 8), ("fsdp", "tensor"))
  m, k, n = 16384, 8192, 16384
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tensor")))
  compiled = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("fsdp", "tensor"))).lower(x, w).compile()
  assert compiled_memory(compiled)["arguments"] == (m * k // 64 + k * n // 8) * 2
  assert compiled_flops(compiled) == 2 * m * k * n / 512


@needs_libtpu
@pytest.mark.parametrize("name", ["v5p:2x2x1", "v5e:2x2", "v6e:2x2", "v4:2x2x1"])
def test_usable_hbm_is_the_compilers_limit(name):
  """An output of HBM_USABLE_BYTES - 1 MiB per chip compiles; 2 MiB over it runs out of HBM."""
  devices = tpu_topology_devices(name)
  usable = HBM_USABLE_BYTES[generation_of(devices[0])]
  replicated = NamedSharding(_mesh(devices, (4,), ("x",)), P())

  def compile_output(nbytes):
    return jax.jit(lambda: jnp.zeros((nbytes,), jnp.int8), out_shardings=replicated).lower().compile()

  assert compiled_memory(compile_output(usable - MiB))["outputs"] == usable - MiB
  with pytest.raises(Exception, match=r"RESOURCE_EXHAUSTED.*exceeds available HBM"):
    compile_output(usable + 2 * MiB)


@needs_libtpu
def test_flops_count_a_scan_body_once():
  """The caveat in compiled_flops: XLA's cost analysis does not multiply a while loop's body by its trip count."""
  mesh = _mesh(tpu_topology_devices("v5p:2x2x1"), (4,), ("x",))
  layers, m, d = 8, 1024, 512
  x = jax.ShapeDtypeStruct((m, d), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
  w = jax.ShapeDtypeStruct((layers, d, d), jnp.float32, sharding=NamedSharding(mesh, P()))

  def scanned(x, w):
    return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

  def unrolled(x, w):
    for i in range(layers):
      x = jnp.tanh(x @ w[i])
    return x

  one_layer = 2 * m * d * d / 4
  flops_scanned = compiled_flops(jax.jit(scanned).lower(x, w).compile())
  flops_unrolled = compiled_flops(jax.jit(unrolled).lower(x, w).compile())
  assert one_layer <= flops_scanned < 1.1 * one_layer
  assert layers * one_layer <= flops_unrolled < 1.1 * layers * one_layer
