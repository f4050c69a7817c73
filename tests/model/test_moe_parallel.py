"""Expert parallelism (moe_parallel.expert_parallel_ffn) against the one-device dropless MoE (moe.grouped_ffn):
outputs and gradients on 8 simulated CPU devices for several meshes and routings, including every pair sent to one
expert, and the compiled program really exchanging tokens with an all-to-all; with a capacity factor, outputs
and dropped counts against a numpy loop over each dispatch group. The checked programs are traced with NaN in the
buffers the exchange leaves unfilled (jax.lax.empty's, in training): no row is read unwritten, so no fill changes an
output or a gradient.
The fast path (buffer_factor: a receive buffer sized for the balanced load, taken when the routing fits it) gives
the same outputs and gradients for routings that fit it and routings that do not.

The checks need 8 devices: they run in tests/test_multi_device.py's session of 8 simulated devices."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from glm_jax.model import moe_parallel, ragged_all_to_all as rat
from glm_jax.model.grouped_ffn import grouped_ffn
from glm_jax.model.moe_parallel import expert_parallel_ffn, expert_parallel_specs
from tests import helpers

N, D, I, E, K = 64, 16, 8, 16, 3
TOL = 1e-5
CAPACITY = 1.0  # cap = ceil(G * K / E) pairs an expert for a dispatch group of G tokens

# name -> (axis sizes, axis names, sharding of the expert weights' D axis before the call)
MESHES = {
  "expert8": ((8,), ("expert",), None),
  "data2_expert4": ((2, 4), ("data", "expert"), None),
  "expert2_data4": ((2, 4), ("expert", "data"), None),
  # tensor-parallel experts (I split, psum) and an fsdp-sharded D that must be all-gathered
  "expert2_fsdp2_tensor2": ((2, 2, 2), ("expert", "fsdp", "tensor"), "fsdp"),
  # no expert axis: no exchange, data parallel grouped_ffn
  "data8": ((8,), ("data",), None),
}


def routings(rng):
  """Expert ids [N, K]: random top-k, every pair to expert 0, every pair to the last shard's experts."""
  random = np.argsort(rng.random((N, E)), axis=-1)[:, :K]
  last = np.broadcast_to(E - 1 - np.arange(K) % 2, (N, K))
  return {"random": random, "all_to_expert_0": np.zeros((N, K)), "all_to_last_experts": last}


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  x, w = f(N, D), jnp.asarray(rng.random((N, K)), jnp.float32)
  gate, up, down = 0.3 * f(E, D, I), 0.3 * f(E, D, I), 0.3 * f(E, I, D)
  ct = f(N, D)  # the cotangent pulled back for the gradients
  return x, w, gate, up, down, ct, {k: jnp.asarray(v, jnp.int32) for k, v in routings(rng).items()}


def value_and_grads(ffn, x, w, idx, gate, up, down, ct):
  """(y, d<y, ct>/d(x, w, gate, up, down))."""
  y, pull = jax.vjp(lambda x, w, g, u, d: ffn(x, w, idx, g, u, d), x, w, gate, up, down)
  return y, pull(ct)


def check(name: str) -> dict:
  """Max |expert parallel - grouped_ffn| of y and of each gradient per routing, and whether the compiled
  program has an all-to-all. Needs jax.device_count() >= 8."""
  shape, names, d_axis = MESHES[name]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  x, w, gate, up, down, ct, idxs = inputs()
  specs = expert_parallel_specs(mesh)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  if d_axis is not None:  # D of the expert weights sharded too, as the fsdp rules would
    specs = dict(
      specs,
      gate=P(specs["gate"][0], d_axis, specs["gate"][2]),
      up=P(specs["up"][0], d_axis, specs["up"][2]),
      down=P(specs["down"][0], specs["down"][1], d_axis),
    )
  sx, sw, sct = put(x, specs["x"]), put(w, specs["w"]), put(ct, specs["y"])
  sg, su, sd = put(gate, specs["gate"]), put(up, specs["up"]), put(down, specs["down"])

  ep = lambda x, w, i, g, u, d: expert_parallel_ffn(x, w, i, g, u, d, jnp.float32, mesh=mesh)[0]
  ref = lambda x, w, i, g, u, d: grouped_ffn(x, w, i, g, u, d, jnp.float32)[0]
  ref_fn = jax.jit(lambda *a: value_and_grads(ref, *a))

  out = {"errors": {}, "ref_scale": {}}
  # The receive buffers and their gradients are not filled (ragged_all_to_all.unwritten: jax.lax.empty, zeros on the
  # CPU). The program is traced with NaN there instead, so a row read before it is written shows as NaN in y or a
  # gradient; where none is read, what fills them changes nothing the program computes, so this one program checks
  # the values of the unfilled one too.
  with nan_unwritten():
    ep_fn = (
      jax.jit(lambda *a: value_and_grads(ep, *a))
      .lower(sx, sw, put(idxs["random"], specs["idx"]), sg, su, sd, sct)
      .compile()
    )
  for routing, idx in idxs.items():
    y_ref, grads_ref = ref_fn(x, w, idx, gate, up, down, ct)
    y, grads = ep_fn(sx, sw, put(idx, specs["idx"]), sg, su, sd, sct)
    errs, scales = {}, {}
    for key, a, b in zip(("y", "dx", "dw", "dgate", "dup", "ddown"), (y, *grads), (y_ref, *grads_ref)):
      errs[key] = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))  # NaN if a NaN got through
      scales[key] = float(np.max(np.abs(np.asarray(b))))
    out["errors"][routing] = errs
    out["ref_scale"][routing] = scales

  if "expert" in names:  # the fast path: a buffer of 1.5x the balanced load, rounded to 8 rows
    out.update(fast_path_check(mesh, (sx, sw, sg, su, sd, sct), idxs, put, specs, ref_fn, (x, w, gate, up, down, ct)))

  idx = put(idxs["random"], specs["idx"])
  out["has_all_to_all"] = "all-to-all" in ep_fn.as_text()  # also matches ragged-all-to-all

  # bf16: equal to grouped_ffn in bf16 up to bf16 rounding (rows travel in bf16)
  y16 = jax.jit(lambda *a: expert_parallel_ffn(*a, jnp.bfloat16, mesh=mesh)[0])(sx, sw, idx, sg, su, sd)
  y16_ref = grouped_ffn(x, w, idxs["random"], gate, up, down, jnp.bfloat16)[0]
  out["bf16_rel_error"] = float(
    np.max(np.abs(np.asarray(y16, np.float32) - np.asarray(y16_ref, np.float32)))
    / np.max(np.abs(np.asarray(y16_ref, np.float32)))
  )
  out["capacity"] = capacity_check(mesh, (sx, sw, sg, su, sd), idxs, put, specs)
  return out


