"""Runs the failure cases of a run's life on a pod (killed runs, a second run, a full disk, hostile files, destructive
flags, bad values, a silent rollout client) as a user would meet them, each as a real subprocess against a checkout,
and prints one markdown row a case: the command, its exit code, the seconds until it ended, the first line of its
error (or its last stderr line) and what survived (inputs and previous outputs, checked by snapshots, checkpoints and
resumed runs).

  bash scripts/with_env.sh python experiments/fault_probe.py --label=after               # this checkout
  git worktree add /tmp/wt_old <commit>     # another checkout to compare with, e.g. one from before a change
  bash scripts/with_env.sh python experiments/fault_probe.py --root=/tmp/wt_old --label=before
  ... --cases=7a,7b,12 re-runs some rows and merges them into the results file

Every command runs with cwd and PYTHONPATH at --root (that checkout's glm_jax; the probe prints the file the child
imports), JAX_PLATFORMS=cpu, its own process group, --as_gib / --rss_gib memory limits and a hard timeout, writing
under one temporary directory removed at the end. The damaged Hugging Face inputs are written by this script's own
checkout (tests/helpers.py's TINY_MODEL), so both sides read the same bytes; the training run, the converted workdir
and the packed model are made by the checkout under test. Rows go to stdout and to
experiments/results/fault_probe_<label>.jsonl (full argv and stderr tail); "stderr lines" counts what a user reads
besides the one line. The full-disk case mounts a tmpfs: it needs root (else its row says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout holding this script
sys.path.insert(0, HERE)

from tests.helpers import edit_json, read_header, write_header  # noqa: E402
from tests.train import runs  # noqa: E402

# tests/train/runs.py's short glm5_tiny run (9 steps of 4 x 64 tokens, a checkpoint every 3), keeping every checkpoint.
OVERRIDES = {**runs.OVERRIDES, "train.keep_checkpoints": 4}
TRAIN_TIMEOUT = 300
CONVERT_TIMEOUT = 120


# ------------------------------------------------------------------------------------------------------ processes


def group_rss_kib(pgid: int) -> int:
  """The resident memory of every process in group `pgid` (/proc/<pid>/stat's rss), in KiB."""
  total, page_kib = 0, os.sysconf("SC_PAGE_SIZE") // 1024
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    if int(fields[2]) == pgid:
      total += int(fields[21]) * page_kib
  return total


LIVE: set[int] = set()  # process groups started and not yet killed (killed on the way out)


def kill_group(pgid: int, sig=signal.SIGKILL) -> None:
  try:
    os.killpg(pgid, sig)
  except (ProcessLookupError, PermissionError):
    pass


class Proc:
  """A command in its own process group, its output in files; poll() reaps it (os.wait4, for its peak resident
  memory) and kills the group past the timeout or the resident-memory limit."""

  def __init__(self, probe: Probe, argv: list[str], folder: str, name: str, timeout: float):
    os.makedirs(folder, exist_ok=True)
    self.argv, self.timeout, self.rss_limit_kib = argv, timeout, int(probe.rss_gib * 2**20)
    self.out_path, self.err_path = os.path.join(folder, f"{name}.out"), os.path.join(folder, f"{name}.err")
    as_bytes = int(probe.as_gib * 2**30)

    def limits():
      resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
      for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):  # a background job's shell ignores SIGINT and
        signal.signal(sig, signal.SIG_DFL)  # SIGQUIT, and an ignored signal stays ignored across exec

    with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
      self.proc = subprocess.Popen(
        argv,
        cwd=probe.root,
        env=probe.env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        start_new_session=True,
        preexec_fn=limits,
      )
    self.pid = self.proc.pid
    LIVE.add(self.pid)
    self.t0 = time.monotonic()
    self.rc: int | None = None
    self.seconds = 0.0
    self.peak_kib = 0
    self.killed: str | None = None
    self._polls = 0

  @property
  def elapsed(self) -> float:
    return time.monotonic() - self.t0

  def signal(self, sig) -> None:
    if self.rc is None:
      os.kill(self.pid, sig)

  def poll(self) -> bool:
    """True once the process has ended (and its group is killed)."""
    if self.rc is not None:
      return True
    pid, status, usage = os.wait4(self.pid, os.WNOHANG)
    if pid:
      self.rc = os.waitstatus_to_exitcode(status)
      self.seconds = self.elapsed
      self.peak_kib = max(self.peak_kib, usage.ru_maxrss)
      self.proc.returncode = self.rc  # reaped here: Popen must not wait for it again
      kill_group(self.pid)  # what it left running (a worker process, ...)
      LIVE.discard(self.pid)
      return True
    self._polls += 1
    if self._polls % 5 == 0:
      rss = group_rss_kib(self.pid)
      self.peak_kib = max(self.peak_kib, rss)
      if rss > self.rss_limit_kib and not self.killed:
        self.killed = f"killed by the probe at {rss / 2**20:.1f} GiB resident after {self.elapsed:.0f} s"
        kill_group(self.pid)
    if self.elapsed > self.timeout and not self.killed:
      self.killed = f"hung, killed at {self.timeout:.0f} s"
      kill_group(self.pid)
    return False

  def wait(self, watch=None) -> Proc:
    while not self.poll():
      if watch:
        watch()
      time.sleep(0.02)
    return self

  @property
  def stdout(self) -> str:
    with open(self.out_path, errors="replace") as f:
      return f.read()

  @property
  def stderr(self) -> str:
    with open(self.err_path, errors="replace") as f:
      return f.read()


ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ (\S+:\d+\])")  # absl's "W1126 21:47:01.218 1396 file.py:53]"


