"""The op-by-op cost of compiled TPU programs (glm_jax/sharding/hlo_cost.py) against hand counts: matmul FLOPs of
einsums in the forms XLA:TPU rewrites as convolutions, the wire bytes of collectives, the grouped matmul's grid as
megablox runs it, and the train step's per-layer report (aot.cost_report) against the analytic FLOPs.

Needs libtpu (compile-only TPU devices); skipped with the install hint without it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from glm_jax.model.grouped_matmul import megablox_grid_cost
from glm_jax.sharding import hlo_cost, ici
from glm_jax.sharding.topology import torus_of, tpu_topology_devices
from tests.helpers import TPU_COMPILE, needs_libtpu


EINSUMS = {  # equation -> operand shapes; the FLOPs are 2 x the product of every distinct index's size
  "ij,jk->ik": ((256, 512), (512, 128)),
  "ij,ik->jk": ((256, 64), (256, 32)),
  "bij,bjk->bik": ((4, 32, 64), (4, 64, 32)),
  "btr,rhk->bthk": ((2, 64, 24), (24, 4, 32)),  # MLA's up-projection of the latent to heads
  "bthk,bsk->bhts": ((2, 64, 4, 24), (2, 64, 24)),  # absorbed-form scores
  "bhts,bshv->bthv": ((2, 4, 64, 64), (2, 64, 4, 16)),
  "bthv,hvd->btd": ((2, 64, 4, 16), (4, 16, 64)),
}


def einsum_flops(eq, shapes):
  sizes = {}
  for labels, shape in zip(eq.split("->")[0].split(","), shapes):
    sizes.update(zip(labels, shape))
  return 2 * math.prod(sizes.values())


@needs_libtpu
@pytest.mark.parametrize("eq", list(EINSUMS))
def test_matmul_flops_of_compiled_einsums(eq):
  device = tpu_topology_devices("v5p:2x2x1")[0]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=SingleDeviceSharding(device)) for s in EINSUMS[eq]]
  text = jax.jit(lambda a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)).lower(*args).compile().as_text()
  ops = hlo_cost.program_ops(text)
  assert sum(o.flops for o in ops) == einsum_flops(eq, EINSUMS[eq])
  assert [o.kind for o in ops if o.flops] == ["matmul fusion"]


@needs_libtpu
def test_collective_wire_bytes():
  """On 4 chips: an all-gather of a [4 x 256, 128] f32 array moves 3/4 of it into each chip, an all-reduce twice
  that of its [256, 128] operand."""
  mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=tpu_topology_devices("v5p:2x2x1"))
  arg = jax.ShapeDtypeStruct((1024, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  fns = {"all-gather": lambda a: jax.lax.all_gather(a, "x", tiled=True), "all-reduce": lambda a: jax.lax.psum(a, "x")}
  for kind, fn in fns.items():
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    ops = [o for o in hlo_cost.program_ops(f.lower(arg).compile().as_text()) if o.wire]
    assert [o.kind for o in ops] == [kind]
    want = 1024 * 128 * 4 * 3 / 4 if kind == "all-gather" else 2 * 256 * 128 * 4 * 3 / 4
    assert ops[0].wire == want


W = 100e9  # v5p: one ICI link, one direction (glm_jax/sharding/ici.py)
LAT = ici.STEP_LATENCY_S


def _cube_mesh():
  """v5p:2x2x2 (no wrap-around: not whole 4x4x4 cubes) as a mesh ("a": the z axis, "b": the x-y plane, x
  fastest), and the chip model placing its partitions."""
  devices = tpu_topology_devices("v5p:2x2x2")
  grid = np.empty((2, 2, 2), dtype=object)
  for d in devices:
    grid[tuple(d.coords)] = d
  mesh = Mesh(grid.transpose(2, 1, 0).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
  return mesh, hlo_cost.Chip.of("v5p", torus_of(list(mesh.devices.flat), "v5p:2x2x2"))


@needs_libtpu
def test_collectives_over_one_axis_of_a_2d_mesh_by_hand():
  """Each chip holds B = 128 x 512 f32 (256 KiB); axis "b" is a 2 x 2 plane without wrap links, so each of its two
  axes delivers one link's bandwidth (a ring of 2 on a line: a whole shard each way a step), 2 ring steps.
    reduce-scatter: 3/4 B on the wire, at 2 links: 3/4 B / 2W + 2 steps;
    all-gather: of the [512, 512] result, 3/4 of it, the same way;
    all-to-all: the busiest link carries B/2 (x routed first: link (0,y)->(1,y) carries the B/4 of (0,y) to each
      chip of x = 1), + 2 steps;
    collective-permute shifting along the plane 0 -> 1 -> 2 -> 3 -> 0 (positions (0,0), (1,0), (0,1), (1,1)):
      every link used carries one buffer B; the longest route is 2 hops."""
  mesh, chip = _cube_mesh()
  b = 128 * 512 * 4
  arg = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P(("a", "b"))))
  cases = {
    "reduce-scatter": (lambda x: jax.lax.psum_scatter(x, "b", tiled=True), 3 / 4 * b, 3 / 4 * b / (2 * W) + 2 * LAT),
    "all-gather": (lambda x: jax.lax.all_gather(x, "b", tiled=True), 3 / 4 * 4 * b, 3 / 4 * 4 * b / (2 * W) + 2 * LAT),
    "all-to-all": (lambda x: jax.lax.all_to_all(x, "b", 0, 0, tiled=True), 3 / 4 * b, b / 2 / W + 2 * LAT),
    "collective-permute": (
      lambda x: jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)]),
      b,
      b / W + 2 * LAT,
    ),
  }
  for kind, (fn, wire, seconds) in cases.items():
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))
    ops = [
      o for o in hlo_cost.program_ops(f.lower(arg).compile().as_text(), chip=chip) if o.collective and o.role != "done"
    ]
    assert [(o.kind, o.wire) for o in ops] == [(kind, wire)]
    assert ops[0].wire_seconds == pytest.approx(seconds, rel=1e-9)


@needs_libtpu
@pytest.mark.parametrize("block, asynchronous", [(1, False), (8, False), (8, True)])
def test_a_ragged_all_to_all_moves_its_real_rows(block, asynchronous):
  """A ragged all-to-all over axis "b" (4 chips) of 256 bf16 rows of 512 into a buffer of 512, as rows
  ([256, 512] -> [512, 512]) or as blocks of 8 rows ([32, 8, 512] -> [64, 8, 512], moe_parallel's layout), sync
  or as an async start/done pair (whose start's tuple holds the operand, the output and the offsets): with
  aot.ragged_model's 64 real rows a chip, the wire carries 3/4 of 64 rows (the rest stay on the chip) whatever the
  form; with no model, 3/4 of the whole output buffer."""
  from glm_jax.train import aot

  mesh, chip = _cube_mesh()
  shape = (256, 512) if block == 1 else (32, 8, 512)
  spec = P(("a", "b"))
  arg = jax.ShapeDtypeStruct((8 * shape[0],) + shape[1:], jnp.bfloat16, sharding=NamedSharding(mesh, spec))
  index = jax.ShapeDtypeStruct((8 * 4,), jnp.int32, sharding=NamedSharding(mesh, spec))
  w = jax.ShapeDtypeStruct((8 * 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, spec))

  def exchange(x, w, *offsets_and_sizes):  # and a matmul the async form can overlap (XLA keeps it sync otherwise)
    out = jnp.zeros((2 * x.shape[0],) + x.shape[1:], x.dtype)  # room for more rows than a chip sends
    return jax.lax.ragged_all_to_all(x, out, *offsets_and_sizes, axis_name="b"), w @ w.T

  f = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec)))
  options = {"xla_tpu_enable_async_ragged_all_to_all": asynchronous}  # the form asked for, not XLA's default's
  text = f.lower(arg, w, *[index] * 4).compile(compiler_options=options).as_text()
  assert ("ragged-all-to-all-start(" in text) == asynchronous
  for model, rows in ((aot.ragged_model(64, 512), 64), (None, 512)):
    ops = [o for o in hlo_cost.program_ops(text, chip=chip, ragged_rows=model) if o.collective and o.role != "done"]
    assert [(o.kind, o.wire) for o in ops] == [("ragged-all-to-all", 3 / 4 * rows * 512 * 2)]


@needs_libtpu
def test_an_fsdp_step_where_the_partitioner_inserts_the_collectives():
  """A two-matrix MLP's SGD step with both weights [1024, 4096] / [4096, 1024] f32 and the batch split over 8 chips
  (one fsdp axis over the whole 2x2x2 cube): the partitioner gathers each weight (in bf16, as the matmul takes it:
  7/8 of 8 MiB each) and sums both f32 gradients in one all-reduce (2 x 7/8 of 32 MiB), all in the mesh syntax
  of replica groups. On the cube the group spans 3 axes of 2 chips without wrap: 3 links' bandwidth, 3 steps."""
  devices = tpu_topology_devices("v5p:2x2x2")
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=devices)
  chip = hlo_cost.Chip.of("v5p", torus_of(list(mesh.devices.flat), "v5p:2x2x2"))
  d, f = 1024, 4096

  def step(w1, w2, x):
    loss = lambda w1, w2: jnp.mean(jnp.tanh(x @ w1) @ w2)
    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2

  spec = NamedSharding(mesh, P("fsdp", None))
  args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=spec) for s in ((d, f), (f, d), (512, d))]
  with jax.set_mesh(mesh):
    text = jax.jit(step).lower(*args).compile().as_text()
  assert "replica_groups=mesh[" in text
  ops = [o for o in hlo_cost.program_ops(text, chip=chip) if o.collective and o.role != "done"]
  gathered, grads = d * f * 2, 2 * d * f * 4
  assert sorted((o.kind, o.wire) for o in ops) == sorted(
    [("all-gather", 7 / 8 * gathered)] * 2 + [("all-reduce", 2 * 7 / 8 * grads)]
  )
  seconds = {o.kind: o.wire_seconds for o in ops}
  assert seconds["all-gather"] == pytest.approx(7 / 8 * gathered / (3 * W) + 3 * LAT, rel=1e-9)
  assert seconds["all-reduce"] == pytest.approx(2 * (7 / 8 * grads / (3 * W) + 3 * LAT), rel=1e-9)
  got = hlo_cost.schedule(text, [o for o in hlo_cost.program_ops(text, chip=chip)], chip)
  assert got["exposed_collective_seconds"] == pytest.approx(sum(o.wire_seconds for o in ops), rel=1e-9)


