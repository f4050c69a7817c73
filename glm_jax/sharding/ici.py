"""How long a collective takes on a TPU slice's interconnect, from which chips take part and where they sit.

A slice is a torus (3-D on v4 / v5p, 2-D on v5e / v6e) whose chips each have 2 links an axis, one a direction per
link; an axis wraps around when the slice spans it whole (Topology.wrap). `Torus` holds, for every partition id of a
compiled program, the coordinates of its chip (and its slice, for multislice), so the replica groups XLA prints
become sets of chips on the torus. The time of one collective, for the bytes one chip holds:

  all-gather, reduce-scatter   each chip receives (or sends) (g - 1) / g of the gathered array V. Along one torus axis
      the chips of a group run a bidirectional ring (half the data each way round): routing every consecutive pair
      of the ring onto the axis's links gives the load of the busiest link, L (0.5 of a shard a step on a wrapped
      axis the group spans whole, 1 on an axis without its wrap-around link, more where groups share links); the
      axis then delivers W / L bytes a second to a chip (W: one link, one way). A group over several axes uses them
      all at once (the array split in as many parts, each gathered in another order of the axes: the JAX scaling
      book, "all-gathers over multiple axes"), so  t = (g - 1) / g x V / sum_axes(W / L_a).
  all-reduce   a reduce-scatter then an all-gather: twice the reduce-scatter's time.
  all-to-all   every ordered pair of a group sends B / g (B: one chip's buffer), routed dimension by dimension on
      shortest paths (half each way at a tie); t = the busiest link's bytes / W.
  collective-permute   every source sends its whole buffer to its target, routed the same way; t as for
      all-to-all.
  latency      STEP_LATENCY_S a ring step: (n_a - 1) steps an axis, twice for an all-reduce, the longest route for a
      permute.
  slices       XLA:TPU compiles a multislice program as one slice's, its cross-slice collectives handed to the DCN
      runtime as send / recv pairs of a chip's shard (dcn_seconds): an all-reduce over m slices moves 2 (m - 1) / m
      of the shard over the chip's DCN share, as a ring over the slices would.

Links.source says where each bandwidth comes from. What this model leaves out: contention between collectives that
run at the same time (hlo_cost's schedule queues them on one interconnect), and the switch-like routing tables of
twisted tori.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Links:
  ports: int  # ICI links a chip has: 2 a torus axis
  link_bytes_per_s: float  # one link, one direction
  dcn_bytes_per_s: float | None  # one chip's share of its host's data-center network, one direction
  source: str


# Google Cloud's published per-chip figures (cloud.google.com/tpu/docs/<generation>). v5p and v6e publish the
# bidirectional ICI bandwidth a chip in GBps (1200, 800): / 2 directions / ports. v4 and v5e publish a Gbps figure
# (2400, 1600), read as one direction of all ports (it equals v5p's 1200 GBps bidirectional for v5p's 4800 Gbps).
LINKS: dict[str, Links] = {
  "v4": Links(6, 2400e9 / 8 / 6, None, "cloud.google.com/tpu/docs/v4: ICI 2400 Gbps a chip, 3-D torus (6 ports)"),
  "v5e": Links(4, 1600e9 / 8 / 4, None, "cloud.google.com/tpu/docs/v5e: ICI 1600 Gbps a chip, 4 ICI ports"),
  "v5p": Links(
    6,
    1200e9 / 2 / 6,
    50e9 / 8,
    "cloud.google.com/tpu/docs/v5p: bidirectional ICI 1200 GBps a chip, 3-D torus (6 ports); DCN 50 Gbps a chip",
  ),
  "v6e": Links(
    4,
    800e9 / 2 / 4,
    4 * 200e9 / 8 / 8,
    "cloud.google.com/tpu/docs/v6e: bidirectional ICI 800 GBps a chip, 4 ICI ports; 4 x 200 Gbps NICs a "
    "host of 8 chips",
  ),
}

# Time a ring step costs beyond its bytes (a message crossing one hop and its synchronisation). An assumption: the
# order of magnitude the JAX scaling book gives for ICI latency; the calibration against a measured run absorbs
# its error. It matters only for small collectives (1 MB over one link is 10 us).
STEP_LATENCY_S = 1e-6

COLLECTIVE_KINDS = (
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "all-to-all",
  "ragged-all-to-all",
  "collective-permute",
)


@dataclasses.dataclass(frozen=True)
class Torus:
  """Where each partition of a compiled program sits: coords[p] is partition p's chip on a torus of `dims`
  (wrap[a]: axis a has its wrap-around links). A multislice program is one slice's program (XLA:TPU compiles the
  same program for every slice, its cross-slice collectives handed to the DCN runtime): num_slices of them."""

  dims: tuple[int, ...]
  wrap: tuple[bool, ...]
  coords: tuple[tuple[int, ...], ...]
  links: Links
  num_slices: int = 1

  def __post_init__(self):
    if len(self.dims) != len(self.wrap) or any(len(c) != len(self.dims) for c in self.coords):
      raise ValueError(
        f"Torus: dims {self.dims}, wrap {self.wrap} and coordinates of {len(self.dims)} axes must "
        f"agree; got coordinates like {self.coords[:1]}"
      )
    if self.num_slices < 1:
      raise ValueError(f"Torus: num_slices={self.num_slices}; at least 1")

  @property
  def num_partitions(self) -> int:
    return len(self.coords)


def _axis_moves(a: int, b: int, n: int, wrap: bool) -> list[tuple[int, int, float]]:
  """The (direction, hops, weight) ways from coordinate a to b along an axis of n chips: the shorter way round on a
  wrapped axis (both, half the bytes each, at a tie), the only way on an unwrapped one."""
  if a == b:
    return []
  if not wrap:
    return [(1 if b > a else -1, abs(b - a), 1.0)]
  up = (b - a) % n
  if 2 * up < n:
    return [(1, up, 1.0)]
  if 2 * up > n:
    return [(-1, n - up, 1.0)]
  return [(1, up, 0.5), (-1, up, 0.5)]


def route(torus: Torus, src: tuple[int, ...], dst: tuple[int, ...], nbytes: float, loads: dict) -> int:
  """Adds nbytes sent from chip src to chip dst to loads[(axis, chip, direction)] (the link leaving `chip` along
  `axis` in `direction`), dimension by dimension; returns the hops of the longest way."""
  cur, hops = list(src), 0
  for axis, (n, wrap) in enumerate(zip(torus.dims, torus.wrap)):
    moves = _axis_moves(cur[axis], dst[axis], n, wrap)
    for direction, steps, weight in moves:
      pos = cur[axis]
      for _ in range(steps):
        key = (axis, tuple(cur[:axis]) + (pos,) + tuple(cur[axis + 1 :]), direction)
        loads[key] = loads.get(key, 0.0) + nbytes * weight
        pos = (pos + direction) % n
    hops += max((s for _, s, _ in moves), default=0)
    cur[axis] = dst[axis]
  return hops


def _lines(torus: Torus, group: Sequence[int], axis: int) -> list[list[tuple[int, ...]]]:
  """The chips of a group that differ only along `axis`, each line sorted along it."""
  lines: dict[tuple, list] = {}
  for p in group:
    c = torus.coords[p]
    lines.setdefault(c[:axis] + c[axis + 1 :], []).append(c)
  return [sorted(line, key=lambda c: c[axis]) for line in lines.values()]


def _is_product(torus: Torus, group: Sequence[int]) -> bool:
  coords = [torus.coords[p] for p in group]
  return len(set(coords)) == len(group) == math.prod(len({c[a] for c in coords}) for a in range(len(torus.dims)))


def _ring_load(torus: Torus, rings: list[list[tuple[int, ...]]]) -> float:
  """The busiest link's bytes when every ring sends half a unit each way between consecutive members (closing the
  ring), all rings at once."""
  loads: dict = {}
  for ring in rings:
    if len(ring) < 2:
      continue
    for i, c in enumerate(ring):
      nxt = ring[(i + 1) % len(ring)]
      route(torus, c, nxt, 0.5, loads)
      route(torus, nxt, c, 0.5, loads)
  return max(loads.values(), default=0.0)


@dataclasses.dataclass(frozen=True)
class GroupShape:
  """What a set of replica groups looks like on the torus: a ring over each spanned axis (or one ring over the
  group where it is not a product of lines) and the members per ring."""

  size: int  # chips a group
  ring_loads: tuple[float, ...]  # per ring: the busiest link's load for one unit a ring step
  ring_sizes: tuple[int, ...]  # per ring: chips on it


@functools.lru_cache(maxsize=256)
def _group_shape(torus: Torus, groups: tuple[tuple[int, ...], ...]) -> GroupShape:
  size = len(groups[0])
  for g in groups:
    if len(g) != size:
      raise ValueError(
        f"replica groups of unequal sizes {sorted({len(x) for x in groups})}: not a collective this model knows"
      )
    bad = [p for p in g if not 0 <= p < torus.num_partitions]
    if bad:
      raise ValueError(f"replica group names partition {bad[0]}; the program has {torus.num_partitions}")
  if all(_is_product(torus, g) for g in groups):
    loads, sizes = [], []
    for axis in range(len(torus.dims)):
      rings = [line for g in groups for line in _lines(torus, g, axis)]
      n = max(len(r) for r in rings)
      if n > 1:
        loads.append(_ring_load(torus, rings))
        sizes.append(n)
    return GroupShape(size, tuple(loads), tuple(sizes))
  rings = [[torus.coords[p] for p in g] for g in groups]
  return GroupShape(size, (_ring_load(torus, rings),), (size,))


def _p2p_seconds(torus: Torus, pairs: Sequence[tuple[int, int, float]]) -> tuple[float, int]:
  loads: dict = {}
  hops = 0
  for src, dst, nbytes in pairs:
    hops = max(hops, route(torus, torus.coords[src], torus.coords[dst], nbytes, loads))
  return max(loads.values(), default=0.0) / torus.links.link_bytes_per_s, hops


@functools.lru_cache(maxsize=256)
def _all_to_all_unit(torus: Torus, groups: tuple[tuple[int, ...], ...]) -> tuple[float, int]:
  """Seconds for one byte a chip's buffer (B = 1) of an all-to-all, and the longest route."""
  pairs = [(s, d, 1.0 / len(g)) for g in groups for s in g for d in g if s != d]
  return _p2p_seconds(torus, pairs)


