r"""A load generator against the serving engine's HTTP server, and the same load through the static-batch Sampler.

  bash scripts/with_env.sh python experiments/bench_serving.py [--clients=32] [--requests=128] [--rate=8]

The server (launch/serve.py's app, glm_jax/serving/server.py) runs in a subprocess on loopback with glm5_tiny's
shapes, randomly initialized (throughput does not depend on the weights: no request stops early, each generates
exactly its output length). The load: --requests requests with Poisson arrivals at --rate a second, at most
--clients in flight at once (a client waits for its answer before it sends the next one due), each a random prompt of
--prompt_min..--prompt_max tokens asking for --out_min..--out_max new tokens, greedy, sent to POST /generate with
stream=true (time to first token is the first event). Printed, one JSON line a system: requests/s, output tokens/s,
and p50 / p99 of the time to first token and of the end-to-end latency.

The static-batch baseline runs the same requests, arriving on the same schedule, through one `Sampler` in this
process: whenever it is idle it takes up to --clients requests that have arrived (padded to --clients rows, one
compiled program) and runs every row for --out_max tokens (one program; a batch of many rows holds an output near that
long anyway), counting each request's own output; a request's latency ends with its batch.
The engine alone (--systems=alone) runs the same load through the engine in this process, without HTTP. Every system
is compiled before the clock starts.
"""

import asyncio
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from absl import app, flags

_CLIENTS = flags.DEFINE_integer("clients", 32, "Requests in flight at once at most (the engine's max_running too).")
_REQUESTS = flags.DEFINE_integer("requests", 128, "Requests in all.")
_RATE = flags.DEFINE_float("rate", 8.0, "Poisson arrivals a second.")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min", 16, "Shortest prompt.")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 128, "Longest prompt.")
_OUT_MIN = flags.DEFINE_integer("out_min", 16, "Fewest new tokens.")
_OUT_MAX = flags.DEFINE_integer("out_max", 64, "Most new tokens.")
_SEED = flags.DEFINE_integer("seed", 0, "The load's seed.")
_ROLE = flags.DEFINE_string("role", "client", "client (the benchmark) or server (its subprocess).")
_PORT = flags.DEFINE_integer("port", 8321, "The server's port on 127.0.0.1.")
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 4, "The engine's prefill step's rows (EngineConfig.prefill_rows).")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 4, "The engine's decode steps a call (EngineConfig.decode_steps).")
_SYSTEMS = flags.DEFINE_list("systems", ["engine", "alone", "static"], "What to measure.")


def model():
  from flax import nnx

  import glm_jax.configs.glm5_tiny
  from glm_jax.model import GlmMoeDsa, ModelConfig

  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  return cfg, *nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)


def max_seq() -> int:
  return _PROMPT_MAX.value + _OUT_MAX.value


def compiled_engine():
  """The engine the server runs, its decode and chunked-prefill programs compiled."""
  from glm_jax.serving import Engine, EngineConfig

  cfg, graphdef, params, rest = model()
  pages = _CLIENTS.value * -(-max_seq() // 16) + 1
  config = EngineConfig(
    num_pages=pages,
    page_size=16,
    max_running=_CLIENTS.value,
    prefill_chunk=64,
    prefill_rows=_PREFILL_ROWS.value,
    max_seq_len=max_seq(),
    decode_steps=_DECODE_STEPS.value,
  )
  engine = Engine(graphdef, params, rest, cfg, config)
  for prompt_len in (_PROMPT_MAX.value, 1):  # compile the chunked-prefill and the decode steps
    engine.add([1] * prompt_len, _sampling(2))
  while engine.has_work():
    engine.step()
  return engine


def serve():
  import uvicorn

  from glm_jax.data import default_data_config, load_tokenizer
  from glm_jax.serving.server import EngineThread, ServerState, make_app

  engine = compiled_engine()
  state = ServerState(EngineThread(engine), load_tokenizer(default_data_config()), "bench")
  uvicorn.run(make_app(state), host="127.0.0.1", port=_PORT.value, log_level="warning")


def _sampling(n: int):
  from glm_jax.inference import SamplingParams

  return SamplingParams(max_new_tokens=n, temperature=0.0)


def load():
  """[(arrival s, prompt ids, new tokens)] in arrival order."""
  rng = np.random.default_rng(_SEED.value)
  arrivals = np.cumsum(rng.exponential(1.0 / _RATE.value, _REQUESTS.value))
  return [
    (
      float(t),
      rng.integers(1, 500, int(rng.integers(_PROMPT_MIN.value, _PROMPT_MAX.value + 1))).tolist(),
      int(rng.integers(_OUT_MIN.value, _OUT_MAX.value + 1)),
    )
    for t in arrivals
  ]


def summary(name: str, wall: float, rows: list[tuple[float, float, int]]) -> dict:
  """rows: (time to first token, end-to-end latency, output tokens) a request."""
  ttft, e2e, out = (np.asarray(x) for x in zip(*rows))
  return {
    "system": name,
    "clients": _CLIENTS.value,
    "rate": _RATE.value,
    "requests": len(rows),
    "wall_s": round(wall, 2),
    "requests_per_s": round(len(rows) / wall, 2),
    "output_tokens_per_s": round(float(out.sum()) / wall, 1),
    "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
    "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
    "e2e_p50_s": round(float(np.percentile(e2e, 50)), 3),
    "e2e_p99_s": round(float(np.percentile(e2e, 99)), 3),
    "e2e_p99_over_p50": round(float(np.percentile(e2e, 99) / np.percentile(e2e, 50)), 2),
  }


async def drive_server(requests) -> dict:
  import httpx

  url = f"http://127.0.0.1:{_PORT.value}/generate"
  slots = asyncio.Semaphore(_CLIENTS.value)
  rows = []
  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=_CLIENTS.value + 4)) as client:
    start = time.perf_counter()

    async def one(arrival, prompt, n):
      await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
      async with slots:
        first = None
        sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}  # exactly n tokens
        body = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
        async with client.stream("POST", url, json=body) as r:
          async for line in r.aiter_lines():
            if line.startswith("data: {"):
              first, last = first or time.perf_counter(), line
        last = json.loads(last[6:])
        done = time.perf_counter()
        assert len(last["output_ids"]) == n, last["meta_info"]
        rows.append((first - start - arrival, done - start - arrival, n))

    await asyncio.gather(*(one(*r) for r in requests))
    wall = time.perf_counter() - start
  return summary("engine (HTTP)", wall, rows)