def _expert_parallel_config():
  """glm5_tiny at 4 layers (1 dense, 3 MoE, no MTP layer) on 4 chips (expert 4, AdamW), 8 rows of 64 tokens."""
  from glm_jax.configs import glm5_tiny

  config = glm5_tiny.get_config()
  config.data.batch_size, config.data.seq_len = 8, 64
  config.mesh.expert = 4
  config.optimizer.name = "adamw"  # Muon's padding of matrix stacks to the device count is not linear in depth
  config.model.num_hidden_layers = 4
  config.model.num_nextn_predict_layers = 0  # outside the layers, like the embedding: five compiles a third faster
  return config


@pytest.fixture(scope="module")
def expert_parallel_step():
  """A function returning _expert_parallel_config's scanned train step compiled for v5p:2x2x1 with glm5_744b's XLA
  flags (train.xla_flags, the pod's compile), compiled once for the two tests that read it: in the first that asks,
  so under that test's tpu_compile setting (no persistent cache), and dropped with the module."""
  compiled = []

  def get():
    if not compiled:
      from glm_jax.configs import glm5_744b
      from glm_jax.train import aot

      config = _expert_parallel_config()
      config.train.xla_flags = glm5_744b.get_config().train.xla_flags
      compiled.append(aot.compile_train_step(config, tpu_topology_devices("v5p:2x2x1")))
    return compiled[0]

  return get


