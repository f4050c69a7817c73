"""The values every config section shares a check for (glm_jax/train/config.py's check_values): a NaN or an infinity in
any float field of any shipped config, and a seed outside [0, 2**32), are refused by name before any work, through
each trainer's own entry check; launch/sample.py refuses its out-of-range flags before it reads the workdir.

The float fields are found by walking every config under configs/, so a float field added later is covered without
editing this file; the expected message is written here from the field's path and the value.
"""

import importlib
import math
import os
import pathlib
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from glm_jax import sweep
from glm_jax.inference.sampling import SamplingParams
from tests.helpers import ROOT

CONFIG_NAMES = sorted(
  p.stem for p in pathlib.Path(ROOT, "configs").glob("*.py") if p.stem not in ("__init__", "common")
)


def shipped(name: str) -> ml_collections.ConfigDict:
  return importlib.import_module(f"configs.{name}").get_config()


def leaves(d, prefix=""):
  """(dotted path, value) of every field, written here apart from the library's walker."""
  for key in d.keys():
    value = d[key]
    if isinstance(value, ml_collections.ConfigDict):
      yield from leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def float_fields(name: str) -> list[str]:
  return [
    p
    for p, v in leaves(shipped(name))
    if isinstance(v, float) or (isinstance(v, tuple) and any(isinstance(x, float) for x in v))
  ]


FLOAT_CASES = [(name, path) for name in CONFIG_NAMES for path in float_fields(name)]
SEED_CASES = [
  (n, p) for n in CONFIG_NAMES for p, _ in leaves(shipped(n)) if p.split(".")[-1] in ("seed", "shuffle_seed")
]


def with_value(config: ml_collections.ConfigDict, path: str, value) -> ml_collections.ConfigDict:
  *sections, field = path.split(".")
  d = config
  for s in sections:
    d = d[s]
  del d[field]  # the field anew: ConfigDict would refuse a value of another type (a float seed, a bool)
  d[field] = value
  return config


def refusal(config: ml_collections.ConfigDict) -> str:
  """The message of the trainer's entry check (the sweep's per-point check: check_config for pretrain / sft,
  validate_rl_config for grpo / distill)."""
  with pytest.raises(ValueError) as e:
    sweep.check_config(config)
  return str(e.value)


def test_the_walk_finds_every_section_with_floats_and_every_seed():
  """The generated cases reach every kind of section (so a section whose floats the walk missed would show here)."""
  sections = {path.split(".")[0] for _, path in FLOAT_CASES}
  assert sections == {"model", "optimizer", "train", "data", "rl", "sft", "tasks", "teachers"}
  assert {p.split(".")[1] for _, p in FLOAT_CASES if p.startswith("sft.")} == {"optimizer", "train_step"}
  assert {p for _, p in SEED_CASES} == {
    "train.seed",
    "data.shuffle_seed",
    "rl.seed",
    "teachers.addition.seed",
    "teachers.sort.seed",
  }
  assert {n for n, _ in FLOAT_CASES} == set(CONFIG_NAMES)  # each shipped config: its trainer's check is exercised


def test_a_nan_or_an_inf_in_any_float_field_is_refused_by_name():
  """Every float field of every shipped config (FLOAT_CASES), each non-finite value; the cases that fail are named."""
  wrong = []
  for name, path in FLOAT_CASES:
    default = dict(leaves(shipped(name)))[path]
    for bad in (math.nan, math.inf, -math.inf):
      if isinstance(default, tuple):  # a list field: its first float entry made non-finite
        i = next(i for i, x in enumerate(default) if isinstance(x, float))
        value = default[:i] + (bad,) + default[i + 1 :]
        want = f"{path}={value!r} is invalid; every entry must be a finite number (entry {i} is {bad!r})"
      else:
        value = bad
        want = f"{path}={bad!r} is invalid; must be a finite number"
      got = refusal(with_value(shipped(name), path, value))
      if got != want:
        wrong.append(f"{name}:{path}={bad!r}: {got!r}, expected {want!r}")
  assert not wrong, "\n".join(wrong)


