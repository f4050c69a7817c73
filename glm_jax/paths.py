"""What a command may read and where it may write: the checks that keep bad input from destroying anything.

  with open_regular(path) as f: ...          # a FIFO, device or directory is refused by name, never waited on
  read_json(path)                            # the same, bounded in size, strict JSON, each failure naming the file
  check_apart("--out_dir", out, sources("--hf_dir", "/x"))  # out is not, does not contain, is not inside an input
  make_partial(path); clear_partial(path, "--out=/x")     # a `.partial` directory is removed only if it is ours

Paths are compared by what they are on disk (device and inode of each existing ancestor, symlinks resolved), so a
symlink, a bind mount or `a/../a` does not hide that an output is its input. A `.partial` directory is ours when it
holds PARTIAL_MARKER, a regular file written by make_partial: anything else under that name was not made here and is
left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

MAX_JSON_BYTES = 100 * 2**20  # a metadata file (config.json, an index, packed.json) larger than this is refused
PARTIAL_MARKER = ".glm_jax-partial"  # the file that makes a `.partial` directory ours

_KINDS = (
  (stat.S_ISDIR, "a directory"),
  (stat.S_ISFIFO, "a named pipe (FIFO)"),
  (stat.S_ISCHR, "a character device"),
  (stat.S_ISBLK, "a block device"),
  (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
  """What a file of this st_mode is, in words ("a regular file", "a named pipe (FIFO)", ...)."""
  return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "special")


def open_regular(path: str) -> IO[bytes]:
  """`path` open for binary reading, once it is known to be a regular file (symlinks followed): opened without
  blocking, so a FIFO or a device is refused (ValueError naming it and what it is) instead of waited on."""
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
  try:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      raise ValueError(f"{path}: {kind_of(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
  except BaseException:
    os.close(fd)
    raise


def strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """json's object_pairs_hook that refuses a key given twice (which one would a reader take?)."""
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"key {key!r} appears twice in one object")
    out[key] = value
  return out


def refuse_constant(word: str):
  """json's parse_constant that refuses NaN and Infinity, which are not JSON."""
  raise ValueError(f"{word} is not a JSON number")


def read_json(path: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
  """The JSON value of the regular file `path` (open_regular), at most max_bytes, strictly parsed: NaN and
  Infinity, a key twice in one object and nesting past the parser's depth are refused. Every failure is a
  ValueError that starts with the path."""
  with open_regular(path) as f:
    data = f.read(min(os.fstat(f.fileno()).st_size, max_bytes) + 1)  # not a buffer of max_bytes for a small file
  if len(data) > max_bytes:
    raise ValueError(f"{path}: larger than {max_bytes} bytes; not a metadata file")
  if not data.strip():
    raise ValueError(f"{path}: empty ({len(data)} bytes); expected a JSON object")
  try:
    return json.loads(data.decode("utf-8"), object_pairs_hook=strict_object, parse_constant=refuse_constant)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from e
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})") from e
  except RecursionError:
    raise ValueError(f"{path}: not strict JSON (nested too deeply to parse)") from None
  except ValueError as e:  # the hooks' refusals
    raise ValueError(f"{path}: not strict JSON ({e})") from e


# ----------------------------------------------------------------------------------- outputs apart from inputs


def _chain(path: str) -> tuple[bool, list[tuple[int, int]]]:
  """(whether path exists, the (device, inode) of it or of its nearest existing ancestor, then of each ancestor up
  to the root), symlinks resolved."""
  real = os.path.realpath(path)
  exists, ids = os.path.exists(real), []
  while True:
    try:
      st = os.stat(real)
      ids.append((st.st_dev, st.st_ino))
    except OSError:
      pass
    parent = os.path.dirname(real)
    if parent == real:
      return exists, ids
    real = parent


def relation(out: str, source: str) -> str | None:
  """How the output path `out` stands to the input `source`: "is", "contains", "is inside", or None when they are
  apart. Compared on disk (device and inode), symlinks resolved; an output that does not exist yet is placed by its
  nearest existing ancestor."""
  out_exists, out_ids = _chain(out)
  src_exists, src_ids = _chain(source)
  if not src_exists:
    return None
  if out_exists and out_ids[0] == src_ids[0]:
    return "is"
  if out_exists and out_ids[0] in src_ids[1:]:
    return "contains"
  if src_ids[0] in (out_ids[1:] if out_exists else out_ids):
    return "is inside"
  return None