@needs_libtpu
@pytest.mark.slow  # a TPU compile of the expert-parallel train step (the cost report's test below reuses it)
def test_a_reduce_scatter_fusion_is_a_reduce_scatter(expert_parallel_step):
  """XLA:TPU writes the gradient reduce-scatters of glm5_tiny's step as all-reduce-scatter fusions (an all-reduce
  whose result is only sliced): each is counted as a reduce-scatter of its operand, (g - 1) / g on the wire a run,
  not as an all-reduce (twice that) nor as HBM traffic alone. The step is expert-parallel (expert 4 on 4 chips),
  whose dense weights are split over the expert axis as FSDP splits them (glm_jax/sharding/mesh.py), so their
  gradients are reduce-scattered over the 4 chips, some outside any loop (the embeddings'), some in the MoE stack's
  loop (3 runs). It is compiled with glm5_744b's XLA flags (train.xla_flags, the pod's compile;
  tests/train/test_aot.py has the flags' other cases): they compile on v5p, and its all-gathers stay synchronous."""
  result = expert_parallel_step()
  assert result.error is None, result.error[-2000:]
  text = result.compiled.as_text()
  comps, _, by_name = hlo_cost.parse_module(text)
  chip = hlo_cost.Chip.of("v5p", torus_of(list(result.mesh.devices.flat), "v5p:2x2x1"))
  ops = hlo_cost.program_ops(text, chip=chip)
  fusions = [o for o in ops if o.opcode == "fusion" and "all-reduce-scatter" in by_name[o.name].attrs]
  assert {o.runs for o in fusions} == {1, 3}, [(o.name, o.runs) for o in fusions]
  for o in fusions:
    [inner] = [i for i in comps[hlo_cost._attr(by_name[o.name].attrs, "calls").lstrip("%")] if i.opcode == "all-reduce"]
    size = hlo_cost.nbytes(by_name[inner.operands[0]].shapes)
    assert (o.kind, o.wire) == ("reduce-scatter", 3 / 4 * size * o.runs)
  # Every collective of the program is read (no group of 1 on a 4-chip step).
  assert all(o.wire > 0 for o in ops if o.collective and o.role in ("sync", "start") and o.kind != "collective-permute")
  assert {o.role for o in ops if o.kind == "all-gather"} == {"sync"}


