"""What the launch scripts share: a user's mistake ends the script in one line, not a traceback.

  cli.run(main)   # instead of absl.app.run(main)

A bad flag or config override, a config file that does not load, a bad config value, a missing or unwritable
path, an unreadable checkpoint or a diverged run prints `error: <message>` on stderr and exits with code 2 (flags
and usage) or 1 (everything else); the message names the field or file, its value and what is valid. A run
stopped by SIGTERM or SIGINT after its checkpoint (glm_jax/train/lifecycle.py) says so in one line and exits with
128 + the signal's number. Set GLM_JAX_TRACEBACK=1, or pass -v 1, to get the full traceback instead. Any other
exception is a bug and keeps its traceback.

The scripts are the package glm_jax.launch (launch/ links to it), so an installed glm-jax runs them as
`python -m glm_jax.launch.train --config=configs/glm5_tiny.py`: a --config path under configs/ that does not exist
from the working directory is the installed package's config of that name (glm_jax/configs; packaged_config_argv).
"""

from __future__ import annotations

import importlib.util
import logging as pylogging
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable

from absl import app, flags, logging

from glm_jax.train.guards import Diverged
from glm_jax.train.lifecycle import Stopped


def require_extra(extra: str, *modules: str) -> None:
  """Ends the script in one line, naming the extra to install, when a module of that optional extra of the package
  (pyproject.toml) is missing. A script calls it before the imports that need the extra."""
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if missing:
    sys.stderr.write(
      f'error: this needs the {extra} extra, which installs {", ".join(missing)}: pip install "glm-jax[{extra}]"\n'
    )
    sys.exit(1)


# What a user's input can cause; anything else is a bug and shows its traceback.
USER_ERRORS = (ValueError, OSError, Diverged, app.UsageError)
TRACEBACK_ENV = "GLM_JAX_TRACEBACK"


def _want_traceback(argv: list[str]) -> bool:
  if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
    return True
  try:
    return flags.FLAGS["verbosity"].present and flags.FLAGS.verbosity >= 1
  except flags.Error:  # flags not parsed
    return any(re.fullmatch(r"-(v|-verbosity)=?[1-9]\d*", a) for a in argv) or "-v" in argv


def fail(message: str, code: int = 1) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(code)


def _message(error: BaseException) -> str:
  """str(error) in one line; ml_collections' "no such field" KeyErrors arrive repr'd with an embedded newline."""
  text = str(error)
  if isinstance(error, (KeyError, AttributeError)):
    text = text.strip("'\"").replace("\\'", "'").replace("\\n", " ")
    text = re.sub(r"^'(\w+)' Did you mean", r"no field '\1'; did you mean", text)
  return " ".join(text.split())


CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def packaged_config_argv(argv: list[str]) -> list[str]:
  """argv with a --config path of the form configs/NAME.py[:variant] that does not exist from the working directory
  replaced by glm_jax/configs/NAME.py[:variant] (a checkout's configs/ is a link to it, so inside a checkout both
  name the same file); a NAME that is in neither is refused in one line listing the configs. Any other --config
  value is left to config_flags, which names it when it does not load."""

  def packaged(value: str) -> str:
    path, sep, variant = value.partition(":")
    head, _, name = path.partition("/")
    if os.path.normpath(head) != "configs" or os.path.exists(path):
      return value
    candidate = os.path.join(CONFIGS_DIR, name)
    if not os.path.isfile(candidate):
      known = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".py") and f not in ("__init__.py", "common.py"))
      fail(f"--config={value}: {path} is neither here nor in the installed package's configs: {', '.join(known)}", 2)
    return candidate + sep + variant

  out = list(argv[:1])
  args = iter(argv[1:])
  for a in args:
    if a in ("--config", "-config"):
      out += [a, packaged(next(args, ""))]
    elif a.startswith(("--config=", "-config=")):
      flag, _, value = a.partition("=")
      out.append(f"{flag}={packaged(value)}")
    else:
      out.append(a)
  return out


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every failure (an unknown --config.* field, a config file that does not load, a
  bad value) reported in one line naming the flag; a --config under configs/ may name the installed package's
  (packaged_config_argv)."""
  argv = packaged_config_argv(argv)
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - whatever the parse raised came from the command line or the config file
    if _want_traceback(argv):
      raise
    text = _message(e)
    key = re.search(r"field '(\w+)'|^'?(\w+)'", text)
    if key and not isinstance(e, flags.Error):
      name = key.group(1) or key.group(2)
      arg = next((a for a in argv[1:] if a.startswith("--config.") and re.search(rf"\.{name}(=|\.|$)", a)), None)
      if arg:
        text = f"{arg}: the config has {text}" if text.startswith("no field") else f"{arg}: {text}"
    fail(text + " (--helpfull lists the flags)", 2)


class _OneLineBackgroundErrors(pylogging.Filter):
  """Shortens a log record of a failure in a library's background thread or event loop (Orbax's save threads, and
  asyncio's "exception was never retrieved" of their writes) to its message and the exception's last line: when a
  checkpoint cannot be written (a full disk), Orbax's threads log one traceback a failed write, hundreds of lines
  before the run's own one-line error, which names the step and the cause. GLM_JAX_TRACEBACK=1 keeps them whole."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    if record.exc_info and (record.name == "asyncio" or f"{os.sep}orbax{os.sep}" in record.pathname):
      last = " ".join(traceback.format_exception_only(*record.exc_info[:2])[-1].split())
      record.msg, record.args = f"{record.getMessage()} ({last[:300]})", None
      record.exc_info = record.exc_text = None
    return True


def _one_line_unraisable(unraisable) -> None:
  """sys.unraisablehook in one line: what the interpreter reports of a coroutine or thread a library left failing
  (at exit, say) is not the run's error, which is printed once, last."""
  where = f" in {unraisable.object!r}"[:120] if unraisable.object is not None else ""
  print(f"(ignored{where}: {unraisable.exc_type.__name__}: {str(unraisable.exc_value)[:200]})", file=sys.stderr)


def run(main: Callable[[list[str]], None]) -> None:
  """absl.app.run(main) with the one-line errors of the module docstring."""

  def guarded(argv):
    if not _want_traceback(argv):
      for name in ("absl", "asyncio"):
        pylogging.getLogger(name).addFilter(_OneLineBackgroundErrors())
      sys.unraisablehook = _one_line_unraisable
    try:
      main(argv)
    except Stopped as e:  # a preemption or Ctrl-C, after the checkpoint of the step it stopped at
      logging.flush()
      print(str(e), file=sys.stderr, flush=True)
      sys.exit(e.exit_code)
    except KeyboardInterrupt:
      if _want_traceback(argv):
        raise
      logging.flush()
      print("interrupted (a second Ctrl-C): nothing more was saved", file=sys.stderr, flush=True)
      sys.exit(128 + signal.SIGINT)
    except USER_ERRORS as e:
      if _want_traceback(argv):
        raise
      logging.flush()
      fail(f"{_message(e)}", 2 if isinstance(e, app.UsageError) else 1)

  app.run(guarded, flags_parser=_parse_flags)
