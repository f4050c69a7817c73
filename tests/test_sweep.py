"""The sweep runner (glm_jax/sweep.py, launch/sweep.py): the spec's grammar and its errors, every point checked
before the first run, and a real 2 x 2 sweep of launch/train.py runs that is killed midway and finished by a
rerun."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from glm_jax import sweep
from tests.helpers import ROOT
from tests.train import runs

CONFIG = "configs/glm5_tiny.py"


def test_spec_is_the_product_of_its_axes_in_order():
  axes = sweep.parse_spec("optimizer.lr=1e-3,3e-3; model.index_topk=16,32,64")
  assert axes == [sweep.Axis("optimizer.lr", ("1e-3", "3e-3")), sweep.Axis("model.index_topk", ("16", "32", "64"))]
  got = sweep.points(axes)
  assert got == [{"optimizer.lr": lr, "model.index_topk": k} for lr in ("1e-3", "3e-3") for k in ("16", "32", "64")]
  assert sweep.run_name(got[0]) == "optimizer.lr=1e-3,model.index_topk=16"
  assert sweep.run_name({"data.path": "/a/b c"}) == "data.path=_a_b_c"


def test_values_with_commas_go_in_brackets_or_quotes():
  (axis,) = sweep.parse_spec("config.model.x=(1, 2),[3,4],'a,b'")
  assert axis == sweep.Axis("model.x", ("(1, 2)", "[3,4]", "'a,b'"))


@pytest.mark.parametrize(
  "spec, message",
  [
    ("", "--sweep is empty"),
    ("optimizer.lr=1e-3;;model.index_topk=16", "axis 2 is empty"),
    ("optimizer.lr", "expected 'field=value1,value2,...'"),
    ("optimizer lr=1", "'optimizer lr' is not a dotted config field name"),
    ("optimizer.lr=1e-3,,3e-3", "value(s) [2] are empty"),
    ("optimizer.lr=1e-3,", "value(s) [2] are empty"),
    ("optimizer.lr=1e-3,1e-3", "value(s) ['1e-3'] appear more than once"),
    ("optimizer.lr=1;optimizer.lr=2", "the field 'optimizer.lr' is already an axis"),
    ("model.x=(1,2", "unclosed bracket or quote"),
    ("model.x=1),2", "unbalanced ')'"),
  ],
)
def test_a_malformed_spec_is_refused_by_name(spec, message):
  with pytest.raises(ValueError) as e:
    sweep.parse_spec(spec)
  assert message in str(e.value)


@pytest.mark.parametrize(
  "config, spec, shared, message",
  [
    (
      CONFIG,
      "optimizer.lr=1e-3;model.index_topk=16,32",
      ["--config.optimizer.nope=1"],
      "sweep point 'optimizer.lr=1e-3,model.index_topk=16':",
    ),
    (CONFIG, "optimizer.lrr=1e-3,3e-3", [], "sweep point 'optimizer.lrr=1e-3':"),
    (CONFIG, "model.index_topk=16,sixteen", [], "sweep point 'model.index_topk=sixteen':"),
    (CONFIG, "model.index_topk=16,0", [], "model.index_topk=0"),
    (CONFIG, "train.dsa_stage=dense,sparsest", [], "train.dsa_stage='sparsest' is invalid"),
    (
      CONFIG + ":huge",
      "train.seed=1,2",
      [],
      "configs/glm5_tiny.py has no variant 'huge'; its variants: ['long', 'smoke']",
    ),
    ("configs/grpo_tiny.py", "rl.group_size=8,1", [], "rl.group_size=1 is invalid"),
    (CONFIG, "train.seed=1", ["--config.train.steps"], "write each as --config.<section>.<field>=<value>"),
  ],
)
def test_every_point_is_checked_before_anything_runs(tmp_path, config, spec, shared, message):
  workdir = tmp_path / "sweep"
  with pytest.raises(ValueError) as e:
    sweep.run_sweep(
      config, str(workdir), sweep.parse_spec(spec), shared, command=lambda *a: pytest.fail("a run started")
    )
  assert message in str(e.value)
  assert not workdir.exists()


def test_values_mean_what_they_mean_to_launch_train(tmp_path):
  config = sweep.load_config(CONFIG + ":long", ["--config.optimizer.lr=3e-3", "--config.model.use_dsa=False"])
  assert config.optimizer.lr == 3e-3 and config.model.use_dsa is False
  assert config.data.seq_len == 2048  # the variant
  with pytest.raises(ValueError, match="lr"):
    sweep.load_config(CONFIG, ["--config.optimizer.lr=fast"])


def test_a_workdir_of_another_sweep_is_refused(tmp_path):
  workdir = tmp_path / "sweep"
  workdir.mkdir()
  (workdir / sweep.SWEEP_FILE).write_text(json.dumps({"config": "configs/grpo_tiny.py", "shared_overrides": []}))
  with pytest.raises(ValueError, match="holds a sweep of config 'configs/grpo_tiny.py'"):
    sweep.plan(CONFIG, str(workdir), sweep.parse_spec("train.seed=1,2"), [])


def test_a_failed_run_is_reported_and_retried(tmp_path):
  """A run that exits non-zero leaves no result; the others go on, and the rerun retries only it."""
  workdir = str(tmp_path / "sweep")
  axes = sweep.parse_spec("train.seed=1,2")

  def fake(config_arg, shared, run):  # a stand-in for launch/train.py that fails for seed 2 on its first attempt
    marker = os.path.join(run.workdir, "attempted")
    fail = run.overrides["train.seed"] == "2" and not os.path.exists(marker)
    code = f"open({marker!r}, 'w').close(); import sys; " + (
      "sys.stderr.write('error: disk full\\n'); sys.exit(1)"
      if fail
      else f"print('noise'); print('{{\"step\": 3, \"seed\": {run.overrides['train.seed']}}}')"
    )
    return [sys.executable, "-c", code]

  lines = []
  rows, failed = sweep.run_sweep(CONFIG, workdir, axes, command=fake, log=lines.append)
  assert failed == ["train.seed=2"]
  assert [r["result"] for r in rows] == [{"step": 3, "seed": 1}]
  assert any("train.seed=2: FAILED (exit code 1) error: disk full" in line for line in lines)
  lines.clear()
  rows, failed = sweep.run_sweep(CONFIG, workdir, axes, command=fake, log=lines.append)
  assert failed == [] and [r["result"]["seed"] for r in rows] == [1, 2]
  assert [r["overrides"] for r in rows] == [{"train.seed": "1"}, {"train.seed": "2"}]
  assert lines[0] == "[sweep] train.seed=1: finished earlier, skipped"
  with open(os.path.join(workdir, sweep.RESULTS_FILE)) as f:
    assert [json.loads(line) for line in f] == rows


@pytest.mark.slow
def test_a_killed_sweep_finishes_only_its_missing_runs(tmp_path, data_cache_dir):
  """A sweep of two 4-step launch/train.py runs over train.seed. It is killed (the whole process group, SIGKILL) once
  its first run has finished; the rerun skips that run and trains the other. Each row carries its override, and each
  run's metrics show it: the two seeds' losses differ. (The product of several axes and its order:
  test_spec_is_the_product_of_its_axes_in_order and test_a_failed_run_is_reported_and_retried, in-process; a field's
  value reaching its run: test_values_mean_what_they_mean_to_launch_train.)"""
  workdir = str(tmp_path / "sweep")
  shared = [*runs.flag_args(data_cache_dir, **{"train.steps": 4, "train.checkpoint_every": 4})]
  shared = [a for a in shared if not a.startswith("--config.train.seed")]
  args = [
    sys.executable,
    "launch/sweep.py",
    f"--config={CONFIG}",
    f"--workdir={workdir}",
    "--sweep=train.seed=1,2",
    *shared,
  ]
  proc = subprocess.Popen(
    args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
  )
  first = os.path.join(workdir, "train.seed=1", sweep.RESULT_FILE)
  deadline = time.time() + 400
  while not os.path.exists(first) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.5)
  assert os.path.exists(first), proc.communicate()[0] if proc.poll() is not None else "the first run did not finish"
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  with open(first) as f:
    first_result = f.read()
  done_before = [n for n in os.listdir(workdir) if os.path.exists(os.path.join(workdir, n, sweep.RESULT_FILE))]
  assert done_before == ["train.seed=1"], done_before  # the second run takes far longer than the kill

  again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  started = [line for line in again.stdout.splitlines() if line.endswith(")") and ": started (" in line]
  skipped = [line for line in again.stdout.splitlines() if "finished earlier, skipped" in line]
  assert len(started) == 1 and len(skipped) == 1, again.stdout
  with open(first) as f:
    assert f.read() == first_result  # the finished run was not redone

  with open(os.path.join(workdir, sweep.RESULTS_FILE)) as f:
    rows = [runs.strict_loads(line) for line in f]
  assert [r["overrides"] for r in rows] == [{"train.seed": "1"}, {"train.seed": "2"}]
  losses = []
  for row in rows:
    assert row["result"]["step"] == 4 and row["result"]["workdir"] == os.path.join(workdir, row["run"])
    logged = runs.train_rows(row["result"]["workdir"])
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    losses.append([r["loss"] for r in logged])
  assert losses[0] != losses[1]  # the seed reached each run


@pytest.mark.slow  # three launch/sweep.py processes; the in-process tests above check the same errors
@pytest.mark.parametrize(
  "args, code, message",
  [
    (
      ["--sweep=optimizer.lr=1e-3,,3e-3"],
      2,
      "error: --sweep axis 1 ('optimizer.lr=1e-3,,3e-3'): value(s) [2] are empty",
    ),
    (["--sweep=optimizer.lrr=1e-3"], 1, "error: sweep point 'optimizer.lrr=1e-3':"),
    (["--sweep=train.seed=1", "--config.train.stepz=3"], 2, "error: --config.train.stepz=3: the config has no field"),
  ],
)
def test_the_command_line_fails_in_one_line_and_creates_nothing(tmp_path, args, code, message):
  done = runs.run_script("launch/sweep.py", f"--config={CONFIG}", f"--workdir={tmp_path}/sweep", *args)
  assert done.returncode == code, done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr
  assert not os.path.exists(tmp_path / "sweep")