def run_server_side(requests) -> dict:
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  args = [sys.executable, __file__, "--role=server"] + [a for a in sys.argv[1:] if not a.startswith("--role")]
  proc = subprocess.Popen(args, env=env)
  try:
    import httpx

    deadline = time.time() + 600
    while True:
      try:
        if httpx.get(f"http://127.0.0.1:{_PORT.value}/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      if proc.poll() is not None or time.time() > deadline:
        raise RuntimeError("the server did not come up")
      time.sleep(0.5)
    return asyncio.run(drive_server(requests))
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def run_alone(requests) -> dict:
  """The same load through the engine in this process, without HTTP: each request added when it has arrived and
  fewer than --clients are in flight (as the clients send them), the engine stepped meanwhile."""
  engine = compiled_engine()
  rows, first, running = [], {}, {}
  i = 0
  start = time.perf_counter()
  while len(rows) < len(requests):
    now = time.perf_counter() - start
    while i < len(requests) and requests[i][0] <= now and len(running) < _CLIENTS.value:
      arrival, prompt, n = requests[i]
      running[engine.add(prompt, _sampling(n))] = (arrival, n)
      i += 1
    if not engine.has_work():
      time.sleep(max(0.0, requests[i][0] - now))
      continue
    for ev in engine.step():
      t = time.perf_counter() - start
      first.setdefault(ev.rid, t)
      if ev.finish_reason:
        arrival, n = running.pop(ev.rid)
        rows.append((first[ev.rid] - arrival, t - arrival, n))
  return summary("engine alone (no HTTP)", time.perf_counter() - start, rows)


def run_static(requests) -> dict:
  from glm_jax.inference import Sampler, SamplingParams

  cfg, graphdef, params, rest = model()
  b = _CLIENTS.value
  sampler = Sampler(
    graphdef, cfg, SamplingParams(max_new_tokens=_OUT_MAX.value, temperature=0.0), width=_PROMPT_MAX.value
  )

  def run_batch(batch):
    prompts = [p for _, p, _ in batch] + [[1]] * (b - len(batch))
    out = sampler(params, rest, prompts, jax.random.key(0))
    jax.block_until_ready(out.tokens)

  run_batch(requests[:1])  # compile
  rows, i = [], 0
  start = time.perf_counter()
  while i < len(requests):
    now = time.perf_counter() - start
    if requests[i][0] > now:
      time.sleep(requests[i][0] - now)
      now = requests[i][0]
    batch = [r for r in requests[i : i + b] if r[0] <= now]
    run_batch(batch)
    done = time.perf_counter() - start
    rows += [(done - arrival, done - arrival, n) for arrival, _, n in batch]
    i += len(batch)
  return summary("static batches (Sampler)", time.perf_counter() - start, rows)


def main(argv):
  if _ROLE.value == "server":
    serve()
    return
  requests = load()
  for system in _SYSTEMS.value:
    run = {"engine": run_server_side, "alone": run_alone, "static": run_static}[system]
    result = run(requests)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