def test_megablox_grid_cost_by_hand():
  """Groups [5, 0, 7, 20, 0, 3] over row tiles of 8: the non-empty groups cover tiles (0), (0, 1), (1, 2, 3), (4),
  7 visits; tgmm also visits one tile per empty group (9). k = 64 is one k tile of 128, n = 200 two n tiles."""
  sizes, tiling = [5, 0, 7, 20, 0, 3], (8, 128, 128)
  flops, moved = megablox_grid_cost("gmm", 40, 64, 200, sizes, tiling=tiling, in_bytes=2, out_bytes=4)
  tile = 2 * 8 * 128 * 128
  assert flops == 7 * 2 * 1 * tile
  # lhs tile each step, the rhs once per run of a group and n tile (4 groups x 2), each output tile per visit
  assert moved == 14 * 8 * 128 * 2 + 8 * 128 * 128 * 2 + 7 * 2 * 8 * 128 * 4
  flops, _ = megablox_grid_cost("tgmm", 40, 64, 200, sizes, tiling=tiling)
  assert flops == 9 * 2 * 1 * tile
  with pytest.raises(ValueError, match="kernel='x'; 'gmm' or 'tgmm'"):
    megablox_grid_cost("x", 40, 64, 200, sizes, tiling=tiling)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("tpu", marks=TPU_COMPILE)])
def test_loop_bodies_count_once_per_iteration(platform):
  """A scan of 3 inside a scan of 5 and a fori_loop from 2 to 6 run the matmul 5 x 3 + 4 = 19 times. XLA:CPU's
  HLO states each loop's trip count; XLA:TPU's does not, and the count is read from the loop's counter."""
  n, d = 256, 512

  def f(x, w):
    inner = lambda c, _: (jnp.tanh(c @ w), None)
    y = jax.lax.scan(lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None), x, None, length=5)[0]
    return jax.lax.fori_loop(2, 6, lambda i, c: jnp.tanh(c @ w), y)

  device = jax.devices("cpu")[0] if platform == "cpu" else tpu_topology_devices("v5p:2x2x1")[0]
  s = SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s) for shape in ((n, d), (d, d))]
  text = jax.jit(f).lower(*args).compile().as_text()
  ops = hlo_cost.program_ops(text)
  assert sum(o.flops for o in ops) == 19 * 2 * n * d * d
  assert any("x15 (loop)" in o.note for o in ops) and any("x4 (loop)" in o.note for o in ops)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("tpu", marks=TPU_COMPILE)])
