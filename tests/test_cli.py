"""glm_jax/cli.py: what libraries print from their background threads when a run fails, and --config paths under
configs/ found in the installed package."""

import logging
import os
import sys

import pytest

from glm_jax import cli
from tests.helpers import ROOT


def test_a_background_failure_is_logged_in_one_line():
  try:
    raise ValueError("RESOURCE_EXHAUSTED: Failed to write 10 bytes: No space left on device\nsecond line")
  except ValueError:
    exc_info = sys.exc_info()
  orbax = logging.LogRecord("absl", logging.ERROR, "/x/orbax/checkpoint/a.py", 1, "save %d failed", (6,), exc_info)
  assert cli._OneLineBackgroundErrors().filter(orbax)
  assert orbax.exc_info is None
  assert orbax.getMessage() == (
    "save 6 failed (ValueError: RESOURCE_EXHAUSTED: Failed to write 10 bytes: No space left on device second line)"
  )
  ours = logging.LogRecord("absl", logging.ERROR, "/x/glm_jax/train/a.py", 1, "ours", None, exc_info)
  assert cli._OneLineBackgroundErrors().filter(ours) and ours.exc_info is exc_info  # our own keep their traceback


def test_a_config_path_under_configs_is_the_packaged_one_where_it_is_not_found(tmp_path, monkeypatch):
  packaged = os.path.join(ROOT, "glm_jax", "configs")
  argv = ["train.py", "--config=configs/glm5_tiny.py:smoke", "--config", "configs/grpo_tiny.py", "--config.x=1"]
  monkeypatch.chdir(tmp_path)  # no configs/ here: the installed package's
  assert cli.packaged_config_argv(argv) == [
    "train.py",
    f"--config={packaged}/glm5_tiny.py:smoke",
    "--config",
    f"{packaged}/grpo_tiny.py",
    "--config.x=1",
  ]
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "glm5_tiny.py").write_text("")  # the user's own file of that name wins
  assert cli.packaged_config_argv(argv)[1] == "--config=configs/glm5_tiny.py:smoke"
  assert cli.packaged_config_argv(["x", "--config=mine/glm5_tiny.py"]) == ["x", "--config=mine/glm5_tiny.py"]
  monkeypatch.chdir(ROOT)  # a checkout: configs/ links to the package, and the path stays as given
  assert cli.packaged_config_argv(argv) == argv


def test_an_unknown_config_name_is_refused_listing_the_configs(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as e:
    cli.packaged_config_argv(["x", "--config=configs/glm5_small.py"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: --config=configs/glm5_small.py: configs/glm5_small.py is neither here nor in the")
  assert "glm5_tiny.py" in err and "common.py" not in err and len(err.splitlines()) == 1


def test_a_missing_extra_ends_the_script_in_one_line_naming_it(capsys):
  cli.require_extra("serve", "json", "os")  # installed: nothing happens
  with pytest.raises(SystemExit) as e:
    cli.require_extra("serve", "json", "no_such_module_here", "neither_this_one")
  assert e.value.code == 1
  assert capsys.readouterr().err == (
    "error: this needs the serve extra, which installs no_such_module_here, neither_this_one: "
    'pip install "glm-jax[serve]"\n'
  )
