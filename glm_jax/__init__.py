"""glm-jax: GLM-5 (MoE + MLA + DeepSeek Sparse Attention + MTP) in JAX / Flax NNX.

Importing glm_jax on a host with libtpu installed (the `tpu` extra, for compiling to TPU topologies) but no TPU chips
and no GPU plugin keeps jax on the CPU (JAX_PLATFORMS=cpu) unless JAX_PLATFORMS is set: otherwise every process
would probe for a TPU and print libtpu's worker-hostname errors. scripts/with_env.sh does the same for its commands.
"""

import glob
import importlib.util
import os
import sys

_GPU_PLUGINS = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def _cpu_when_no_accelerator() -> None:
  if "JAX_PLATFORMS" in os.environ or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  if importlib.util.find_spec("libtpu") is None or any(importlib.util.find_spec(p) for p in _GPU_PLUGINS):
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # imported before glm_jax: its backends start at their first use, read from its config
    sys.modules["jax"].config.update("jax_platforms", "cpu")


_cpu_when_no_accelerator()