def test_a_scanned_layer_moves_its_slice_of_the_stack(platform):
  """A scan over 8 stacked [d, d] weights reads one layer's slice an iteration, not the stack (XLA's operand is the
  whole stack; a dynamic-slice, at top level or in a fusion, reads its slice), and its stacked output rows are
  written in place (a dynamic-update-slice moves its update). Hand counts per iteration, fp32 x [n, d]:
  TPU fuses the slice (in bf16, the default matmul precision) into the matmul: x + slice + result + the index;
  CPU slices into a buffer of its own (slice read and written + the index), then multiplies."""
  layers, n, d = 8, 256, 512

  def f(x, w):
    def body(c, wl):
      y = jnp.tanh(c @ wl)
      return y, y[:1]

    return jax.lax.scan(body, x, w)

  device = jax.devices("cpu")[0] if platform == "cpu" else tpu_topology_devices("v5p:2x2x1")[0]
  s = SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s) for shape in ((n, d), (layers, d, d))]
  ops = hlo_cost.program_ops(jax.jit(f).lower(*args).compile().as_text())
  looped = [o for o in ops if f"x{layers} (loop)" in o.note]
  if platform == "tpu":
    matmul = [o for o in looped if o.flops]
    assert len(matmul) == 1 and matmul[0].bytes == layers * (4 * n * d + 2 * d * d + 4 * n * d + 4)
  else:
    sliced = [o for o in looped if "dynamic-slice" in o.name]
    assert len(sliced) == 1 and sliced[0].bytes == layers * (2 * 4 * d * d + 4)
  # The output rows: y read whole (a static slice), the [1, d] row written into the stacked output in place.
  rows = [
    o
    for o in looped
    if "dynamic-update-slice" in o.name or (platform == "tpu" and not o.flops and "copy" not in o.opcode)
  ]
  assert any(o.bytes == layers * (4 * n * d + 2 * 4 * d + 4) for o in rows), [(o.name, o.bytes) for o in looped]


@needs_libtpu
@pytest.mark.slow  # four unrolled TPU compiles of the tiny train step (and the scanned one, if not compiled above)
def test_cost_report_of_the_expert_parallel_step(tmp_path, expert_parallel_step):
  """glm5_tiny at 4 layers (1 dense, 3 MoE, no MTP layer) on 4 chips (expert 4, AdamW): a dense layer's compiled
  matmul FLOPs are the analytic count, the MoE layer's kernels are counted by their grids, and the depth
  extrapolation from the 1+1, 2+1 and 1+2-layer copies is linear: it equals the unrolled full depth (the 1+3 copy)
  both in XLA's count and op by op. XLA's count of the scanned step has one MoE layer of three (a loop body is
  counted once); that step is the reduce-scatter test's, compiled with glm5_744b's XLA flags, which schedule the
  collectives and leave the FLOPs as they are."""
  from glm_jax.sharding.topology import compiled_flops
  from glm_jax.train import aot

  config = _expert_parallel_config()
  devices = tpu_topology_devices("v5p:2x2x1")
  depths = aot.compile_depths(config, devices, linearity=True)
  assert sorted(depths["programs"]) == [(1, 1), (1, 2), (1, 3), (2, 1)]
  report = aot.cost_report(config, devices, depths, top=1000)  # every op kind of a layer, not the costliest 8
  for routing in aot.ROUTINGS:
    entry = report["routings"][routing]
    assert entry["per_dense_layer"]["compiled_over_analytic"] == pytest.approx(1.0, abs=0.01)
    assert entry["linearity"]["flops_rel_error"] < 1e-3, entry["linearity"]
    kernels = [o for o in entry["top_ops_per_moe_layer"] if o["op"].startswith("pallas gmm")]
    assert kernels and kernels[0]["flops"] > 0
  balanced, hot = (report["routings"][r]["moe_real_rows_per_device"] for r in aot.ROUTINGS)
  assert balanced == 8 * 64 // 4 * 2 and hot == 4 * balanced  # n K and P n K rows
  assert report["routings"]["hot"]["per_moe_layer"]["flops"] > report["routings"]["balanced"]["per_moe_layer"]["flops"]
  balanced = report["routings"]["balanced"]
  assert (
    np.isfinite(balanced["estimated_mfu"]) and balanced["estimated_step_seconds"] <= balanced["serial_step_seconds"]
  )
  assert balanced["linearity"]["scheduled_seconds_rel_error"] < 0.05, balanced["linearity"]
  # MFU over the useful-work numerator on 4 chips' peaks; the calibrated step is the scheduled one x the factor
  assert balanced["estimated_mfu"] == pytest.approx(
    report["useful_flops_per_step"] / (4 * 459e12 * balanced["estimated_step_seconds"]), rel=1e-3
  )
  assert balanced["calibrated_step_seconds"] == pytest.approx(
    balanced["estimated_step_seconds"] * hlo_cost.CALIBRATION["realism_factor"], rel=1e-3
  )
  # The programs kept (launch/compile.py --hlo_dir) give the same report without compiling: what load_depths reads
  # back is what compile_depths returned, XLA's counts and every HLO text, so cost_report (a function of its
  # arguments) makes the report above from it.
  aot.save_depths(depths, str(tmp_path))
  assert aot.load_depths(str(tmp_path)) == depths

  flops = aot.extrapolated_flops(config, devices, depths)
  exact = depths["programs"][(1, 3)][0]  # XLA's count of the unrolled full depth
  # Linear in depth up to what XLA's simplifications change with depth (elementwise ops fused or folded
  # differently): 2.7e-4 of the count here.
  assert flops["per_device"] == pytest.approx(exact, rel=1e-3)
  scanned = compiled_flops(expert_parallel_step().compiled)
  assert scanned == pytest.approx(exact - 2 * flops["per_moe_layer"], rel=0.02)  # a loop body counted once


