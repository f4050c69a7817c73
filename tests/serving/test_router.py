"""launch/router.py, run as a user runs it: two engines (launch/serve.py) behind SGLang's router (the sglang-router
package), supervised.

The engines serve a small checkpoint (glm5_tiny at its random initialization, saved as the trainer saves it) behind the
router (round_robin, so that both take requests); a trainer's POST /update_weights to each engine tags the weights
"rl-1". One engine is SIGKILLed while it decodes a batch of concurrent /generate requests sent through the router: every
request gets its whole answer (the router retries those the dead engine held on the other one) or a clear HTTP error,
none is lost (a dropped connection, a cut body); the engine comes back (restarted from the checkpoint, under the
checkpoint's own version, put back into the router) and answers requests through the router again. SIGTERM then stops
the router and the engines: exit code 143, every port closed.
"""

import concurrent.futures
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import glm_jax.configs.glm5_tiny
from glm_jax.data import load_tokenizer
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.trainer import create_train_state
from glm_jax.serving import fleet as fleet_lib
from glm_jax.serving.fleet import free_port_run
from tests.helpers import ROOT

STEP = 3  # the checkpoint's step: the engines' weight version until /update_weights names another
VERSION = "rl-1"
NEW_TOKENS = 48
# a token a step: the 16 requests stay running long enough to be caught there by the kill below, on a loaded machine too
ENGINE_FLAGS = "--pages=64 --page_size=16 --max_running=8 --prefill_chunk=32 --max_seq_len=256 --decode_steps=1"


def refuses(port: int) -> bool:
  with socket.socket() as s:
    return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_cache_dir):
  """A run directory with one checkpoint at step STEP, as launch/train.py writes it (state, config, tokenizer)."""
  config = glm_jax.configs.glm5_tiny.get_config()
  config.data.cache_dir = data_cache_dir
  _, state, _, _ = create_train_state(config, model_config_for_stage(config))
  path = str(tmp_path_factory.mktemp("run"))
  with Checkpointer(path) as ckpt:
    ckpt.save(STEP, state, None, config.to_dict(), tokenizer=load_tokenizer(config.data).record(), force=True)
  return path