def error_line(stderr: str) -> str:
  """The line a user reads: the first `error: ...` line, else the exception of a traceback, else the last line."""
  lines = [ABSL_PREFIX.sub(r"\1", line.rstrip()) for line in stderr.splitlines() if line.strip()]
  for line in lines:
    if line.startswith("error: "):
      return line
  tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
  if tracebacks:
    for line in lines[tracebacks[-1] + 1 :]:
      if not line.startswith((" ", "\t", "Traceback", "-----", "The above exception", "During handling", "For simpl")):
        return "Traceback: " + line
  return lines[-1] if lines else ""


def trim(text: str, n: int = 160) -> str:
  text = " ".join(text.split())
  return text if len(text) <= n else text[: n - 1] + "…"


# ------------------------------------------------------------------------------------------------------ files


def snapshot(*roots: str) -> dict[str, str]:
  """{path: sha256 of its bytes, or what it is for a directory, a symlink or a special file} under `roots` (a FIFO
  is never opened)."""
  out = {}
  for root in roots:
    if not os.path.lexists(root):
      continue
    for folder, dirs, files in os.walk(root):
      out[folder] = "dir"
      for name in dirs + files:
        path = os.path.join(folder, name)
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
          out[path] = "-> " + os.readlink(path)
        elif stat.S_ISREG(mode):
          with open(path, "rb") as f:
            out[path] = hashlib.sha256(f.read()).hexdigest()
        elif not stat.S_ISDIR(mode):
          out[path] = "special"
  return out


def compare(before: dict, after: dict, base: str) -> str:
  if before == after:
    return f"intact ({sum(v != 'dir' for v in before.values())} files byte for byte)"
  rel = lambda p: os.path.relpath(p, base)  # noqa: E731
  gone = sorted(rel(p) for p in before if p not in after)
  new = sorted(rel(p) for p in after if p not in before)
  changed = sorted(rel(p) for p in before if p in after and before[p] != after[p])
  parts = []
  for what, items in (("removed", gone), ("added", new), ("changed", changed)):
    if items:
      parts.append(f"{len(items)} {what} (" + ", ".join(items[:3]) + (", …" if len(items) > 3 else "") + ")")
  return "NOT intact: " + "; ".join(parts)


def copytree(src: str, dst: str) -> str:
  shutil.copytree(src, dst, symlinks=True)
  return dst


def ckpt_steps(workdir: str) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def ckpt_tmp(workdir: str) -> list[str]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(n for n in os.listdir(folder) if not n.isdigit()) if os.path.isdir(folder) else []


