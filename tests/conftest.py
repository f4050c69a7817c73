"""Fixtures shared by the test packages (helpers that are not fixtures: tests/helpers.py; the data tests'
own fixtures: tests/data/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory):
  """A data cache (config.data.cache_dir) for the tests that train on the embedded corpus: its BPE and tokenized
  corpus are built once per test process, and never in the user's ~/.cache."""
  return str(tmp_path_factory.mktemp("data_cache"))
