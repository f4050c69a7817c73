"""Fault injection: the ways a run could go wrong silently, each asserting what happens now.

Corrupt and partial checkpoints fall back to the step before, with losses equal to an uninterrupted run; a
resume under other data or another tokenizer is refused by name; an unwritable checkpoints directory fails at
once; a diverging run stops non-zero with only finite checkpoints; metrics are strict JSON and hold each step
once; the launch scripts fail in one line and create nothing.
"""

import glob
import json
import math
import os
import shutil
import time

import numpy as np
import pytest

from glm_jax import data as data_lib
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.guards import Diverged, first_nonfinite
from glm_jax.train.progress import TIMING_KEYS
from glm_jax.train.trainer import BATCH_KEYS, abstract_train_state, train_and_evaluate
from tests.train.runs import (
  make_config,
  metric_rows,
  run_script,
  run_train,
  snapshot,
  stopped_after,
  strict_loads,
  train_rows,
)

# training runs, a few of them through launch/train.py


@pytest.fixture
def straight(glm5_tiny_run):
  """9 uninterrupted steps, the session's shared run (read only): the rows every recovered run must reproduce."""
  return glm5_tiny_run


@pytest.fixture(scope="module")
def six_steps(glm5_tiny_run, tmp_path_factory):
  """The first 6 of those steps: the shared run as it stood after step 6, checkpointed at 1, 3 and 6 (its
  train.steps=9 recorded); tests corrupt copies of it."""
  return stopped_after(glm5_tiny_run[0], 6, tmp_path_factory.mktemp("six") / "run")


def copy_of(workdir, tmp_path):
  target = str(tmp_path / "run")
  shutil.copytree(workdir, target)
  return target


def without_speed(rows):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def largest_array_file(step_dir):
  files = [
    f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True) if os.path.isfile(f) and "/d/" in f
  ]
  return max(files, key=os.path.getsize)


def truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def delete_manifests(path):
  manifests = glob.glob(os.path.join(path, "state", "**", "manifest.ocdbt"), recursive=True)
  assert manifests
  for m in manifests:
    os.remove(m)