def train_rows(workdir: str) -> list[dict]:
  """The training rows of metrics.jsonl (NaN allowed: a checkout under test may write bare NaN); a torn line is
  skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = []
  if os.path.exists(path):
    with open(path, errors="replace") as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:
          rows.append({"torn": line[:40]})
          continue
        if isinstance(row, dict) and "loss" in row:
          rows.append(row)
  return rows


def steps_text(rows: list[dict]) -> str:
  """`1..9` or the run of step numbers as written (repeats and gaps shown)."""
  steps = [r.get("step") for r in rows if "step" in r]
  torn = sum("torn" in r for r in rows)
  if not steps:
    text = "no rows"
  elif steps == list(range(steps[0], steps[-1] + 1)):
    text = f"rows of steps {steps[0]}..{steps[-1]}"
  else:
    runs, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
      if b != a + 1:
        runs.append(f"{start}..{a}" if start != a else f"{a}")
        start = b
    text = f"{len(steps)} rows, steps " + ", ".join(runs[:6]) + (", …" if len(runs) > 6 else "")
  return text + (f" (+{torn} torn lines)" if torn else "")


def dropped_text(workdir: str) -> str:
  path = os.path.join(workdir, "metrics.dropped.jsonl")
  if not os.path.exists(path):
    return ""
  with open(path) as f:
    return f" (+{sum(1 for _ in f)} rows moved to metrics.dropped.jsonl)"


def resumed_text(again: Proc, before: list[dict], after: list[dict]) -> str:
  """What a rerun did: the rows of metrics.jsonl past those it kept of `before` (a run that resumes from an earlier
  checkpoint moves the later rows aside first; rows are told apart by tokens_per_s, NaN compared by repr)."""
  if again.rc != 0:
    return f"rc {rc_text(again)}: {trim(error_line(again.stderr), 80)}"
  kept = 0
  while kept < min(len(before), len(after)) and repr(sorted(before[kept].items())) == repr(sorted(after[kept].items())):
    kept += 1
  new = after[kept:]
  if not new:
    return "rc 0, no step trained"
  first = new[0].get("step")
  text = f"resumed at step {first}" if first and first > 1 else "started again from step 1"
  return text + f", ended at {new[-1].get('step')} (rc 0)"


# ------------------------------------------------------------------------------------------------------ the probe


@dataclasses.dataclass
class Row:
  case: str
  title: str
  command: str
  rc: str
  seconds: float | None
  line: str
  survived: str
  peak_mib: float | None = None
  stderr_lines: int | None = None  # how much a user reads besides the line (a traceback, logs)
  last_line: str = ""  # the last stderr line (a thread's log can come after the `error:` line)
  argv: list | None = None
  stderr_tail: str = ""


class Probe:
  def __init__(self, root: str, tmp: str, as_gib: float, rss_gib: float):
    self.root, self.tmp, self.as_gib, self.rss_gib = root, tmp, as_gib, rss_gib
    self.python = sys.executable
    self.env = {
      **os.environ,
      "PYTHONPATH": root,
      "JAX_PLATFORMS": "cpu",
      "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, "jax_cache"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    self.env.pop("GLM_JAX_TRACEBACK", None)
    self.cache = os.path.join(tmp, "data_cache")
    self._base_run: str | None = None
    self._base_error: str | None = None
    self._fixtures: dict[str, str] | None = None
    self._packed: str | None = None
    self._packed_error: str | None = None

  def folder(self, case: str) -> str:
    path = os.path.join(self.tmp, f"case_{case}")
    os.makedirs(path, exist_ok=True)
    return path

  def start(self, argv, folder, name="cmd", timeout=TRAIN_TIMEOUT) -> Proc:
    return Proc(self, argv, folder, name, timeout)

  def run(self, argv, folder, name="cmd", timeout=TRAIN_TIMEOUT, watch=None) -> Proc:
    return self.start(argv, folder, name, timeout).wait(watch)

  def script(self, name: str, *args: str) -> list[str]:
    return [self.python, f"launch/{name}", *args]

  def run_flags(self) -> list[str]:
    """The base run's config overrides (launch/quantize.py and sample.py refuse a config the run was not)."""
    return [f"--config.{k}={v}" for k, v in {**OVERRIDES, "data.cache_dir": self.cache}.items()]

  def train_argv(self, workdir: str, config: str = "configs/glm5_tiny.py", **changes) -> list[str]:
    items = {**OVERRIDES, "data.cache_dir": self.cache, **{k.replace("__", "."): v for k, v in changes.items()}}
    return self.script(
      "train.py", f"--config={config}", f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in items.items()]
    )

  def imported_glm_jax(self) -> str:
    proc = subprocess.run(
      [self.python, "-c", "import glm_jax; print(glm_jax.__file__)"],
      cwd=self.root,
      env=self.env,
      capture_output=True,
      text=True,
      timeout=120,
    )
    return proc.stdout.strip() or proc.stderr.strip()[-300:]

  # --- what several cases share, made on first use ---

  def base_run(self) -> str:
    """A finished 9-step run (checkpoints 3, 6, 9), made by the checkout under test; raises if it failed."""
    if self._base_run is None and self._base_error is None:
      workdir = os.path.join(self.tmp, "base", "run")
      p = self.run(self.train_argv(workdir), os.path.join(self.tmp, "base"), "train", timeout=600)
      if p.rc == 0 and ckpt_steps(workdir)[-1:] == [9]:
        self._base_run = workdir
        self.base_seconds = p.seconds
      else:
        self._base_error = f"the base run failed (rc {p.rc}): {trim(error_line(p.stderr))}"
    if self._base_error:
      raise RuntimeError(self._base_error)
    return self._base_run

  def fixtures(self) -> dict[str, str]:
    """{"single", "sharded"}: a one-file HF directory of TINY_MODEL and the same in 4 shards with an index, written
    by this script's checkout."""
    if self._fixtures is None:
      folder = os.path.join(self.tmp, "hf_fixtures")
      code = """
import sys
import numpy as np
from flax import nnx
from glm_jax.convert import hf
from glm_jax.model import GlmMoeDsa
from tests.helpers import TINY_MODEL

leaves = {p: v for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(TINY_MODEL, nnx.Rngs(0)))))}
for name, shard in (("single", 5 * 2**30), ("sharded", 20_000)):
  rng = np.random.default_rng(0)
  hf.write(TINY_MODEL, f"{sys.argv[1]}/{name}", leaves,
           lambda s: rng.standard_normal(hf.slice_shape(s, leaves)).astype(np.float32), max_shard_bytes=shard)
"""
      env = {**self.env, "PYTHONPATH": HERE}
      proc = subprocess.run(
        [self.python, "-c", code, folder], cwd=HERE, env=env, capture_output=True, text=True, timeout=300
      )
      if proc.returncode:
        raise RuntimeError(f"writing the HF fixtures failed: {proc.stderr[-2000:]}")
      self._fixtures = {k: os.path.join(folder, k) for k in ("single", "sharded")}
    return self._fixtures

  def packed(self) -> str:
    """base_run packed w8a8 by the checkout under test's launch/quantize.py."""
    if self._packed is None and self._packed_error is None:
      out = os.path.join(self.tmp, "packed", "w8a8")
      argv = self.script(
        "quantize.py",
        "--config=configs/glm5_tiny.py",
        f"--workdir={self.base_run()}",
        "--scheme=w8a8",
        f"--out={out}",
        *self.run_flags(),
      )
      p = self.run(argv, os.path.join(self.tmp, "packed"), "quantize", timeout=600)
      if p.rc == 0 and os.path.exists(os.path.join(out, "packed.json")):
        self._packed = out
      else:
        self._packed_error = f"packing the base run failed (rc {p.rc}): {trim(error_line(p.stderr))}"
    if self._packed_error:
      raise RuntimeError(self._packed_error)
    return self._packed


def rc_text(p: Proc) -> str:
  if p.killed:
    return f"{p.rc} (killed by the probe)"
  if p.rc is not None and p.rc < 0:
    return f"{p.rc} (killed by {signal.Signals(-p.rc).name})"
  if p.rc is not None and 128 < p.rc < 160:
    return f"{p.rc} (128 + {signal.Signals(p.rc - 128).name})"
  return str(p.rc)


def stdout_line(p: Proc) -> str | None:
  """For a command that succeeded: its last stdout line (what it printed), else None (the default line)."""
  lines = [x for x in p.stdout.splitlines() if x.strip()]
  return "stdout: " + lines[-1] if p.rc == 0 and lines else None


