"""RL rollouts through the serving engines' HTTP API, as slime makes GLM-5's: the trainer is a client of SGLang's
router in front of rl.rollout_engines engine processes. GRPO (asynchronous with rl.async_rollouts, else a rollout a
step from the step's weights) and distillation (a rollout a step), on the single-turn tasks or, with
rl.tokenizer="model", the agent loop's multi-turn episodes.

  rl.rollout_server=True     (glm_jax/rl/trainer.py)

`ServerRolloutWorker` has the RolloutWorker interface (push_weights, start, get, stop) and `rollout_at` for the
synchronous loops. `start` writes the first weights (glm_jax/serving/weights.py) and starts the fleet
(glm_jax/serving/fleet.py: engine processes `python -m glm_jax.rl.rollout_server <spec.json>` behind the router);
`push_weights` writes each version under <workdir>/rollout/weights/<version> and has every engine load it from a
sender thread. A rollout is rollout.step_rollout's (or, agentic, agentic.step_rollout's with `ApiAgentLoop`) through
POST /generate, its version the oldest weight version among its samples'. A failed request is sent again, up to 5
times with a growing wait; then the rollout fails and `get` raises. Each step in full: docs/post_training.md,
"RL rollouts through the API".
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import shutil
import sys
import threading
import time
from typing import Any

import httpx
import jax
import numpy as np
from absl import logging

from glm_jax import chat
from glm_jax.rl import agentic
from glm_jax.rl import rewards as rewards_lib
from glm_jax.rl.agent_loop import AgentParams, LoopResult, after_turn
from glm_jax.rl.rollout import Rollout, put_until_stopped, step_problems
from glm_jax.serving import fleet as fleet_lib
from glm_jax.serving.weights import save_weights

RETRIES = 5


class ServerRolloutWorker:
  """GRPO rollouts through the router (module docstring). ctx: the run's RunContext (its config, workdir, model
  config, tasks, reward function, vocabulary and `served`)."""

  def __init__(self, ctx, group_size: int):
    self.ctx, self.rl, self.group_size = ctx, ctx.config.rl, group_size
    self.dir = os.path.join(ctx.workdir, "rollout")
    self.agentic = bool(ctx.environments)
    if self.agentic:  # an episode's whole sequence
      self.length = self.rl.cache_len
    else:  # the Sampler's prompt width and the answer
      self.width = max(t.max_prompt_len for t, _ in ctx.tasks_and_weights)
      self.length = self.width + self.rl.max_new_tokens
    self._queue: queue.Queue = queue.Queue(maxsize=max(1, self.rl.max_pending))
    self._weights: queue.Queue = queue.Queue()
    self._latest: tuple[int, str] | None = None  # (version, directory) of the newest weights written
    self._written: list[str] = []  # the directories kept: the newest two
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self.fleet: fleet_lib.Fleet | None = None
    self.router_url = ""

  # ---- weights

  def _write(self, version: int, params, rest) -> str:
    cfg = self.ctx.model_cfg
    if self.rl.rollout_dtype and self.rl.rollout_dtype != cfg.dtype:  # the engines compute in the rollout dtype
      cfg = cfg.replace(dtype=self.rl.rollout_dtype)
    path = os.path.join(self.dir, "weights", str(version))
    tokenizer = self.ctx.vocab.record() if self.agentic else {"kind": "char"}
    save_weights(path, self.ctx.served(params), rest, cfg, version=version, tokenizer=tokenizer)
    # The one before stays: an engine the fleet is restarting may have just been told its name.
    self._written = [p for p in self._written if p != path] + [path]
    for old in self._written[:-2]:
      shutil.rmtree(old, ignore_errors=True)
    self._written = self._written[-2:]
    self._latest = (version, path)
    return path

  def push_weights(self, version: int, params, rest) -> None:
    """The weights of the rollouts from now on; before start they are the engines' first, after it they are sent
    by a thread (the trainer goes on)."""
    if self._latest is not None and version < self._latest[0]:
      raise ValueError(f"push_weights: version {version} is older than the engines' {self._latest[0]}")
    if self.fleet is None:
      self._write(version, params, rest)
    else:
      self._weights.put((version, params, rest))

  def _send_weights(self) -> None:
    while not self._stop.is_set():
      try:
        item = self._weights.get(timeout=0.5)
      except queue.Empty:
        continue
      while not self._weights.empty():  # only the newest matters
        item = self._weights.get_nowait()
      self._load(*item)

  def _load(self, version: int, params, rest) -> None:
    """Writes the weights and has every engine load them (each call returns when its engine has them)."""
    path = self._write(version, params, rest)
    for e in self.fleet.engines:
      try:
        fleet_lib.call(
          "POST", f"{e.url}/update_weights", body={"weights_path": path, "weight_version": version}, timeout=600
        )
      except OSError as err:  # a dead engine: the fleet restarts it with the newest weights
        logging.warning("rollout engine %d did not take weights %d: %s", e.index, version, err)

  def rollout_at(self, index: int, version: int, params, rest) -> Rollout:
    """The synchronous loops' rollout: every engine on weights `version` (params, rest), then rollout `index`."""
    if version != self._latest[0]:
      self._load(version, params, rest)
    rollout = self.rollout(self._client, index)
    if rollout.version != version:
      raise RuntimeError(f"rollout {index}: made by weights {rollout.version}, not the step's {version}")
    return rollout

  # ---- the fleet

  def _engine_argv(self, port: int) -> list[str]:
    spec = {
      "weights": self._latest[1],
      "port": port,
      "engine": _engine_config(self.rl, self.length),
      "model_name": "policy",
    }
    path = os.path.join(self.dir, f"engine-{port}.json")
    with open(path, "w") as f:
      json.dump(spec, f)
    return [sys.executable, "-m", "glm_jax.rl.rollout_server", path]

  def start(self, first_index: int = 0, *, produce: bool = True) -> ServerRolloutWorker:
    """Starts the fleet; with `produce` (asynchronous), the threads that make rollouts ahead and send new weights."""
    if self._latest is None:
      raise RuntimeError("push_weights before start: the engines start with the newest weights")
    n = self.rl.rollout_engines
    port = fleet_lib.free_port_run(n + 2)
    options = fleet_lib.RouterOptions(policy="round_robin", health_every=2, start_timeout=self.rl.worker_start_timeout)
    self.fleet = fleet_lib.Fleet(self._engine_argv, n, "127.0.0.1", port, None, options)
    self.fleet.start()
    self.router_url = f"http://127.0.0.1:{port}"
    logging.info("rollouts through the router %s in front of %d engines", self.router_url, n)
    self._client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))
    threads = [(self._supervise, ())]
    if produce:
      threads += [(self._produce_loop, (first_index,)), (self._send_weights, ())]
    for target, args in threads:
      t = threading.Thread(target=target, args=args, daemon=True)
      t.start()
      self._threads.append(t)
    return self

  def _supervise(self) -> None:
    while not self._stop.wait(1.0):
      self.fleet.check()

  def get(self, timeout: float = 600.0) -> Rollout:
    item = self._queue.get(timeout=timeout)
    if isinstance(item, BaseException):
      raise RuntimeError(f"rollouts through the serving engines failed: {item}") from item
    return item

  def stop(self) -> None:
    self._stop.set()
    for t in self._threads:
      t.join(timeout=30)
    if self.fleet is not None:
      self._client.close()
      self.fleet.stop()

  # ---- rollouts

  def _produce_loop(self, index: int) -> None:
    while not self._stop.is_set():
      try:
        rollout = self.rollout(self._client, index)
      except Exception as e:  # handed to the trainer: get raises
        put_until_stopped(self._queue, e, self._stop)
        return
      put_until_stopped(self._queue, rollout, self._stop)
      index += 1

  def _post(self, client: httpx.Client, body: dict) -> Any:
    """The batch's outputs, every sample whole (ended by a stop id or max_new_tokens: an aborted one is sent again)."""
    wait = 0.5
    for attempt in range(RETRIES + 1):
      try:
        r = client.post(f"{self.router_url}/generate", json=body)
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in r.json()] if r.status_code == 200 else []
        if r.status_code == 200 and all(x in ("stop", "length") for x in reasons):
          return r.json()
        why = f"HTTP {r.status_code}: {r.text[:500]}" if r.status_code != 200 else f"finish reasons {reasons}"
      except httpx.HTTPError as e:
        why = repr(e)
      if attempt == RETRIES or self._stop.is_set():
        raise RuntimeError(f"POST /generate failed {attempt + 1} times; the last: {why}")
      time.sleep(wait)
      wait *= 2
    raise AssertionError("unreachable")

  def rollout(self, client: httpx.Client, index: int) -> Rollout:
    """Rollout `index` through the router (module docstring)."""
    if self.agentic:
      ctx = self.ctx
      loop = ApiAgentLoop(ctx.vocab, ctx.sampler.params, lambda body: self._post(client, body))
      run = agentic.AgenticRun(ctx.config, ctx.environments, loop, ctx.vocab, ctx.rollout_fn)
      return agentic.step_rollout(run, None, None, self._latest[0], index, self.group_size)
    rl, vocab, g = self.rl, self.ctx.vocab, self.group_size
    t0 = time.perf_counter()
    problems = step_problems(self.ctx.tasks_and_weights, rl, index)
    # A problem's samples draw with seeds s, s + 1, ..., s + g - 1 (the server's batch rule), s from (rl.seed, index).
    seeds = np.random.default_rng((rl.seed, index)).integers(0, 2**31 - g, size=len(problems)).tolist()

    def sample(k: int) -> list[dict]:
      params = dict(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p)
      body = {
        "input_ids": [list(problems[k].prompt_ids)] * g,
        "sampling_params": dict(params, stop_token_ids=[vocab.eos_id], sampling_seed=seeds[k]),
        "return_logprob": True,
      }
      return self._post(client, body)

    with concurrent.futures.ThreadPoolExecutor(min(32, len(problems))) as pool:
      outs = [o for group in pool.map(sample, range(len(problems))) for o in group]
    rows = [p for p in problems for _ in range(g)]
    n = len(rows)
    tokens = np.full((n, self.length), vocab.pad_id, np.int32)
    mask = np.zeros((n, self.length), bool)
    logp = np.zeros((n, self.length), np.float32)
    prompt_lens, lengths = np.zeros(n, np.int32), np.zeros(n, np.int32)
    finished = np.zeros(n, bool)
    for i, (p, out) in enumerate(zip(rows, outs)):
      ids, resp = list(p.prompt_ids), out["output_ids"]
      tokens[i, : len(ids)] = ids
      tokens[i, len(ids) : len(ids) + len(resp)] = resp
      mask[i, len(ids) : len(ids) + len(resp)] = True
      logp[i, len(ids) : len(ids) + len(resp)] = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
      prompt_lens[i], lengths[i] = len(ids), len(ids) + len(resp)
      finished[i] = out["meta_info"]["finish_reason"]["type"] == "stop"
    rollout = Rollout(
      version=min(int(out["meta_info"]["weight_version"]) for out in outs),
      problems=rows,
      tokens=tokens,
      response_mask=mask,
      rollout_logp=logp,
      prompt_lens=prompt_lens,
      lengths=lengths,
      finished=finished,
      rewards=np.zeros(n, np.float32),
      failures=[],
      index=index,
    )
    rollout.rewards, rollout.failures = rewards_lib.score(
      self.ctx.reward_fn, rows, rollout.responses(), [f"step{index}/{i}" for i in range(n)]
    )
    rollout.seconds = time.perf_counter() - t0
    return rollout


