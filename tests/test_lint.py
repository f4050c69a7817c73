"""The code is lint-clean and formatted as pyproject.toml's [tool.ruff] says: `ruff check` and `ruff format --check`
over the repository (ruff is pinned in the test extra). To fix what this finds: `ruff check --fix .`, then
`ruff format .`."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
  ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
  proc = subprocess.run([ruff, *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