def sources(flag: str, directory: str, files: Iterable[str] = ()) -> list[tuple[str, str]]:
  """check_apart's inputs for a directory given as `flag` and the files read through it, which a symlink may put
  elsewhere (the Hugging Face cache links a snapshot's files to its blobs)."""
  out = [(f"{flag}={directory}", directory)]
  for f in files:
    real = os.path.realpath(f)
    out.append((f"{f}{f' (-> {real})' if real != os.path.abspath(f) else ''}, which {flag} reads", f))
  return out


def check_apart(out_arg: str, out: str, sources: Sequence[tuple[str, str]]) -> None:
  """Raises ValueError (one line naming both) when the output `out` (the flag or argument out_arg) is, contains or
  is inside one of `sources` ((how to name it, its path)): a write there, or an --overwrite's removal, would
  destroy an input."""
  for name, source in sources:
    how = relation(out, source)
    if how:
      raise ValueError(
        f"{out_arg}={out} {how} {name}; an output must be apart from its input (not it, not above it, not inside "
        "it), or writing it could destroy the input"
      )


# ------------------------------------------------------------------------------------------ .partial directories


# ------------------------------------------------------------------------------------ who is writing something

LOCK_NAME = "workdir.lock"  # a workdir's lock file (glm_jax/train/lifecycle.py): a writer of the directory holds it
STALE_SECONDS = 300.0  # a writer on another host whose record was not refreshed for this long is taken as gone


def process_start(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (Linux's /proc/<pid>/stat field 22), or None."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def writer_record() -> dict[str, Any]:
  """This process, as a lock file or a `.partial` marker records its writer: host, pid, the pid's start time."""
  return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid())}


def writer_gone(record: Mapping[str, Any], age: float) -> str | None:
  """Why the writer that `record` (writer_record's fields) names is gone, or None when it may still be writing.
  On this host: no process with that pid, or one that started at another time (the pid was reused). On another
  host (or an unreadable record): its record, refreshed by the writer, is older than STALE_SECONDS (age, seconds)."""
  pid = record.get("pid")
  if record.get("host") == socket.gethostname() and isinstance(pid, int) and not isinstance(pid, bool):
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return f"no process {pid} on this host"
    except PermissionError:
      pass  # alive, another user's
    if record.get("pid_start") is not None and process_start(pid) not in (None, record["pid_start"]):
      return f"process {pid} on this host is another process (it started later)"
    return None
  if age > STALE_SECONDS:
    return f"its record was last refreshed {age:.0f} s ago (more than {STALE_SECONDS:.0f} s)"
  return None


def read_record(path: str) -> dict[str, Any]:
  """The JSON object of a lock file or marker, or {} when it is being written, torn or not one."""
  try:
    with open_regular(path) as f:
      record = json.loads(f.read(65536).decode("utf-8"))
    return record if isinstance(record, dict) else {}
  except (OSError, ValueError):
    return {}


def is_ours(partial: str) -> bool:
  """Whether `partial` is a directory (not a symlink) made by make_partial (it holds the marker file)."""
  try:
    if not stat.S_ISDIR(os.lstat(partial).st_mode):
      return False
    return stat.S_ISREG(os.lstat(os.path.join(partial, PARTIAL_MARKER)).st_mode)
  except OSError:
    return False


def make_partial(partial: str) -> None:
  """Creates the directory `partial` (which must not exist) with the marker that makes it ours and names its writer
  (writer_record)."""
  os.makedirs(partial)
  with open(os.path.join(partial, PARTIAL_MARKER), "w", encoding="utf-8") as f:
    json.dump({"made_by": "glm_jax", **writer_record(), "time": time.time()}, f)


def clear_partial(partial: str, owner: str) -> None:
  """Removes `partial` when it is ours and its writer is gone (a write that died before its rename). Anything else at
  that path is left as it is and refused: FileExistsError naming it and `owner`, the output written through it
  ("--out=/x"): a `.partial` not made by this code, or one whose writer may still be writing it."""
  if not os.path.lexists(partial):
    return
  if not is_ours(partial):
    raise FileExistsError(
      f"{owner} is written through {partial}, which exists and was not made by this code (no {PARTIAL_MARKER} in "
      "it), so it is left alone; move it away or choose another output"
    )
  marker = os.path.join(partial, PARTIAL_MARKER)
  record = read_record(marker)
  if writer_gone(record, time.time() - os.path.getmtime(marker)) is None:
    raise FileExistsError(
      f"{owner} is being written through {partial} by pid {record.get('pid')} on host {record.get('host')!r}; "
      "wait for it to end or choose another output"
    )
  shutil.rmtree(partial)
