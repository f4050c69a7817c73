"""Which keys a query may see: the one visibility rule every attention path and kernel consumes.

Queries t = 0..T-1 sit at positions t + q_offset among keys s = 0..S-1. Key s is visible to query t when

  causal:      s <= t + q_offset  or  s < q_prefix_end[t]      (non-causal: every key)
  segments:    q_segment_ids[t] == kv_segment_ids[s]            (when segment ids are given)

q_offset (None for 0, an int or a traced integer scalar) places the queries among the keys: a block of blockwise
attention, a context-parallel chunk, the last T of S keys when prefilling a chunk. q_prefix_end [B, T] is GLM's
bidirectional prefix (blank infilling: part A of a document attends both ways, part B causally after it): key s is
visible when s <= max(t + q_offset, q_prefix_end[t] - 1), still only within the segment. A query whose prefix ends
at or before its own position + 1 (all zeros, say) sees exactly the causal set, so all zeros equal None. A decode
step against a cache is a prefix too (`up_to`): query t sees the slots up to its reach, no further.

Who reads it: the reference mask (`mask`, for the pure-jnp oracles and the dense MHA path), the indexer kernel (the
per-block reach it skips key blocks by), blockwise attention and context parallelism (`rows`: their query blocks),
splash (`is_static_causal`: its mask is static), decode (`up_to`), and the shard_maps that split its arrays over the
batch or gather the keys' side over a context axis (`arrays`, `with_arrays`). A new option is a field here (an array
with its side, or a static one), its term in `mask`, and the indexer kernel's own test of it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Visibility:
  """The rule in the module docstring. A pytree: its arrays (and a traced q_offset) are leaves, `causal` is static."""

  q_offset: jax.Array | int | None = None  # None: 0, and known to be 0 through any jit (a pytree without leaves)
  # The arrays, each a query's ([B, T]) or a key's ([B, S]): `side` says which (a shard_map splits them over the
  # batch; context parallelism gathers the keys' side).
  q_segment_ids: jax.Array | None = dataclasses.field(default=None, metadata=dict(side="q"))  # [B, T]
  kv_segment_ids: jax.Array | None = dataclasses.field(default=None, metadata=dict(side="kv"))  # [B, S]
  q_prefix_end: jax.Array | None = dataclasses.field(default=None, metadata=dict(side="q"))  # [B, T] integers
  causal: bool = dataclasses.field(default=True, metadata=dict(static=True))

  @classmethod
  def self_attention(cls, segment_ids: jax.Array | None = None, prefix_end: jax.Array | None = None) -> Visibility:
    """One sequence attending to itself: causal, its segments on both sides, GLM's prefix ends if any."""
    return cls(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, q_prefix_end=prefix_end)

  @classmethod
  def up_to(cls, reach_BT: jax.Array) -> Visibility:
    """Query t sees keys 0..reach[t] (decoding against a cache: reach = the slot of the query's own token, at
    least t). With q_offset 0 the causal rule admits s <= t and the prefix reach + 1 widens it to s <= reach."""
    return cls(q_prefix_end=reach_BT + 1)

  @property
  def is_static_causal(self) -> bool:
    """Causal, no prefix and q_offset 0 (a Python int): what a static block mask (splash's CausalMask) expresses,
    with segment ids as its only data."""
    static_zero = self.q_offset is None or (isinstance(self.q_offset, (int, np.integer)) and self.q_offset == 0)
    return self.causal and self.q_prefix_end is None and static_zero

  @property
  def offset(self) -> jax.Array | int:
    """q_offset, 0 for None."""
    return 0 if self.q_offset is None else self.q_offset

  def check(self, fn: str, b: int | None, t_len: int, s_len: int | None = None) -> Visibility:
    """self with its arrays as jnp arrays, or a ValueError naming `fn`, the field, its value and what is valid:
    segment ids [b, T] and [b, S], both or neither; q_prefix_end [b, T] integers, causal only (b None: any B)."""
    want_b = "B" if b is None else b
    if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
      raise ValueError(f"{fn}: give both q_segment_ids and kv_segment_ids, or neither")
    seg = {}
    if self.q_segment_ids is not None:
      q_seg, kv_seg = jnp.asarray(self.q_segment_ids), jnp.asarray(self.kv_segment_ids)
      bad_q = q_seg.ndim != 2 or q_seg.shape[1] != t_len or (b is not None and q_seg.shape[0] != b)
      bad_kv = kv_seg.ndim != 2 or (s_len is not None and kv_seg.shape[1] != s_len)
      if bad_q or bad_kv or (b is None and kv_seg.shape[0] != q_seg.shape[0]):
        raise ValueError(
          f"{fn}: segment ids must be q [{want_b}, {t_len}] and kv [{want_b}, {'S' if s_len is None else s_len}]; "
          f"got {q_seg.shape}, {kv_seg.shape}"
        )
      seg = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    pe = self.q_prefix_end
    if pe is not None:
      pe = jnp.asarray(pe)
      if not self.causal:
        raise ValueError(
          f"{fn}: q_prefix_end given with causal=False; a prefix widens the causal mask only "
          "(a non-causal mask already shows every key): pass causal=True or q_prefix_end=None"
        )
      if pe.ndim != 2 or pe.shape[1] != t_len or (b is not None and pe.shape[0] != b):
        raise ValueError(
          f"{fn}: q_prefix_end shape {pe.shape}; want [B, T] = [{want_b}, {t_len}] (each query's prefix end)"
        )
      if not jnp.issubdtype(pe.dtype, jnp.integer):
        raise ValueError(f"{fn}: q_prefix_end dtype {pe.dtype}; want an integer dtype (a key position)")
    q_offset = self.offset
    if isinstance(q_offset, bool) or not (
      isinstance(q_offset, (int, np.integer))
      or (hasattr(q_offset, "dtype") and jnp.issubdtype(q_offset.dtype, jnp.integer) and jnp.ndim(q_offset) == 0)
    ):
      raise TypeError(f"{fn}: q_offset={q_offset!r}; must be an int or an integer scalar array")
    return dataclasses.replace(self, q_prefix_end=pe, **seg)

  def mask(self, t_len: int, s_len: int) -> jax.Array:
    """[B or 1, T, S] bool, the rule in full; [B, T, S] with segment ids or a prefix."""
    vis = self.check("Visibility.mask", None, t_len, s_len)
    t = jnp.arange(t_len)[:, None] + vis.offset
    s = jnp.arange(s_len)[None, :]
    mask = ((s <= t) if vis.causal else jnp.ones((t_len, s_len), bool))[None]
    if vis.q_prefix_end is not None:
      mask = mask | (s[None] < vis.q_prefix_end[:, :, None])  # s < end, not s <= end - 1: no wrap at the int min
    if vis.q_segment_ids is not None:
      mask = mask & (vis.q_segment_ids[:, :, None] == vis.kv_segment_ids[:, None, :])
    return mask

  def rows(self, start: int, size: int, q_offset: jax.Array | int | None = None) -> Visibility:
    """Queries start..start + size - 1 of these, against the same keys: at q_offset + start, or at `q_offset`
    when given (a context-parallel chunk, whose rows are not at consecutive positions)."""
    cut = lambda x: None if x is None else x[:, start : start + size]  # noqa: E731
    return dataclasses.replace(
      self,
      q_offset=self.offset + start if q_offset is None else q_offset,
      q_segment_ids=cut(self.q_segment_ids),
      q_prefix_end=cut(self.q_prefix_end),
    )

  def query_blocks(self, n: int, offsets: jax.Array) -> Visibility:
    """The T queries as n blocks of T / n, stacked on a leading axis for a lax.scan: q arrays [n, B, T / n],
    q_offset [n] (`offsets`: each block's position among the keys). The keys' segment ids are not stacked (each
    block sees all of them): the scanned block takes them back with `with_keys`."""

    def blocks(x):
      return None if x is None else jnp.moveaxis(x.reshape(x.shape[0], n, -1), 1, 0)

    return dataclasses.replace(
      self,
      q_offset=offsets,
      q_segment_ids=blocks(self.q_segment_ids),
      kv_segment_ids=None,
      q_prefix_end=blocks(self.q_prefix_end),
    )

  def arrays(self) -> dict[str, jax.Array]:
    """The [B, T] / [B, S] arrays it holds, by field name (the ones not None)."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if "side" in f.metadata and getattr(self, f.name) is not None
    }

  def with_arrays(self, arrays: dict[str, jax.Array], keys=None) -> Visibility:
    """These arrays in place of its own (a shard's, inside a shard_map); the keys' side passed through `keys`
    when given (context parallelism: a device's key arrays -> the whole sequence's)."""
    side = {f.name: f.metadata.get("side") for f in dataclasses.fields(self)}
    return dataclasses.replace(
      self, **{k: keys(x) if keys is not None and side[k] == "kv" else x for k, x in arrays.items()}
    )

  def with_keys(self, kv_segment_ids: jax.Array | None) -> Visibility:
    return dataclasses.replace(self, kv_segment_ids=kv_segment_ids)
