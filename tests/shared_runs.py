"""Runs the whole test session shares: each is trained once, by whichever pytest-xdist worker asks first (the others
wait on a file lock), in a directory beside the workers' temporary folders, and handed out read-only by contract.

A test that writes into a run copies it first (`copy_run`). What each run held when it was made is kept as a
manifest (every file's path, size and sha256); at the end of the session each process checks the runs it was handed
against theirs (tests/conftest.py: verify_shared_runs), so a test that changed a shared run fails the session."""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil

_handed_out: dict[str, str] = {}  # run directory -> its manifest, in this process


def session_root(tmp_path_factory) -> str:
  """The folder every process of the session sees: pytest's basetemp, or with xdist its workers' common parent."""
  base = tmp_path_factory.getbasetemp()
  return str(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@contextlib.contextmanager
def _locked(path: str):
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def manifest(directory: str) -> dict[str, list]:
  """{relative path: [size, sha256]} of every file under `directory`."""
  out = {}
  for folder, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(path, directory)] = [os.path.getsize(path), digest]
  return out


def shared_run(tmp_path_factory, name: str, make) -> str:
  """The session's run `name`: made by make(directory) the first time any process asks, then the same directory.
  make writes only inside `directory` (which does not exist yet) and raises if the run failed."""
  root = os.path.join(session_root(tmp_path_factory), "shared_runs")
  os.makedirs(root, exist_ok=True)
  run, record = os.path.join(root, name), os.path.join(root, f"{name}.manifest.json")
  with _locked(os.path.join(root, f"{name}.lock")):
    if not os.path.exists(record):
      shutil.rmtree(run, ignore_errors=True)  # a make that failed part way, in an earlier test
      make(run)
      with open(record, "w") as f:
        json.dump(manifest(run), f)
  _handed_out[run] = record
  return run


def copy_run(run: str, target) -> str:
  """A copy of a shared run at `target`, for a test that writes into it (resumes, corrupts, locks it)."""
  shutil.copytree(run, str(target))
  return str(target)


def changed_runs() -> list[str]:
  """The shared runs this process was handed whose files differ from their manifests, each with what differs."""
  problems = []
  for run, record in sorted(_handed_out.items()):
    with open(record) as f:
      want = json.load(f)
    got = manifest(run)
    diff = sorted(p for p in set(want) | set(got) if want.get(p) != got.get(p))
    if diff:
      problems.append(f"{run}: {diff[:10]} changed (a test wrote into a shared run: copy it with copy_run)")
  return problems
