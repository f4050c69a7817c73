"""Helpers the tests share (fixtures live in conftest.py files): the repository root, modules with random
parameters built without per-shape XLA compiles, a plain-jnp Newton-Schulz, a persistent compilation cache, a test
module rerun as a script on simulated CPU devices."""

import contextlib
import json
import os
import re
import struct
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from glm_jax.model.config import ModelConfig
from glm_jax.sharding.topology import install_hint, libtpu_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, where launch/ scripts run
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (Keller Jordan / Moonlight / optax)


# The tests' small GlmMoeDsa: every mechanism (a dense and two MoE layers, MLA's low-rank paths, DSA with index_topk
# 3, one MTP layer) at toy widths; a test takes it with .replace(...) of what it varies.
TINY_MODEL = ModelConfig(
  vocab_size=40,
  hidden_size=16,
  intermediate_size=24,
  moe_intermediate_size=8,
  num_hidden_layers=3,
  first_k_dense_replace=1,
  num_nextn_predict_layers=1,
  num_attention_heads=2,
  num_key_value_heads=2,
  q_lora_rank=12,
  kv_lora_rank=10,
  qk_nope_head_dim=6,
  qk_rope_head_dim=4,
  v_head_dim=5,
  n_routed_experts=4,
  num_experts_per_tok=2,
  index_topk=3,
  index_n_heads=2,
  index_head_dim=8,
  rope_theta=100.0,
)


def init_module(ctor, seed, scale=0.3):
  """Builds a module abstractly and fills it from numpy (no per-shape XLA compiles): weights N(0, scale^2),
  norm scales and biases 1 + N(0, 0.2^2), so that every parameter matters to the outputs."""
  graphdef, state = nnx.split(nnx.eval_shape(ctor))
  rng = np.random.default_rng(seed)

  def fill(path, a):
    is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
    z = rng.standard_normal(a.shape)
    return jnp.asarray(1 + 0.2 * z if is_norm else scale * z, a.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


@jax.jit
def newton_schulz(g, steps=5):
  """Muon's orthogonalization of one matrix written out: X <- a X + (b A + c A^2) X, A = X X^T, from
  X = G / (||G||_F + 1e-8), on the wide orientation."""
  a, b, c = NS_COEFFS
  x = g / (jnp.linalg.norm(g) + 1e-8)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


def fp32_ulps(x, ulps: float) -> float:
  """`ulps` float32 units in the last place of x's largest magnitude: an absolute tolerance for results that
  equal `x` up to the order of their float32 sums (another fusion of the same program, another backend's kernels).
  A test that uses it for "this does not depend on that" also checks that a real dependence is orders larger."""
  return float(ulps * np.finfo(np.float32).eps * np.abs(np.asarray(x, np.float32)).max())


@contextlib.contextmanager
def persistent_compilation_cache(path: str):
  """jax's persistent compilation cache in `path` for everything compiled inside, in this process and in the
  subprocesses it starts (through the environment), every program cached however fast it compiled; this
  process's settings are restored afterwards. For tests that compile the same programs in several processes."""
  options = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0.0}
  saved = {name: getattr(jax.config, name) for name in (*options, "jax_persistent_cache_min_entry_size_bytes")}
  env_saved = {
    k: os.environ.get(k) for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
  }
  os.environ.update(JAX_COMPILATION_CACHE_DIR=path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  compilation_cache.reset_cache()
  for name, value in options.items():
    jax.config.update(name, value)
  try:
    yield path
  finally:
    compilation_cache.reset_cache()
    for name, value in saved.items():
      jax.config.update(name, value)
    for key, value in env_saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


# A test that compiles for TPU through libtpu's topology descriptions (compile only, nothing runs): marked
# `tpu_compile` (`-m tpu_compile` runs them alone; CI runs them with the rest) and skipped, with the hint, where
# libtpu is not installed. TPU_COMPILE for a module's pytestmark, needs_libtpu to decorate a test.
TPU_COMPILE = [
  pytest.mark.tpu_compile,
  pytest.mark.skipif(not libtpu_installed(), reason=f"libtpu is not installed: {install_hint()}"),
]


def needs_libtpu(test):
  for mark in reversed(TPU_COMPILE):
    test = mark(test)
  return test


SIMULATED_DEVICES = 8  # the devices of tests/test_multi_device.py's session


def multi_device(devices: int):
  """A decorator for a test that needs `devices` (at most SIMULATED_DEVICES) devices: marked `multi_device` and
  skipped with fewer, it runs in the one process with simulated devices that tests/test_multi_device.py starts
  for every such test (`simulated_devices_session`)."""
  skip = pytest.mark.skipif(
    jax.device_count() < devices, reason=f"runs in tests/test_multi_device.py's session of {SIMULATED_DEVICES} devices"
  )

  def mark(test):
    return pytest.mark.multi_device(skip(test))

  return mark


def simulated_devices_session(paths: list[str], basetemp: str, *, timeout: int = 2400) -> str:
  """Runs the multi_device tests of `paths` in one pytest process with SIMULATED_DEVICES simulated CPU devices, its
  temporary files (and so its persistent compilation cache: tests/conftest.py) under `basetemp`, and asserts they
  passed; returns pytest's summary line."""
  # Not an xdist worker: the inner session keeps its cache in its own basetemp, not beside the outer run's (a
  # worker's cache is its basetemp's parent, which here would be pytest's root, kept from run to run).
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_CURRENT_TEST"}
  env.update(
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={SIMULATED_DEVICES}",
    JAX_PLATFORMS="cpu",
  )
  args = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    f"--basetemp={basetemp}",
    "--durations=20",
    "-m",
    "multi_device",
    *paths,
  ]
  proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  print(proc.stdout[-6000:])  # with the slowest tests' durations (pytest -s shows it)
  assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
  summary = proc.stdout.splitlines()[-1]
  assert " passed" in summary and " skipped" not in summary, summary
  return summary