def summary_of(p: Proc) -> dict:
  """The JSON line a finished launch/train.py prints, or {}."""
  for line in reversed(p.stdout.splitlines()):
    try:
      value = json.loads(line)
    except ValueError:
      continue
    if isinstance(value, dict):
      return value
  return {}


# ------------------------------------------------------------------------------------------------------ the cases


# Each case is fn(probe, case) -> (the Proc whose exit the row reports, what survived), or a Row when it cannot run.


def case_rerun(pr: Probe, case: str):
  """The same command again on a finished run (a copy of the base run: the first of the two commands)."""
  folder = pr.folder(case)
  workdir = copytree(pr.base_run(), os.path.join(folder, "run"))
  before = snapshot(workdir)
  p = pr.run(pr.train_argv(workdir), folder)
  return p, "workdir " + compare(before, snapshot(workdir), workdir)


def case_signal(pr: Probe, case: str, sig: signal.Signals):
  """A signal once the run logged its first step; then the same command again."""
  folder = pr.folder(case)
  workdir = os.path.join(folder, "run")
  sent = {}

  def watch():
    if not sent and train_rows(workdir):
      p.signal(sig)
      sent["at"] = p.elapsed

  p = pr.start(pr.train_argv(workdir), folder, "train")
  p.wait(watch)
  steps, rows = ckpt_steps(workdir), train_rows(workdir)
  lock = os.path.exists(os.path.join(workdir, "workdir.lock"))
  again = pr.run(pr.train_argv(workdir), folder, "rerun")
  resumed = resumed_text(again, rows, train_rows(workdir))
  at = f"sent at {sent['at']:.1f} s" if sent else "never sent (the run ended first)"
  return p, (
    f"{sig.name} {at}; checkpoints {steps}, {steps_text(rows)}, lock {'left' if lock else 'none'}; "
    f"the same command again: {resumed}"
  )


def case_second_run(pr: Probe, case: str):
  """The same command on the same workdir while a first run (150 steps) is training."""
  folder = pr.folder(case)
  workdir = os.path.join(folder, "run")
  argv = pr.train_argv(workdir, train__steps=150)
  first = pr.start(argv, folder, "first", timeout=600)
  while not train_rows(workdir) and not first.poll():
    time.sleep(0.02)
  started = first.elapsed
  second = pr.run(argv, folder, "second", watch=first.poll)
  first_running = first.rc is None
  first.wait()
  return second, (
    f"second started {started:.1f} s into the first, which was {'still' if first_running else 'no longer'} running "
    f"when the second ended; first: rc {rc_text(first)}; workdir: {steps_text(train_rows(workdir))}"
    f"{dropped_text(workdir)}, checkpoints {ckpt_steps(workdir)}"
  )


def case_stale_lock(pr: Probe, case: str):
  """workdir.lock naming a process on this host that is gone."""
  folder = pr.folder(case)
  workdir = os.path.join(folder, "run")
  os.makedirs(workdir)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  record = {
    "host": socket.gethostname(),
    "pid": dead.pid,
    "pid_start": None,
    "started": "2026-11-26T10:00:00+00:00",
    "command": "train.py --config=configs/glm5_tiny.py",
    "purpose": "training",
  }
  lock = os.path.join(workdir, "workdir.lock")
  with open(lock, "w") as f:
    f.write(json.dumps(record))
  with open(lock) as f:
    text = f.read()
  p = pr.run(pr.train_argv(workdir), folder)
  if not os.path.exists(lock):
    left = "lock taken over and released"
  else:
    with open(lock) as f:
      left = "the dead pid's lock left as it was" if f.read() == text else "lock rewritten and left"
  took = [x for x in p.stderr.splitlines() if "took over" in x]
  survived = f"{left}; {steps_text(train_rows(workdir))}, checkpoints {ckpt_steps(workdir)}"
  if took:
    survived += f"; log: {trim(took[0][took[0].index('took over') :], 110)}"
  return p, survived


def case_full_disk(pr: Probe, case: str):
  """A 16 MiB tmpfs, filled but for 512 KiB once checkpoints/3 is written (the run's process group is stopped while
  the filler is written); then the filler is removed and the same command run again in place."""
  folder = pr.folder(case)
  disk = os.path.join(folder, "disk")
  os.makedirs(disk)
  mount = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", disk]
  if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
    return "(not run: mounting a tmpfs needs root)"
  try:
    workdir, filler = os.path.join(disk, "run"), os.path.join(disk, "filler")
    filled = {}

    def watch():
      if not filled and os.path.isdir(os.path.join(workdir, "checkpoints", "3")):
        kill_group(p.pid, signal.SIGSTOP)
        filled["at"], filled["ckpts"] = p.elapsed, ckpt_steps(workdir)
        st = os.statvfs(disk)
        with open(filler, "wb") as f:
          f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - 512 * 1024))
        kill_group(p.pid, signal.SIGCONT)

    p = pr.start(pr.train_argv(workdir), folder, "train")
    p.wait(watch)
    steps, tmps, rows = ckpt_steps(workdir), ckpt_tmp(workdir), train_rows(workdir)
    lock = os.path.exists(os.path.join(workdir, "workdir.lock"))
    if os.path.exists(filler):
      os.remove(filler)
    again = pr.run(pr.train_argv(workdir), folder, "rerun")
    resumed = resumed_text(again, rows, train_rows(workdir))
    steps2, tmps2 = ckpt_steps(workdir), ckpt_tmp(workdir)
  finally:
    subprocess.run(["umount", "-l", disk], capture_output=True)
  when = f"filled at {filled['at']:.1f} s (checkpoints {filled['ckpts']})" if filled else "never filled"
  unfinished = lambda t: f" + {len(t)} unfinished" if t else ""  # noqa: E731
  return p, (
    f"{when}; after: {steps_text(rows)}, checkpoints {steps}{unfinished(tmps)}, lock {'left' if lock else 'none'}; "
    f"filler removed, the same command again: {resumed}, checkpoints {steps2}{unfinished(tmps2)}"
  )