def test_a_seed_out_of_range_is_refused_by_name():
  """Every seed field of every shipped config (SEED_CASES): each out-of-range value refused, the largest accepted."""
  wrong = []
  for name, path in SEED_CASES:
    for bad in (-1, 2**32, 2**64, 1.5, True):
      want = f"{path}={bad!r} is invalid; must be an integer in [0, 2**32) (the PRNG keys are 32-bit: jax keeps a "
      got = refusal(with_value(shipped(name), path, bad))
      if not got.startswith(want):
        wrong.append(f"{name}:{path}={bad!r}: {got!r}, expected it to start {want!r}")
    sweep.check_config(with_value(shipped(name), path, 2**32 - 1))  # the largest seed passes every check
  assert not wrong, "\n".join(wrong)


def test_the_seed_range_is_where_jax_keys_are_distinct_and_built():
  """Why [0, 2**32): jax.random.key keeps a seed's low 32 bits (2**32 is seed 0 again, -1 is 2**32 - 1) and raises
  OverflowError (a traceback, not a user error) from 2**63 up."""
  data = lambda s: np.asarray(jax.random.key_data(jax.random.key(s)))  # noqa: E731
  np.testing.assert_array_equal(data(2**32), data(0))
  np.testing.assert_array_equal(data(-1), data(2**32 - 1))
  assert not np.array_equal(data(2**32 - 1), data(0))
  with pytest.raises(OverflowError):
    jax.random.key(2**63)


def test_a_float_field_of_any_section_is_covered_without_naming_it():
  """A section without floats today (quant, mesh), free-form ones (optimizer.hparams) and list fields holding
  sections: the walk finds each."""
  config = shipped("sft_tiny")
  config.quant.future_scale = math.nan
  assert refusal(config) == "quant.future_scale=nan is invalid; must be a finite number"
  config = shipped("glm5_tiny")
  config.mesh.future_ratio = -math.inf
  assert refusal(config) == "mesh.future_ratio=-inf is invalid; must be a finite number"
  config = shipped("glm5_tiny")
  config.optimizer.hparams.momentum = math.nan
  assert refusal(config) == "optimizer.hparams.momentum=nan is invalid; must be a finite number"
  config = shipped("grpo_tiny")
  config.rl.schedule = [
    ml_collections.ConfigDict({"temperature": 1.0}),
    ml_collections.ConfigDict({"temperature": math.inf}),
  ]
  assert refusal(config) == "rl.schedule[1].temperature=inf is invalid; must be a finite number"


def test_nan_safe_range_checks_after_the_finite_one():
  """The sections' own range checks that NaN used to slip through, and fields that had none."""
  cases = [
    (
      "glm5_tiny",
      "model.routed_scaling_factor",
      -1.0,
      "model config: routed_scaling_factor=-1.0 is invalid; must be a number > 0",
    ),
    ("glm5_tiny", "model.mla_norm_eps", 0.0, "model config: mla_norm_eps=0.0 is invalid; must be a number > 0"),
    (
      "glm5_tiny",
      "model.initializer_range",
      -0.02,
      "model config: initializer_range=-0.02 is invalid; must be a number >= 0",
    ),
    ("glm5_tiny", "optimizer.b2", 1.0, "optimizer config: b2=1.0; expected in [0, 1)"),
    ("glm5_tiny", "optimizer.eps", -1e-8, "optimizer config: eps=-1e-08; expected >= 0"),
    ("grpo_tiny", "rl.tis_cap", 0.0, "rl.tis_cap=0.0 is invalid; must be > 0"),
    ("grpo_tiny", "optimizer.lr", -1.0, "optimizer config: lr=-1.0; expected > 0"),
    ("distill_tiny", "sft.optimizer.b1", 1.5, "sft.optimizer config: b1=1.5; expected in [0, 1)"),
  ]
  for name, path, value, want in cases:
    assert refusal(with_value(shipped(name), path, value)).startswith(want), path


