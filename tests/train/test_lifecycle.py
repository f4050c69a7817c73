"""How runs end and restart (glm_jax/train/lifecycle.py, the checkpointer's failed saves): a rerun of a finished run,
SIGTERM and SIGINT mid-run, a second run on a locked workdir, a stale lock, a checkpoint write into a full
filesystem, SFT data that leaves nothing to train on. Each asserts the exit code or exception, the one line, and
that nothing was lost: a stopped or failed run resumes to the uninterrupted run's rows, bit for bit."""

import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from glm_jax.configs import sft_tiny

from glm_jax import data as data_lib, paths
from glm_jax.train import lifecycle
from glm_jax.train.checkpoint import Checkpointer, CheckpointWriteError
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.progress import TIMING_KEYS
from glm_jax.train.trainer import abstract_train_state, train_and_evaluate
from tests.shared_runs import copy_run
from tests.train.runs import (
  KEEP_ALL,
  make_config,
  run_script,
  run_train,
  snapshot,
  stopped_after,
  strict_loads,
  train_rows,
)

KEEP = KEEP_ALL  # every checkpoint of a 9-step run (1, 3, 6, 9) stays


@pytest.fixture
def straight(glm5_tiny_run):
  """9 uninterrupted steps (checkpoints at 1, 3, 6 and 9), the session's shared run (read only): the rows every
  stopped and resumed run must reproduce."""
  return glm5_tiny_run


def without_speed(rows):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def last_line(proc):
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc.stderr.strip().splitlines()[-1]


def lock_path(workdir):
  return os.path.join(workdir, lifecycle.LOCK_NAME)


# A rerun of a finished run


@pytest.mark.slow
def test_a_rerun_of_a_finished_run_prints_its_line_and_exits_0(straight, data_cache_dir, tmp_path):
  workdir = str(tmp_path / "run")
  copy_run(straight[0], workdir)
  before = snapshot(workdir)
  proc = run_train(workdir, data_cache_dir, **KEEP)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = strict_loads(proc.stdout.strip().splitlines()[-1])
  # The run's own figures: its last logged loss, the held-out loss of its final weights.
  assert summary["step"] == 9
  assert summary["train_loss"] == train_rows(straight[0])[-1]["loss"]
  assert summary["eval_loss"] == straight[1]["eval_loss"]
  assert f"{workdir} is complete at step 9 (train.steps=9): nothing to train" in proc.stderr
  assert snapshot(workdir) == before  # nothing written, no lock left behind


@pytest.mark.slow
def test_a_rerun_with_more_steps_goes_on(straight, data_cache_dir, tmp_path):
  workdir = str(tmp_path / "run")
  copy_run(straight[0], workdir)
  summary = train_and_evaluate(make_config(data_cache_dir, **KEEP, **{"train.steps": 11}), workdir)
  assert summary["step"] == 11
  rows = train_rows(workdir)
  assert [r["step"] for r in rows] == list(range(1, 12))
  assert without_speed(rows[:9]) == without_speed(train_rows(straight[0]))


# SIGTERM (a preemption) and SIGINT (Ctrl-C)


def start_train(workdir, data_cache_dir, **changes):
  """run_train in a thread, so the test can signal the run while it trains: (thread, a list that receives its
  CompletedProcess)."""
  done = []
  thread = threading.Thread(target=lambda: done.append(run_train(workdir, data_cache_dir, **changes)), daemon=True)
  thread.start()
  return thread, done


