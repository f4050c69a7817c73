"""Multi-process start-up: jax.distributed.initialize when the job spans several hosts.

One process per host (a TPU VM of a pod slice, a GPU node, a local process in tests) runs the same program;
after jax.distributed.initialize, jax.devices() lists every host's devices, the mesh spans them all, each
process feeds its own rows of the global batch and Orbax writes checkpoints from all of them.

  maybe_initialize("auto")   initializes when the environment names a multi-process job (below), else nothing
  maybe_initialize("on", coordinator_address="10.0.0.2:1234", num_processes=2, process_id=0)
  maybe_initialize("off")

"auto" looks only at environment variables, never at the network, so a laptop or CI machine starts at once:
JAX_COORDINATOR_ADDRESS (jax's own), TPU_WORKER_HOSTNAMES with more than one host or MEGASCALE_COORDINATOR_ADDRESS
(Cloud TPU pod slices and multislice), SLURM_NTASKS > 1, OMPI_COMM_WORLD_SIZE > 1. Then jax.distributed.initialize
finds the coordinator, process count and index itself (its cluster detection for Cloud TPU, Slurm, Open MPI).
Must run before anything initializes a jax backend. On CPU, cross-process collectives use gloo (jax 0.10's
default jax_cpu_collectives_implementation), which is how tests/train/test_multihost.py runs two processes.
"""

from __future__ import annotations

import os

import jax
from absl import logging

MODES = ("auto", "on", "off")


def multi_process_environment(environ: dict | None = None) -> str | None:
  """The environment variable that says this is one process of several, or None."""
  env = os.environ if environ is None else environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hosts) > 1:
    return "TPU_WORKER_HOSTNAMES"
  if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "MEGASCALE_COORDINATOR_ADDRESS"
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if env.get(var, "").isdigit() and int(env[var]) > 1:
      return var
  return None


def maybe_initialize(
  mode: str = "auto",
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> bool:
  """Calls jax.distributed.initialize per `mode` (see the module docstring); returns whether it did.
  Explicit arguments (all three, or none) override jax's detection; they imply mode "on" under "auto"."""
  if mode not in MODES:
    raise ValueError(f"distributed={mode!r} is invalid; one of {MODES}")
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
  named = {k: v for k, v in given.items() if v is not None}
  if named and len(named) != 3:
    missing = sorted(set(given) - set(named))
    raise ValueError(
      f"distributed: {named} given without {missing}; pass all three or none (to let jax detect the cluster)"
    )
  if named:
    if not isinstance(num_processes, int) or num_processes < 1:
      raise ValueError(f"num_processes={num_processes!r} is invalid; a positive integer")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id!r} is invalid; an integer in [0, num_processes={num_processes})")
    if ":" not in coordinator_address:
      raise ValueError(f"coordinator_address={coordinator_address!r} is invalid; host:port of process 0")
  if mode == "off" and named:
    raise ValueError(f"distributed='off' contradicts the given {sorted(named)}")
  if mode == "off" or (mode == "auto" and not named and multi_process_environment() is None):
    return False
  jax.distributed.initialize(**named)
  logging.info(
    "jax.distributed: process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  return True