def collective_seconds(
  torus: Torus,
  kind: str,
  groups: Sequence[Sequence[int]] | None,
  nbytes: float,
  pairs: Sequence[tuple[int, int]] | None = None,
) -> float:
  """Seconds one collective within a slice takes, by the rules of the module docstring.

  kind: one of COLLECTIVE_KINDS. groups: the replica groups as partition ids (None for collective-permute).
  nbytes: the gathered result (all-gather), the operand (reduce-scatter, all-reduce), one chip's buffer (all-to-all,
  the real rows for a ragged one; collective-permute). pairs: collective-permute's (source, target) partitions."""
  if kind == "collective-permute":
    if not pairs:
      return 0.0
    bad = [p for pair in pairs for p in pair if not 0 <= p < torus.num_partitions]
    if bad:
      raise ValueError(f"collective-permute names partition {bad[0]}; the program has {torus.num_partitions}")
    seconds, hops = _p2p_seconds(torus, [(s, d, nbytes) for s, d in pairs])
    return seconds + STEP_LATENCY_S * max(hops, 1)
  if kind not in COLLECTIVE_KINDS:
    raise ValueError(f"collective kind {kind!r}; one of {COLLECTIVE_KINDS}")
  groups = tuple(tuple(g) for g in groups)
  shape = _group_shape(torus, groups)
  g = shape.size
  if g <= 1:
    return 0.0
  steps = sum(n - 1 for n in shape.ring_sizes)
  if kind in ("all-to-all", "ragged-all-to-all"):
    unit, _ = _all_to_all_unit(torus, groups)
    return unit * nbytes + STEP_LATENCY_S * steps
  bandwidth = sum(torus.links.link_bytes_per_s / load for load in shape.ring_loads if load > 0)
  seconds = (g - 1) / g * nbytes / bandwidth + STEP_LATENCY_S * steps
  return 2 * seconds if kind == "all-reduce" else seconds


