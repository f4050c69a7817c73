"""Compile-only TPU devices: ahead-of-time compilation for TPU topologies on a machine without a TPU.

With libtpu installed (`pip install "glm-jax[tpu]"`) the TPU compiler runs on any x86-64 Linux host:

  devices = tpu_topology_devices("v5p:8x8x8")          # 512 compile-only TPU v5 devices, one per chip
  mesh = jax.make_mesh((64, 8), ("fsdp", "tensor"), devices=devices, axis_types=(AxisType.Auto,) * 2)
  args = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)), ...
  compiled = jax.jit(step).lower(*args).compile()        # the real XLA:TPU compile, nothing runs
  compiled_memory(compiled), compiled_flops(compiled)      # per chip

The devices can only compile (no arrays can be put on them); jax's default backend stays CPU. A program that does
not fit fails in compile() with RESOURCE_EXHAUSTED, naming the usable HBM (HBM_USABLE_BYTES). Topology names:
"<generation>:<chips per axis>" ("v5p:8x8x8", "v4:2x2x1", "v5e:16x16", "v6e:16x16"; what libtpu parses), or a Cloud
accelerator type from KNOWN_TOPOLOGIES ("v5p-1024", "v4-8": TensorCores; "v5litepod-256", "v5e-256", "v6e-256":
chips). On a host with no TPU chips tpu_topology_devices sets ALLOW_MULTIPLE_LIBTPU_LOAD=1 (unless set), so that
several processes can load libtpu; why, and libtpu's other process-wide effects: docs/pods.md, "Compile-only TPU
devices".
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

from glm_jax.sharding import ici

GiB = 1 << 30

# The pin jax 0.12.0.1 declares for its "tpu" extra (importlib.metadata.requires("jax")); _libtpu_pin() re-reads it.
LIBTPU_PIN = "libtpu==0.0.50.1"


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
  name: str  # our name and the prefix libtpu parses: "v5p" -> "v5p:8x8x8"
  device_kind: str  # jax Device.device_kind of its compile-only devices
  ndim: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
  chip_config_name: str  # libtpu chip config: "megacore" = one jax device per chip (both TensorCores)
  max_chips: int  # the largest single slice Cloud TPU offers
  cloud_prefix: str  # the accelerator-type prefix: "v5p" -> "v5p-1024"
  cloud_counts_cores: bool  # v4/v5p accelerator types count TensorCores (2 per chip), v5e/v6e count chips


GENERATIONS: dict[str, TpuGeneration] = {
  "v4": TpuGeneration("v4", "TPU v4", 3, "megacore", 4096, "v4", True),
  "v5p": TpuGeneration("v5p", "TPU v5", 3, "megacore", 6144, "v5p", True),
  "v5e": TpuGeneration("v5e", "TPU v5 lite", 2, "default", 256, "v5litepod", False),
  "v6e": TpuGeneration("v6e", "TPU v6 lite", 2, "default", 256, "v6e", False),
}
_ALIASES = {"v5": "v5p", "v5litepod": "v5e", "v5lite": "v5e"}

# HBM per chip as Google Cloud publishes it (cloud.google.com/tpu/docs/{v4,v5p,v5e,v6e}: "95GB" for v5p, 16 / 32 /
# 32 for v5e / v6e / v4), read as GiB.
HBM_BYTES: dict[str, int] = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

# What XLA:TPU (libtpu 0.0.50.1) lets one program use per chip: the largest output that still compiled, found by
# bisection, rounded down to a MiB; the compiler's own message says "available HBM (95.73G / 15.75G / 31.24G /
# 30.75G)". v5p's 95.74 GiB usable means its physical HBM is 96 GiB; "95GB" above is the published figure.
# A program fits a chip when compiled_memory(...)["total"] and ["peak"] are both at most this.
HBM_USABLE_BYTES: dict[str, int] = {
  "v4": 31484 << 20,
  "v5e": 16125 << 20,
  "v5p": 98024 << 20,
  "v6e": 31991 << 20,
}

# Standard slice shapes, keyed by Cloud accelerator type (cloud.google.com/tpu/docs/v5p etc.; MaxText's
# accelerator_to_spec_map.py uses the same shapes).
_SHAPES_3D = {
  4: (2, 2, 1),
  8: (2, 2, 2),
  16: (2, 2, 4),
  32: (2, 4, 4),
  64: (4, 4, 4),
  128: (4, 4, 8),
  256: (4, 8, 8),
  512: (8, 8, 8),
  1024: (8, 8, 16),
  2048: (8, 16, 16),
  4096: (16, 16, 16),
  6144: (16, 16, 24),
}
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


def _dims_str(dims: tuple[int, ...]) -> str:
  return "x".join(map(str, dims))


def _known_topologies() -> dict[str, str]:
  known = {}
  for gen in GENERATIONS.values():
    shapes = _SHAPES_3D if gen.ndim == 3 else _SHAPES_2D
    for chips, dims in shapes.items():
      if chips > gen.max_chips:
        continue
      count = 2 * chips if gen.cloud_counts_cores else chips
      known[f"{gen.cloud_prefix}-{count}"] = f"{gen.name}:{_dims_str(dims)}"
      if gen.cloud_prefix != gen.name:  # "v5e-256" as well as "v5litepod-256"
        known[f"{gen.name}-{count}"] = f"{gen.name}:{_dims_str(dims)}"
  return known


# Cloud accelerator type -> canonical topology name ("v5p-1024" -> "v5p:8x8x8").
KNOWN_TOPOLOGIES: dict[str, str] = _known_topologies()


def _known_names_message() -> str:
  lines = []
  for gen in GENERATIONS.values():
    names = [f"{alias} ({canon})" for alias, canon in KNOWN_TOPOLOGIES.items() if canon.startswith(gen.name + ":")]
    form = "AxBxC" if gen.ndim == 3 else "AxB"
    lines.append(f"  {gen.name}:{form} (at most {gen.max_chips} chips), e.g. " + ", ".join(names))
  return "Known TPU topologies:\n" + "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str  # canonical, e.g. "v5p:8x8x8"
  generation: TpuGeneration
  dims: tuple[int, ...]

  @property
  def num_chips(self) -> int:
    return math.prod(self.dims)


def parse_topology(name: str) -> Topology:
  """A topology name or Cloud accelerator type -> its generation and chip grid; ValueError naming the known ones."""
  canon = KNOWN_TOPOLOGIES.get(name.strip().lower(), name.strip().lower())
  m = re.fullmatch(r"([a-z0-9]+)[:=_]([0-9]+(?:x[0-9]+)*)", canon)
  gen_name = _ALIASES.get(m.group(1), m.group(1)) if m else None
  if gen_name not in GENERATIONS:
    raise ValueError(f"unknown TPU topology {name!r}.\n{_known_names_message()}")
  gen = GENERATIONS[gen_name]
  dims = tuple(int(d) for d in m.group(2).split("x"))
  if len(dims) != gen.ndim or min(dims) < 1:
    raise ValueError(
      f"TPU topology {name!r}: {gen.name} has a {gen.ndim}-D chip grid, got {_dims_str(dims)}.\n"
      f"{_known_names_message()}"
    )
  if math.prod(dims) > gen.max_chips:
    raise ValueError(
      f"TPU topology {name!r}: {math.prod(dims)} chips, more than the largest {gen.name} slice "
      f"({gen.max_chips} chips); use num_slices for multislice.\n{_known_names_message()}"
    )
  return Topology(f"{gen.name}:{_dims_str(dims)}", gen, dims)


def _libtpu_pin() -> str:
  """The libtpu requirement of the installed jax's "tpu" extra ("libtpu==0.0.50.*"), else LIBTPU_PIN."""
  try:
    for req in importlib.metadata.requires("jax") or ():
      if req.startswith("libtpu") and 'extra == "tpu"' in req:
        return req.split(";")[0].strip()
  except importlib.metadata.PackageNotFoundError:
    pass
  return LIBTPU_PIN


