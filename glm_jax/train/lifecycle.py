"""How a run ends and what it holds while it runs: stop signals (a preemption, Ctrl-C) and the workdir lock.

Stop signals (StopSignals, used by the training loops): SIGTERM (how Cloud TPU, Kubernetes and Slurm announce a
preemption) and SIGINT (Ctrl-C) finish the step in flight, save and wait for its checkpoint, and raise Stopped, which
launch scripts turn into one line and exit code 128 + the signal's number (143, 130); the same command resumes. A
second Ctrl-C interrupts at once (KeyboardInterrupt, nothing more saved). One process reads a flag at each step
boundary. Several processes must stop at the same step, or the checkpoint's collective writes would wait forever:
SIGTERM is left to jax's preemption sync manager (multihost_utils.reached_preemption_sync_point(step), true at one
step on all of them), and SIGINT is passed on as a SIGTERM to this process.

The workdir lock (workdir_lock): one run at a time writes a workdir. `<workdir>/workdir.lock` is created with O_EXCL
and records the holder (host, pid, the process's start time, when, the command), its modification time refreshed
every HEARTBEAT_SECONDS. A second run refuses in one line naming the holder; a lock whose holder is gone (on this
host: no process with that pid and start time; elsewhere: no heartbeat for STALE_SECONDS) is taken over with a log
line. In a multi-process run process 0 holds it for the job, so all start or all refuse; it is re-entrant within a
process.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
from absl import logging

from glm_jax import paths

LOCK_NAME = paths.LOCK_NAME
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = paths.STALE_SECONDS  # a holder on another host whose lock was not refreshed for this long is gone


class Stopped(Exception):
  """The run stopped on a signal after saving a checkpoint; exit_code is 128 + the signal's number."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


class WorkdirLocked(OSError):
  """Another live process holds the workdir (the message names it)."""


def _multi_process() -> bool:
  return jax.process_count() > 1


class StopSignals:
  """A context manager that turns SIGTERM and SIGINT into a stop at the next step boundary (see the module
  docstring); `due(step)` after each step says whether to stop there: the signal's number, or None. Outside the main
  thread (where Python cannot set signal handlers) it installs nothing and only the multi-process agreement is
  asked."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}
    self._multi = False

  def __enter__(self) -> "StopSignals":
    self._multi = _multi_process()
    if threading.current_thread() is not threading.main_thread():
      return self
    wanted = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
    for sig in wanted:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    if self._multi:  # the preemption sync manager's protocol, which every process takes part in
      os.kill(os.getpid(), signal.SIGTERM)
      return
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: at once
    if self.signum is None:
      self.signum = signum
      print(
        f"{signal.Signals(signum).name}: stopping after this step with a checkpoint (Ctrl-C again stops at once)",
        file=sys.stderr,
        flush=True,
      )

  def due(self, step: int) -> int | None:
    """The signal to stop for after `step` (the number of steps done), or None. Call it after every step."""
    if self._multi:
      from jax.experimental import multihost_utils

      try:
        if multihost_utils.reached_preemption_sync_point(step):
          return signal.SIGTERM
      except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
        pass
      return None
    return self.signum


def stopped_message(signum: int, step: int, checkpoint_dir: str) -> str:
  """The line a run stopped by `signum` after `step` ends with."""
  return (
    f"stopped by {signal.Signals(signum).name} after step {step}: its checkpoint is in {checkpoint_dir}/{step}; "
    "run the same command again to resume"
  )


# The workdir lock.

_held: dict[str, list] = {}  # realpath of the lock file -> [count, heartbeat thread's stop event]


def _holder_record() -> dict:
  return {
    **paths.writer_record(),
    "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    "command": " ".join([os.path.basename(sys.argv[0] if sys.argv else "python"), *sys.argv[1:]])[:500],
  }


def _describe(holder: dict) -> str:
  if not holder:
    return "an unknown process (the lock file is empty or unreadable)"
  command = str(holder.get("command", "?"))
  command = command if len(command) <= 80 else command[:77] + "..."
  return f"pid {holder.get('pid')} on host {holder.get('host')!r}, started {holder.get('started')} ({command})"


def _holder_gone(holder: dict, path: str) -> str | None:
  """Why the holder of the lock at `path` is gone, or None when it may be alive (paths.writer_gone)."""
  try:
    age = time.time() - os.path.getmtime(path)
  except OSError:
    return "the lock file is gone"
  return paths.writer_gone(holder, age)


def _heartbeat(path: str, stop: threading.Event) -> None:
  while not stop.wait(HEARTBEAT_SECONDS):
    with contextlib.suppress(OSError):
      os.utime(path)


def _acquire(path: str, purpose: str) -> None:
  for _ in range(5):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      holder = paths.read_record(path)
      gone = _holder_gone(holder, path)
      if gone is None:
        raise WorkdirLocked(
          f"{os.path.dirname(path)} is in use by {_describe(holder)}: one run at a time writes a workdir; wait for "
          f"it to end or use another --workdir (if that process is gone for good, remove {path})"
        ) from None
      aside = f"{path}.stale.{os.getpid()}"
      try:
        os.rename(path, aside)  # of several processes taking it over at once, one renames it
      except FileNotFoundError:
        continue
      os.remove(aside)
      logging.warning("took over %s from %s: %s", path, _describe(holder), gone)
      continue
    with os.fdopen(fd, "w") as f:
      json.dump({**_holder_record(), "purpose": purpose}, f)
      f.flush()
      os.fsync(f.fileno())
    return
  raise WorkdirLocked(f"{path}: could not take the lock (other processes keep taking it)")


@contextlib.contextmanager
def workdir_lock(workdir: str, purpose: str) -> Iterator[None]:
  """Holds `workdir`'s lock for the block (see the module docstring); raises WorkdirLocked naming the holder when a
  live process holds it. A workdir this call creates is removed again at the end if the block left it empty.
  `purpose` (e.g. "training") is recorded in the lock file."""
  workdir = os.path.abspath(workdir)
  path = os.path.realpath(os.path.join(workdir, LOCK_NAME))
  if path in _held:  # this process holds it already
    _held[path][0] += 1
    try:
      yield
    finally:
      _held[path][0] -= 1
    return
  created = not os.path.exists(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise NotADirectoryError(f"{workdir}: a file, not a directory; it cannot be written as one")
  error = None
  if jax.process_index() == 0:
    try:
      os.makedirs(workdir, exist_ok=True)
      _acquire(path, purpose)
    except OSError as e:
      error = e
      if created:
        with contextlib.suppress(OSError):
          os.rmdir(workdir)
  if _multi_process():  # every process starts, or none
    from jax.experimental import multihost_utils

    failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
    if failed and error is None:
      error = WorkdirLocked(f"{workdir}: process 0 could not take the workdir's lock (its error says why)")
  if error is not None:
    raise error
  stop = threading.Event()
  if jax.process_index() == 0:
    threading.Thread(target=_heartbeat, args=(path, stop), daemon=True, name="workdir-lock-heartbeat").start()
  _held[path] = [1, stop]
  try:
    yield
  finally:
    del _held[path]
    stop.set()
    if jax.process_index() == 0:
      if paths.read_record(path).get("pid") == os.getpid():
        with contextlib.suppress(OSError):
          os.remove(path)
      if created:
        with contextlib.suppress(OSError):
          os.rmdir(workdir)  # only when empty
