"""The training loop end to end: launch/train.py, exact resume, a kill during an async save, bad input."""

import json
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.configs import common
from glm_jax import data as data_lib
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.progress import TIMING_KEYS
from glm_jax.train import trainer as trainer_lib
from glm_jax.train.trainer import create_train_state, train_and_evaluate
from tests.helpers import DEFAULT_COMPILE, ROOT
from tests.train.runs import OVERRIDES, make_config, metric_rows, run_train, snapshot, train_rows

# training runs end to end, several of them in subprocesses


@pytest.fixture
def straight_run(glm5_tiny_run):
  """9 uninterrupted steps through launch/train.py, as a user runs it: the session's shared run (read only)."""
  return glm5_tiny_run


@pytest.mark.slow
def test_train_py_end_to_end(straight_run, data_cache_dir):
  workdir, summary = straight_run
  rows = train_rows(workdir)
  assert [r["step"] for r in rows] == list(range(1, 10))
  assert all(r["skipped"] == 0 and np.isfinite(r["loss"]) for r in rows)
  assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
  assert summary["step"] == 9
  # The last step is always checkpointed, whatever checkpoint_every says.
  with Checkpointer(workdir, read_only=True) as ckpt:
    assert ckpt.latest_step() == 9
  # The reported held-out loss equals a numpy cross-entropy of the checkpointed model on the held-out
  # batches: targets are the next token within the same (non-padding) document.
  config = make_config(data_cache_dir)
  model_cfg = model_config_for_stage(config)
  graphdef, state, _, _ = create_train_state(config, model_cfg)
  with Checkpointer(workdir, read_only=True) as ckpt:
    state = ckpt.restore(9, state)
  from flax import nnx

  model = nnx.merge(graphdef, state.params, state.rest)
  tok = data_lib.load_tokenizer(config.data)
  total, count = 0.0, 0
  for batch in data_lib.make_eval_batches(config.data, tok):
    logits = np.asarray(
      model(
        jnp.asarray(batch["input_ids"]),
        positions=jnp.asarray(batch["positions"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
      ).logits,
      np.float64,
    )
    ids, seg = batch["input_ids"], batch["segment_ids"]
    logp = (
      logits
      - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
      - logits.max(-1, keepdims=True)
    )
    for b in range(ids.shape[0]):
      for t in range(ids.shape[1] - 1):
        if seg[b, t] != 0 and seg[b, t + 1] == seg[b, t]:
          total -= logp[b, t, ids[b, t + 1]]
          count += 1
  assert summary["eval_loss"] == pytest.approx(total / count, rel=1e-5)
  assert summary["unigram_entropy"] == pytest.approx(data_lib.unigram_entropy(config.data, tok))


@pytest.mark.slow
def test_a_run_outside_a_terminal_prints_a_progress_line_a_logged_step(straight_run):
  """stdout is a pipe here: a line each log_every (1) steps with the step's losses as logged, tokens/s of the steps
  alone and an ETA, the compilation announced, the JSON line last; the summary's rates from the logged ones."""
  workdir, summary = straight_run
  proc_lines = open(os.path.join(workdir, "stdout.txt")).read().splitlines()
  rows = train_rows(workdir)
  assert proc_lines[0] == "[glm5_tiny] compiling the train step (the first step waits for it)"
  assert re.fullmatch(r"\[glm5_tiny\] step 1 took [\d.]+ s \(compilation included\)", proc_lines[1])
  lines = [line for line in proc_lines if re.match(r"\[glm5_tiny\] step \d+/9 ", line)]
  assert len(lines) == 9 and json.loads(proc_lines[-1]) == summary
  for row, line in zip(rows, lines):
    head = f"[glm5_tiny] step {row['step']}/9  |  loss {row['loss']:.4g}  lm_loss {row['lm_loss']:.4g}"
    assert line.startswith(head), (line, head)
    if row["step"] > 1:  # the first step (compilation) has no rate; every later one was logged alone
      shown = re.search(r"\|  ([\d.]+)(k?) tok/s", line)
      assert float(shown.group(1)) * (1e3 if shown.group(2) else 1) == pytest.approx(row["tokens_per_s"], rel=5e-3)
      assert row["tokens_per_s"] == pytest.approx(4 * 64 / row["step_s"], rel=1e-9)
    assert ("ETA" in line) == (1 < row["step"] < 9)
  assert summary["train_lm_loss"] == rows[-1]["lm_loss"] and summary["train_loss"] == rows[-1]["loss"]
  # 8 steps after the first, 4 x 64 tokens each, in the steps' own time (the sum of the logged windows)
  assert summary["steps_s"] == pytest.approx(sum(r["step_s"] for r in rows[1:]), rel=1e-6)
  assert summary["tokens_per_s"] == pytest.approx(8 * 4 * 64 / summary["steps_s"], rel=1e-9)
  assert summary["wall_s"] > summary["first_step_s"] + summary["steps_s"] and summary["mfu"] is None


@pytest.mark.slow
def test_resume_is_bitwise(straight_run, data_cache_dir, tmp_path):
  """Steps 1-4, stop, then resume to 9 in a new call: the logged losses equal the straight run's bit for bit."""
  workdir, _ = straight_run
  train_and_evaluate(make_config(data_cache_dir, **{"train.steps": 4}), str(tmp_path))
  train_and_evaluate(make_config(data_cache_dir), str(tmp_path))
  straight, resumed = train_rows(workdir), train_rows(str(tmp_path))
  assert [r["step"] for r in resumed] == list(range(1, 10))
  for a, b in zip(straight, resumed):
    assert (a["loss"], a["grad_norm"], a["lm_loss"]) == (b["loss"], b["grad_norm"], b["lm_loss"]), a["step"]


@pytest.mark.slow  # two initializations of glm5_tiny's state compiled
def test_a_restored_state_is_laid_out_as_a_fresh_one(tmp_path, data_cache_dir):
  """A resumed run's state reaches the step with the fresh state's layout (each array on the same device, committed
  to it), so the step program a resumed run compiles is the fresh run's, which jax's persistent compilation cache
  then serves (before, a restart after preemption recompiled the whole step)."""
  config = make_config(data_cache_dir)
  target = trainer_lib.abstract_train_state(config, model_config_for_stage(config))
  fresh = target.fresh()
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(1, fresh, None, {}, force=True)
  with Checkpointer(str(tmp_path), read_only=True) as ckpt:
    restored = ckpt.restore(1, target.state)

  def program(state):  # the shardings of the step's arguments are in the lowered text of any jit that takes them
    return jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s)).lower(state).as_text()

  assert program(restored) == program(fresh)