def libtpu_installed() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def install_hint() -> str:
  return (
    f"pip install \"glm-jax[tpu]\"   (i.e. pip install '{_libtpu_pin()}', the TPU compiler that "
    f"jax[tpu]=={_jax_version()} pins; a ~204 MiB wheel, CPU work does not need it)"
  )


def _jax_version() -> str:
  try:
    return importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    return "?"


def _check_libtpu(topology_name: str) -> None:
  if not libtpu_installed():
    raise ModuleNotFoundError(
      f"compiling for TPU topology {topology_name!r} needs libtpu, which is not installed: {install_hint()}",
      name="libtpu",
    )
  pin = _libtpu_pin()
  want = pin.split("==", 1)[1] if "==" in pin else ""
  have = importlib.metadata.version("libtpu")
  if want and not (have == want or (want.endswith(".*") and have.startswith(want[:-1]))):
    warnings.warn(
      f"libtpu {have} is installed but jax {_jax_version()} pins {pin}; TPU compiles may fail or "
      f"differ. {install_hint()}",
      stacklevel=3,
    )


# TPU chips on the PCI bus: Google's vendor id and the chips' device ids (v3, v4, v5p, v5e, v6e, 7x and the
# "plc" variant), the table jax itself reads at start-up (jax._src.hardware_utils) to decide whether a host has TPUs.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}


