"""Fixtures shared by the test packages (helpers that are not fixtures: tests/helpers.py; the data tests'
own fixtures: tests/data/conftest.py)."""

import os

import pytest

from tests.helpers import persistent_compilation_cache


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory):
  """A data cache (config.data.cache_dir) for the tests that train on the embedded corpus: its BPE and tokenized
  corpus are built once per test process, and never in the user's ~/.cache."""
  return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for the tests that compile the same programs more than once (the short
  glm5_tiny runs of the trainer, fault and sweep tests, the RL loops and the notebooks), in this process and in the
  subprocesses and notebook kernels they start (under pytest-xdist, shared by the workers): each program is
  compiled once and its executable reused as is."""
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  path = os.path.join(str(root), "jax_cache_short_runs")
  os.makedirs(path, exist_ok=True)
  with persistent_compilation_cache(path):
    yield path
