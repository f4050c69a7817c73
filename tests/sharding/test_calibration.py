"""The cost model on a program it did not come from: MaxText's DeepSeek-V3 671B train step compiled for v5p-1024
(experiments/maxtext/compile.sh, checked in compressed beside this file, 250 KB). Its parser must read every
collective of it (mesh replica groups over MaxText's 12 named axes; gradient all-reduces that XLA:TPU offloads to
the SparseCore as custom-call-start / -update / -done around a called computation), and
experiments/calibrate_maxtext.py on it must give the realism factor hlo_cost.CALIBRATION holds.

Needs libtpu (the calibration places the partitions with the topology's compile-only devices)."""

import json
import lzma
import os
import re
import subprocess
import sys

import pytest

from glm_jax.sharding import hlo_cost, ici
from glm_jax.sharding.topology import torus_of, tpu_topology_devices
from tests.helpers import ROOT
from tests.helpers import needs_libtpu

HLO = os.path.join(os.path.dirname(__file__), "maxtext_deepseek3_671b_v5p1024_b5.hlo.txt.xz")


@pytest.fixture(scope="module")
def program():
  with lzma.open(HLO, "rt") as f:
    text = f.read()
  chip = hlo_cost.Chip.of("v5p", torus_of(tpu_topology_devices("v5p:8x8x8"), "v5p:8x8x8"))
  return text, chip, hlo_cost.program_ops(text, chip=chip)


@needs_libtpu
def test_every_collective_of_maxtexts_program_is_read(program):
  """Counted in the text itself: each all-gather and all-to-all instruction is one op of its kind, and the
  all-reduces are the top-level ones plus those the SparseCore runs (one custom-call-start each)."""
  text, _, ops = program
  in_text = lambda opcode: len(re.findall(rf"^\s*(?:ROOT )?%\S+ = .* {opcode}\(", text, re.M))
  starts = [o for o in ops if o.role in ("sync", "start")]
  kinds = lambda kind: sum(1 for o in starts if o.kind == kind)
  assert kinds("all-gather") == in_text("all-gather") == 84
  assert kinds("all-to-all") == in_text("all-to-all") == 2
  offloaded = [o for o in starts if o.opcode == "custom-call-start"]
  assert offloaded and kinds("all-reduce") == in_text("all-reduce") == 31
  assert all(o.wire > 0 and o.wire_seconds > 0 for o in starts)


@needs_libtpu
def test_an_offloaded_all_reduce_by_hand(program):
  """all-reduce.300's called computation sums a bf16[256,7168,2048] gradient over all 512 chips (the 8x8x8 torus,
  every axis wrapped): 2 x 511/512 of it on the wire, at 3 axes x 2 directions x 100 GB/s, twice (reduce-scatter
  and all-gather), 3 x 7 ring steps each."""
  text, _, ops = program
  [op] = [o for o in ops if o.name == "all-reduce.300.cloned.1.call-start"]
  v = 256 * 7168 * 2048 * 2
  assert op.kind == "all-reduce" and op.role == "start" and op.wire == 2 * 511 / 512 * v * op.runs
  assert op.wire_seconds == pytest.approx(op.runs * 2 * (511 / 512 * v / (6 * 100e9) + 21 * ici.STEP_LATENCY_S))


@needs_libtpu
@pytest.mark.slow  # a process with jax and the whole program's cost (about 20 s)
def test_the_calibration_is_what_the_script_prints(tmp_path):
  out = tmp_path / "calibration.json"
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments/calibrate_maxtext.py"), f"--out={out}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["realism_factor"] == hlo_cost.CALIBRATION["realism_factor"]
  assert report["model_scheduled_seconds"] == hlo_cost.CALIBRATION["model_scheduled_seconds"]
  assert report["measured_seconds_scaled"] == pytest.approx(90.7 * 5 / 6, abs=1e-3)
