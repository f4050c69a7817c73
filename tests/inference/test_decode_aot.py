"""launch/compile.py --decode (glm_jax/inference/aot.py): the decode step and prefill compiled for a TPU slice.

The bytes a chip holds are checked against hand counts of the tiny model's parameters and cache under the mesh; the
decode program writes the cache in place (XLA's aliased bytes are the cache's); bad sizes are named before any
compile. The slow test compiles glm5_744b's decode step for a v5p slice and checks that it fits.
"""

import json

import pytest

from glm_jax.configs import glm5_tiny
from glm_jax.model import ModelConfig, param_counts
from tests.helpers import TPU_COMPILE
from tests.train.runs import run_script

pytestmark = TPU_COMPILE


def compile_decode(*args: str, timeout: int = 600) -> tuple[int, dict | None, str]:
  proc = run_script("launch/compile.py", "--decode", *args, timeout=timeout)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  return proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr


@pytest.mark.slow  # a launch/compile.py process: four TPU compiles (decode, a speculative round's three)
def test_tiny_decode_on_a_v5p_slice_holds_its_hand_counted_bytes():
  """glm5_tiny (fp32 weights) on 4 v5p chips with expert=4: the routed experts are split 4 ways, every other weight is
  whole on each chip; the cache's 8 rows 2 a chip, for the 3 decoder layers and, speculating, the MTP layer. No
  prefill (--prefill_len=0): test_glm5_744b_decode_fits_a_v5p_slice compiles one and checks that it fits."""
  b, s = 8, 64
  rc, report, err = compile_decode(
    "--config=configs/glm5_tiny.py",
    "--topology=v5p:2x2x1",
    f"--batch_size={b}",
    f"--cache_len={s}",
    "--prefill_len=0",
    "--config.mesh.expert=4",
    "--speculate=2",
    timeout=300,
  )
  assert rc == 0 and report is not None, err[-3000:]
  cfg = ModelConfig.from_dict(glm5_tiny.get_config().model)
  assert report["mesh"]["expert"] == 4 and report["mesh"]["fsdp"] == 1 and report["fits"]
  counts = param_counts(cfg)
  moe_layers = cfg.num_moe_layers + cfg.num_nextn_predict_layers  # the MTP layer is an MoE layer here
  routed = moe_layers * 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size
  bias = moe_layers * cfg.n_routed_experts  # e_score_correction_bias, replicated
  weights = 4 * (counts["total"] + counts["mtp"] - routed + routed // 4 + bias)
  assert report["weights_bytes_per_chip"] == weights
  width = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
  cache = (cfg.num_hidden_layers + 1) * (b // 4) * s * width * 4
  assert report["cache_bytes_per_chip"] == cache
  # The donated cache is written in place: XLA aliases it (in TPU's tiled layout, so at least its plain size).
  assert report["decode_per_chip_bytes"]["aliased"] >= cache
  # The roofline's figures come from the compiled program: a decode step reads at least every chip's cache.
  assert report["decode_step"]["hbm_bytes"] >= cache and report["roofline_ms_per_token"] > 0
  assert report["max_batch_at_cache_len"] > b and report["max_cache_len_at_batch"] > s
  # A speculative round (k = 2): the verification, two draft steps and the rewrite, all compiled and fitting.
  spec = report["speculative"]
  assert spec["k"] == 2 and all(report[f"{p}_per_chip_bytes"]["total"] > 0 for p in ("verify", "draft", "rewrite"))
  assert abs(spec["round_ms"] - (spec["verify_ms"] + 2 * spec["draft_ms"] + spec["rewrite_ms"])) < 2e-4
  assert spec["verify_ms"] >= spec["draft_ms"] > 0 and spec["break_even_acceptance_length"] > 1


def test_bad_sizes_exit_2_with_their_message_and_no_report():
  """launch/compile.py --decode's contract for bad input: exit status 2, no report, the message on stderr (one
  process; the messages of the other bad sizes are checked in-process below)."""
  rc, report, err = compile_decode(
    "--config=configs/glm5_tiny.py", "--topology=v5p:2x2x1", "--cache_len=64", "--prefill_len=100", timeout=120
  )
  assert rc == 2 and report is None
  assert "error: --prefill_len=100; in [0, cache_len=64]" in err


@pytest.mark.parametrize(
  "args, message",
  [
    ({"cache_len": 4096}, "--cache_len=4096 exceeds model.max_position_embeddings=2048"),
    ({"batch_size": 6, "mesh.expert": 4}, "a batch of 6 rows; the mesh's batch axes {'expert': 4} split"),
    ({"prefill_len": 100}, "--prefill_len=100; in [0, cache_len=64]"),
    ({"mesh.tensor": 8, "topology": "v5p:2x2x2"}, "mesh.tensor=8 does not divide model.num_attention_heads=4"),
    ({"speculate": -1}, "--speculate=-1: the drafted tokens a round must be an integer >= 1"),
    ({"speculate": 2, "model.num_nextn_predict_layers": 0}, "model.num_nextn_predict_layers=0"),
  ],
)
def test_bad_sizes_are_named_before_compiling(args, message):
  """What launch/compile.py --decode runs for these flags (its defaults otherwise: --batch_size=64, --prefill_len
  min(1024, --cache_len), no speculation; here --topology=v5p:2x2x1 and --cache_len=64), in-process: a ValueError
  naming the bad size (the script prints it and exits 2), raised before anything is compiled (a failed compile is
  returned, not raised)."""
  from glm_jax.inference import aot as serving
  from glm_jax.sharding.topology import parse_topology, tpu_topology_devices

  flags = {"topology": "v5p:2x2x1", "batch_size": 64, "cache_len": 64, "speculate": 0}
  config = glm5_tiny.get_config()
  for key, value in args.items():
    if "." in key:
      section, field = key.split(".")
      config[section][field] = value
    else:
      flags[key] = value
  devices = tpu_topology_devices(parse_topology(flags["topology"]).name)
  with pytest.raises(ValueError) as e:
    serving.compile_decode(
      config,
      devices,
      batch_size=flags["batch_size"],
      cache_len=flags["cache_len"],
      prefill_len=flags.get("prefill_len", min(1024, flags["cache_len"])),
      speculate=flags["speculate"],
    )
  assert message in str(e.value)


@pytest.mark.slow  # the 744B decode step and prefill compiled for 64 chips
def test_glm5_744b_decode_fits_a_v5p_slice():
  rc, report, err = compile_decode(
    "--config=configs/glm5_744b.py",
    "--topology=v5p:4x4x4",
    "--batch_size=64",
    "--cache_len=32768",
    "--prefill_len=1024",
    "--config.mesh.expert=64",
  )
  assert rc == 0 and report is not None and report["fits"], err[-3000:]
  assert report["weights_dtype"] == "bfloat16" and report["dsa_selects"]
