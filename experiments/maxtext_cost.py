"""Our cost model (glm_jax/sharding/hlo_cost.py) on MaxText's compiled programs, as calibrate_maxtext.py and
maxtext_v32.py both read them."""

import gzip
import lzma


def read_hlo(path: str) -> str:
  opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def cost_maxtext_program(text: str, topology: str, tokens_per_chip: int, experts_per_token: int, splash_block: int):
  """Our cost model on a MaxText program as on ours (calibrate_maxtext.py's docstring): (ops, summarize's totals,
  schedule's times). MaxText's MoE is pure FSDP here, so a chip's grouped matmuls take its own tokens x K rows."""
  from glm_jax.sharding import hlo_cost
  from glm_jax.sharding.topology import parse_topology, torus_of, tpu_topology_devices
  from glm_jax.train.aot import kernel_model

  topo = parse_topology(topology)
  chip = hlo_cost.Chip.of(topo.generation.name, torus_of(tpu_topology_devices(topo.name), topo.name))
  rows = tokens_per_chip * experts_per_token
  model = kernel_model(rows, "balanced", splash_block=splash_block, split_backward="splash_mha_dq_" in text)
  ops = hlo_cost.program_ops(text, kernel_model=model, ragged_rows=lambda ins: rows, chip=chip)
  return ops, hlo_cost.summarize(ops), hlo_cost.schedule(text, ops, chip)
