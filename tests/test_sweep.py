"""The sweep runner (glm_jax/sweep.py, launch/sweep.py): the spec's grammar and its errors, every point checked
before the first run, an axis the runs ignore refused by name (and the table of such fields checked against the
compiled programs), each finished run's final metrics, and a real sweep of launch/train.py runs that is killed
midway and finished by a rerun."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
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


def test_an_axis_the_runs_ignore_is_refused_by_name(tmp_path):
  """model.index_topk in the default (dense) DSA stage: one line naming the field, its values, the stage, what makes
  it matter and the flag that sweeps it anyway; nothing is written. The flag turns it into a warning."""
  workdir = tmp_path / "sweep"
  axes = sweep.parse_spec("optimizer.lr=1e-3,3e-3;model.index_topk=16,32")
  with pytest.raises(ValueError) as e:
    sweep.run_sweep(CONFIG, str(workdir), axes, command=lambda *a: pytest.fail("a run started"))
  assert str(e.value) == (
    "--sweep axis model.index_topk=16,32 changes nothing with train.dsa_stage='dense' (dense attention; the DSA "
    "indexer neither runs nor trains): every value would train the same run; it matters with "
    "--config.train.dsa_stage=sparse (from a warm-up run's checkpoint: experiments/dsa_quality.py); pass "
    "--allow_unused_axes to sweep anyway"
  )
  assert not workdir.exists()
  lines = []
  runs_planned = sweep.plan(CONFIG, str(workdir), axes, [], allow_unused_axes=True, log=lines.append)
  assert len(runs_planned) == 4 and len(lines) == 1
  assert lines[0].startswith("[sweep] warning: --sweep axis model.index_topk=16,32 changes nothing with")
  # in the sparse stage the same axis is a real one
  assert len(sweep.plan(CONFIG, str(workdir), axes, ["--config.train.dsa_stage=sparse"], log=pytest.fail)) == 4


@pytest.mark.parametrize(
  "config, spec, shared, message",
  [
    (CONFIG, "train.mtp_loss_weight=0.1,0.3", ["--config.train.dsa_stage=warmup"], "train.dsa_stage='warmup'"),
    (CONFIG, "train.indexer_loss_weight=0.5,1", ["--config.train.dsa_stage=warmup"], "--config.train.dsa_stage=sparse"),
    ("configs/grpo_tiny.py", "rl.tau=1,2", [], "rl.async_rollouts=False"),
    ("configs/grpo_tiny.py", "rl.tis_cap=1.5,3", [], "it matters with --config.rl.is_correction=truncated"),
    ("configs/distill_tiny.py", "rl.max_pending=1,4", [], "config.trainer='distill'"),
  ],
)
def test_the_unused_fields_of_each_trainer_and_stage(tmp_path, config, spec, shared, message):
  with pytest.raises(ValueError, match="changes nothing") as e:
    sweep.plan(config, str(tmp_path / "sweep"), sweep.parse_spec(spec), shared)
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
  "config, spec, shared",
  [
    ("configs/grpo_tiny.py", "rl.tau=1,2", ["--config.rl.async_rollouts=True"]),
    ("configs/grpo_tiny.py", "rl.tis_cap=1.5,3", ["--config.rl.is_correction=truncated"]),
    (CONFIG, "train.mtp_loss_weight=0.1,0.3", []),
  ],
)
def test_the_same_fields_where_they_matter_are_swept(tmp_path, config, spec, shared):
  assert len(sweep.plan(config, str(tmp_path / "sweep"), sweep.parse_spec(spec), shared, log=pytest.fail)) == 2


def test_an_axis_some_points_ignore_is_a_warning_naming_them(tmp_path):
  lines = []
  axes = sweep.parse_spec("train.dsa_stage=dense,sparse;model.index_topk=16,32")
  assert len(sweep.plan(CONFIG, str(tmp_path / "sweep"), axes, [], log=lines.append)) == 4
  assert lines == [
    "[sweep] warning: --sweep axis model.index_topk changes nothing with train.dsa_stage='dense' (dense attention; "
    "the DSA indexer neither runs nor trains), so the points train.dsa_stage=dense,model.index_topk=16, "
    "train.dsa_stage=dense,model.index_topk=32 repeat each other"
  ]


def test_final_metrics_are_the_runs_headline_numbers():
  summary = {"step": 600, "eval_loss": 3.02441, "unigram_entropy": 5.179, "train_loss": 2.98, "params": 262144}
  assert sweep.final_metrics(summary) == "eval_loss 3.024, train_loss 2.98"
  grpo = {"trainer": "grpo", "step": 200, "start_eval_accuracy": 0.1, "eval_accuracy": 0.84375, "reward_mean": 0.5}
  assert sweep.final_metrics(grpo) == "eval_accuracy 0.8438, reward_mean 0.5"
  assert sweep.final_metrics({"step": 3, "seed": 1, "ok": True, "workdir": "/x"}) == "seed 1"  # none of the above
  assert sweep.final_metrics({"step": 3, "eval_loss": None}) == ""


# The table of unused fields, checked against what the trainer compiles: for each pretraining row of sweep.UNUSED,
# each field at two values gives the same programs (the train state's initialization, the train step, the eval step)
# in the row's stage, and different ones (or a refused config) in the stage of MATTERS. glm5_tiny at 2 x 16 tokens,
# DSA selecting 4 keys; every program is traced, not compiled. Two programs are the same when their traces are: the
# jaxpr (its equations, their parameters and literals), its constants' values and which arguments are donated; the
# jit around it is the same code for both values, and lowering a trace is deterministic, so the same trace lowers to
# the same StableHLO, and compiles to the same program. A difference found in the traces is confirmed in the StableHLO
# it lowers to (a trace that differs only in what it prints would not lower differently).
TWO_VALUES = {
  "model.index_topk": (4, 8),
  "model.use_dsa": (True, False),
  "model.indexer_types": (None, "FSF"),
  "model.indexer_rope_interleave": (True, False),
  "model.index_norm_eps": (1e-6, 1e-3),
  "train.indexer_loss_weight": (1.0, 0.5),
  "train.mtp_loss_weight": (0.3, 0.1),
  "train.balance_loss_weight": (1e-4, 1e-2),
  "train.expert_bias_rate": (1e-3, 1e-2),
}
MATTERS = {  # a stage where the field changes the programs
  "model.index_topk": "sparse",
  "model.use_dsa": "sparse",  # (False is refused there)
  "model.indexer_types": "sparse",
  "model.indexer_rope_interleave": "warmup",
  "model.index_norm_eps": "warmup",
  "train.indexer_loss_weight": "sparse",
  "train.mtp_loss_weight": "dense",
  "train.balance_loss_weight": "dense",
  "train.expert_bias_rate": "dense",
}
PROGRAMS = ("eval", "init", "train")  # the cheapest first: a difference is looked for in that order


def pretrain_program(stage: str, field: str, value, program: str):
  """The trace (jax.stages.Traced) of one program that glm_jax/train/trainer.py builds for glm5_tiny at
  (stage, field=value) and its fingerprint: "init" (the state's initialization), "train" (the train step) or
  "eval" (the eval step)."""
  from glm_jax.configs import glm5_tiny
  from glm_jax.train import step as step_lib, trainer

  config = glm5_tiny.get_config()
  config.data.seq_len, config.data.batch_size, config.model.index_topk = 16, 2, 4
  config.train.dsa_stage = stage
  section, name = field.split(".")
  config[section][name] = value
  model_cfg = trainer.check_config(config)
  text = config.to_json_best_effort(sort_keys=True)
  key = (text, program)
  if key not in _TRACED:  # many (stage, field, value) are one config: a field at its default in the same stage
    if text not in _TARGETS:  # the state's shapes, which the three programs of a config share
      _TARGETS[text] = trainer.abstract_train_state(config, model_cfg)
    target = _TARGETS[text]
    batch = {k: jax.ShapeDtypeStruct((2, 16), jnp.int32) for k in ("input_ids", "segment_ids", "positions")}
    if program == "init":
      traced = jax.jit(target.make_state).trace()
    elif program == "train":
      train_step = step_lib.make_train_step(target.graphdef, target.optimizer, target.schedule, config.train)
      traced = train_step.trace(target.state, batch)
    else:
      eval_step = step_lib.make_eval_step(target.graphdef, {}, loss_chunk=config.train.loss_chunk)
      traced = eval_step.trace(target.state.params, target.state.rest, batch)
    _TRACED[key] = traced, fingerprint(traced)
  return _TRACED[key]


# Once a module: (a config as JSON, program) -> its trace and fingerprint; a config as JSON -> its abstract state.
_TRACED: dict[tuple[str, str], tuple[jax.stages.Traced, tuple]] = {}
_TARGETS: dict[str, object] = {}


@pytest.fixture(autouse=True, scope="module")
def drop_traces():
  """The traces go when the module ends, with its compiled programs (tests/conftest.py: release_compiled_programs)."""
  yield
  _TRACED.clear()
  _TARGETS.clear()


def fingerprint(traced) -> tuple:
  """What a trace lowers from: the jaxpr's text, its constants' values and the donated arguments."""
  consts = [(c.dtype.str, c.shape, c.tobytes()) for c in map(np.asarray, traced.jaxpr.consts)]
  donated = [a.donated for a in jax.tree.leaves(traced.args_info, is_leaf=lambda x: hasattr(x, "donated"))]
  return str(traced.jaxpr), consts, donated


def pretrain_rows():
  """(stage, field) of every pretraining row of sweep.UNUSED."""
  from glm_jax.configs import glm5_tiny
  from glm_jax.train.step import STAGES

  out = []
  for row in sweep.UNUSED:
    if "pretrain" in row.trainers:
      config = glm5_tiny.get_config()
      for stage in STAGES:
        config.train.dsa_stage = stage
        if row.when(config):
          out += [(stage, field) for field in row.fields]
  return out


def assert_unused_then_used(stage, field):
  """The programs are the same for both values in `stage`, and differ (or a value is refused) in MATTERS[field]."""
  a, b = TWO_VALUES[field]
  for program in PROGRAMS:
    same = pretrain_program(stage, field, a, program)[1] == pretrain_program(stage, field, b, program)[1]
    assert same, (stage, field, program)
  try:
    for program in PROGRAMS:  # the first program whose traces differ, then its StableHLO
      (x, x_print), (y, y_print) = (pretrain_program(MATTERS[field], field, v, program) for v in (a, b))
      if x_print != y_print:
        assert x.lower().as_text() != y.lower().as_text(), (field, program)
        break
    else:
      pytest.fail(f"{field}: the same programs in train.dsa_stage={MATTERS[field]!r}")
  except ValueError as e:  # a value the stage refuses: it matters there too
    assert field in str(e), e


@pytest.mark.slow  # 12 (stage, field) pairs, 4 x 3 programs each (the same config's traced once)
@pytest.mark.parametrize("stage, field", pretrain_rows())
def test_each_unused_pretraining_field_compiles_the_same_programs(stage, field):
  assert_unused_then_used(stage, field)


@pytest.mark.slow  # six GRPO steps traced, two lowered
def test_tis_cap_changes_the_grpo_step_only_under_truncated_is():
  """rl.tis_cap's rows: the GRPO step's program for tis_cap 1.5 and 3 is the same under IcePop and under the
  asynchronous objective (the same trace: fingerprint above), and differs under truncated IS."""
  import ml_collections
  import optax
  from flax import nnx

  import glm_jax.configs.grpo_tiny
  from glm_jax.model import GlmMoeDsa, ModelConfig
  from glm_jax.rl import step as rl_step
  from glm_jax.train.step import new_train_state

  model = glm_jax.configs.grpo_tiny.get_config().model.to_dict()
  model.update(num_hidden_layers=2)
  abstract = nnx.eval_shape(lambda: GlmMoeDsa(ModelConfig.from_dict(model), nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  optimizer = optax.sgd(0.1)
  state = jax.eval_shape(lambda: new_train_state(params, rest, optimizer))
  n, s = 4, 8
  batch = dict(
    tokens=jax.ShapeDtypeStruct((n, s), jnp.int32),
    response_mask=jax.ShapeDtypeStruct((n, s), jnp.bool_),
    rollout_logp=jax.ShapeDtypeStruct((n, s), jnp.float32),
    advantages=jax.ShapeDtypeStruct((n,), jnp.float32),
  )

  def program(**changes):
    config = glm_jax.configs.grpo_tiny.get_config()
    config.rl.update(changes)
    field_used = sweep.unused_in(config, "rl.tis_cap") is None
    rl_cfg = ml_collections.FrozenConfigDict(config.rl)
    step = rl_step.make_grpo_step(graphdef, optimizer, lambda step: 0.1, rl_cfg)
    return field_used, step.trace(state, batch)

  for setting in (dict(is_correction="icepop"), dict(objective="async", async_rollouts=True)):
    (used_a, a), (used_b, b) = program(tis_cap=1.5, **setting), program(tis_cap=3.0, **setting)
    assert fingerprint(a) == fingerprint(b) and not used_a and not used_b, setting
  (used_a, a), (used_b, b) = (
    program(tis_cap=1.5, is_correction="truncated"),
    program(tis_cap=3.0, is_correction="truncated"),
  )
  assert fingerprint(a) != fingerprint(b) and a.lower().as_text() != b.lower().as_text() and used_a and used_b


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
      else f"print('noise'); print('{{\"step\": 3, \"seed\": {run.overrides['train.seed']}, \"eval_loss\": 3.14159}}')"
    )
    return [sys.executable, "-c", code]

  lines = []
  rows, failed = sweep.run_sweep(CONFIG, workdir, axes, command=fake, log=lines.append)
  assert failed == ["train.seed=2"]
  assert [r["result"] for r in rows] == [{"step": 3, "seed": 1, "eval_loss": 3.14159}]
  assert any("train.seed=2: FAILED (exit code 1) error: disk full" in line for line in lines)
  (done,) = [line for line in lines if "done in" in line]
  assert re.fullmatch(r"\[sweep\] train\.seed=1: done in \d+ s: eval_loss 3\.142", done), done
  lines.clear()
  rows, failed = sweep.run_sweep(CONFIG, workdir, axes, command=fake, log=lines.append)
  assert failed == [] and [r["result"]["seed"] for r in rows] == [1, 2]
  assert [r["overrides"] for r in rows] == [{"train.seed": "1"}, {"train.seed": "2"}]
  assert lines[0] == "[sweep] train.seed=1: finished earlier, skipped"
  with open(os.path.join(workdir, sweep.RESULTS_FILE)) as f:
    assert [json.loads(line) for line in f] == rows


@pytest.mark.slow
def test_a_killed_sweep_finishes_only_its_missing_runs(tmp_path, data_cache_dir):
  """A sweep of two 2-step launch/train.py runs over data.shuffle_seed. It is killed (the whole process group,
  SIGKILL) once its first run has finished; the rerun skips that run and trains the other. Each row carries its
  override, and each run's metrics show it: the two data orders' losses differ. (An axis the compiled programs do
  not depend on: the two runs share their programs, with each other and with the session's other glm5_tiny runs of
  these shapes. The product of several axes and its order: test_spec_is_the_product_of_its_axes_in_order and
  test_a_failed_run_is_reported_and_retried, in-process; a field's value reaching its run:
  test_values_mean_what_they_mean_to_launch_train.)"""
  workdir = str(tmp_path / "sweep")
  shared = [*runs.flag_args(data_cache_dir, **{"train.steps": 2, "train.checkpoint_every": 2})]
  args = ["launch/sweep.py", f"--config={CONFIG}", f"--workdir={workdir}", "--sweep=data.shuffle_seed=1,2", *shared]
  proc = subprocess.Popen(
    [sys.executable, *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  first = os.path.join(workdir, "data.shuffle_seed=1", sweep.RESULT_FILE)
  deadline = time.time() + 400
  while not os.path.exists(first) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert os.path.exists(first), proc.communicate()[0] if proc.poll() is not None else "the first run did not finish"
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  with open(first) as f:
    first_result = f.read()
  done_before = [n for n in os.listdir(workdir) if os.path.exists(os.path.join(workdir, n, sweep.RESULT_FILE))]
  assert done_before == ["data.shuffle_seed=1"], done_before  # the second run takes far longer than the kill

  again = runs.run_script(*args)
  assert again.returncode == 0, again.stderr[-3000:]
  started = [line for line in again.stdout.splitlines() if line.endswith(")") and ": started (" in line]
  skipped = [line for line in again.stdout.splitlines() if "finished earlier, skipped" in line]
  assert len(started) == 1 and len(skipped) == 1, again.stdout
  with open(first) as f:
    assert f.read() == first_result  # the finished run was not redone

  with open(os.path.join(workdir, sweep.RESULTS_FILE)) as f:
    rows = [runs.strict_loads(line) for line in f]
  assert [r["overrides"] for r in rows] == [{"data.shuffle_seed": "1"}, {"data.shuffle_seed": "2"}]
  losses = []
  for row in rows:
    assert row["result"]["step"] == 2 and row["result"]["workdir"] == os.path.join(workdir, row["run"])
    logged = runs.train_rows(row["result"]["workdir"])
    assert [r["step"] for r in logged] == [1, 2]
    losses.append([r["loss"] for r in logged])
  assert losses[0] != losses[1]  # the data order reached each run


@pytest.mark.slow  # four launch/sweep.py processes; the in-process tests above check the same errors
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
    (
      ["--sweep=model.index_topk=16,32"],
      1,
      "error: --sweep axis model.index_topk=16,32 changes nothing with train.dsa_stage='dense'",
    ),
  ],
)
def test_the_command_line_fails_in_one_line_and_creates_nothing(tmp_path, args, code, message):
  done = runs.run_script("launch/sweep.py", f"--config={CONFIG}", f"--workdir={tmp_path}/sweep", *args)
  assert done.returncode == code, done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr
  assert not os.path.exists(tmp_path / "sweep")
