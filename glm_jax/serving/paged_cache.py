"""The serving engine's cache: fixed-size pages of MLA latents and indexer keys from one pool, a page table a request.

  pool.kv       [(L,) N, page_size, kv_lora_rank + qk_rope_head_dim]   the LayerCache's kv, its rows being pages
  pool.index_k  [(L,) N, page_size, index_head_dim]                    (DSA only)
  page_table    [R, P] int32                                           request r's slot s lives in page
                                                                       page_table[r, s // page_size] at s % page_size
Memory is the pool's N pages, whatever the number of requests or their lengths. Page 0 is scratch: a page-table entry
of 0 is "no page", writes to slots with no page land there, and no query ever reads it. Under a mesh each shard of the
batch axes holds its rows' pages, its own page 0, and page tables indexing its own pages (no page crosses a chip).
`PagedLayerCache` gives MLA.decode (glm_jax/model/mla.py) the LayerCache interface over a pool: `write` scatters the
new entries into their pages, `kv` / `index_k` gather a request's pages into the contiguous [R, P * page_size, W] view
the decode attends over (a ragged paged-attention kernel would read them in place on TPU). `PagePool` is the host side:
free pages, which request holds which, and the prefix cache: a full page is registered under a hash chain of every
token up to its end, so a request whose prompt starts with the same tokens maps it instead of prefilling; shared pages
are read-only (a request writes only past its matched prefix), unheld cached pages are evicted least recently used
first, and new weights make every cached page stale (`clear_prefix_cache`). The engine: docs/serving.md.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glm_jax.mesh_axes import BATCH_AXES
from glm_jax.model.config import ModelConfig
from glm_jax.model.kv_cache import KVCache, LayerCache
from glm_jax.model.layers import dtype_of

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLayerCache:
  """LayerCache's interface (length, kv, index_k, write) over one layer's pages and the requests' page tables."""

  pages: LayerCache  # kv [N, page_size, A], index_k [N, page_size, Z] or None
  page_table: jax.Array  # [R, P] int32

  @property
  def page_size(self) -> int:
    return self.pages.kv.shape[-2]

  @property
  def length(self) -> int:
    return self.page_table.shape[-1] * self.page_size

  def _view(self, pool: jax.Array) -> jax.Array:
    def gather(pool, table):
      r, p = table.shape
      return pool[table].reshape(r, p * self.page_size, pool.shape[-1])

    return _per_shard(gather, pool, self.page_table)

  @property
  def kv(self) -> jax.Array:
    return self._view(self.pages.kv)

  @property
  def index_k(self) -> jax.Array | None:
    return None if self.pages.index_k is None else self._view(self.pages.index_k)

  def write(self, pos_B: jax.Array, kv_BTA: jax.Array, index_k_BTZ: jax.Array | None) -> PagedLayerCache:
    """Row b's T new entries at slots pos[b]..pos[b] + T - 1, each in its page (scratch past the table's end)."""
    size = self.page_size

    def put(pool, table, pos, new):
      slots = pos[:, None] + jnp.arange(new.shape[1])
      col = slots // size
      width = table.shape[1]
      page = jnp.where(col < width, jnp.take_along_axis(table, jnp.minimum(col, width - 1), axis=1), SCRATCH_PAGE)
      return pool.at[page, slots % size].set(new.astype(pool.dtype))

    kv = _per_shard(put, self.pages.kv, self.page_table, pos_B, kv_BTA)
    index_k = None
    if self.pages.index_k is not None:
      index_k = _per_shard(put, self.pages.index_k, self.page_table, pos_B, index_k_BTZ)
    return PagedLayerCache(LayerCache(kv=kv, index_k=index_k), self.page_table)


