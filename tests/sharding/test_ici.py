"""The interconnect model (glm_jax/sharding/ici.py), the replica-group syntaxes and the schedule of hlo_cost against
hand counts on small tori and hand-written HLO: pure Python, no compile."""

import itertools

import pytest

from glm_jax.sharding import hlo_cost, ici

W = 100e9  # v5p: one link, one direction
LAT = ici.STEP_LATENCY_S
V5P = ici.LINKS["v5p"]


def torus(dims, wrap, num_slices=1):
  """Partitions numbered row-major over dims."""
  coords = list(itertools.product(*[range(n) for n in dims]))
  return ici.Torus(tuple(dims), tuple(wrap), tuple(coords), V5P, num_slices)


def test_links_are_the_published_figures():
  assert V5P.link_bytes_per_s == 100e9 and V5P.ports == 6  # 1200 GBps bidirectional / 2 / 6
  assert V5P.dcn_bytes_per_s == 50e9 / 8
  assert ici.LINKS["v6e"].link_bytes_per_s == 100e9  # 800 GBps / 2 / 4


def test_all_gather_on_a_wrapped_ring_uses_both_directions():
  """8 chips on a wrapped axis of 8: each receives 7 shards, half from each neighbour: 3.5 shards over one link."""
  t = torus((8,), (True,))
  v = 8e6
  assert ici.collective_seconds(t, "all-gather", [list(range(8))], v) == pytest.approx(7 / 8 * v / (2 * W) + 7 * LAT)
  assert ici.collective_seconds(t, "reduce-scatter", [list(range(8))], v) == pytest.approx(
    7 / 8 * v / (2 * W) + 7 * LAT
  )
  assert ici.collective_seconds(t, "all-reduce", [list(range(8))], v) == pytest.approx(
    2 * (7 / 8 * v / (2 * W) + 7 * LAT)
  )


def test_all_gather_without_the_wrap_link_is_half_as_fast():
  """A line of 4: the ring's closing pair crosses every link back, so each direction carries a whole shard a
  step: (g - 1) shards at one link's bandwidth."""
  t = torus((4,), (False,))
  v = 4e6
  assert ici.collective_seconds(t, "all-gather", [[0, 1, 2, 3]], v) == pytest.approx(3 / 4 * v / W + 3 * LAT)


def test_all_gather_over_a_plane_uses_four_links():
  """An 8 x 8 wrapped plane: two axes of bidirectional rings, 4 links' bandwidth; groups in other planes use other
  links."""
  t = torus((8, 8, 2), (True, True, False))
  groups = [[p for p in range(128) if t.coords[p][2] == z] for z in range(2)]
  v = 64e6
  assert ici.collective_seconds(t, "all-gather", groups, v) == pytest.approx(63 / 64 * v / (4 * W) + 14 * LAT)


def test_strided_groups_share_links():
  """Groups {0, 4}, {1, 5}, {2, 6}, {3, 7} on a wrapped ring of 8: every chip receives its partner's half of V from
  4 hops away (a tie: half each way round), and the four groups share every link: 8 chips x V/2 x 4 hops over 16
  directed links is V a link, twice what a 2-chip group of neighbours would take."""
  t = torus((8,), (True,))
  v = 2e6
  groups = [[i, i + 4] for i in range(4)]
  assert ici.collective_seconds(t, "all-gather", groups, v) == pytest.approx(v / W + LAT)
  assert ici.collective_seconds(t, "all-gather", [[2 * i, 2 * i + 1] for i in range(4)], v) == pytest.approx(
    v / 2 / W + LAT
  )


def test_all_to_all_on_a_wrapped_ring_of_four():
  """Each chip sends B/4 to each other: a neighbour's over one hop, the opposite chip's half each way over two.
  Link i -> i+1 carries i's B/4 to i+1, half of i's B/4 to i+2 and half of (i-1)'s to i+1: B/2."""
  t = torus((4,), (True,))
  b = 4e6
  assert ici.collective_seconds(t, "all-to-all", [[0, 1, 2, 3]], b) == pytest.approx(b / 2 / W + 3 * LAT)