def test_tpu_tiling_and_splash_grid_by_hand():
  from glm_jax.model import splash
  from glm_jax.model.grouped_matmul import tpu_tiling

  assert tpu_tiling(6144, 2048) == (256, 1024, 1024) and tpu_tiling(64, 32) == (256, 128, 128)
  # 4096 tokens in blocks of 512: 8 x 9 / 2 = 36 of the 64 blocks on or below the diagonal, for each of 2 x 64
  # (sequence, head) pairs; P = O = 256
  flops, _ = splash.grid_cost("fwd", 128, 4096, 256, 256, 2)
  assert flops == 128 * 36 * 2 * 512 * 512 * (256 + 256)
  flops, _ = splash.grid_cost("dkv", 128, 4096, 256, 256, 2)
  assert flops == 128 * 36 * 2 * 512 * 512 * (3 * 256 + 2 * 256)
  # MaxText's split backward with blocks of 2048 at 8192 tokens: 4 x 5 / 2 = 10 blocks; P = 192, O = 128
  flops, _ = splash.grid_cost("dkv_no_dq", 128, 8192, 192, 128, 2, block=2048)
  assert flops == 128 * 10 * 2 * 2048 * 2048 * (2 * 192 + 2 * 128)
  flops, _ = splash.grid_cost("dq", 128, 8192, 192, 128, 2, block=2048)
  assert flops == 128 * 10 * 2 * 2048 * 2048 * (2 * 192 + 128)


@needs_libtpu
def test_moe_rows_count_the_tokens_a_device_holds_under_context():
  """4 chips as expert 2 x context 2, 8 rows of 64 tokens: a device holds 8 x 64 / 4 = 128 tokens, so its experts
  get 128 x K rows with balanced routing (the context axis splits the tokens as the batch axes do)."""
  from glm_jax.configs import glm5_tiny
  from glm_jax.sharding.mesh import make_mesh
  from glm_jax.train import aot

  config = glm5_tiny.get_config()
  config.data.batch_size, config.data.seq_len = 8, 64
  config.mesh.fsdp, config.mesh.expert, config.mesh.context = 1, 2, 2
  mesh = make_mesh(config.mesh, tpu_topology_devices("v5p:2x2x1"))
  k = config.model.num_experts_per_tok
  assert aot.moe_real_rows(config, mesh, "balanced") == 128 * k
  assert aot.moe_real_rows(config, mesh, "hot") == 2 * 128 * k


