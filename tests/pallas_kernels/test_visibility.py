"""The one visibility rule (pallas_kernels/visibility.py) in the forms its readers take: the rows of a query block
(blockwise attention, a context-parallel chunk), stacked blocks for a scan, a decode step's reach, and whether
splash's static mask expresses it. Each against the rule written as a loop (tests/pallas_kernels/
test_indexer_prefix.py's _loop_mask) or a plain numpy formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.visibility import Visibility
from tests.pallas_kernels.test_indexer_prefix import _loop_mask

B, T = 2, 12


def _data(seed=0):
  rng = np.random.default_rng(seed)
  seg = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  pe = rng.integers(0, T + 1, (B, T)).astype(np.int32)
  return seg, pe


def test_rows_are_the_rows_of_the_whole_mask():
  seg, pe = _data()
  vis = Visibility.self_attention(jnp.asarray(seg), jnp.asarray(pe))
  whole = _loop_mask(T, T, 0, seg, seg, pe)
  for start, size in [(0, 4), (4, 4), (9, 3)]:
    np.testing.assert_array_equal(np.asarray(vis.rows(start, size).mask(size, T)), whole[:, start : start + size])


def test_rows_at_a_given_offset_are_a_chunk_elsewhere_in_the_sequence():
  # context parallelism's zig-zag: a device's second chunk holds rows 3..5 of its own array but sits at positions
  # 9..11 of the sequence, whose segment ids and prefix ends are those of positions 9..11
  seg, pe = _data(1)
  mine = [0, 1, 2, 9, 10, 11]
  local = Visibility(jnp.asarray(0), jnp.asarray(seg[:, mine]), jnp.asarray(seg), jnp.asarray(pe[:, mine]))
  got = local.rows(3, 3, q_offset=9).mask(3, T)
  np.testing.assert_array_equal(np.asarray(got), _loop_mask(T, T, 0, seg, seg, pe)[:, 9:12])


def test_query_blocks_scanned_give_the_whole_mask():
  seg, pe = _data(2)
  vis = Visibility.self_attention(jnp.asarray(seg), jnp.asarray(pe))
  n = 3
  blocks = vis.query_blocks(n, jnp.arange(n, dtype=jnp.int32) * (T // n))

  def one(carry, block):
    return carry, block.with_keys(vis.kv_segment_ids).mask(T // n, T)

  _, masks = jax.lax.scan(one, (), blocks)
  got = np.moveaxis(np.asarray(masks), 0, 1).reshape(B, T, T)
  np.testing.assert_array_equal(got, _loop_mask(T, T, 0, seg, seg, pe))


def test_up_to_sees_every_slot_to_its_reach_and_no_further():
  reach = np.array([[3, 4, 5], [0, 1, 7]], np.int32)  # decode: a row's T = 3 new tokens at slots pos .. pos + 2
  got = np.asarray(Visibility.up_to(jnp.asarray(reach)).mask(3, 10))
  np.testing.assert_array_equal(got, np.arange(10)[None, None, :] <= reach[:, :, None])


def test_static_causal_is_what_splash_expresses_and_survives_jit():
  seg, pe = _data()
  assert Visibility().is_static_causal and Visibility.self_attention(jnp.asarray(seg)).is_static_causal
  assert Visibility(q_offset=0).is_static_causal
  for other in (Visibility(q_offset=3), Visibility(causal=False), Visibility.self_attention(None, jnp.asarray(pe))):
    assert not other.is_static_causal
  # through jit an int q_offset becomes a tracer (not known to be 0); the default None has no leaf and stays None
  seen = {}

  def probe(vis):
    seen[vis.q_offset is None] = vis.is_static_causal
    return vis.mask(4, 4)

  jax.jit(probe)(Visibility.self_attention(jnp.asarray(seg[:, :4])))
  jax.jit(probe)(Visibility(q_offset=0))
  assert seen == {True: True, False: False}


def test_errors_name_the_field():
  seg = jnp.zeros((B, T), jnp.int32)
  with pytest.raises(ValueError, match=r"f: give both q_segment_ids and kv_segment_ids, or neither"):
    Visibility(q_segment_ids=seg).check("f", B, T, T)
  with pytest.raises(ValueError, match=r"f: segment ids must be q \[2, 12\] and kv \[2, 5\]; got \(2, 12\), \(2, 12\)"):
    Visibility.self_attention(seg).check("f", B, T, 5)
  with pytest.raises(TypeError, match=r"f: q_offset=1.5; must be an int or an integer scalar array"):
    Visibility(q_offset=1.5).check("f", B, T, T)


def test_arrays_and_with_arrays_sort_the_query_side_from_the_key_side():
  seg, pe = _data()
  vis = Visibility(3, jnp.asarray(seg), jnp.asarray(seg), jnp.asarray(pe))
  assert sorted(vis.arrays()) == ["kv_segment_ids", "q_prefix_end", "q_segment_ids"]
  assert sorted(Visibility(q_prefix_end=jnp.asarray(pe)).arrays()) == ["q_prefix_end"]
  # a shard's arrays back in (keys' side through `keys`): only kv_segment_ids is passed through
  doubled = vis.with_arrays(vis.arrays(), keys=lambda x: jnp.concatenate([x, x], axis=1))
  assert doubled.q_segment_ids.shape == doubled.q_prefix_end.shape == (B, T)
  assert doubled.kv_segment_ids.shape == (B, 2 * T) and doubled.q_offset == 3