def test_all_to_all_over_a_square():
  """A 2 x 2 plane without wrap, x routed first: link (0,y) -> (1,y) carries (0,y)'s B/4 to both chips of x = 1 (B/2),
  link (x,0) -> (x,1) the B/4 of both chips of y = 0 to (x,1) (B/2)."""
  t = torus((2, 2), (False, False))
  b = 4e6
  assert ici.collective_seconds(t, "all-to-all", [[0, 1, 2, 3]], b) == pytest.approx(b / 2 / W + 2 * LAT)


def test_collective_permute_routes_each_pair():
  """A shift by 2 on a wrapped ring of 8: every pair two hops the same way, each link carries two buffers."""
  t = torus((8,), (True,))
  b = 1e6
  pairs = [(i, (i + 2) % 8) for i in range(8)]
  assert ici.collective_seconds(t, "collective-permute", None, b, pairs) == pytest.approx(2 * b / W + 2 * LAT)


def test_cross_slice_transfers_at_the_chips_dcn_share():
  """4 slices: an all-reduce of a chip's 8 MB shard over them moves 2 x 3/4 of it over the chip's 50 Gbps."""
  t = torus((4,), (False,), num_slices=4)
  wire, seconds = ici.dcn_seconds(t, "ALL_REDUCE", 8e6)
  assert wire == 2 * 3 / 4 * 8e6 and seconds == pytest.approx(wire / (50e9 / 8))
  assert ici.dcn_seconds(t, "ALL_GATHER", 8e6)[0] == 3 * 8e6
  with pytest.raises(ValueError, match="transfer type 'BROADCAST'"):
    ici.dcn_seconds(t, "BROADCAST", 1.0)


def test_bad_groups_are_named():
  t = torus((4,), (True,))
  with pytest.raises(ValueError, match="partition 9"):
    ici.collective_seconds(t, "all-gather", [[0, 9]], 1.0)
  with pytest.raises(ValueError, match="unequal sizes"):
    ici.collective_seconds(t, "all-gather", [[0, 1, 2], [3]], 1.0)
  with pytest.raises(ValueError, match="collective kind 'gather'"):
    ici.collective_seconds(t, "gather", [[0, 1]], 1.0)


def _ins(attrs, opcode="all-gather"):
  return hlo_cost._Instr("ag.1", opcode, [("f32", (8,))], ["x"], attrs, "")