# A cross-slice transfer's bytes on one chip's DCN share, in units of its buffer B, over m slices (ring algorithms
# over the slices; each chip exchanges its own shard, in-slice collectives around it having split the array).
DCN_TRANSFERS = {
  "ALL_REDUCE": lambda m: 2 * (m - 1) / m,
  "REDUCE_SCATTER": lambda m: (m - 1) / m,
  "ALL_GATHER": lambda m: m - 1,
  "ALL_TO_ALL": lambda m: (m - 1) / m,
}


def dcn_seconds(torus: Torus, transfer: str, nbytes: float) -> tuple[float, float]:
  """(bytes a chip sends over DCN, seconds) for a cross-slice transfer of `transfer` type (XLA:TPU's
  _xla_megascale_transfer_type) of a chip's nbytes over torus.num_slices slices, at the chip's DCN bandwidth.
  DCN latency is left out: the transfers that cross slices (gradient reductions) are large."""
  if transfer not in DCN_TRANSFERS:
    raise ValueError(f"cross-slice transfer type {transfer!r}; one of {sorted(DCN_TRANSFERS)}")
  if not torus.links.dcn_bytes_per_s:
    raise ValueError(
      f"a collective crosses slices but this generation has no DCN bandwidth in ici.LINKS ({torus.links.source})"
    )
  wire = DCN_TRANSFERS[transfer](torus.num_slices) * nbytes
  return wire, wire / torus.links.dcn_bytes_per_s