def _no_tpu_attached() -> bool:
  """True when no TPU chip is on this host's PCI bus (a build machine), by the check jax runs at start-up."""
  for vendor_path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    folder = os.path.dirname(vendor_path)
    try:
      with open(vendor_path) as v, open(os.path.join(folder, "device")) as d:
        if v.read().strip() == _GOOGLE_PCI_VENDOR and d.read().strip() in _TPU_PCI_DEVICES:
          return False
    except OSError:
      continue
  return True


def tpu_topology_devices(name: str, *, num_slices: int = 1, wrap: tuple[bool, ...] | None = None) -> list[Any]:
  """Compile-only jax devices for a TPU slice (one per chip, ordered as libtpu numbers them), for any mesh.

  name: "v5p:8x8x8" / "v6e:16x16" / ... or a Cloud accelerator type ("v5p-1024", "v6e-256"); see KNOWN_TOPOLOGIES.
  num_slices: >1 gives that many slices joined by DCN (device.slice_index tells them apart).
  wrap: torus wrap-around per axis; by default as Cloud TPU has it (v4/v5p: full cubes, all axes a multiple of 4;
    v5e/v6e: an axis of 16 chips). It changes collective routing, not memory.
  """
  topo = parse_topology(name)
  _check_libtpu(name)
  if _no_tpu_attached():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # the libtpu lockfile (docs/pods.md)
  import jax
  from jax.experimental import topologies

  gen = topo.generation
  if wrap is None:
    wrap = default_wrap(topo) + ((False,) if gen.ndim == 2 else ())
  host_bounds = (1, 1, 1) if topo.num_chips == 1 else (2, 2, 1)
  try:
    desc = topologies.get_topology_desc(
      topo.name,
      "tpu",
      chip_config_name=gen.chip_config_name,
      chips_per_host_bounds=host_bounds,
      num_slices=num_slices,
      wrap=wrap,
    )
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(
      f"libtpu rejects TPU topology {name!r} ({topo.name}, num_slices={num_slices}, wrap={wrap}): "
      f"{e}\n{_known_names_message()}"
    ) from e
  devices = list(desc.devices)
  if len(devices) != topo.num_chips * num_slices or devices[0].device_kind != gen.device_kind:
    raise RuntimeError(
      f"TPU topology {topo.name}: expected {topo.num_chips * num_slices} {gen.device_kind!r} devices "
      f"(one per chip), libtpu gave {len(devices)} {devices[0].device_kind!r}"
    )
  return devices


def default_wrap(topo: Topology) -> tuple[bool, ...]:
  """Which torus axes have their wrap-around links, as Cloud TPU builds slices: v4 / v5p slices of whole 4x4x4
  cubes wrap on every axis, smaller ones on none; v5e / v6e wrap an axis of 16 chips."""
  if topo.generation.ndim == 3:
    return (all(d % 4 == 0 for d in topo.dims),) * 3
  return tuple(d == 16 for d in topo.dims)