@pytest.mark.parametrize(
  "attrs,want",
  [
    ("replica_groups={{0,1},{2,3}}, dimensions={0}", [[0, 1], [2, 3]]),
    ("replica_groups={}, to_apply=%add", [[0, 1, 2, 3]]),
    ("dimensions={0}", [[0, 1, 2, 3]]),
    ("replica_groups=[2,2]<=[4], dimensions={0}", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}", [[0, 1, 2, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'b'}, dimensions={1}", [[0, 1], [2, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}, dimensions={1}", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'a'}, x", [[0, 1], [2, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'a'}, x", [[0, 1], [2, 3]]),  # iota 0,2,1,3
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=([4]<=[2,2]T(1,0)) {'b'}, x", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=4] {'a':(1)2}, x", [[0, 2], [1, 3]]),  # the major half of a: positions 0/2, 1/3
    ("replica_groups=mesh['a'=4] {'a':(2)2}, x", [[0, 1], [2, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'b','a'}, x", [[0, 2, 1, 3]]),
  ],
)
def test_replica_group_syntaxes(attrs, want):
  assert hlo_cost.replica_groups(_ins(attrs), 4) == want


def test_an_unknown_replica_group_syntax_names_the_op():
  with pytest.raises(ValueError, match="all-gather %ag.1: replica_groups='<<0,1>>"):
    hlo_cost.replica_groups(_ins("replica_groups=<<0,1>>, dimensions={0}"), 4)
  with pytest.raises(ValueError, match="all-gather %ag.1"):
    hlo_cost.replica_groups(_ins("replica_groups=mesh['a'=4] {'c'}, x"), 4)


# A hand-written scheduled module on 2 partitions (one wrapped ring of 2 chips is not a torus Cloud builds; a line
# of 2: one link each way): fusion A (1000 cycles), an all-gather of a 1 MB f32 result, fusion B (3000 cycles), then
# fusion C using the gathered array. With a start / done pair the gather runs beside B; as one op it does not.
_MODULE = """HloModule m, is_scheduled=true, num_partitions=2

%fa (p: f32[125000]) -> f32[125000] {
  %p = f32[125000] parameter(0)
  ROOT %t = f32[125000] tanh(%p)
}

ENTRY %main (x: f32[125000]) -> f32[250000] {
  %x = f32[125000] parameter(0)
  %a = f32[125000] fusion(%x), kind=kLoop, calls=%fa, backend_config={"estimated_cycles":"1000"}
  {GATHER}
  %b = f32[125000] fusion(%a), kind=kLoop, calls=%fa, backend_config={"estimated_cycles":"3000"}
  {DONE}
  ROOT %c = f32[250000] fusion(%g, %b), kind=kLoop, calls=%fa, backend_config={"estimated_cycles":"500"}
}
"""
_ASYNC = (
  "%gs = (f32[125000], f32[250000]) all-gather-start(%a), channel_id=1, replica_groups={{0,1}}, dimensions={0}",
  "%g = f32[250000] all-gather-done(%gs)",
)
_SYNC = ("%g = f32[250000] all-gather(%a), channel_id=1, replica_groups={{0,1}}, dimensions={0}", "")


@pytest.mark.parametrize("overlap", [True, False])
def test_schedule_overlaps_only_what_the_program_overlaps(overlap):
  gather, done = _ASYNC if overlap else _SYNC
  text = _MODULE.replace("{GATHER}", gather).replace("{DONE}", done)
  chip = hlo_cost.Chip.of("v5p", torus((2,), (False,)))
  ops = hlo_cost.program_ops(text, chip=chip)
  clock = hlo_cost.CLOCK_HZ["v5p"]
  a, b, c = 1000 / clock, 3000 / clock, 500 / clock
  wire = 1 / 2 * 1e6 / W + LAT  # the gathered 1 MB, half of it received over the one link
  [g] = [o for o in ops if o.collective and o.role != "done"]
  assert g.wire == 0.5e6 and g.wire_seconds == pytest.approx(wire)
  got = hlo_cost.schedule(text, ops, chip)
  assert got["serial_seconds"] == pytest.approx(a + b + c + wire)
  want = a + max(b, wire) + c if overlap else a + wire + b + c
  assert got["seconds"] == pytest.approx(want)
  assert got["exposed_collective_seconds"] == pytest.approx(max(0.0, wire - b) if overlap else wire)


def test_a_generation_without_figures_is_named():
  with pytest.raises(ValueError, match="TPU generation 'v7x' has no peaks"):
    hlo_cost.Chip.of("v7x")
  t = ici.Torus((4,), (False,), ((0,), (1,), (2,), (3,)), ici.LINKS["v4"], num_slices=2)
  with pytest.raises(ValueError, match="crosses slices but this generation has no DCN bandwidth"):
    ici.dcn_seconds(t, "ALL_REDUCE", 1e6)


def test_a_program_on_another_number_of_chips_is_refused():
  chip = hlo_cost.Chip.of("v5p", torus((4,), (False,)))
  text = _MODULE.replace("{GATHER}", _SYNC[0]).replace("{DONE}", "")
  with pytest.raises(ValueError, match="runs on 2 partitions, the torus places 4"):
    hlo_cost.program_ops(text, chip=chip)
