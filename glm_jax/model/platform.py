"""The backend a program is traced for: jax's default, or the one a `target_platform` block names.

Code that picks an implementation by backend (the DSA kernels, the routed experts' grouped matmul) asks
`current_platform()`, so that a program lowered on a CPU host for compile-only TPU devices (glm_jax/train/aot.py)
gets the TPU implementations, not the CPU ones.
"""

from __future__ import annotations

import contextlib

import jax

_stack: list[str] = []


@contextlib.contextmanager
def target_platform(platform: str):
  """Trace for `platform` ("tpu", "cpu", ...) instead of jax's default backend, e.g. while lowering a program for
  compile-only TPU devices on a CPU host."""
  _stack.append(platform)
  try:
    yield
  finally:
    _stack.pop()


def current_platform() -> str:
  return _stack[-1] if _stack else jax.default_backend()