def wait_for_lock(thread, workdir, timeout=300):
  """The pid of the run that holds workdir's lock (its signal handlers are set by then), once it does: a fresh
  workdir, so the holder is the run `thread` started."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert thread.is_alive(), "the run ended before it took the lock"
    try:
      with open(lock_path(workdir)) as f:
        return json.load(f)["pid"]
    except (OSError, ValueError, KeyError):
      pass
    time.sleep(0.02)
  raise TimeoutError(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_next_step_and_the_resumed_run_is_bit_identical(straight, data_cache_dir, tmp_path, sig):
  """launch/train.py gets the signal while it trains: it stops at a step boundary with that step's checkpoint, and
  the same command resumes to the uninterrupted run's rows. Which signal stopped a run makes no difference to its
  checkpoint or to the resume, so the SIGINT case checks the stop and the SIGTERM case also the resume."""
  workdir = str(tmp_path / "run")
  thread, done = start_train(workdir, data_cache_dir, **KEEP)
  os.kill(wait_for_lock(thread, workdir), sig)
  thread.join(600)
  assert done, "the run did not end (or run_train raised: its traceback is the thread's)"
  (proc,) = done
  out, err = proc.stdout, proc.stderr
  assert proc.returncode == 128 + sig, err[-3000:]
  # no summary line, the run did not finish: its stdout is progress lines only (glm_jax/train/progress.py)
  assert all(line.startswith("[glm5_tiny] ") for line in out.splitlines()), out
  assert "Traceback" not in err
  line = err.strip().splitlines()[-1]
  match = re.fullmatch(
    rf"stopped by {sig.name} after step (\d): its checkpoint is in {re.escape(workdir)}/checkpoints/(\d); run the "
    "same command again to resume",
    line,
  )
  assert match and match[1] == match[2], line
  step = int(match[1])
  assert 1 <= step < 9  # the signal came while the first step compiled: the loop stopped at a step boundary
  with Checkpointer(workdir, read_only=True) as ckpt:
    assert ckpt.steps()[0] == step
  assert [r["step"] for r in train_rows(workdir)] == list(range(1, step + 1))
  assert not os.path.exists(lock_path(workdir))
  if sig != signal.SIGTERM:
    return
  # The same command again: every row and the final held-out loss as the uninterrupted run's.
  summary = train_and_evaluate(make_config(data_cache_dir, **KEEP), workdir)
  assert without_speed(train_rows(workdir)) == without_speed(train_rows(straight[0]))
  assert summary["eval_loss"] == straight[1]["eval_loss"]


def test_stop_signals_stop_at_the_step_boundary_and_a_second_ctrl_c_interrupts():
  previous = signal.getsignal(signal.SIGINT)
  with lifecycle.StopSignals() as stop:
    assert stop.due(1) is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.due(2) == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):  # after a first signal, Ctrl-C interrupts at once
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(100):  # the handler runs between bytecodes, soon after the signal
        time.sleep(0.01)
  assert signal.getsignal(signal.SIGINT) is previous  # the handlers are put back


# The workdir lock


def holder_record(pid, host=None, **extra):
  return {
    "host": host or socket.gethostname(),
    "pid": pid,
    "pid_start": paths.process_start(pid),
    "started": "2026-11-26T10:00:00+00:00",
    "command": "train.py --config=configs/glm5_tiny.py",
    "purpose": "training",
    **extra,
  }


def write_lock(workdir, record, age=0.0):
  os.makedirs(workdir, exist_ok=True)
  path = lock_path(workdir)
  with open(path, "w") as f:
    f.write(json.dumps(record) if isinstance(record, dict) else record)
  if age:
    os.utime(path, (time.time() - age, time.time() - age))
  return path


@pytest.fixture
def live_process():
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  yield proc
  proc.kill()
  proc.wait()


def dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_a_second_run_on_a_locked_workdir_refuses_naming_the_holder(tmp_path, data_cache_dir, live_process):
  workdir = str(tmp_path / "run")
  record = holder_record(live_process.pid)
  write_lock(workdir, record)
  before = snapshot(workdir)
  t0 = time.perf_counter()
  proc = run_train(workdir, data_cache_dir)
  assert proc.returncode == 1
  assert last_line(proc) == (
    f"error: {workdir} is in use by pid {live_process.pid} on host {socket.gethostname()!r}, started "
    f"2026-11-26T10:00:00+00:00 (train.py --config=configs/glm5_tiny.py): one run at a time writes a workdir; "
    f"wait for it to end or use another --workdir (if that process is gone for good, remove {workdir}/workdir.lock)"
  )
  assert snapshot(workdir) == before
  assert time.perf_counter() - t0 < 60  # refused before any compile


def test_a_conversion_into_a_locked_workdir_refuses_and_writes_nothing(tmp_path, live_process):
  from glm_jax.model import ModelConfig
  from tests.convert.test_untrusted import write_hf

  hf_dir = write_hf(str(tmp_path / "hf"), ModelConfig.from_dict(sft_tiny.get_config().model))
  workdir = str(tmp_path / "run")
  write_lock(workdir, holder_record(live_process.pid))
  before = snapshot(str(tmp_path))
  proc = run_script("launch/convert.py", f"--hf_dir={hf_dir}", f"--out_dir={workdir}", "--overwrite")
  assert proc.returncode == 1
  assert last_line(proc).startswith(f"error: {workdir} is in use by pid {live_process.pid} on host ")
  assert snapshot(str(tmp_path)) == before


@pytest.mark.parametrize(
  "record, age, reason",
  [
    (lambda: holder_record(dead_pid()), 0, r"no process (\d+) on this host"),
    (lambda: holder_record(os.getppid(), pid_start="1"), 0, r"process (\d+) on this host is another process"),
    (lambda: holder_record(4242, host="another-host"), 400, r"its record was last refreshed 4\d\d s ago"),
    (lambda: "", 400, r"its record was last refreshed 4\d\d s ago"),
  ],
  ids=["dead_pid", "reused_pid", "other_host_silent", "torn_lock_file"],
)
def test_a_stale_lock_is_taken_over_with_a_log_line(tmp_path, caplog, record, age, reason):
  workdir = str(tmp_path / "run")
  path = write_lock(workdir, record(), age)
  with caplog.at_level(logging.WARNING), lifecycle.workdir_lock(workdir, "training"):
    with open(path) as f:
      assert json.load(f)["pid"] == os.getpid()
  (message,) = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
  assert message.startswith(f"took over {path} from "), message
  assert re.search(reason, message), message
  assert not os.path.exists(path)  # released
  assert os.listdir(workdir) == []  # the workdir existed before: it stays, empty


@pytest.mark.parametrize(
  "record, age",
  [(lambda pid: holder_record(pid, host="another-host"), 100), (lambda pid: "", 0)],
  ids=["other_host_recent", "being_written"],
)
def test_a_lock_that_may_be_alive_is_kept(tmp_path, record, age, live_process):
  workdir = str(tmp_path / "run")
  path = write_lock(workdir, record(live_process.pid), age)
  before = snapshot(workdir)
  with pytest.raises(lifecycle.WorkdirLocked, match=f"^{re.escape(workdir)} is in use by "):
    with lifecycle.workdir_lock(workdir, "training"):
      pass
  assert snapshot(workdir) == before and os.path.exists(path)


def test_the_lock_is_reentrant_and_a_workdir_it_made_goes_when_empty(tmp_path):
  workdir = str(tmp_path / "new")
  with lifecycle.workdir_lock(workdir, "training"):
    with lifecycle.workdir_lock(workdir, "warm start"):  # the same process: held once
      assert os.listdir(workdir) == [lifecycle.LOCK_NAME]
    assert os.path.exists(lock_path(workdir))
  assert not os.path.exists(workdir)


# A checkpoint that cannot be written


@pytest.fixture
def small_disk(tmp_path):
  """A 32 MB tmpfs, where this process may mount one (root)."""
  path = str(tmp_path / "disk")
  os.makedirs(path)
  mount = ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", path]
  if os.geteuid() != 0 or not shutil.which("mount") or subprocess.run(mount, capture_output=True).returncode:
    pytest.skip("mounting a tmpfs needs root (the patched-writer case covers the rest)")
  yield path
  subprocess.run(["umount", "-l", path])


def fill_after_step_3(workdir):
  """A hook that, once step 3's checkpoint is written, fills the disk but for 512 KiB (a checkpoint is 2.9 MB)."""

  def hook(step, state, metrics):
    if step != 4:
      return
    deadline = time.monotonic() + 120
    while not os.path.isdir(os.path.join(workdir, "checkpoints", "3")):  # an asynchronous save renames it when done
      assert time.monotonic() < deadline
      time.sleep(0.05)
    stat = os.statvfs(workdir)
    with open(os.path.join(os.path.dirname(workdir), "filler"), "wb") as f:
      f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 512 * 1024))

  return hook