@pytest.mark.slow  # two compiles of the initialization
def test_the_initial_state_is_the_default_compilers_to_a_few_ulps(data_cache_dir):
  """The trainer compiles the initialization at LLVM O1 on CPU (trainer.INIT_CPU_COMPILER_OPTIONS): the state is
  the one the default compilation makes, its integers and almost all its floats bit for bit, no float more than
  4 float32 ulps off (docs/training.md, "Compile times", has the count). The reference asks for XLA:CPU's default
  compilation itself: the suite compiles faster (tests/conftest.py)."""
  config = make_config(data_cache_dir)
  target = trainer_lib.abstract_train_state(config, model_config_for_stage(config))
  want = jax.jit(target.make_state, compiler_options=DEFAULT_COMPILE)()
  got = target.fresh()
  differing = total = 0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    total += a.size
    if a.dtype != np.float32:
      np.testing.assert_array_equal(a, b)
      continue
    ulps = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))  # same sign: adjacent floats are 1 apart
    assert np.all(np.sign(a) == np.sign(b)) and ulps.max() <= 4, ulps.max()
    differing += int(np.count_nonzero(ulps))
  assert differing <= total // 1000, (differing, total)


# A training process that SIGKILLs itself from a step hook (train_and_evaluate's public `hooks`) right after the
# asynchronous save of step argv[3] has started, while Orbax is still writing it.
KILL_DURING_SAVE = """
import json, os, signal, sys
from glm_jax.configs import glm5_tiny
from glm_jax.train.trainer import train_and_evaluate
config = glm5_tiny.get_config()
for key, value in json.loads(sys.argv[2]).items():
  section, field = key.split(".")
  config[section][field] = value
def kill_at(step, state, metrics):
  if step == int(sys.argv[3]):
    os.kill(os.getpid(), signal.SIGKILL)
train_and_evaluate(config, sys.argv[1], hooks=[kill_at])
"""