class Fleet:
  """`python launch/router.py ...` in a subprocess, its output in a file: the lines it logs, the engines' pids."""

  def __init__(self, workdir, data_cache_dir, log_path):
    self.port = free_port_run(4)  # the router, 2 engines, the router's metrics
    self.engine_urls = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(2)]
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = log_path
    args = [
      "--config=configs/glm5_tiny.py",
      f"--config.data.cache_dir={data_cache_dir}",  # passed on to the engines, as the run was configured
      f"--workdir={workdir}",
      "--engines=2",
      f"--port={self.port}",
      "--policy=round_robin",
      "--health_every=1",
      f"--engine_flags={ENGINE_FLAGS}",
    ]
    with open(log_path, "w") as log:
      self.proc = subprocess.Popen(
        [sys.executable, "launch/router.py", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
      )

  def log(self) -> str:
    with open(self.log_path, errors="replace") as f:
      return f.read()

  def wait_for(self, pattern: str, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
      match = re.search(pattern, self.log())
      if match:
        return match
      assert self.proc.poll() is None, f"launch/router.py exited ({self.proc.returncode}):\n{self.log()[-4000:]}"
      time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {timeout} s:\n{self.log()[-4000:]}")

  def pid(self, index: int) -> int:
    return int(re.findall(rf"engine {index} \(pid (\d+)\) is (?:up|back)", self.log())[-1])

  def stop(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
        self.proc.wait()


def generate(url: str, i: int) -> httpx.Response:
  sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}  # every answer NEW_TOKENS long
  body = {"input_ids": [5 + i, 6, 7, 8 + i], "sampling_params": sampling}
  return httpx.post(f"{url}/generate", json=body, timeout=300)


def finished(engine_url: str) -> int:
  """Requests the engine finished (its /get_server_info stats)."""
  stats = httpx.get(f"{engine_url}/get_server_info", timeout=10).json()["stats"]
  return sum(v for k, v in stats.items() if k.startswith("finished_"))


class ScriptedBases(random.Random):
  """A generator that picks the given first ports in turn (the span that holds each, then the port)."""

  def __init__(self, bases):
    super().__init__(0)
    self.bases = list(bases)

  def choices(self, population, weights=None, *, cum_weights=None, k=1):
    return [next(span for span in population if span[0] <= self.bases[0] <= span[1])]

  def randint(self, a, b):
    base = self.bases.pop(0)
    assert a <= base <= b, (a, base, b)
    return base


def test_free_port_run_lies_outside_the_ephemeral_range_and_passes_over_a_busy_port(tmp_path, monkeypatch):
  """The ports free_port_run picks (bound later, some many seconds later) lie outside the kernel's ephemeral range, from
  which any process's outgoing connection may be given one meanwhile: the range as /proc says (Linux's default where
  it cannot be read), each port of the run free, a run holding a port in use passed over, none when the range leaves
  no room."""
  ranges = tmp_path / "ip_local_port_range"
  ranges.write_text("20000\t50000\n")
  assert fleet_lib.ephemeral_ports(str(ranges)) == (20000, 50000)
  assert fleet_lib.ephemeral_ports(str(tmp_path / "absent")) == (32768, 60999)
  ranges.write_text("garbled\n")
  assert fleet_lib.ephemeral_ports(str(ranges)) == (32768, 60999)

  def check(n, first, last, seeds):
    for seed in seeds:
      port = free_port_run(n, random.Random(seed))
      run = range(port, port + n)
      assert run[0] >= 1024 and run[-1] <= 65535 and (run[-1] < first or run[0] > last), (port, first, last)
      for p in run:  # each free: it binds
        with socket.socket() as s:
          s.bind(("127.0.0.1", p))

  check(4, *fleet_lib.ephemeral_ports(), range(30))  # this machine's range
  busy, spare = free_port_run(4), free_port_run(4)
  while abs(spare - busy) < 4:
    spare = free_port_run(4)
  with socket.socket() as s:
    s.bind(("127.0.0.1", busy + 2))
    assert free_port_run(4, ScriptedBases([busy, spare])) == spare  # busy .. busy + 3 holds a port in use

  monkeypatch.setattr(fleet_lib, "ephemeral_ports", lambda: (1024, 40000))  # room only above
  check(4, 1024, 40000, range(10))
  monkeypatch.setattr(fleet_lib, "ephemeral_ports", lambda: (30000, 65535))  # room only below
  check(4, 30000, 65535, range(10))

  monkeypatch.setattr(fleet_lib, "ephemeral_ports", lambda: (1024, 65533))
  with pytest.raises(RuntimeError, match="leave no run of 4"):
    free_port_run(4)


@pytest.mark.slow  # two engine processes start, one twice; about 2 minutes on 2 CPU cores
def test_a_killed_engine_loses_no_request_and_comes_back_with_the_current_weights(workdir, data_cache_dir, tmp_path):
  fleet = Fleet(workdir, data_cache_dir, str(tmp_path / "router.log"))
  try:
    fleet.wait_for(r"router on http://", timeout=600)
    for url in fleet.engine_urls:  # as a trainer pushes new weights: each engine reloads the checkpoint, renamed
      assert httpx.get(f"{url}/health").json()["weight_version"] == STEP
      reply = httpx.post(f"{url}/update_weights", json={"weight_version": VERSION}, timeout=120).json()
      assert reply == {"success": True, "weight_version": VERSION}
    for i in range(2):  # one each (round robin): the first generations after new weights compile
      assert generate(fleet.url, i).json()["meta_info"]["weight_version"] == VERSION
    time.sleep(2)  # the supervisor polls every second: it has seen the new version

    victim, victim_pid = fleet.engine_urls[0], fleet.pid(0)
    # The watching client is made before the requests start. Made after them, beside the 16 request threads making
    # their own, its first poll once came after 14 of the 16 had been answered, and no later poll saw a request.
    with httpx.Client() as watch, concurrent.futures.ThreadPoolExecutor(16) as pool:
      futures = [pool.submit(generate, fleet.url, i) for i in range(16)]
      # It holds requests when it dies: running, or waiting for their first step. On a loaded machine that first step
      # can wait for a compile (a fresh-clone CI run saw none running within 60 s; the test passes alone in 34 s).
      deadline = time.time() + 240
      while sum(watch.get(f"{victim}/get_server_info").json()[k] for k in ("running", "waiting")) == 0:
        assert time.time() < deadline, "engine 0 got no request"
        time.sleep(0.01)
      os.kill(victim_pid, signal.SIGKILL)
      answers = errors = 0
      for future in futures:
        reply = future.result()  # a dropped connection or a timeout raises here: a lost request
        if reply.status_code == 200:
          out = reply.json()
          assert len(out["output_ids"]) == NEW_TOKENS, out
          assert out["meta_info"]["weight_version"] == VERSION
          answers += 1
        else:  # a clear error: an HTTP status and a body that says what failed
          assert reply.status_code >= 400 and reply.text, reply
          errors += 1
    assert answers + errors == 16 and answers >= 8, (answers, errors)

    fleet.wait_for(rf"engine 0 \(pid (?!{victim_pid}\))\d+\) is back in the router", timeout=600)
    assert fleet.pid(0) != victim_pid
    # It serves the workdir's latest checkpoint, under that checkpoint's own version: a restarted engine is never
    # given another weights' name (the trainer's label went with the process it was pushed to).
    assert httpx.get(f"{victim}/health").json()["weight_version"] == STEP
    workers = httpx.get(f"{fleet.url}/workers").json()["workers"]
    assert sorted(w["url"] for w in workers if w["is_healthy"]) == fleet.engine_urls
    before = finished(victim)
    versions = set()
    for i in range(4):  # round robin: two reach the restarted engine
      out = generate(fleet.url, i).json()
      assert len(out["output_ids"]) == NEW_TOKENS
      versions.add(out["meta_info"]["weight_version"])
    assert finished(victim) - before >= 1 and versions == {VERSION, STEP}

    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(60) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in fleet.log()
    assert all(refuses(fleet.port + i) for i in range(3))
  finally:
    fleet.stop()