def torus_of(devices: Sequence[Any], name: str | None = None) -> ici.Torus:
  """The ici.Torus of a program's partitions: `devices` in partition order (a mesh's devices.flat, the device
  assignment jax compiles a mesh program for), each chip's coordinates. The slice's shape is `name`, or else the
  smallest grid holding the devices (every device of a slice takes part in a mesh program). Devices of several
  slices: XLA:TPU compiles one slice's program, whose partitions are the first slice's devices in this order."""
  gen = GENERATIONS[generation_of(devices[0])]
  slice_of = [int(getattr(d, "slice_index", 0) or 0) for d in devices]
  first = [d for d, s in zip(devices, slice_of) if s == slice_of[0]]
  coords = tuple(tuple(int(c) for c in d.coords[: gen.ndim]) for d in first)
  if name is None:
    dims = tuple(max(c[a] for c in coords) + 1 for a in range(gen.ndim))
    topo = Topology(f"{gen.name}:{_dims_str(dims)}", gen, dims)
  else:
    topo = parse_topology(name)
  bad = [c for c in coords if any(not 0 <= x < n for x, n in zip(c, topo.dims))]
  if bad:
    raise ValueError(f"device coordinates {bad[0]} lie outside topology {topo.name}")
  return ici.Torus(topo.dims, default_wrap(topo), coords, ici.LINKS[topo.generation.name], len(set(slice_of)))


def generation_of(device: Any) -> str:
  """ "v5p" etc. for a (compile-only or real) TPU device; KeyError for another kind."""
  for gen in GENERATIONS.values():
    if device.device_kind == gen.device_kind:
      return gen.name
  raise KeyError(f"not a known TPU generation: device_kind={device.device_kind!r}")


def compiled_memory(compiled: Any) -> dict[str, int]:
  """Per-chip HBM bytes of a compiled executable (jax.stages.Compiled), from XLA's memory_analysis().

  arguments / outputs / temporaries / generated_code / aliased are XLA's argument_size_in_bytes,
  output_size_in_bytes, temp_size_in_bytes, generated_code_size_in_bytes, alias_size_in_bytes (outputs that reuse
  a donated argument's buffer). total = arguments + outputs + temporaries + generated_code - aliased.
  peak = peak_memory_in_bytes, XLA's own live-buffer peak (no generated code; lower than the sum when buffers are
  not all live at once, and on TPU sometimes higher, e.g. a sharded matmul: 7 MiB against a 5 MiB sum).
  host_* are the same for host memory (memory_kind="pinned_host" offload).
  """
  m = compiled.memory_analysis()
  if m is None:
    raise ValueError("this executable has no memory analysis (XLA returned None)")
  out = {
    "arguments": m.argument_size_in_bytes,
    "outputs": m.output_size_in_bytes,
    "temporaries": m.temp_size_in_bytes,
    "generated_code": m.generated_code_size_in_bytes,
    "aliased": m.alias_size_in_bytes,
    "peak": getattr(m, "peak_memory_in_bytes", 0),
    "host_arguments": m.host_argument_size_in_bytes,
    "host_outputs": m.host_output_size_in_bytes,
    "host_temporaries": m.host_temp_size_in_bytes,
  }
  out = {k: int(v) for k, v in out.items()}
  out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] + out["generated_code"] - out["aliased"]
  return out


def compiled_flops(compiled: Any) -> float:
  """FLOPs of one chip's program, from XLA's cost_analysis() of the SPMD-partitioned executable.

  Per chip, not global: a [M,K]@[K,N] matmul split over n chips on M/N reports exactly 2*M*N*K/n (a split
  contraction adds the partial-sum additions). XLA counts a while loop's body ONCE, whatever its trip count: a
  jax.lax.scan over L layers reports about 1/L of the real FLOPs (on TPU and CPU alike), so for a scanned model
  multiply by the trip count or count FLOPs analytically.
  """
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per executable
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    raise ValueError(f"XLA's cost analysis has no 'flops' entry: {cost!r}")
  return float(cost["flops"])
