"""The serving engine: many requests on one model at once, over a paged cache, a step at a time.

  engine = Engine(graphdef, params, rest, model_cfg, EngineConfig(num_pages=256, page_size=16, max_running=16))
  rid = engine.add(prompt_ids, SamplingParams(max_new_tokens=64, temperature=0.0, stop_ids=(eos,)), seed=0)
  while engine.has_work():
    for ev in engine.step():      # Event(rid, token, logp, finish_reason): a request's new token, as it is made
      ...
  engine.abort(rid)                 # between steps: the request ends ("abort") and its pages go back

Continuous batching over `max_running` rows: each step retires finished requests and admits waiting ones (first
come, first served) while the page pool has room (glm_jax/serving/paged_cache.py: a request reserves its pages on
admission, whole pages of a cached prefix shared), then runs a decode program ([max_running, 1] tokens, decode_steps
steps a call) and a chunked-prefill step ([prefill_rows, prefill_chunk] tokens), each compiled once. Each row draws
with its own temperature, top_p and key (its seed folded with the token's position), so greedy output is the
Sampler's for the prompt alone; `update_weights` swaps weights between steps and drops the prefix cache. Under a
mesh rows and pages split over the batch axes; `EngineConfig(speculate=k)` decodes with MTP drafts. Not here yet:
GLM's blank-infilling layouts. How each part works: docs/serving.md, "Inside the engine".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glm_jax.inference.sampler import check_heads
from glm_jax.inference import speculative
from glm_jax.inference.sampling import SamplingParams, draw_log_probs_rows, sample_rows
from glm_jax.mesh_axes import BATCH_AXES
from glm_jax.model.config import ModelConfig
from glm_jax.model.transformer import check_draft
from glm_jax.sharding.state import weight_shardings
from glm_jax.serving import paged_cache
from glm_jax.serving.paged_cache import PagePool


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_pages: int = 256  # pages in the pool (page 0 is scratch): the cache holds (num_pages - 1) * page_size tokens
  page_size: int = 16  # tokens a page
  max_running: int = 16  # requests running at once (the decode step's rows)
  prefill_chunk: int = 32  # prompt tokens a prefilling request feeds a step
  prefill_rows: int = 4  # requests prefilled together (the prefill step's rows; at most max_running)
  speculate: int = 0  # k >= 1: MTP speculative decoding, k drafts a round (the model needs an MTP layer)
  max_seq_len: int = 1024  # a request's prompt + max_new_tokens at most (the page table's width)
  # decode steps in one call of the decode program: a host round trip (and an update of the streams) for that many
  # tokens a row; a request admitted meanwhile waits for the call, and one that ends inside it wastes the rest of its
  # steps. Speculating, the decode program is one speculative round instead.
  decode_steps: int = 4

  def check(self, cfg: ModelConfig) -> None:
    names = ("num_pages", "page_size", "max_running", "prefill_chunk", "prefill_rows", "max_seq_len", "decode_steps")
    for name in names:
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"engine.{name}={v!r}; must be a positive integer")
    if self.prefill_rows > self.max_running:
      raise ValueError(
        f"engine.prefill_rows={self.prefill_rows} exceeds engine.max_running={self.max_running} (the requests that run)"
      )
    if self.num_pages < 2:
      raise ValueError(f"engine.num_pages={self.num_pages}; need at least 2 (page 0 is scratch)")
    if isinstance(self.speculate, bool) or not isinstance(self.speculate, int) or self.speculate < 0:
      raise ValueError(f"engine.speculate={self.speculate!r}; must be an integer >= 0 (0: no speculation)")
    if self.speculate:
      check_draft(cfg)
    if self.max_seq_len > cfg.max_position_embeddings:
      raise ValueError(
        f"engine.max_seq_len={self.max_seq_len} exceeds model.max_position_embeddings={cfg.max_position_embeddings}"
      )

  @property
  def table_width(self) -> int:
    """Pages a request can hold: the page table's columns."""
    return -(-self.max_seq_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class Event:
  """What a step made of one request: its new token (None when it ended without one: an abort) and the token's
  log-probability; finish_reason "stop" (a stop id), "length" (max_new_tokens), "abort", or None while it runs;
  version: the weight version the request was admitted under (update_weights lets running requests go on with the
  new weights, so a request's tokens come from that version or later ones)."""

  rid: int
  token: int | None
  logp: float | None
  finish_reason: str | None = None
  version: Any = None  # the weights the request was admitted under (it may finish under newer ones)


@dataclasses.dataclass
class _Request:
  rid: int
  prompt: list[int]
  sampling: SamplingParams
  seed: int
  tokens: list[int]  # prompt, then what was generated
  hashes: list[bytes]  # prefix-cache keys of the prompt's whole pages that can be shared (the last token excluded)
  pages: list[int] = dataclasses.field(default_factory=list)
  row: int | None = None
  shard: int = 0  # the batch shard its row and pages are on (0 without a mesh)
  computed: int = 0  # tokens whose cache entries are written (the first `computed` of `tokens`)
  registered: int = 0  # leading pages registered in the prefix cache
  abort: bool = False
  version: Any = None  # the weight version it was admitted under
  h: np.ndarray | None = None  # speculating: the main model's last hidden state at its last fed slot (the drafts')

  @property
  def generated(self) -> int:
    return len(self.tokens) - len(self.prompt)


class Engine:
  """The engine (module docstring). Not thread-safe: one thread calls add / abort / step (glm_jax/serving/server.py
  runs it in a loop of its own). `stats` counts the prompt tokens prefilled, the tokens decoded, the prompt tokens
  taken from the prefix cache, the steps of each kind and the requests ended by each finish reason."""

  def __init__(
    self, graphdef, params, rest, cfg: ModelConfig, config: EngineConfig = EngineConfig(), *, version=0, mesh=None
  ):
    config.check(cfg)
    self.cfg, self.config = cfg, config
    self.mesh = None if mesh is None or mesh.size == 1 else mesh
    self._batch_axes = batch_axes(self.mesh, cfg, config)
    self.shards = math.prod(self.mesh.shape[a] for a in self._batch_axes) if self._batch_axes else 1
    self._graphdef, self._step = graphdef, compiled_step(graphdef)
    self._decode = compiled_decode(graphdef, config.decode_steps)
    self._round = compiled_round(graphdef, config.speculate) if config.speculate else None
    self._params, self._rest = self._placed(params, rest)
    self.version = version
    self.pools = [PagePool(config.num_pages // self.shards, config.page_size) for _ in range(self.shards)]
    self._cache = paged_cache.empty_pool(cfg, config.num_pages, config.page_size, mtp=config.speculate > 0)
    if self.mesh is not None:  # pages split over the batch axes like the rows
      self._cache = jax.device_put(self._cache, NamedSharding(self.mesh, P(None, self._batch_axes)))
    self._ids = itertools.count()
    self._waiting: collections.deque[_Request] = collections.deque()
    self._rows: list[_Request | None] = [None] * config.max_running
    self._by_id: dict[int, _Request] = {}
    self.stats = collections.Counter()

  # ---- requests

  def add(self, prompt: Sequence[int], sampling: SamplingParams, *, seed: int = 0) -> int:
    """Queues a request and returns its id; bad input is refused by name (nothing queued)."""
    prompt = [int(t) for t in prompt]
    self.check_request(prompt, sampling)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**31:
      raise ValueError(f"seed={seed!r}; must be an integer in [0, 2**31)")
    size = self.config.page_size
    req = _Request(
      rid=next(self._ids),
      prompt=prompt,
      sampling=sampling,
      seed=int(seed),
      tokens=list(prompt),
      hashes=paged_cache.page_hashes(prompt, size, (len(prompt) - 1) // size),
    )
    self._waiting.append(req)
    self._by_id[req.rid] = req
    return req.rid

  def check_request(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
    """ValueError naming what is wrong with a request: an empty prompt, a token id outside the vocabulary, a prompt
    plus max_new_tokens longer than a request may be or than the whole pool holds."""
    if not len(prompt):
      raise ValueError("prompt is empty; a request needs at least one token")
    bad = [t for t in prompt if not 0 <= int(t) < self.cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
    need = len(prompt) + sampling.max_new_tokens + self.config.speculate  # a last round's drafts past the end
    if need > self.config.max_seq_len:
      drafts = f" and {self.config.speculate} draft slots" if self.config.speculate else ""
      raise ValueError(
        f"a prompt of {len(prompt)} tokens plus max_new_tokens={sampling.max_new_tokens}{drafts} is {need} tokens; "
        f"this engine serves at most engine.max_seq_len={self.config.max_seq_len}"
      )
    if self._pages_for(len(prompt), sampling) > self.config.num_pages // self.shards - 1:
      raise ValueError(
        f"a prompt of {len(prompt)} tokens plus max_new_tokens={sampling.max_new_tokens} needs more pages than the "
        f"pool has (engine.num_pages={self.config.num_pages}, page_size={self.config.page_size})"
      )

  def abort(self, rid: int) -> bool:
    """Ends a request at the next step (an Event with finish_reason "abort"); False if it is unknown or over."""
    req = self._by_id.get(rid)
    if req is None:
      return False
    req.abort = True
    return True

  @property
  def free_pages(self) -> int:
    """Pages a request could be given now (cached pages nobody holds included), over every shard."""
    return sum(p.free_pages for p in self.pools)

  @property
  def used_pages(self) -> int:
    return sum(p.used_pages for p in self.pools)

  def _placed(self, params, rest):
    """The weights in the serving layout on the mesh (as the Sampler lays them out), or as they are."""
    if self.mesh is None:
      return params, rest
    return jax.device_put((params, rest), weight_shardings(params, rest, self.mesh))

  def has_work(self) -> bool:
    return bool(self._waiting) or any(r is not None for r in self._rows)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self._rows)

  def update_weights(self, params, rest, version) -> None:
    """New weights from the next step on; every cached prefix page was computed with the old ones and is dropped
    (running requests keep their pages: they continue with the new weights, as RL's asynchronous rollouts do)."""
    (self._params, self._rest), self.version = self._placed(params, rest), version
    for pool in self.pools:
      pool.clear_prefix_cache()
    for req in self._rows:
      if req is not None:
        req.registered = len(req.pages)  # its pages are stale for anyone else: never register them

  # ---- the step

  def step(self) -> list[Event]:
    """Retires aborted requests, admits waiting ones, then runs the decode program (decode_steps steps, or a
    speculative round) over the decoding requests and the prefill step over up to prefill_rows prefilling ones: the
    events of both."""
    events = [self._finish(req, "abort") for req in list(self._waiting) + self._running() if req.abort]
    self._admit()
    running = self._running()

    # Speculating, a request also goes through the prefill step until it has the hidden state its drafts start from:
    # one whose prompt the prefix cache holds all but the last token of (a GRPO group's copies), a 1-token prompt.
    def prefills(req):
      return len(req.tokens) - req.computed > 1 or (self.config.speculate and req.h is None)

    per_shard = self.config.prefill_rows // self.shards  # a shard's rows of the prefill step
    decoding, prefilling, taken = {}, {}, collections.Counter()
    for req in running:
      if not prefills(req):
        decoding[req.row] = req
      elif taken[req.shard] < per_shard:
        prefilling[req.shard * per_shard + taken[req.shard]] = req
        taken[req.shard] += 1
    if decoding and self.config.speculate:
      events += self._spec_round(decoding)
    elif decoding:
      events += self._decode_steps(decoding)
    if prefilling:
      events += self._prefill_step(prefilling)
    return events

  def _prefill_step(self, group: dict[int, _Request]) -> list[Event]:
    """One prefill step, [prefill_rows, prefill_chunk] tokens: each request of `group` ({row: request}, a row on the
    request's shard) feeds its next prompt tokens (up to a chunk) in its row; one whose prompt is then all fed gets its
    first token."""
    rows, t = self.config.prefill_rows, self.config.prefill_chunk
    tokens = np.zeros((rows, t), np.int32)
    pos, n_new = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    table = np.zeros((rows, self.config.table_width), np.int32)
    temp, top_p, seed = np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)
    after = np.full(rows, -1, np.int32)  # the token after the fed ones, when known (the MTP layer's input)
    for i, req in group.items():
      n = min(t, len(req.tokens) - req.computed)
      tokens[i, :n] = req.tokens[req.computed : req.computed + n]
      pos[i], n_new[i] = req.computed, n
      table[i, : len(req.pages)] = req.pages
      temp[i], top_p[i], seed[i] = req.sampling.temperature, req.sampling.top_p, req.seed
      if req.computed + n < len(req.tokens):
        after[i] = req.tokens[req.computed + n]
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      tok, logp, h, self._cache = self._step(
        self._params,
        self._rest,
        self._cache,
        *self._rows_on_mesh(tokens, pos, n_new, table, temp, top_p, seed, after),
      )
    tok, logp = np.asarray(tok), np.asarray(logp)
    h = np.asarray(h) if self.config.speculate else None
    self.stats["steps_prefill"] += 1
    events = []
    for i, req in group.items():
      n = int(n_new[i])
      prefill = min(n, max(len(req.prompt) - req.computed, 0))
      self.stats["prefill_tokens"] += prefill
      self.stats["decode_tokens"] += n - prefill
      req.computed += n
      if h is not None:
        req.h = h[i]
      self._register(req)
      if req.computed < len(req.tokens):
        continue  # a chunk inside the prompt: what was drawn after it is not a next token
      req.tokens.append(int(tok[i]))
      s = req.sampling
      reason = "stop" if int(tok[i]) in s.stop_ids else ("length" if req.generated >= s.max_new_tokens else None)
      events.append(Event(req.rid, int(tok[i]), float(logp[i]), reason, req.version))
      if reason:
        self._finish(req, reason)
    return events

  def _decode_steps(self, group: dict[int, _Request]) -> list[Event]:
    """decode_steps steps of the decode program ([max_running, 1] tokens a step) in one call: each decoding request
    of `group` ({row: request}) feeds its last token, then each token it draws; it keeps them up to a stop id or
    max_new_tokens (the steps after that are discarded: their entries land in slots it never reads)."""
    rows = self.config.max_running
    x, pos, live = np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    table = np.zeros((rows, self.config.table_width), np.int32)
    temp, top_p, seed = np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)
    for i, req in group.items():
      x[i], pos[i], live[i] = req.tokens[-1], req.computed, 1
      table[i, : len(req.pages)] = req.pages
      temp[i], top_p[i], seed[i] = req.sampling.temperature, req.sampling.top_p, req.seed
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      tok, logp, self._cache = self._decode(
        self._params, self._rest, self._cache, *self._rows_on_mesh(x, pos, live, table, temp, top_p, seed)
      )
    tok, logp = np.asarray(tok), np.asarray(logp)
    self.stats["steps_decode"] += self.config.decode_steps
    events = []
    for i, req in group.items():
      s = req.sampling
      for j in range(self.config.decode_steps):
        token = int(tok[i, j])
        # the token fed at this step is in the cache now (a prompt's last token, when the prefill step left just it)
        self.stats["prefill_tokens" if req.computed < len(req.prompt) else "decode_tokens"] += 1
        req.computed += 1
        req.tokens.append(token)
        reason = "stop" if token in s.stop_ids else ("length" if req.generated >= s.max_new_tokens else None)
        events.append(Event(req.rid, token, float(logp[i, j]), reason, req.version))
        if reason:
          break
      self._register(req)  # its pages written whole, for the prefix cache (a next turn re-sends them)
      if reason:
        self._finish(req, reason)
    return events

  def _spec_round(self, group: dict[int, _Request]) -> list[Event]:
    """One speculative round ([max_running, k + 1] tokens, speculative.py's round): each decoding request of `group`
    ({row: request}) drafts k tokens with the MTP layer and the main model checks them; it gains the kept drafts and
    one drawn token, cut at a stop id or max_new_tokens."""
    rows = self.config.max_running
    x, n = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    h = np.zeros((rows, self.cfg.hidden_size), np.float32)
    table = np.zeros((rows, self.config.table_width), np.int32)
    temp, top_p, seed = np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)
    for i, req in group.items():
      x[i], n[i], h[i] = req.tokens[-1], req.computed, req.h
      table[i, : len(req.pages)] = req.pages
      temp[i], top_p[i], seed[i] = req.sampling.temperature, req.sampling.top_p, req.seed
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      cand, kept, logp, h_new, self._cache = self._round(
        self._params, self._rest, self._cache, *self._rows_on_mesh(x, n, h, table, temp, top_p, seed)
      )
    cand, kept, logp, h_new = map(np.asarray, (cand, kept, logp, h_new))
    self.stats["spec_rounds"] += len(group)
    events = []
    for i, req in group.items():
      a = int(kept[i])
      self.stats["spec_drafts_kept"] += a
      req.computed, req.h = int(n[i]) + a + 1, h_new[i]  # x and the kept drafts are in the cache now
      self._register(req)
      s = req.sampling
      for j in range(a + 1):
        token = int(cand[i, j])
        req.tokens.append(token)
        self.stats["decode_tokens"] += 1
        reason = "stop" if token in s.stop_ids else ("length" if req.generated >= s.max_new_tokens else None)
        events.append(Event(req.rid, token, float(logp[i, j]), reason, req.version))
        if reason:
          self._finish(req, reason)
          break
    return events

  def _rows_on_mesh(self, *arrays: np.ndarray) -> list[jax.Array]:
    """A step's [rows, ...] operands, split over the mesh's batch axes like the pool's pages."""
    if self.mesh is None:
      return list(arrays)  # jit moves them (its own transfer is faster than a device_put a step)
    return jax.device_put(list(arrays), NamedSharding(self.mesh, P(self._batch_axes)))

  def _running(self) -> list[_Request]:
    return [r for r in self._rows if r is not None]

  def _pages_for(self, prompt_len: int, sampling: SamplingParams) -> int:
    """Pages a request holds: every slot it writes (prompt + max_new_tokens - 1: the last token is never fed; and
    speculating, a last round's k drafts past them)."""
    slots = prompt_len + sampling.max_new_tokens - 1 + self.config.speculate
    return -(-slots // self.config.page_size)

  def _admit(self) -> None:
    """Waiting requests into free rows, in order, while the pool has their pages. A request whose next prompt page a
    running request is about to write is passed over (it will find the page cached); one the pool cannot hold
    stops admission (first come, first served)."""
    pending = {(req.shard, h) for req in self._running() for h in req.hashes[req.registered :]}
    per_shard = self.config.max_running // self.shards
    for req in list(self._waiting):
      free = {}  # shard -> its first free row
      for i, r in enumerate(self._rows):
        if r is None:
          free.setdefault(i // per_shard, i)
      if not free:
        return
      # On each shard with a free row: the request's prompt pages its prefix cache has. The longest match wins.
      options = []
      for shard in free:
        shared = []
        for h in req.hashes:
          page = self.pools[shard].cached(h)
          if page is None:
            break
          shared.append(page)
        options.append((-len(shared), -self.pools[shard].free_pages, shard, shared))
      _, _, shard, shared = min(options)
      if len(shared) < len(req.hashes) and (shard, req.hashes[len(shared)]) in pending:
        continue
      pages = self.pools[shard].acquire(shared, self._pages_for(len(req.prompt), req.sampling) - len(shared))
      if pages is None:
        return
      self._waiting.remove(req)
      req.pages, req.row, req.shard = pages, free[shard], shard
      req.registered, req.computed = len(shared), len(shared) * self.config.page_size
      req.version = self.version
      self.stats["prefix_cached_tokens"] += req.computed
      self._rows[req.row] = req
      pending.update((shard, h) for h in req.hashes[req.registered :])

  def _register(self, req: _Request) -> None:
    """Registers the request's pages that are now wholly written (prompt pages by their known keys, later ones by
    the tokens' chain) in the prefix cache."""
    size = self.config.page_size
    whole = min(req.computed // size, len(req.pages))
    if whole <= req.registered:
      return
    keys = req.hashes if whole <= len(req.hashes) else paged_cache.page_hashes(req.tokens, size, whole)
    for i in range(req.registered, whole):
      self.pools[req.shard].register(req.pages[i], keys[i])
    req.registered = whole

  def _finish(self, req: _Request, reason: str) -> Event:
    if req.row is not None:
      self._rows[req.row] = None
      self.pools[req.shard].release(req.pages)
      req.row, req.pages = None, []
    elif req in self._waiting:
      self._waiting.remove(req)
    self._by_id.pop(req.rid, None)
    self.stats[f"finished_{reason}"] += 1
    return Event(req.rid, None, None, reason) if reason == "abort" else None


def batch_axes(mesh, cfg: ModelConfig, config: EngineConfig) -> tuple[str, ...]:
  """The mesh's batch axes (of size > 1) that split the engine's rows and pages (() without a mesh); a head count or
  an engine size the mesh does not divide is refused by name."""
  if mesh is None:
    return ()
  check_heads(cfg, mesh)
  axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
  shards = math.prod(mesh.shape[a] for a in axes)
  for name in ("max_running", "prefill_rows", "num_pages"):
    if getattr(config, name) % shards:
      raise ValueError(
        f"engine.{name}={getattr(config, name)}: the mesh's batch axes {dict((a, mesh.shape[a]) for a in axes)} "
        f"split rows and pages {shards} ways; give a multiple of {shards}"
      )
  return axes


_compiled: dict[Any, Any] = {}  # graphdef -> its jitted step: engines of one model share the compiled programs


def compiled_step(graphdef):
  """step_fn jitted with `graphdef` bound, the pool donated. (Binding it once: a static graphdef argument would be
  hashed at every call, a tenth of a small model's step on the CPU.)"""
  if graphdef not in _compiled:
    _compiled[graphdef] = jax.jit(functools.partial(step_fn, graphdef), donate_argnums=2)
  return _compiled[graphdef]


def step_fn(graphdef, params, rest, pool, tokens_RT, pos_R, n_new_R, table_RP, temp_R, top_p_R, seed_R, after_R):
  """One engine step: row r feeds tokens[r, :n_new[r]] at slots pos[r].. over its pages; returns the token drawn
  after each row's last fed token, its log-probability, the last layer's hidden state there (before the final norm)
  and the pool with the new entries written. With an MTP cache in the pool (speculative decoding) the MTP layer's
  entries for the fed slots are written too: slot s's from the hidden state at s and the token at s + 1, the last
  one's being after[r] (the prompt's next token), or the token just drawn when after[r] < 0."""
  model = nnx.merge(graphdef, params, rest)
  rows = jnp.arange(tokens_RT.shape[0])
  _, h_RTD, cache = model.decode_tokens(tokens_RT, pos_R, paged_cache.paged(pool, table_RP))
  last = jnp.maximum(n_new_R - 1, 0)
  last_RD = h_RTD[rows, last]
  logits_RV = model.head(model.norm(last_RD[:, None]))[:, 0]
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed_R, pos_R + n_new_R)
  tok, logp = sample_rows(logits_RV, keys, temp_R, top_p_R)
  if pool.mtp is not None:
    next_RT = jnp.pad(tokens_RT[:, 1:], ((0, 0), (0, 1)))
    next_RT = next_RT.at[rows, last].set(jnp.where(after_R >= 0, after_R, tok))
    _, _, cache = model.draft(h_RTD, next_RT, pos_R, cache)
  return tok, logp, last_RD, paged_cache.unpaged(cache)


def compiled_decode(graphdef, steps: int):
  """decode_fn jitted for `graphdef` and `steps` steps a call, the pool donated."""
  if (graphdef, "decode", steps) not in _compiled:
    _compiled[graphdef, "decode", steps] = jax.jit(functools.partial(decode_fn, graphdef, steps), donate_argnums=2)
  return _compiled[graphdef, "decode", steps]


def decode_fn(graphdef, steps: int, params, rest, pool, x_R, pos_R, live_R, table_RP, temp_R, top_p_R, seed_R):
  """`steps` decode steps (step_fn with one token a row), each row feeding the token drawn at the step before: row r
  (live[r] = 1; 0 for an idle row, which writes to the scratch page) feeds x[r] at slot pos[r], then its drawn tokens
  at the slots after, each drawn with the key the single steps would use. Returns the tokens [R, steps], their
  log-probabilities and the pool."""
  after_R = jnp.full_like(x_R, -1)

  def one(carry, i):
    x_R, pool = carry
    tok, logp, _, pool = step_fn(
      graphdef, params, rest, pool, x_R[:, None], pos_R + i * live_R, live_R, table_RP, temp_R, top_p_R, seed_R, after_R
    )
    return (tok, pool), (tok, logp)

  (_, pool), (tok_SR, logp_SR) = jax.lax.scan(one, (x_R, pool), jnp.arange(steps))
  return tok_SR.T, logp_SR.T, pool


def compiled_round(graphdef, k: int):
  """round_fn jitted for `graphdef` and k drafts a round, the pool donated (one compile for every engine of them)."""
  if (graphdef, k) not in _compiled:
    _compiled[graphdef, k] = jax.jit(functools.partial(round_fn, graphdef, k), donate_argnums=2)
  return _compiled[graphdef, k]


def round_fn(graphdef, k: int, params, rest, pool, x_R, n_R, h_RD, table_RP, temp_R, top_p_R, seed_R):
  """A speculative round for rows whose next token x (slot n) is drawn and whose main model's hidden state at slot
  n - 1 is h (glm_jax/inference/speculative.py's round, each row with its own temperature, top_p and key): the MTP
  layer drafts k tokens, the main model feeds [x, d_1..d_k] at slots n..n+k, accept_rows keeps a prefix of the
  drafts and draws the token after it, and the MTP layer's entries at slots n..n+k-1 are rewritten from the main
  model's states. Returns (candidates [R, k + 1]: the drafts with the drawn token at index kept, kept [R], their
  log-probabilities under the main model, the main model's hidden state at the last kept slot, the pool)."""
  model = nnx.merge(graphdef, params, rest)
  rows = jnp.arange(x_R.shape[0])
  cache = paged_cache.paged(pool, table_RP)
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed_R, n_R)
  k_draft, k_accept = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  draft_keys_KR = jnp.moveaxis(jax.vmap(lambda key: jax.random.split(key, k))(k_draft), 1, 0)

  def draft_step(carry, keys_R):  # the MTP layer at one slot: its input state, the token after it, the slot
    g_R1D, tok_R, slot_R, cache = carry
    q_R1V, g_R1D, cache = model.draft(g_R1D, tok_R[:, None], slot_R, cache)
    d_R, _ = sample_rows(q_R1V[:, 0], keys_R, temp_R, top_p_R)
    return (g_R1D, d_R, slot_R + 1, cache), (d_R, q_R1V[:, 0])

  carry = (h_RD[:, None].astype(model.dtype), x_R, n_R - 1, cache)
  (_, _, _, cache), (drafts_KR, q_KRV) = jax.lax.scan(draft_step, carry, draft_keys_KR)
  drafts_RK, q_RKV = drafts_KR.T, jnp.moveaxis(q_KRV, 0, 1)
  p_RJV, h_RJD, cache = model.decode_tokens(jnp.concatenate([x_R[:, None], drafts_RK], axis=1), n_R, cache)
  kept_R, next_R = speculative.accept_rows(p_RJV, q_RKV, drafts_RK, k_accept, temp_R, top_p_R)
  _, _, cache = model.draft(h_RJD[:, :k], drafts_RK, n_R, cache)
  j = jnp.arange(k + 1)
  cand_RJ = jnp.where(j == kept_R[:, None], next_R[:, None], jnp.pad(drafts_RK, ((0, 0), (0, 1))))
  logp_RJV, _ = draw_log_probs_rows(p_RJV, temp_R, top_p_R)
  logp_RJ = jnp.take_along_axis(logp_RJV, cand_RJ[..., None], axis=-1)[..., 0]
  return cand_RJ, kept_R, logp_RJ, h_RJD[rows, kept_R], paged_cache.unpaged(cache)
