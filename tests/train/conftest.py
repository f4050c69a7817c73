"""Fixtures of the training tests."""

import os

import pytest

from tests.helpers import persistent_compilation_cache


@pytest.fixture(scope="module")
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for the short runs of both trainer test files, in this process and in the
  launch/train.py subprocesses they start (under pytest-xdist, shared by the workers): the runs train the same
  model, so each program is compiled once and its executable reused as is."""
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  path = os.path.join(str(root), "jax_cache_short_runs")
  os.makedirs(path, exist_ok=True)
  with persistent_compilation_cache(path):
    yield path
