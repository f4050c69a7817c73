"""Launch scripts run as a user runs them (`python launch/<script> args...` from the repository root), each in a
process forked from a zygote that has already imported what the scripts import (jax, flax, optax, Orbax, Grain,
glm_jax: about 2 s of CPU a start, most of what a refusal costs).

The zygote is started by the first call in a test process, with that process's environment, and forks one child a
call. No jax backend exists before the fork (importing jax starts none), so the child starts its own, as a fresh
process would; its stdin is /dev/null and its stdout and stderr go to files read back after it exits. The zygote
stops a child past `limit_kib` resident or `timeout` seconds, and reports its exit code and peak resident memory
(os.wait4's ru_maxrss: the pages the child holds, those it shares with the zygote included).

A call's environment is applied in the child; one whose JAX_* variables (which jax reads at import) differ from
every zygote's starts a zygote of its own.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading

from tests.helpers import ROOT

_ZYGOTE = """
import json, os, runpy, sys, time
import jax, flax.nnx, grain, ml_collections.config_flags, optax, orbax.checkpoint
import glm_jax.cli, glm_jax.convert.stream, glm_jax.quant.packed, glm_jax.train.lifecycle, glm_jax.train.trainer
for line in sys.stdin:
  argv, env, timeout, limit_kib, out_path, err_path = json.loads(line)
  pid = os.fork()
  if pid == 0:
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, out_path), (2, err_path)):
      os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    for key, value in env.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
    sys.argv, code = list(argv), 0
    try:
      runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
      import traceback
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  t0, killed = time.monotonic(), False
  while True:
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done:
      break
    if limit_kib:
      try:
        with open(f"/proc/{pid}/status") as f:
          rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
      except (OSError, StopIteration):
        rss = 0
      killed = killed or rss > limit_kib
    killed = killed or time.monotonic() - t0 > timeout
    if killed:
      os.kill(pid, 9)
    time.sleep(0.02)
  print(json.dumps([out_path, os.waitstatus_to_exitcode(status), usage.ru_maxrss, killed]), flush=True)
"""


@dataclasses.dataclass
class Run:
  returncode: int
  stdout: str
  stderr: str
  peak_kib: int
  killed: bool  # stopped past limit_kib or timeout


class _Zygote:
  def __init__(self, env: dict):
    self.env = env
    self.proc = subprocess.Popen(
      [sys.executable, "-c", _ZYGOTE], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    self.lock = threading.Lock()
    atexit.register(self.proc.stdin.close)

  def run(self, argv, env: dict, timeout: float, limit_kib: int) -> Run:
    changes = {k: v for k, v in env.items() if self.env.get(k) != v}
    changes.update({k: None for k in self.env if k not in env})
    with self.lock, tempfile.TemporaryDirectory() as d:
      out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
      self.proc.stdin.write(json.dumps([list(argv), changes, timeout, limit_kib, out, err]) + "\n")
      self.proc.stdin.flush()
      answer = self.proc.stdout.readline()
      assert answer, f"the zygote exited with code {self.proc.wait()}"
      request, rc, peak_kib, killed = json.loads(answer)
      if request != out:  # an answer to an earlier call that was interrupted: this zygote is out of step
        self.proc.kill()
        raise RuntimeError(f"the zygote answered another call ({request}); it is stopped, the next call starts one")
      with open(out) as f_out, open(err) as f_err:
        return Run(rc, f_out.read(), f_err.read(), peak_kib, killed)


_zygotes: dict[tuple, _Zygote] = {}  # by the JAX_* variables of their environment, which jax reads at import


def run(script: str, *args: str, timeout: float = 600, env: dict | None = None, limit_kib: int = 0) -> Run:
  """`python <script> args...` from the repository root with `env` (default: this process's environment), in a
  child of the zygote started with env's JAX_* variables (a variable jax reads at import), the first such call
  starting it; `killed` when it was stopped past `limit_kib` resident KiB (0: no limit) or `timeout` seconds."""
  env = dict(os.environ if env is None else env)
  key = tuple(sorted((k, v) for k, v in env.items() if k.startswith("JAX_")))
  if key not in _zygotes or _zygotes[key].proc.poll() is not None:
    _zygotes[key] = _Zygote(env)
  return _zygotes[key].run([script, *args], env, timeout, limit_kib)
