"""Every test marked multi_device (tests/helpers.py: multi_device), run in one process with 8 simulated CPU devices.

Simulated devices must be requested before jax starts, and each one slows every other test, so the suite's own
processes have one device and skip those tests; this test starts one process for all of them (a single jax start,
tokenizer build and compilation cache, rather than one subprocess a file)."""

import glob
import os

import pytest

from tests.helpers import ROOT, simulated_devices_session

# The files that hold multi_device tests (a test file that uses the decorator is found by its text).
FILES = sorted(
  os.path.relpath(p, ROOT)
  for p in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
  if "multi_device(" in open(p, encoding="utf-8").read() and not p.endswith("test_multi_device.py")
)


def test_the_files_with_multi_device_tests_are_found():
  assert {
    "tests/sharding/test_mesh.py",
    "tests/sharding/test_context_parallel.py",
    "tests/inference/test_sharded_decoding.py",
    "tests/convert/test_stream.py",
    "tests/pallas_kernels/test_indexer_prefix.py",
    "tests/model/test_moe_parallel.py",
    "tests/model/test_ragged_all_to_all.py",
  } <= set(FILES)


@pytest.mark.slow  # about 5.5 minutes on 2 cores, beside the other worker
def test_multi_device_tests_on_8_simulated_devices(tmp_path):
  simulated_devices_session(FILES, str(tmp_path / "session"))