A = "model.layers.1.mlp.experts.0.gate_proj.weight"
B = "model.layers.1.mlp.experts.1.gate_proj.weight"


def convert_case(make, timeout=CONVERT_TIMEOUT):
  """launch/convert.py --hf_dir=<made> --out_dir=<new>: the input's bytes and the output afterwards."""

  def fn(pr: Probe, case: str):
    folder = pr.folder(case)
    hf_dir, roots = make(pr.fixtures(), folder)
    out = os.path.join(folder, "out")
    before = snapshot(*roots)
    p = pr.run(pr.script("convert.py", f"--hf_dir={hf_dir}", f"--out_dir={out}"), folder, timeout=timeout)
    files = sum(v != "dir" for v in snapshot(out).values())
    written = f"out written ({files} files)" if os.path.exists(out) else "no out"
    return p, f"input {compare(before, snapshot(*roots), folder)}; {written}; peak {p.peak_kib / 1024:.0f} MiB"

  return fn


def copy_single(fixtures, folder):
  path = copytree(fixtures["single"], os.path.join(folder, "hf"))
  return path, [path]


def claim(**fields):
  """config.json claiming `fields` (its per-layer lists dropped, so that nothing else refuses it first)."""

  def make(fixtures, folder):
    path, roots = copy_single(fixtures, folder)

    def edit(cfg):
      for key in ("mlp_layer_types", "indexer_types"):
        cfg.pop(key, None)
      cfg.update(fields)

    edit_json(os.path.join(path, "config.json"), edit)
    return path, roots

  return make


def header_edit(edit):
  """model.safetensors with its header changed by edit(header) -> (header, header text or None)."""

  def make(fixtures, folder):
    path, roots = copy_single(fixtures, folder)
    file = os.path.join(path, "model.safetensors")
    header, data = read_header(file)
    header, text = edit(header)
    write_header(file, header, data, text)
    return path, roots

  return make


def _overlap(header):
  header[B]["data_offsets"] = header[A]["data_offsets"]
  return header, None


def _fractional(header):
  begin, end = header[A]["data_offsets"]
  header[A]["data_offsets"] = [begin + 0.5, end + 0.5]
  return header, None


def _nested(header):
  return header, json.dumps(header)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"


def index_entry(value, fifo=False, outside=False):
  """The sharded directory with lm_head.weight's shard in the index replaced by `value`; fifo: a FIFO of that name
  beside it; outside: a real one-file directory at ../outside."""

  def make(fixtures, folder):
    path = copytree(fixtures["sharded"], os.path.join(folder, "hf"))
    index = os.path.join(path, "model.safetensors.index.json")
    edit_json(index, lambda i: i["weight_map"].update({"lm_head.weight": value}))
    if fifo:
      os.mkfifo(os.path.join(path, value))
    roots = [path]
    if outside:
      roots.append(copytree(fixtures["single"], os.path.join(folder, "outside")))
    return path, roots

  return make


def case_to_hf_onto_workdir(pr: Probe, case: str):
  """--to_hf with the output the input workdir (a copy of the base run), --overwrite."""
  folder = pr.folder(case)
  workdir = copytree(pr.base_run(), os.path.join(folder, "W"))
  before = snapshot(workdir)
  argv = pr.script("convert.py", "--to_hf", f"--workdir={workdir}", f"--out_dir={workdir}", "--overwrite")
  p = pr.run(argv, folder, timeout=CONVERT_TIMEOUT)
  return p, f"W {compare(before, snapshot(workdir), workdir)}; checkpoints left {ckpt_steps(workdir)}"


def case_hf_onto_parent(pr: Probe, case: str):
  """--hf_dir=P/X --out_dir=P --overwrite, P also holding another file."""
  folder = pr.folder(case)
  parent = os.path.join(folder, "P")
  hf_dir = copytree(pr.fixtures()["single"], os.path.join(parent, "X"))
  with open(os.path.join(parent, "keep.txt"), "w") as f:
    f.write("a file beside the input")
  before_x, before_p = snapshot(hf_dir), snapshot(parent)
  p = pr.run(pr.script("convert.py", f"--hf_dir={hf_dir}", f"--out_dir={parent}", "--overwrite"), folder)
  keep = "keep.txt intact" if os.path.exists(os.path.join(parent, "keep.txt")) else "keep.txt GONE"
  return p, f"X {compare(before_x, snapshot(hf_dir), parent)}; {keep}; P {compare(before_p, snapshot(parent), parent)}"


def case_foreign_partial(pr: Probe, case: str):
  """quantize.py --out=X of the base run, with an X.partial directory it did not make."""
  folder = pr.folder(case)
  out, partial = os.path.join(folder, "X"), os.path.join(folder, "X.partial")
  os.makedirs(partial)
  with open(os.path.join(partial, "keep.txt"), "w") as f:
    f.write("not launch/quantize.py's")
  base = pr.base_run()
  before, before_base = snapshot(partial), snapshot(base)
  argv = pr.script(
    "quantize.py",
    "--config=configs/glm5_tiny.py",
    f"--workdir={base}",
    "--scheme=w8a8",
    f"--out={out}",
    *pr.run_flags(),
  )
  p = pr.run(argv, folder)
  return p, (
    f"X.partial {compare(before, snapshot(partial), folder)}; X {'written' if os.path.exists(out) else 'not written'}; "
    f"the run {compare(before_base, snapshot(base), base)}"
  )