@needs_libtpu
def test_a_multislice_step_reduces_gradients_over_dcn():
  """The same MLP step on 2 slices of v5p:2x2x1 (make_mesh's hybrid mesh: fsdp 4 in a slice, data 2 across): XLA:TPU
  compiles one slice's program, reduce-scatters each f32 gradient in the slice, and hands the cross-slice sum of
  a chip's 4 MiB shard to the DCN runtime. Each of the two shards is all-reduced over 2 slices: 2 x 1/2 of it over
  the chip's 50 Gbps of DCN."""
  from glm_jax.sharding.mesh import make_mesh

  devices = tpu_topology_devices("v5p:2x2x1", num_slices=2)
  mesh = make_mesh({"data": 1, "fsdp": -1}, devices)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
  chip = hlo_cost.Chip.of("v5p", torus_of(list(mesh.devices.flat)))
  assert chip.torus.num_slices == 2 and chip.torus.num_partitions == 4
  d, f = 1024, 4096

  def step(w1, w2, x):
    loss = lambda w1, w2: jnp.mean(jnp.tanh(x @ w1) @ w2)
    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2

  ws, xs = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P(("data", "fsdp"), None))
  args = [
    jax.ShapeDtypeStruct((d, f), jnp.float32, sharding=ws),
    jax.ShapeDtypeStruct((f, d), jnp.float32, sharding=ws),
    jax.ShapeDtypeStruct((512, d), jnp.float32, sharding=xs),
  ]
  with jax.set_mesh(mesh):
    text = jax.jit(step).lower(*args).compile().as_text()
  ops = hlo_cost.program_ops(text, chip=chip)
  dcn = [o for o in ops if o.kind.startswith("dcn") and o.role == "start"]
  shard = d * f * 4 // 4
  assert [(o.kind, o.wire) for o in dcn] == [("dcn all-reduce", shard)] * 2
  for o in dcn:
    assert o.wire_seconds == pytest.approx(shard / (50e9 / 8), rel=1e-9)
  timed = hlo_cost.schedule(text, ops, chip)
  assert timed["seconds"] >= 2 * shard / (50e9 / 8)  # one DCN queue: the two transfers one after the other


@pytest.mark.parametrize("platform", ["cpu", pytest.param("tpu", marks=TPU_COMPILE)])
def test_a_branch_model_counts_the_branch_that_runs(platform):
  """lax.cond between a 128-row matmul (named scope "fast") and a 1024-row one: every branch counted once without a
  branch model (2 x (128 + 1024) x k x n FLOPs), only the picked one with it, and the schedule follows it."""
  k, n = 512, 256

  def f(pred, x, w):
    def fast(x, w):
      with jax.named_scope("fast"):
        return jnp.pad(jnp.tanh(x[:128] @ w), ((0, 1024 - 128), (0, 0)))

    return jax.lax.cond(pred, fast, lambda x, w: jnp.tanh(x @ w), x, w)

  device = jax.devices("cpu")[0] if platform == "cpu" else tpu_topology_devices("v5p:2x2x1")[0]
  s = SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct((), jnp.bool_, sharding=s)] + [
    jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s) for shape in ((1024, k), (k, n))
  ]
  text = jax.jit(f).lower(*args).compile().as_text()
  pick = lambda want: lambda branches: next(i for i, names in enumerate(branches) if ("fast" in names) == want)
  flops = lambda model: sum(o.flops for o in hlo_cost.program_ops(text, branch_model=model))
  assert flops(None) == 2 * (128 + 1024) * k * n
  assert flops(pick(True)) == 2 * 128 * k * n and flops(pick(False)) == 2 * 1024 * k * n
  if platform == "tpu":
    chip = hlo_cost.Chip.of("v5p")
    time = lambda model: hlo_cost.schedule(text, hlo_cost.program_ops(text, chip=chip, branch_model=model), chip)
    assert time(pick(True))["seconds"] < time(pick(False))["seconds"] == time(None)["seconds"]