class ApiAgentLoop:
  """AgentLoop.run's episodes through the engines' /generate (module docstring): `post(body)` sends one and returns
  its outputs (ServerRolloutWorker._post). The weights are the engines'; run's params and rest are not used."""

  def __init__(self, tokenizer, params: AgentParams, post):
    self.tokenizer, self.params, self.post = tokenizer, params, post
    self._stop_ids = [tokenizer.chat_ids[s] for s in chat.STOP_STRINGS]

  def run(self, params, rest, trajectories, envs, key, *, script=None, return_logits=False) -> LoopResult:
    if script is not None or return_logits:
      raise ValueError("ApiAgentLoop.run: no script or return_logits through the engines (AgentLoop has them)")
    if len(envs) != len(trajectories) or not trajectories:
      raise ValueError(f"{len(trajectories)} trajectories and {len(envs)} environments; one environment an episode")
    t0 = time.perf_counter()
    seeds = np.asarray(jax.random.randint(key, (len(trajectories),), 0, 2**31 - 1)).tolist()
    with concurrent.futures.ThreadPoolExecutor(min(64, len(trajectories))) as pool:
      ends = list(pool.map(self._episode, trajectories, envs, seeds))
    return LoopResult(
      trajectories=list(trajectories),
      rewards=[e["reward"] for e in ends],
      turns=[t.turns for t in trajectories],
      finish=[e["finish"] for e in ends],
      tool_calls=sum(e["tool_calls"] for e in ends),
      tool_errors=sum(e["tool_errors"] for e in ends),
      sampled_tokens=sum(e["sampled"] for e in ends),
      seconds=time.perf_counter() - t0,
      weight_version=min(e["version"] for e in ends),
    )

  def _episode(self, traj, env, seed: int) -> dict:
    """One episode to its end: the agent loop's turns, each a request (its draws keyed by the seed and the slot)."""
    p = self.params
    end = {"reward": 0.0, "finish": "", "tool_calls": 0, "tool_errors": 0, "sampled": 0, "version": None}
    for turn in range(1, p.max_turns + 1):
      sampling = dict(max_new_tokens=min(p.max_turn_tokens, p.cache_len - len(traj.tokens)), top_p=p.top_p)
      sampling.update(temperature=p.temperature, stop_token_ids=self._stop_ids, sampling_seed=seed)
      out = self.post({"input_ids": [list(traj.tokens)], "sampling_params": sampling, "return_logprob": True})[0]
      logp = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
      if not np.isfinite(logp).all():
        raise FloatingPointError("an engine drew tokens with non-finite log-probabilities: broken weights?")
      version = out["meta_info"]["weight_version"]
      end["version"] = version if end["version"] is None else min(end["version"], version)
      parsed = traj.add_sample(out["output_ids"], logp)
      parsed["stop"] = traj.stop
      end["sampled"] += len(logp)
      end["tool_calls"] += len(parsed["tool_calls"])
      end["tool_errors"] += len(parsed["errors"])
      res = env.step(parsed)
      end["reward"] = float(res.reward)
      finish, _ = after_turn(traj, parsed, res, turn, p)
      if finish is not None:
        end["finish"] = finish
        break
    traj.version = end["version"]
    return end