def packed_case(edit):
  """launch/sample.py --packed=<a copy of the packed base run with packed.json edited>."""

  def fn(pr: Probe, case: str):
    folder = pr.folder(case)
    model = copytree(pr.packed(), os.path.join(folder, "model"))
    edit(os.path.join(model, "packed.json"))
    before = snapshot(model)
    argv = pr.script(
      "sample.py",
      "--config=configs/glm5_tiny.py",
      f"--packed={model}",
      "--max_new_tokens=8",
      *pr.run_flags(),
    )
    p = pr.run(argv, folder)
    return p, "packed model " + compare(before, snapshot(model), folder), stdout_line(p)

  return fn


def _drop_plan(path):
  edit_json(path, lambda m: m.pop("plan"))


def _null_tokenizer(path):
  edit_json(path, lambda m: m.update(tokenizer=None))


def _empty(path):
  open(path, "w").close()


def bad_value(**changes):
  """A training run with a non-finite or out-of-range config value."""

  def fn(pr: Probe, case: str):
    folder = pr.folder(case)
    workdir = os.path.join(folder, "run")
    p = pr.run(pr.train_argv(workdir, **changes), folder)
    if not os.path.exists(workdir):
      return p, "no workdir created"
    rows = train_rows(workdir)
    bad = sum(1 for r in rows if not isinstance(r.get("loss"), (int, float)) or r["loss"] != r["loss"])
    summary = summary_of(p)
    skipped = f", summary skipped_steps={summary.get('skipped_steps')}" if summary else ""
    return p, (
      f"workdir created: {steps_text(rows)} ({bad} with a non-finite loss){skipped}, checkpoints {ckpt_steps(workdir)}"
    )

  return fn


def sampling(flag):
  """launch/sample.py on the base run with an out-of-range flag."""

  def fn(pr: Probe, case: str):
    folder = pr.folder(case)
    base = pr.base_run()
    before = snapshot(base)
    argv = pr.script(
      "sample.py", "--config=configs/glm5_tiny.py", f"--workdir={base}", "--max_new_tokens=8", flag, *pr.run_flags()
    )
    p = pr.run(argv, folder)
    return p, "the run " + compare(before, snapshot(base), base), stdout_line(p)

  return fn


def case_sft_cut(pr: Probe, case: str):
  """SFT on 12 examples whose prompts (20 random words) all outrun data.seq_len=16 (test_lifecycle.py's data)."""
  folder = pr.folder(case)
  rng = random.Random(0)
  words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(200)]
  examples = [{"prompt": " ".join(rng.sample(words, 20)), "response": "yes"} for _ in range(12)]
  path = os.path.join(folder, "sft.jsonl")
  with open(path, "w") as f:
    f.write("".join(json.dumps(e) + "\n" for e in examples))
  workdir = os.path.join(folder, "run")
  changes = {
    "data__source": "jsonl",
    "data__path": path,
    "data__eval_fraction": 0.0,
    "data__seq_len": 16,
    "data__batch_size": 4,
    "data__cache_dir": os.path.join(folder, "cache"),
  }
  p = pr.run(pr.train_argv(workdir, config="configs/sft_tiny.py", **changes), folder)
  if not os.path.exists(workdir):
    return p, "no workdir created"
  rows = train_rows(workdir)
  losses = sorted({str(r.get("loss")) for r in rows})
  return p, f"workdir created: {steps_text(rows)}, losses {losses[:3]}, checkpoints {ckpt_steps(workdir)}"


ROLLOUT_DRIVER = r"""
import json, secrets, socket, sys, time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

from flax import nnx

import glm_jax.configs.grpo_tiny
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import rollout_engine
from glm_jax.train.step import split_model

intruder, workdir = sys.argv[1], sys.argv[2]
config = glm_jax.configs.grpo_tiny.get_config()
config.sft.steps = 0
rl = dict(tensorboard=False, async_rollouts=True, rollout_process=True, prompts_per_step=8, group_size=4,
          eval_prompts=8, eval_every=1000, checkpoint_every=1000, max_worker_restarts=0, worker_start_timeout=240.0)
if "handshake_timeout" in config.rl:
  rl["handshake_timeout"] = 5.0
config.rl.update(rl)
host = getattr(rollout_engine, "HOST", "localhost")
events, intruders = {}, []
read_port = rollout_engine._Connection._read_port

def read_port_then_intrude(self, timeout):
  port = read_port(self, timeout)
  if "port_read" not in events:  # the first worker: another local client connects before the trainer does
    if intruder == "silent":
      intruders.append(socket.create_connection((host, port)))
      events["intruder"] = "connected and stays silent"
    else:
      try:
        Client((host, port), authkey=secrets.token_bytes(16))
        events["intruder"] = "ACCEPTED with another key"
      except AuthenticationError as e:
        events["intruder"] = f"refused ({e})"
      except Exception as e:
        events["intruder"] = f"{type(e).__name__}: {e}"
    print(f"intruder ({intruder}): {events['intruder']}", file=sys.stderr, flush=True)
    events["port_read"] = time.monotonic()
  return port

rollout_engine._Connection._read_port = read_port_then_intrude
_, params, rest = split_model(GlmMoeDsa(ModelConfig.from_dict(config.model), nnx.Rngs(0)))
worker = rollout_engine.ProcessRolloutWorker(config, workdir)
worker.push_weights(7, params, rest)
try:
  worker.start()
  handshake = time.monotonic() - events["port_read"]
  rollout = worker.get(timeout=240)
  log, deadline = f"{workdir}/rollout/worker-1.log", time.monotonic() + 12
  while time.monotonic() < deadline and "refused a connection" not in open(log).read():
    time.sleep(0.2)  # the worker logs a silent client's refusal at its handshake deadline
finally:
  worker.stop()
  for sock in intruders:
    sock.close()
print(json.dumps({"intruder": events.get("intruder"), "handshake_s": round(handshake, 2), "index": rollout.index,
                  "version": rollout.version, "replaced": worker.replaced}))
"""