@pytest.mark.parametrize(
  "corrupt",
  [lambda step_dir: truncate(largest_array_file(step_dir)), delete_manifests],
  ids=["truncated_array_file", "deleted_manifest"],
)
@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_step_before(
  six_steps, straight, data_cache_dir, tmp_path, corrupt, caplog
):
  workdir = copy_of(six_steps, tmp_path)
  bad = os.path.join(workdir, "checkpoints", "6")
  corrupt(bad)
  bad_files = snapshot(bad)
  summary = train_and_evaluate(make_config(data_cache_dir), workdir)
  # One line says which step failed and why; the run went on from step 3.
  warned = [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
  assert len(warned) == 1 and "/checkpoints/6 cannot be restored (ValueError: " in warned[0], warned
  assert "\n" not in warned[0] and "tensorstore_spec" not in warned[0], warned
  assert summary["step"] == 9
  # Steps 4-6 ran again from step 3's state and data position: every row equals the uninterrupted run's, once.
  assert without_speed(train_rows(workdir)) == without_speed(train_rows(straight[0]))
  assert summary["eval_loss"] == straight[1]["eval_loss"]
  # The bad step was moved aside, byte for byte, not deleted.
  assert snapshot(bad + ".unreadable") == bad_files
  with Checkpointer(workdir, read_only=True) as ckpt:
    assert ckpt.steps() == [9, 6]  # keep_checkpoints=2


@pytest.mark.slow
def test_when_no_step_restores_the_error_names_each_and_moves_nothing(six_steps, data_cache_dir, tmp_path):
  workdir = copy_of(six_steps, tmp_path)
  with Checkpointer(workdir, read_only=True) as ckpt:
    steps = ckpt.steps()
  assert steps == [6, 3, 1]  # every checkpoint the run wrote (it keeps 4)
  for step in steps:
    truncate(largest_array_file(os.path.join(workdir, "checkpoints", str(step))))
  before = snapshot(workdir)
  with pytest.raises(ValueError, match=r"no checkpoint in .* can be restored: step 6 \(.*\); step 3 \(.*\); step 1 \("):
    train_and_evaluate(make_config(data_cache_dir), workdir)
  assert snapshot(workdir) == before


@pytest.mark.parametrize(
  "changes, named",
  [
    ({"data.batch_size": 8}, r"data\.batch_size: checkpoint 4, config 8"),
    ({"data.seq_len": 32}, r"data\.seq_len: checkpoint 64, config 32"),
    (
      {"data.source": "text", "data.path": __file__, "data.text_document": "paragraph"},
      r"data\.path: checkpoint '', config '.*test_faults\.py'; data\.source: checkpoint 'embedded', config 'text'; "
      r"data\.text_document: checkpoint 'file', config 'paragraph'",
    ),
    (
      {"data.bpe_vocab_size": 384},
      r"data\.bpe_vocab_size: checkpoint 512, config 384; tokenizer: checkpoint "
      r"'.*bpe512-.*' \(sha256 \w{12}, 512 ids\), config '.*bpe384-.*'",
    ),
  ],
)
@pytest.mark.slow
def test_resuming_on_other_data_is_refused_by_name(six_steps, data_cache_dir, changes, named):
  before = snapshot(six_steps)
  with pytest.raises(ValueError, match=named + r".*--config\.train\.allow_data_change=True"):
    train_and_evaluate(make_config(data_cache_dir, **changes), six_steps)
  assert snapshot(six_steps) == before


@pytest.mark.slow
def test_a_checkpoint_written_before_fields_were_added_resumes(six_steps, straight, data_cache_dir, tmp_path, caplog):
  """Adding a field to a config section must not break resuming the runs saved before it: here every compared
  section of the saved configs loses a field, as if the library had added it since, and the run goes on from
  step 6 exactly as the uninterrupted one did, saying in one line which fields it took at their defaults."""
  workdir = copy_of(six_steps, tmp_path)
  removed = {"model": "norm_style", "optimizer": "b2", "data": "shuffle_seed", "train": "dsa_stage"}
  for path in glob.glob(os.path.join(workdir, "checkpoints", "*", "config", "metadata")):
    with open(path) as f:
      saved = json.load(f)
    for section, field in removed.items():
      del saved[section][field]
    with open(path, "w") as f:
      json.dump(saved, f)
  # a field the checkpoint lacks is its default: another value is a difference, named as such, and changes nothing
  before = snapshot(workdir)
  with pytest.raises(ValueError, match=r"optimizer\.b2: checkpoint absent \(default 0\.95\), config 0\.99"):
    train_and_evaluate(make_config(data_cache_dir, **{"optimizer.b2": 0.99}), workdir)
  assert snapshot(workdir) == before
  with caplog.at_level("INFO"):
    summary = train_and_evaluate(make_config(data_cache_dir), workdir)
  assert summary["step"] == 9
  assert without_speed(train_rows(workdir)) == without_speed(train_rows(straight[0]))
  said = [r.getMessage() for r in caplog.records if "does not give" in r.getMessage()]
  assert said and all(f"{s}.{f}" in said[0] for s, f in removed.items()), said


@pytest.mark.slow
def test_init_from_a_run_with_another_tokenizer_is_refused(six_steps, data_cache_dir, tmp_path):
  config = make_config(data_cache_dir, **{"train.init_from": six_steps, "data.bpe_vocab_size": 384})
  with pytest.raises(
    ValueError,
    match=r"train\.init_from='.*': .* was trained with the tokenizer '.*bpe512-.*' "
    r"\(sha256 \w{12}, 512 ids\), but this run uses '.*bpe384-.*'",
  ):
    train_and_evaluate(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_allow_data_change_resumes_the_state_on_fresh_data(six_steps, data_cache_dir, tmp_path):
  """With the override, the weights and optimizer continue from step 6 and the new data starts from its first
  batch: step 7's loss is the loss of step 6's state on the new data's first batch."""
  workdir = copy_of(six_steps, tmp_path)
  changes = {"data.shuffle_seed": 7, "train.allow_data_change": True, "train.steps": 7}
  train_and_evaluate(make_config(data_cache_dir, **changes), workdir)
  config = make_config(data_cache_dir, **changes)
  tok = data_lib.load_tokenizer(config.data)
  first = next(data_lib.make_train_iterator(config.data, tok))
  target = abstract_train_state(config, model_config_for_stage(config))  # the state the run restored onto
  with Checkpointer(six_steps, read_only=True) as ckpt:
    state = ckpt.restore(6, target.state)
  from glm_jax.train import step as step_lib

  step = step_lib.make_train_step(target.graphdef, target.optimizer, target.schedule, config.train)
  # The batch as the trainer passes it (the same keys): the same program, so the run's compiled step is reused.
  _, m = step(state, {k: np.asarray(v) for k, v in first.items() if k in BATCH_KEYS})
  assert train_rows(workdir)[-1]["step"] == 7
  assert train_rows(workdir)[-1]["loss"] == float(m["loss"])


def test_an_unwritable_checkpoints_directory_fails_at_once_and_creates_nothing(tmp_path, data_cache_dir):
  if os.geteuid() == 0:  # root writes through permissions; sysfs refuses it
    parent = "/sys"
  else:
    parent = str(tmp_path / "locked")
    os.makedirs(parent)
    os.chmod(parent, 0o500)
  workdir = os.path.join(parent, "glm_jax_run")
  t0 = time.perf_counter()
  proc = run_train(workdir, data_cache_dir)
  seconds = time.perf_counter() - t0
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines[-1] == (
    f"error: {workdir}/checkpoints: checkpoints cannot be written there ({parent}: Permission "
    "denied); use another --workdir"
  ), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(workdir)
  assert seconds < 60, seconds  # the process's start-up; nothing is built (it hung 340 s before)


@pytest.mark.slow
def test_a_diverging_run_stops_non_zero_and_checkpoints_only_finite_weights(straight, tmp_path, data_cache_dir):
  """AdamW at lr 1e12 without clipping, from the shared run's weights (train.init_from: no random initialization to
  compile): the first update makes the weights huge, every later loss is NaN and every later step is skipped; after
  3 in a row the run stops with exit code 1."""
  workdir = str(tmp_path / "run")
  proc = run_train(
    workdir,
    data_cache_dir,
    **{
      "optimizer.name": "adamw",
      "optimizer.lr": 1e12,
      "optimizer.warmup_steps": 0,
      "train.grad_clip_norm": 0.0,
      "train.max_consecutive_skips": 3,
      "train.checkpoint_every": 1,
      "train.keep_checkpoints": 10,
      "train.init_from": straight[0],
    },
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: the run is diverging: 3 steps in a row were skipped (steps 2-4"), last
  assert "train.max_consecutive_skips=3" in last and "Traceback" not in proc.stderr
  rows = train_rows(workdir)
  assert [r["skipped"] for r in rows] == [0, 1, 1, 1, 1][: len(rows)] and len(rows) >= 4
  # Strict JSON: the NaN losses are null, and the row says so.
  assert rows[1]["loss"] is None and "loss" in rows[1]["nonfinite"]
  # Without the stop (0 = never), the rerun resumes from step 4, skips steps 5-6 too and ends with NaN losses: it
  # prints its JSON line (strict: null, with the fields named) and then fails.
  proc = run_train(
    workdir,
    data_cache_dir,
    **{
      "optimizer.name": "adamw",
      "optimizer.lr": 1e12,
      "optimizer.warmup_steps": 0,
      "train.grad_clip_norm": 0.0,
      "train.max_consecutive_skips": 0,
      "train.checkpoint_every": 1,
      "train.keep_checkpoints": 10,
      "train.init_from": straight[0],
      "train.steps": 6,
    },
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  summary = strict_loads(proc.stdout.strip().splitlines()[-1])
  assert summary["eval_loss"] is None and summary["train_loss"] is None
  assert summary["train_lm_loss"] is None
  assert summary["nonfinite"] == ["eval_loss", "train_loss", "train_lm_loss"] and summary["skipped_steps"] == 5
  assert one_error_line(proc) == (
    f"error: the run ended with a non-finite eval_loss and train_loss (step 6, 5 steps "
    f"skipped in all); see {workdir}/metrics.jsonl"
  )
  config = make_config(data_cache_dir)
  state = abstract_train_state(config, model_config_for_stage(config)).state  # shapes to read the weights onto
  with Checkpointer(workdir, read_only=True) as ckpt:
    assert ckpt.steps() == [6, 5, 4, 3, 2, 1]
    for step in ckpt.steps():
      assert first_nonfinite(ckpt.restore_weights(step, state.params, state.rest)[0]) is None, step


@pytest.mark.slow
def test_non_finite_weights_are_never_saved(tmp_path, data_cache_dir):
  config = make_config(data_cache_dir)
  state = abstract_train_state(config, model_config_for_stage(config)).fresh()  # the trainer's initialization
  from flax import nnx

  flat = list(nnx.to_flat_state(state.params))
  path, var = flat[3]
  value = var[...]
  flat[3] = (path, var.replace(value=value.at[(0,) * value.ndim].set(math.inf)))
  state.params = nnx.from_flat_state(flat)
  with (
    Checkpointer(str(tmp_path / "run"), async_save=False) as ckpt,
    pytest.raises(Diverged, match=r"not saving step 1: parameter " + "/".join(map(str, path)) + " is not finite"),
  ):
    ckpt.save(1, state, None, {}, force=True)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_sample_py_decodes_with_the_recorded_tokenizer(six_steps, data_cache_dir):
  """The sampler is given a config whose data section would build another tokenizer (a 384-token BPE); it uses
  the one recorded with the checkpoint, so its text is the right run's greedy continuation."""
  args = [
    "--config=configs/glm5_tiny.py",
    f"--workdir={six_steps}",
    "--prompt=And God said",
    "--max_new_tokens=8",
    "--temperature=0",
    f"--config.data.cache_dir={data_cache_dir}",
    "--config.data.seq_len=64",
    "--config.optimizer.warmup_steps=2",
    "--config.optimizer.decay_steps=7",
  ]
  right = run_script("launch/sample.py", *args)
  wrong = run_script("launch/sample.py", *args, "--config.data.bpe_vocab_size=384")
  assert right.returncode == 0 and wrong.returncode == 0, wrong.stderr[-3000:]
  assert wrong.stdout == right.stdout and right.stdout.startswith("[step 6] And God said")


@pytest.mark.slow
def test_post_training_refuses_an_init_from_with_another_vocabulary(six_steps, data_cache_dir):
  """GRPO and distillation read a character vocabulary; a pretraining run's checkpoint (a 512-token BPE) would be
  read as other tokens. rl.init_from and teachers.<name>.init_from check the recorded tokenizer first."""
  from glm_jax.rl.tasks import CharVocab

  with Checkpointer(six_steps, read_only=True) as ckpt:
    ckpt.require_tokenizer(ckpt.recorded_tokenizer(6), "rl.init_from")  # the same tokenizer passes
    with pytest.raises(
      ValueError,
      match=r"rl\.init_from: .*/checkpoints \(step 6\) was trained with the tokenizer "
      r"'.*bpe512-.*' \(sha256 \w{12}, 512 ids\), but this run uses "
      r"\"CharVocab\('0123456789\+=-sr,'\)\" \(sha256 \w{12}, 18 ids\)",
    ):
      ckpt.require_tokenizer(CharVocab().record(), "rl.init_from")


def test_metrics_are_strict_json_with_the_non_finite_named(tmp_path):
  from glm_jax.train.metrics import MetricsWriter

  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  row = writer.write(5, {"loss": np.float32("nan"), "lr": 1e-3, "expert_load_entropy": np.array([1.5, np.inf])})
  writer.close()
  assert math.isnan(row["loss"])  # the caller still sees the value
  assert metric_rows(str(tmp_path)) == [
    {
      "step": 5,
      "loss": None,
      "lr": 1e-3,
      "expert_load_entropy": [1.5, None],
      "nonfinite": ["loss", "expert_load_entropy[1]"],
    }
  ]


def test_metrics_rows_after_the_restored_step_are_moved_aside(tmp_path):
  from glm_jax.train.metrics import DROPPED_FILE, MetricsWriter

  lines = [json.dumps({"step": s, "loss": float(s)}) for s in (1, 2, 3, 4, 5)] + ['{"step": 6, "lo']  # torn
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(lines) + "\n")
  MetricsWriter(str(tmp_path), tensorboard=False, keep_through=3).close()
  assert path.read_text() == "\n".join(lines[:3]) + "\n"
  assert (tmp_path / DROPPED_FILE).read_text() == "\n".join(lines[3:]) + "\n"


# --- the launch scripts: one line, exit code, nothing created ---


def one_error_line(proc):
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc.stderr.strip().splitlines()[-1]


def test_an_unknown_config_field_is_one_line_naming_the_flag(tmp_path):
  proc = run_script(
    "launch/train.py", "--config=configs/glm5_tiny.py", f"--workdir={tmp_path}/run", "--config.train.stepz=3"
  )
  assert proc.returncode == 2
  assert one_error_line(proc) == (
    "error: --config.train.stepz=3: the config has no field 'stepz'; did you mean "
    "\"steps\" instead of \"stepz\"? (--helpfull lists the flags)"
  )
  assert not os.path.exists(tmp_path / "run")


def test_a_bad_config_value_fails_before_any_work(tmp_path, data_cache_dir):
  t0 = time.perf_counter()
  proc = run_train(str(tmp_path / "run"), data_cache_dir, **{"optimizer.lr": -1.0})
  assert proc.returncode == 1
  assert one_error_line(proc) == "error: optimizer config: lr=-1.0; expected > 0"
  assert not os.path.exists(tmp_path / "run")
  assert time.perf_counter() - t0 < 60


@pytest.mark.slow  # starts launch/sample.py
def test_sample_py_checks_its_flags_and_workdir_first(tmp_path):
  base = ["--config=configs/glm5_tiny.py", f"--workdir={tmp_path}/missing"]
  proc = run_script("launch/sample.py", *base, "--temperature=1e-31")
  assert proc.returncode == 1
  assert one_error_line(proc).startswith("error: --temperature=1e-31; must be 0 (greedy) or at least 1e-30")
  proc = run_script("launch/sample.py", *base, "--speculate=-1")
  assert proc.returncode == 1
  assert one_error_line(proc).startswith("error: --speculate=-1: the drafted tokens a round must be an integer >= 1")
  proc = run_script("launch/sample.py", *base)
  assert proc.returncode == 1
  assert one_error_line(proc) == (
    f"error: --workdir={tmp_path}/missing: no checkpoints directory ({tmp_path}/missing/checkpoints does not exist); "
    "give a run's directory: launch/train.py's --workdir or launch/convert.py's --out_dir"
  )
  assert not os.path.exists(tmp_path / "missing")


def test_the_traceback_is_one_variable_away(tmp_path):
  proc = run_script(
    "launch/train.py",
    "--config=configs/glm5_tiny.py",
    f"--workdir={tmp_path}/run",
    "--config.optimizer.lr=-1.0",
    env={**os.environ, "GLM_JAX_TRACEBACK": "1"},
  )
  assert proc.returncode == 1 and "Traceback" in proc.stderr and "lr=-1.0; expected > 0" in proc.stderr