def fifo_errors(fifo, calls) -> list[str]:
  """The ValueError messages of `calls` (each reads the named pipe `fifo`), asserting that none blocks: they run in a
  thread given 10 s; one still waiting then is unblocked (a writer opens the pipe) and the assertion fails."""
  got = []

  def attempt():
    for call in calls:
      try:
        call()
      except ValueError as e:
        got.append(str(e))

  thread = threading.Thread(target=attempt, daemon=True)
  thread.start()
  thread.join(10)
  if thread.is_alive():  # unblock it before failing
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
  assert not thread.is_alive(), f"reading {fifo} blocked"
  return got


# XLA:CPU's fastest compilation (LLVM at level 0: tests/conftest.py sets it for the rest of the suite), for the step
# tests' explicit compiles whatever XLA_FLAGS says: the same computation, rounded otherwise.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
# XLA:CPU's default compilation, for a test whose tolerance is derived for it: a float32 comparison of two programs
# that another valid compilation moves past the tolerance by rounding alone (Newton-Schulz's five steps amplify it),
# and the bit-for-bit comparisons of two programs.
DEFAULT_COMPILE = {"xla_backend_optimization_level": 3}


def requirement_name(req: str) -> str:
  """The normalized distribution name of a requirement ("tensorboardX>=2.6,<3" -> "tensorboardx"), as pip compares
  them (case and "_" / "-" aside)."""
  return re.split(r"[<>=!~\[; ]", req.strip())[0].lower().replace("_", "-")


def edit_json(path, edit):
  """Rewrites the JSON file `path` after edit(value) changed its value in place."""
  with open(path) as f:
    value = json.load(f)
  edit(value)
  with open(path, "w") as f:
    json.dump(value, f)


def read_header(path):
  """(header, data bytes) of a safetensors file."""
  with open(path, "rb") as f:
    raw = f.read()
  (n,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path, header, data, text=None):
  """A safetensors file of `header` (or the raw header `text`, which may be malformed) and `data`."""
  raw = (text if text is not None else json.dumps(header)).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data)