def rollout(intruder, timeout=90):
  """A real rollout worker (ProcessRolloutWorker, as tests/rl/test_rollout_engine.py drives it); between its port
  being read and the trainer connecting, another local client connects: silent, or with another key."""

  def fn(pr: Probe, case: str):
    folder = pr.folder(case)
    driver = os.path.join(folder, "driver.py")
    with open(driver, "w") as f:
      f.write(ROLLOUT_DRIVER)
    workdir = os.path.join(folder, "run")
    os.makedirs(workdir)
    p = pr.run([pr.python, driver, intruder, workdir], folder, timeout=timeout)
    out = [x for x in p.stdout.splitlines() if x.startswith("{")]
    log = os.path.join(workdir, "rollout", "worker-1.log")
    refusals = []
    if os.path.exists(log):
      with open(log, errors="replace") as f:
        refusals = [x for x in f if "refused a connection" in x]
    said = [x for x in p.stderr.splitlines() if x.startswith("intruder (")]
    said = said[0].split(": ", 1)[1] if said else "did not connect"
    if not out:
      return p, f"the trainer got no rollout; the intruder {said}; worker log: {len(refusals)} refusal(s)"
    got = json.loads(out[-1])
    return p, (
      f"the trainer got rollout {got['index']} (version {got['version']}), its handshake done {got['handshake_s']} s "
      f"after the intruder's, {got['replaced']} workers replaced; the intruder {said}; worker log: "
      f"{len(refusals)} refusal(s)"
    )

  return fn


CASES = {  # id: (title, command, fn)
  "0": ("control: a valid HF dir", "convert.py --hf_dir=X --out_dir=Y", convert_case(copy_single)),
  "1": ("rerun of a finished run", "train.py twice on one workdir", case_rerun),
  "2": ("SIGTERM mid-run", "train.py, SIGTERM after step 1", lambda pr, c: case_signal(pr, c, signal.SIGTERM)),
  "3": ("SIGINT mid-run", "train.py, SIGINT after step 1", lambda pr, c: case_signal(pr, c, signal.SIGINT)),
  "4": ("second run while one runs", "train.py ×2 at once, one workdir", case_second_run),
  "5": ("stale lock", "train.py, workdir.lock of a dead pid", case_stale_lock),
  "6": ("checkpoint into a full disk", "train.py, tmpfs full after checkpoints/3", case_full_disk),
  "7a": (
    "config.json: 10^6 layers",
    "convert.py, num_hidden_layers=10^6",
    convert_case(claim(num_hidden_layers=10**6)),
  ),
  "7b": ("config.json: 10^7 experts", "convert.py, n_routed_experts=10^7", convert_case(claim(n_routed_experts=10**7))),
  "8": ("overlapping data offsets", "convert.py, 2 tensors at one offset", convert_case(header_edit(_overlap))),
  "9": ("non-integer offsets", "convert.py, data_offsets [x.5, y.5]", convert_case(header_edit(_fractional))),
  "10": ("deeply nested header", "convert.py, header nested 10^5 deep", convert_case(header_edit(_nested))),
  "11": (
    "index path traversal",
    "convert.py, weight_map → ../outside/model.safetensors",
    convert_case(index_entry("../outside/model.safetensors", outside=True)),
  ),
  "12": (
    "index names a FIFO",
    "convert.py, weight_map → a FIFO",
    convert_case(index_entry("fifo.safetensors", fifo=True), timeout=60),
  ),
  "13": ("output = input (--to_hf)", "convert.py --to_hf --workdir=W --out_dir=W --overwrite", case_to_hf_onto_workdir),
  "14": ("output = input's parent", "convert.py --hf_dir=P/X --out_dir=P --overwrite", case_hf_onto_parent),
  "15": ("foreign X.partial", "quantize.py --out=X, a foreign X.partial/", case_foreign_partial),
  "16a": ("packed.json without 'plan'", "sample.py --packed=M", packed_case(_drop_plan)),
  "16b": ("packed.json tokenizer null", "sample.py --packed=M", packed_case(_null_tokenizer)),
  "16c": ("packed.json empty", "sample.py --packed=M", packed_case(_empty)),
  "17a": ("NaN in a model field", "train.py --config.model.rope_theta=nan", bad_value(model__rope_theta="nan")),
  "17b": ("NaN in an optimizer field", "train.py --config.optimizer.b2=nan", bad_value(optimizer__b2="nan")),
  "17c": (
    "inf in a train field",
    "train.py --config.train.mtp_loss_weight=inf",
    bad_value(train__mtp_loss_weight="inf"),
  ),
  "18": ("seed out of range", f"train.py --config.train.seed={2**64}", bad_value(train__seed=str(2**64))),
  "19a": ("sampling: temperature inf", "sample.py --temperature=inf", sampling("--temperature=inf")),
  "19b": ("sampling: seed -1", "sample.py --seed=-1", sampling("--seed=-1")),
  "20": ("SFT: every response cut", "train.py sft_tiny, prompts ≥ seq_len=16", case_sft_cut),
  "21": ("silent client", "ProcessRolloutWorker + a silent local client", rollout("silent")),
  "22": ("wrong-key client", "ProcessRolloutWorker + a wrong-key local client", rollout("wrong_key")),
}
CONVERT_CASES = ("0", "7a", "7b", "8", "9", "10", "11", "12", "13", "14")