def batch_shards(rows: int, pages: int) -> tuple[str, ...]:
  """The current mesh's batch axes (of size > 1) that split the requests' rows and the pool's pages alike: each
  shard holds its rows' pages, and a page table's entries index its own shard's pages. () without a mesh; sizes
  the axes do not divide are refused by name."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  shards = math.prod(mesh.shape[a] for a in axes)
  for name, n in (("rows", rows), ("pages", pages)):
    if n % shards:
      raise ValueError(
        f"the paged cache under a mesh: {n} {name}; the batch axes {dict((a, mesh.shape[a]) for a in axes)} split "
        f"rows and pages {shards} ways (each shard its rows' pages): give a multiple of {shards}"
      )
  return axes


def _per_shard(fn, pool, table, *row_args):
  """fn(pool, table, *row_args) on each batch shard's pages and rows (a shard_map over batch_shards), or on the
  whole pool without a mesh. The pool's leading axis is pages, every other operand's rows."""
  axes = batch_shards(table.shape[0], pool.shape[0])
  if not axes:
    return fn(pool, table, *row_args)
  spec = P(axes)
  return jax.shard_map(fn, in_specs=(spec,) * (2 + len(row_args)), out_specs=spec, check_vma=False)(
    pool, table, *row_args
  )


def empty_pool(cfg: ModelConfig, num_pages: int, page_size: int, *, mtp: bool = False) -> KVCache:
  """A KVCache of zeros whose LayerCaches' rows are pages: [L, num_pages, page_size, W] a stack; with mtp, the first
  MTP layer's too ([num_pages, page_size, W], no layer axis: speculative decoding's drafts), on the same pages."""
  dtype = dtype_of(cfg.dtype)

  def stack(*lead: int) -> LayerCache | None:
    if not all(lead):
      return None
    index_k = jnp.zeros((*lead, num_pages, page_size, cfg.index_head_dim), dtype) if cfg.use_dsa else None
    return LayerCache(kv=jnp.zeros((*lead, num_pages, page_size, cfg.kv_latent_dim), dtype), index_k=index_k)

  return KVCache(dense=stack(cfg.num_dense_layers), moe=stack(cfg.num_moe_layers), mtp=stack() if mtp else None)


def paged(pool: KVCache, page_table_RP: jax.Array) -> KVCache:
  """The pool as a KVCache of PagedLayerCaches (the page table repeated for each layer of a stack: scan slices it)."""

  def wrap(stack: LayerCache | None, layered: bool = True):
    if stack is None:
      return None
    lead = stack.kv.shape[:1] if layered else ()
    return PagedLayerCache(stack, jnp.broadcast_to(page_table_RP, (*lead, *page_table_RP.shape)))

  return KVCache(dense=wrap(pool.dense), moe=wrap(pool.moe), mtp=wrap(pool.mtp, layered=False))


def unpaged(cache: KVCache) -> KVCache:
  """The pool back out of `paged`'s KVCache."""
  return KVCache(**{k: None if c is None else c.pages for k, c in vars(cache).items()})


def page_hashes(tokens, page_size: int, pages: int) -> list[bytes]:
  """The prefix-cache keys of the first `pages` whole pages of `tokens`: page i's key hashes page i - 1's key and
  page i's tokens, so it names every token up to the page's end."""
  out, prev = [], b""
  arr = np.asarray(tokens[: pages * page_size], np.int64)
  for i in range(pages):
    prev = hashlib.blake2b(prev + arr[i * page_size : (i + 1) * page_size].tobytes(), digest_size=16).digest()
    out.append(prev)
  return out


class PagePool:
  """Host-side bookkeeping of the pages 1..num_pages - 1 (0 is scratch): free pages, the pages each holder has, and
  the prefix cache (module docstring). Counts: `free_pages` (allocatable now, cached-but-unused pages included)."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}; need at least 2 (page 0 is scratch)")
    self.num_pages, self.page_size = num_pages, page_size
    self._free = list(range(num_pages - 1, 0, -1))  # pop() gives the lowest page first
    self._refs = np.zeros(num_pages, np.int32)
    self._by_hash: dict[bytes, int] = {}
    self._hash_of: dict[int, bytes] = {}
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, held by nobody: LRU first

  @property
  def free_pages(self) -> int:
    return len(self._free) + len(self._idle)

  @property
  def used_pages(self) -> int:
    return int(np.count_nonzero(self._refs))

  def cached(self, key: bytes) -> int | None:
    return self._by_hash.get(key)

  def is_cached(self, key: bytes) -> bool:
    return key in self._by_hash

  def acquire(self, shared: list[int], fresh: int) -> list[int] | None:
    """Holds the cached pages `shared` and `fresh` new ones, or returns None (holding nothing) when the pool
    cannot give them. Returns the pages in order: shared, then fresh."""
    held = set(shared)
    spare = len(self._free) + sum(1 for p in self._idle if p not in held)
    if fresh > spare:
      return None
    for p in shared:
      self._refs[p] += 1
      self._idle.pop(p, None)
    out = list(shared)
    for _ in range(fresh):
      if self._free:
        p = self._free.pop()
      else:  # evict the least recently used cached page
        p, _ = self._idle.popitem(last=False)
        del self._by_hash[self._hash_of.pop(p)]
      self._refs[p] = 1
      out.append(p)
    return out

  def register(self, page: int, key: bytes) -> None:
    """Marks a held, fully written page as the prefix cache's page for `key` (a page already cached under that key
    stays the cached one)."""
    if key not in self._by_hash and page not in self._hash_of:
      self._by_hash[key] = page
      self._hash_of[page] = key

  def release(self, pages: list[int]) -> None:
    """Lets go of a holder's pages: cached ones stay cached (most recently used last), the rest are free."""
    for p in pages:
      self._refs[p] -= 1
      if self._refs[p] == 0:
        if p in self._hash_of:
          self._idle[p] = None
          self._idle.move_to_end(p)
        else:
          self._free.append(p)

  def clear_prefix_cache(self) -> None:
    """Forgets every cached page (new weights: their entries are stale); pages still held are freed on release."""
    for p in self._idle:
      self._free.append(p)
    self._idle.clear()
    self._by_hash.clear()
    self._hash_of.clear()