@pytest.mark.slow
def test_kill_during_async_save_resumes_from_last_complete_checkpoint(straight_run, data_cache_dir, tmp_path):
  """A training process SIGKILLed while the step-6 checkpoint is being written; the rerun (here in this process,
  the same train_and_evaluate) resumes from step 3 and logs the uninterrupted run's losses."""
  workdir = str(tmp_path)
  overrides = json.dumps({**OVERRIDES, "data.cache_dir": data_cache_dir})
  proc = subprocess.run(
    [sys.executable, "-c", KILL_DURING_SAVE, workdir, overrides, "6"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  ckpt_dir = os.path.join(workdir, "checkpoints")
  # Step 6 was being written when the process died: it is not a complete checkpoint.
  with Checkpointer(workdir, read_only=True) as ckpt:
    assert ckpt.latest_step() == 3, os.listdir(ckpt_dir)
  assert train_and_evaluate(make_config(data_cache_dir), workdir)["step"] == 9

  # Steps 4-6 ran twice: before the kill and after the resume from step 3. metrics.jsonl holds each step once,
  # as the uninterrupted run wrote it (but its speed); the first run's rows of steps 4-6 were moved aside, and
  # they too equal the uninterrupted run's.
  def same(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]

  straight = train_rows(straight_run[0])
  assert same(train_rows(workdir)) == same(straight)
  assert same(metric_rows(workdir, "metrics.dropped.jsonl")) == same(straight[3:6])


# --- bad input: stopped before any work, with the field and value named, checkpoints untouched ---


@pytest.mark.slow
def test_incompatible_checkpoint_is_refused(straight_run, data_cache_dir):
  workdir, _ = straight_run
  before = snapshot(os.path.join(workdir, "checkpoints"))
  with pytest.raises(ValueError, match=r"model\.hidden_size: checkpoint 64, config 96"):
    train_and_evaluate(make_config(data_cache_dir, **{"model.hidden_size": 96, "train.steps": 12}), workdir)
  assert snapshot(os.path.join(workdir, "checkpoints")) == before


def test_unknown_flag_override_is_refused(tmp_path, data_cache_dir):
  proc = run_train(str(tmp_path), data_cache_dir, **{"train.no_such_field": 1})
  assert proc.returncode != 0
  assert "no_such_field" in proc.stderr
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"data.source": "text", "data.path": "/no/such/corpus.txt"}, r"data\.path='/no/such/corpus\.txt'"),
    ({"data.bpe_vocab_size": 1024}, r"1024.*512|512.*1024"),
    ({"train.steps": 0}, r"train\.steps=0"),
    ({"train.dsa_stage": "sparse", "data.seq_len": 32}, r"data\.seq_len=32 <= model\.index_topk=32"),
    ({"train.dsa_stage": "sideways"}, r"train\.dsa_stage='sideways'"),
    ({"optimizer.lr": -1.0}, r"lr=-1\.0; expected > 0"),
    ({"data.batch_size": 3, "train.microbatches": 2}, r"microbatches=2"),
  ],
)
def test_bad_input_stops_before_work(tmp_path, data_cache_dir, changes, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    train_and_evaluate(make_config(data_cache_dir, **changes), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")  # nothing was created


@pytest.mark.parametrize(
  "change, message",
  [
    (
      lambda c: c.data.update(format="sft"),
      r"data\.format='sft' is invalid; config\.trainer='pretrain' trains on 'lm'",
    ),
    (
      lambda c: setattr(c, "trainer", "sft"),
      r"data\.format='lm' is invalid; config\.trainer='sft' trains on 'sft' or 'chat'",
    ),
    (
      lambda c: setattr(c, "quant", common.quant(scheme="w8a8")),
      r"quant\.scheme='w8a8' is invalid; quantization-aware "
      r"training takes \['int4', 'int4_row'\]",
    ),
    (
      lambda c: setattr(c, "quant", common.quant(scheme="int4", group_size=48)),
      r"quant\.group_size=48 does not divide moe_layers/mlp/down_proj's input of 32",
    ),
    (lambda c: setattr(c, "quant", common.quant(scheme="int4", scope="re:no_such_weight")), r"matches no parameter"),
  ],
)
def test_bad_sft_and_quant_sections_stop_before_work(tmp_path, data_cache_dir, change, message):
  config = make_config(data_cache_dir)
  change(config)
  with pytest.raises(ValueError, match=message):
    train_and_evaluate(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_init_from_starts_the_warmup_stage_from_a_dense_run(straight_run, data_cache_dir, tmp_path, monkeypatch):
  """Dense -> warm-up, as GLM-5 trains DSA: the warm-up run starts from the dense run's weights and changes
  only the indexer, so its held-out loss (dense attention) is exactly the dense run's. No random initialization is
  made on the way (the weights are read into an abstract state)."""
  workdir, summary = straight_run
  config = make_config(data_cache_dir, **{"train.dsa_stage": "warmup", "train.steps": 3, "train.init_from": workdir})

  def no_random_init(self):
    raise AssertionError("a random train state was created for a run that starts from train.init_from")

  with monkeypatch.context() as m:
    m.setattr(trainer_lib.AbstractTrainState, "fresh", no_random_init)
    warm = train_and_evaluate(config, str(tmp_path))
  assert warm["eval_loss"] == summary["eval_loss"]
  model_cfg = model_config_for_stage(config)
  _, state, _, _ = create_train_state(config, model_cfg)
  with Checkpointer(workdir, read_only=True) as ckpt:
    source = ckpt.restore_weights(9, state.params, state.rest)[0]
  with Checkpointer(str(tmp_path), read_only=True) as ckpt:
    trained = ckpt.restore_weights(3, state.params, state.rest)[0]
  from flax import nnx

  changed = {
    p: not np.array_equal(a[...], b[...])
    for (p, a), (_, b) in zip(nnx.to_flat_state(source), nnx.to_flat_state(trained))
  }
  assert not any(c for p, c in changed.items() if "indexer" not in p)
  assert any(c for p, c in changed.items() if "indexer" in p)


@pytest.mark.slow
def test_init_from_an_incompatible_run_is_refused(straight_run, data_cache_dir, tmp_path):
  workdir, _ = straight_run
  config = make_config(data_cache_dir, **{"train.init_from": workdir, "model.hidden_size": 96})
  with pytest.raises(ValueError, match=r"model\.hidden_size: checkpoint 64, config 96"):
    train_and_evaluate(config, str(tmp_path))
  with pytest.raises(FileNotFoundError, match="no checkpoints directory"):
    train_and_evaluate(make_config(data_cache_dir, **{"train.init_from": str(tmp_path / "nothing")}), str(tmp_path))
