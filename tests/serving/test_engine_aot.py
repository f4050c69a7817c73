"""launch/compile.py --serve (glm_jax/serving/aot.py): the serving engine's decode and prefill steps compiled for a TPU
slice. The bytes a chip holds are checked against hand counts of the tiny model's weights and page pool under the
mesh, the pool is written in place (XLA aliases it), and sizes the mesh does not divide are named before any
compile."""

import json

import pytest

from glm_jax.configs import glm5_tiny
from glm_jax.model import ModelConfig, param_counts
from tests.helpers import TPU_COMPILE
from tests.train.runs import run_script

pytestmark = TPU_COMPILE


def compile_serve(*args: str, timeout: int = 600) -> tuple[int, dict | None, str]:
  proc = run_script(
    "launch/compile.py", "--serve", "--config=configs/glm5_tiny.py", "--topology=v5p:2x2x1", *args, timeout=timeout
  )
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  return proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr


@pytest.mark.slow  # a launch/compile.py process: two TPU compiles (the speculative round, the prefill step)
def test_tiny_engine_on_a_v5p_slice_holds_its_hand_counted_bytes():
  """glm5_tiny (fp32 weights) with one decoder layer, a dense one, beside its MTP layer (an MoE layer), on 4 v5p chips
  with expert=4, speculating 2 tokens a round: the routed experts split 4 ways, every other weight whole on each
  chip; the 64 pages of 8 tokens split 4 ways with the 8 rows, for the decoder layer and the MTP layer; the decode
  program is the speculative round. One decoder layer: the counts are the same at any depth, and the MTP layer
  brings the routed experts."""
  rc, report, err = compile_serve(
    "--pages=64",
    "--page_size=8",
    "--max_running=8",
    "--prefill_rows=4",
    "--prefill_chunk=16",
    "--max_seq_len=64",
    "--speculate=2",
    "--config.mesh.expert=4",
    "--config.mesh.fsdp=1",
    "--config.model.num_hidden_layers=1",
    "--config.model.first_k_dense_replace=1",
  )
  assert rc == 0 and report is not None, err[-3000:]
  cfg = ModelConfig.from_dict(glm5_tiny.get_config().model).replace(num_hidden_layers=1, first_k_dense_replace=1)
  assert cfg.num_moe_layers == 0 and cfg.num_nextn_predict_layers == 1
  assert report["mesh"]["expert"] == 4 and report["batch_shards"] == 4 and report["fits"]
  counts = param_counts(cfg)
  moe_layers = cfg.num_moe_layers + cfg.num_nextn_predict_layers  # the MTP layer is an MoE layer here
  routed = moe_layers * 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size
  bias = moe_layers * cfg.n_routed_experts  # e_score_correction_bias, replicated
  assert report["weights_bytes_per_chip"] == 4 * (counts["total"] + counts["mtp"] - routed + routed // 4 + bias)
  width = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
  pool = (cfg.num_hidden_layers + 1) * (64 // 4) * 8 * width * 4  # the decoder's layers and the MTP layer's
  assert report["pool_bytes_per_chip"] == pool and report["pool_tokens"] == (64 - 4) * 8
  for step in ("decode", "prefill"):  # the donated pool is written in place (TPU's tiled layout: at least its size)
    assert report[f"{step}_per_chip_bytes"]["aliased"] >= pool and report[f"{step}_step_ms"] > 0


def test_sizes_the_mesh_does_not_divide_exit_2_with_their_message():
  rc, report, err = compile_serve(
    "--pages=63", "--max_seq_len=64", "--config.mesh.expert=4", "--config.mesh.fsdp=1", timeout=120
  )
  assert rc == 2 and report is None
  assert "engine.num_pages=63: the mesh's batch axes {'expert': 4} split rows and pages 4 ways" in err