def test_the_trainers_refuse_before_any_work(tmp_path):
  """Through each trainer's own entry (not only its check): the error, and no workdir."""
  from glm_jax.rl import trainer as rl_trainer
  from glm_jax.train.trainer import train_and_evaluate

  with pytest.raises(ValueError, match=r"^model\.rope_theta=nan is invalid; must be a finite number$"):
    train_and_evaluate(with_value(shipped("glm5_tiny"), "model.rope_theta", math.nan), str(tmp_path / "pre"))
  with pytest.raises(ValueError, match=r"^rl\.temperature=inf is invalid; must be a finite number$"):
    rl_trainer.run(with_value(shipped("grpo_tiny"), "rl.temperature", math.inf), str(tmp_path / "grpo"))
  with pytest.raises(ValueError, match=r"^teachers\.sort\.seed=-1 is invalid; must be an integer in \[0, 2\*\*32\)"):
    rl_trainer.run(with_value(shipped("distill_tiny"), "teachers.sort.seed", -1), str(tmp_path / "distill"))
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  "kwargs,want",
  [
    (dict(temperature=math.inf), "temperature=inf; must be 0 (greedy) or a finite number >= 1e-30"),
    (dict(temperature=-math.inf), "temperature=-inf; must be 0 (greedy) or at least 1e-30"),
    (dict(temperature=math.nan), "temperature=nan; must be 0 (greedy) or at least 1e-30"),
    (dict(temperature=-0.5), "temperature=-0.5; must be 0 (greedy) or at least 1e-30"),
    (dict(top_p=0.0), "top_p=0.0; must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5; must be in (0, 1]"),
    (dict(top_p=math.nan), "top_p=nan; must be in (0, 1]"),
    (dict(max_new_tokens=0), "max_new_tokens=0; must be a positive integer"),
    (dict(max_new_tokens=True), "max_new_tokens=True; must be a positive integer"),
  ],
)
def test_sampling_values_out_of_range_are_refused(kwargs, want):
  with pytest.raises(ValueError) as e:
    SamplingParams(**{"max_new_tokens": 4, **kwargs})
  assert str(e.value).startswith(want)


def run_script(script, *args):
  return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def error_line(proc) -> str:
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc.stderr.strip().splitlines()[-1]


def test_launch_train_refuses_a_nan_before_any_work(tmp_path):
  t0 = time.perf_counter()
  proc = run_script(
    "launch/train.py", "--config=configs/glm5_tiny.py", f"--workdir={tmp_path}/run", "--config.optimizer.lr=nan"
  )
  assert proc.returncode == 1
  assert error_line(proc) == "error: optimizer.lr=nan is invalid; must be a finite number"
  assert not os.path.exists(tmp_path / "run")
  assert time.perf_counter() - t0 < 60


@pytest.mark.slow  # starts launch/sample.py
def test_launch_sample_refuses_its_flags_before_the_workdir(tmp_path):
  """The flags first, then the config's values, then the (here missing) workdir: each fails in one line."""
  base = ["--config=configs/glm5_tiny.py", f"--workdir={tmp_path}/missing"]
  positions = shipped("glm5_tiny").model.max_position_embeddings
  cases = [
    (["--temperature=inf"], "error: --temperature=inf; must be 0 (greedy) or a finite number >= 1e-30"),
    (["--top_p=1.5"], "error: --top_p=1.5; must be in (0, 1]"),
    (["--seed=-1"], "error: --seed=-1 is invalid; must be an integer in [0, 2**32)"),
    (
      [f"--max_new_tokens={positions}"],
      f"error: --max_new_tokens={positions} is invalid; must be in [1, {positions - 1}]",
    ),
    (["--config.model.rope_theta=nan"], "error: model.rope_theta=nan is invalid; must be a finite number"),
  ]
  procs = [
    subprocess.Popen(
      [sys.executable, "launch/sample.py", *base, *flags],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for flags, _ in cases
  ]
  for proc, (flags, want) in zip(procs, cases):
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, (flags, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(want), (flags, stderr[-500:])
  assert not os.path.exists(tmp_path / "missing")