FAST_FACTOR, FAST_TILE = 1.5, 8
# The fast path's check exchanges blocks of 2 rows: at these sizes (1.5 pairs a sender and expert under random
# routing) blocks of 8 would pad a random routing beyond the skewed ones, so no buffer would fit one and not the other.
FAST_BLOCK = 2


def busiest_rows(idx, p: int, n_loc: int, block: int) -> int:
  """numpy: the rows the busiest shard receives, each sender's run of an expert padded to whole blocks (a dispatch
  group is p consecutive devices of n_loc tokens; shard q holds experts [q E/p, (q+1) E/p))."""
  groups = np.asarray(idx).reshape(-1, p, n_loc * K)
  return max(
    sum(-(-int(np.sum(sender == e)) // block) * block for sender in group for e in range(q * E // p, (q + 1) * E // p))
    for group in groups
    for q in range(p)
  )


def fast_path_check(mesh, sharded, idxs, put, specs, ref_fn, plain) -> dict:
  """expert_parallel_ffn with buffer_factor=FAST_FACTOR (unfilled buffers NaN) against grouped_ffn, per routing,
  and whether that routing's busiest shard fits the fast buffer (busiest_rows)."""
  saved = moe_parallel.ROW_TILE, moe_parallel.BLOCK
  moe_parallel.ROW_TILE, moe_parallel.BLOCK = FAST_TILE, FAST_BLOCK
  try:
    fast = lambda x, w, i, g, u, d: expert_parallel_ffn(
      x, w, i, g, u, d, jnp.float32, mesh=mesh, buffer_factor=FAST_FACTOR
    )[0]
    with nan_unwritten():
      fn = (
        jax.jit(lambda *a: value_and_grads(fast, *a))
        .lower(*sharded[:2], put(idxs["random"], specs["idx"]), *sharded[2:])
        .compile()
      )
  finally:
    moe_parallel.ROW_TILE, moe_parallel.BLOCK = saved
  p = mesh.shape["expert"]
  shards = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert") if a in mesh.axis_names)
  n_loc = N // shards
  fast_rows = math.ceil(FAST_FACTOR * n_loc * K / FAST_TILE) * FAST_TILE
  # the worst case: all of a group's pairs to one shard, each sender's runs of its E / p experts padded
  worst = p * (n_loc * K + E // p * (FAST_BLOCK - 1)) // FAST_BLOCK * FAST_BLOCK
  out = {"fast_errors": {}, "fast_fits": {}, "fast_rows": fast_rows, "worst_rows": worst}
  for routing, idx in idxs.items():
    y, grads = fn(*sharded[:2], put(idx, specs["idx"]), *sharded[2:])
    y_ref, grads_ref = ref_fn(*plain[:2], idx, *plain[2:])
    out["fast_errors"][routing] = {
      key: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for key, a, b in zip(("y", "dx", "dw", "dgate", "dup", "ddown"), (y, *grads), (y_ref, *grads_ref))
    }
    out["fast_fits"][routing] = busiest_rows(idx, p, n_loc, FAST_BLOCK) <= fast_rows
  return out


@contextlib.contextmanager
def nan_unwritten():
  """Programs traced inside get NaN-filled buffers where the code asks for undefined ones."""
  saved = rat._UNWRITTEN
  rat._UNWRITTEN = lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)
  try:
    yield
  finally:
    rat._UNWRITTEN = saved


def capacity_reference(x, w, idx, gate, up, down, group: int, cap: int):
  """numpy float64: each block of `group` consecutive tokens is one dispatch group, in which every expert takes its
  first `cap` (token, slot) pairs in token order; returns (y [N, D], pairs dropped)."""
  x, w, gate, up, down = (np.asarray(a, np.float64) for a in (x, w, gate, up, down))
  y, dropped = np.zeros_like(x), 0
  for start in range(0, N, group):
    taken = np.zeros(E, int)
    for n in range(start, start + group):
      for k, e in enumerate(np.asarray(idx)[n]):
        if taken[e] == cap:
          dropped += 1
          continue
        taken[e] += 1
        a = x[n] @ gate[e]
        y[n] += w[n, k] * ((a / (1 + np.exp(-a)) * (x[n] @ up[e])) @ down[e])
  return y, dropped


def capacity_check(mesh, args, idxs, put, specs) -> dict:
  """With capacity factor CAPACITY: max |y - numpy| and the dropped counts, per routing. A dispatch group is the
  tokens of the P devices along `expert` (P = 1 without one), consecutive in N as the token axes split it."""
  names = mesh.axis_names
  shards = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert") if a in names)
  group = N // shards * (mesh.shape["expert"] if "expert" in names else 1)
  cap = math.ceil(CAPACITY * group * K / E)
  with nan_unwritten():  # traced with NaN where the buffers are left unfilled; the dropped rows' must be 0
    fn = (
      jax.jit(lambda *a: expert_parallel_ffn(*a, jnp.float32, mesh=mesh, capacity_factor=CAPACITY))
      .lower(*args[:2], put(idxs["random"], specs["idx"]), *args[2:])
      .compile()
    )
  out = {}
  for routing in ("random", "all_to_expert_0"):
    y, dropped = fn(*args[:2], put(idxs[routing], specs["idx"]), *args[2:])
    want_y, want_dropped = capacity_reference(*args[:2], idxs[routing], *args[2:], group, cap)
    out[routing] = {
      "y_error": float(np.max(np.abs(np.asarray(y) - want_y))),
      "scale": float(np.abs(want_y).max()),
      "dropped": int(dropped),
      "want_dropped": want_dropped,
    }
  return out


@helpers.multi_device(8)
@pytest.mark.parametrize("name", list(MESHES))
def test_expert_parallel_equals_grouped_ffn(name):
  result = check(name)
  assert set(result["errors"]) == {"random", "all_to_expert_0", "all_to_last_experts"}
  for routing, errs in result["errors"].items():
    for key, err in errs.items():
      scale = result["ref_scale"][routing][key]
      assert scale > 1e-3, (routing, key, scale)  # the quantity is not trivially zero
      assert err <= TOL * max(1.0, scale), (name, routing, key, err, scale)  # False for NaN
  has_expert_axis = "expert" in MESHES[name][1]
  assert result["has_all_to_all"] == has_expert_axis, result["has_all_to_all"]
  if has_expert_axis:  # the fast path: equal results whether the routing fits its buffer (random) or not
    assert result["fast_rows"] < result["worst_rows"], result
    assert result["fast_fits"] == {"random": True, "all_to_expert_0": False, "all_to_last_experts": False}, result
    for routing, errs in result["fast_errors"].items():
      for key, err in errs.items():
        assert err <= TOL * max(1.0, result["ref_scale"][routing][key]), (name, "fast", routing, key, err)
  assert result["bf16_rel_error"] < 2e-2, result["bf16_rel_error"]
  for routing, got in result["capacity"].items():
    assert got["dropped"] == got["want_dropped"] > 0, (routing, got)
    assert got["y_error"] <= TOL * max(1.0, got["scale"]), (name, routing, got)


@pytest.mark.slow  # compiles the expert-parallel layer
def test_errors_name_the_sizes():
  mesh = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  x, w, gate, up, down, _, idxs = inputs()
  ffn = lambda x, w, g, u, d, m: expert_parallel_ffn(x, w, idxs["random"][: x.shape[0]], g, u, d, jnp.float32, mesh=m)[
    0
  ]
  if jax.device_count() >= 3:
    mesh3 = jax.make_mesh((3,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:3])
    with pytest.raises(ValueError, match="n_routed_experts=16 must divide over mesh axis 'expert' of size 3"):
      ffn(x[:48], w[:48], gate, up, down, mesh3)
    with pytest.raises(ValueError, match="N=64 tokens must divide over the token axes"):
      ffn(x, w, gate, up, down, mesh3)
  # an expert axis of size 1 is grouped_ffn
  np.testing.assert_allclose(
    ffn(x, w, gate, up, down, mesh), grouped_ffn(x, w, idxs["random"], gate, up, down, jnp.float32)[0], atol=TOL
  )