def _engine_config(rl, length: int) -> dict:
  """An engine's EngineConfig fields for the run: rl.rollout_max_running rows, pages for all of them at full length."""
  page = 16
  per_request = -(-length // page)
  return dict(
    num_pages=rl.rollout_max_running * per_request + 1,
    page_size=page,
    max_running=rl.rollout_max_running,
    prefill_rows=min(8, rl.rollout_max_running),
    prefill_chunk=max(16, 1 << (length - 1).bit_length()),
    max_seq_len=per_request * page,
  )


def serve_engine(spec_path: str) -> None:
  """An engine process (module docstring): the weights its spec names, on 127.0.0.1:port, until it is stopped."""
  import uvicorn

  from glm_jax.data import Tokenizer
  from glm_jax.model import ModelConfig
  from glm_jax.rl.tasks import CharVocab
  from glm_jax.serving import Engine, EngineConfig
  from glm_jax.serving.server import EngineThread, ServerState, make_app
  from glm_jax.serving.weights import load_weights

  with open(spec_path) as f:
    spec = json.load(f)
  meta, graphdef, params, rest = load_weights(spec["weights"])
  cfg = ModelConfig.from_dict(meta["model"])
  engine = Engine(graphdef, params, rest, cfg, EngineConfig(**spec["engine"]), version=meta["version"])

  def load(body: dict):
    path = body.get("weights_path")
    if not isinstance(path, str):
      raise ValueError(f"weights_path={path!r}: the directory of the weights to load")
    new_meta, _, new_params, new_rest = load_weights(path, cfg)
    return new_params, new_rest, body.get("weight_version", new_meta["version"])

  record = meta["tokenizer"]  # the run's: an agentic run's model tokenizer, else the tasks' characters
  tokenizer = Tokenizer.from_record(record) if "json" in record else CharVocab()
  state = ServerState(EngineThread(engine), tokenizer, spec["model_name"], load_weights=load)
  try:
    uvicorn.run(make_app(state), host="127.0.0.1", port=spec["port"], log_level="warning")
  finally:
    state.engine.stop()


if __name__ == "__main__":
  serve_engine(sys.argv[1])