def run_case(pr: Probe, case: str) -> Row:
  title, command, fn = CASES[case]
  try:
    out = fn(pr, case)
  except Exception as e:  # a setup that failed is the row, not the end of the probe
    return Row(case, title, command, "-", None, trim(f"(setup failed) {type(e).__name__}: {e}", 300), "-")
  if isinstance(out, str):
    return Row(case, title, command, "-", None, out, "-")
  p, survived, *line = out
  if line and line[0] and not p.killed:
    line = line[0]
  elif p.killed:
    line = p.killed + (f"; last stderr: {error_line(p.stderr)}" if p.stderr.strip() else "")
  elif p.rc == 0:
    stdout = [x for x in p.stdout.splitlines() if x.strip()]
    line = error_line(p.stderr) or ("stdout: " + stdout[-1] if stdout else "")
  else:
    line = error_line(p.stderr) or "(nothing on stderr)"
  lines = [x for x in p.stderr.splitlines() if x.strip()]
  return Row(
    case,
    title,
    command,
    rc_text(p),
    round(p.seconds, 1),
    trim(line),
    survived,
    round(p.peak_kib / 1024),
    len(lines),
    trim(lines[-1], 300) if lines else "",
    p.argv,
    p.stderr[-1500:],
  )


def table(rows: list[dict]) -> str:
  cols = (
    "case",
    "command",
    "exit code",
    "seconds",
    "stderr lines",
    "first line of the error (or last stderr line)",
    "what survived",
  )
  cell = lambda v: "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    values = (
      f"{r['case']}. {r['title']}",
      f"`{r['command']}`",
      r["rc"],
      r["seconds"],
      r.get("stderr_lines"),
      r["line"],
      r["survived"],
    )
    lines.append("| " + " | ".join(cell(v) for v in values) + " |")
  return "\n".join(lines)


def case_order(case: str) -> tuple[int, str]:
  m = re.match(r"(\d+)(.*)", case)
  return int(m[1]), m[2]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--root", default=HERE, help="the checkout whose launch/ scripts and glm_jax run")
  parser.add_argument(
    "--label", required=True, help="names the results file: experiments/results/fault_probe_<label>.jsonl"
  )
  parser.add_argument("--cases", default="", help="comma-separated case ids (default: all); rows merge into the file")
  parser.add_argument("--convert_last", action="store_true", help="run the convert cases after the others")
  parser.add_argument("--as_gib", type=float, default=6.0, help="each process's address-space limit (RLIMIT_AS)")
  parser.add_argument("--rss_gib", type=float, default=4.0, help="a command's process group is killed past this")
  parser.add_argument("--keep_tmp", action="store_true")
  args = parser.parse_args()
  root = os.path.abspath(args.root)
  wanted = [c for c in args.cases.split(",") if c] or list(CASES)
  unknown = [c for c in wanted if c not in CASES]
  if unknown:
    parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
  if args.convert_last:
    wanted = [c for c in wanted if c not in CONVERT_CASES] + [c for c in wanted if c in CONVERT_CASES]
  results = os.path.join(HERE, "experiments", "results", f"fault_probe_{args.label}.jsonl")
  tmp = tempfile.mkdtemp(prefix=f"fault_probe_{args.label}_")
  probe = Probe(root, tmp, args.as_gib, args.rss_gib)
  commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
  dirty = subprocess.run(["git", "-C", root, "status", "--porcelain"], capture_output=True, text=True).stdout
  meta = {
    "kind": "meta",
    "label": args.label,
    "root": root,
    "commit": commit,
    "uncommitted_files": len(dirty.splitlines()),
    "glm_jax_imported_from": probe.imported_glm_jax(),
    "python": sys.executable,
    "host": socket.gethostname(),
    "cpus": os.cpu_count(),
    "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  print(f"# root {root} (HEAD {commit[:9]}, {meta['uncommitted_files']} uncommitted files)", flush=True)
  print(f"# the children import glm_jax from {meta['glm_jax_imported_from']}", flush=True)
  if not meta["glm_jax_imported_from"].startswith(os.path.join(root, "glm_jax")):
    sys.exit(f"glm_jax does not come from {root}: {meta['glm_jax_imported_from']}")
  rows = {}
  if args.cases and os.path.exists(results):
    with open(results) as f:
      rows = {r["case"]: r for r in map(json.loads, f) if r.get("kind") == "case"}
  try:
    for case in wanted:
      t0 = time.monotonic()
      result = run_case(probe, case)
      rows[case] = {"kind": "case", **dataclasses.asdict(result)}
      print(f"# case {case} done in {time.monotonic() - t0:.0f} s: rc {result.rc}, {result.line[:100]}", flush=True)
  finally:
    for pgid in list(LIVE):
      kill_group(pgid)
    with open("/proc/mounts") as f:
      for line in f:
        if line.split()[1].startswith(tmp):
          subprocess.run(["umount", "-l", line.split()[1]], capture_output=True)
    if args.keep_tmp:
      print(f"# kept {tmp}")
    else:
      shutil.rmtree(tmp, ignore_errors=True)
  ordered = [rows[c] for c in sorted(rows, key=case_order)]
  os.makedirs(os.path.dirname(results), exist_ok=True)
  with open(results, "w") as f:
    for r in [meta, *ordered]:
      f.write(json.dumps(r) + "\n")
  print()
  print(table(ordered))
  print(f"\n(rows: {results})")


if __name__ == "__main__":
  main()