def full_disk_writer(monkeypatch):
  """Orbax's save raising ENOSPC from step 6 on (where no tmpfs can be mounted)."""
  save = ocp.CheckpointManager.save

  def patched(self, step, *args, **kw):
    if step >= 6:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(self, step, *args, **kw)

  monkeypatch.setattr(ocp.CheckpointManager, "save", patched)


@pytest.mark.slow
@pytest.mark.parametrize(
  "disk, async_save",
  # the patched save raises at once, so only a real disk tests an asynchronous failure
  [("tmpfs", False), ("tmpfs", True), ("patched", False)],
  ids=["tmpfs-sync", "tmpfs-async", "patched-sync"],
)
def test_a_full_disk_stops_the_run_at_that_step_and_keeps_the_one_before(
  disk, async_save, straight, data_cache_dir, tmp_path, monkeypatch, request
):
  """The run starts from the uninterrupted run as it stood after step 3 (a run resumed there), so step 6's is the
  first checkpoint it writes. After the failure step 3 restores as the uninterrupted run saved it; the asynchronous
  case, whose run went on past step 6 before it stopped, also resumes it to the uninterrupted run's rows. (A
  synchronous failure leaves step 3 and the rows through step 6: resuming that step 3 to the uninterrupted rows is
  test_faults.py's test_a_corrupt_latest_checkpoint_falls_back_to_the_step_before.)"""
  hooks = []
  if disk == "tmpfs":
    workdir = os.path.join(request.getfixturevalue("small_disk"), "run")
    hooks.append(fill_after_step_3(workdir))
  else:
    full_disk_writer(monkeypatch)
    workdir = str(tmp_path / "run")
  stopped_after(straight[0], 3, workdir)
  config = make_config(data_cache_dir, **KEEP, **{"train.async_checkpoints": async_save})
  with pytest.raises(CheckpointWriteError) as raised:
    train_and_evaluate(config, workdir, hooks=hooks)
  message = str(raised.value)
  assert re.fullmatch(
    rf"the checkpoint of step 6 could not be written to {re.escape(workdir)}/checkpoints \(.*No space left on "
    r"device.*\); the run stops: step 3 is the latest one written",
    message,
  ), message
  steps = [r["step"] for r in train_rows(workdir)]
  # A synchronous save fails in step 6's boundary; an asynchronous one at the first boundary after its thread failed,
  # at the latest when the next save (here the last step's) would start.
  assert steps[-1] == 6 if not async_save else 6 <= steps[-1] <= 9, steps
  assert not os.path.exists(lock_path(workdir))
  monkeypatch.undo()
  # Nothing was lost: step 3 restores as the uninterrupted run saved it, and the run goes on from it to the
  # uninterrupted run's rows.
  moved = str(tmp_path / "moved")
  shutil.copytree(workdir, moved, ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp*"))
  target = abstract_train_state(config, model_config_for_stage(config)).state
  with Checkpointer(moved, read_only=True) as got, Checkpointer(straight[0], read_only=True) as want:
    assert got.steps()[0] == 3
    pairs = zip(jax.tree.leaves(got.restore(3, target)), jax.tree.leaves(want.restore(3, target)), strict=True)
  assert all(np.array_equal(a, b) for a, b in pairs)
  if not async_save:
    return
  summary = train_and_evaluate(make_config(data_cache_dir, **KEEP), moved)
  assert without_speed(train_rows(moved)) == without_speed(train_rows(straight[0]))
  assert summary["eval_loss"] == straight[1]["eval_loss"]


# SFT data with nothing to train on


def test_sft_data_whose_responses_are_all_cut_refuses_before_compiling(tmp_path, data_cache_dir):
  rng = random.Random(0)
  words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(200)]
  examples = [{"prompt": " ".join(rng.sample(words, 20)), "response": "yes"} for _ in range(12)]
  path = tmp_path / "sft.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in examples))
  overrides = {
    "data.source": "jsonl",
    "data.path": str(path),
    "data.eval_fraction": 0.0,
    "data.seq_len": 16,
    "data.batch_size": 4,
  }
  config = sft_tiny.get_config()
  for key, value in {**overrides, "data.cache_dir": data_cache_dir}.items():
    config.data[key.split(".")[1]] = value
  tokenizer = data_lib.load_tokenizer(config.data)
  prompt_lens = [len(tokenizer.encode(e["prompt"])) for e in examples]
  assert min(prompt_lens) >= 16  # every response starts past data.seq_len
  workdir = str(tmp_path / "run")
  t0 = time.perf_counter()
  proc = run_script(
    "launch/train.py",
    "--config=configs/sft_tiny.py",
    f"--workdir={workdir}",
    *[f"--config.{k}={v}" for k, v in {**overrides, "data.cache_dir": data_cache_dir}.items()],
  )
  assert proc.returncode == 1
  assert last_line(proc) == (
    f"error: data.seq_len=16 leaves no response token to train on: each of the 12 training examples of "
    f"data.source='jsonl' (data.path={str(path)!r}) has a prompt of at least data.seq_len tokens (12 are cut; the "
    f"shortest prompt has {min(prompt_lens)} tokens); raise data.seq_len or shorten the prompts"
  )
  assert not os.path.exists(workdir)
  assert time.perf_counter() - t0 < 90  # before the step compiles
