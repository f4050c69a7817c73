"""Ahead-of-time compilation of the real train step for TPU topologies (glm_jax/train/aot.py, launch/compile.py).

Needs libtpu (the tpu extra; CI installs it); skipped with that hint without it. Each compile is of
glm5_tiny-sized models on a 4-chip v5p slice, a few seconds each."""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.sharding import hlo_cost
from glm_jax.sharding.mesh import batch_sharding, make_mesh
from glm_jax.sharding.state import abstract_sharded
from glm_jax.sharding.topology import parse_topology, tpu_topology_devices
from glm_jax.train import aot, trainer
from glm_jax.train.config import model_config_for_stage
from glm_jax.configs import glm5_tiny
from tests.helpers import needs_libtpu
from tests.train.runs import run_script


def tiny(mesh: dict, **train):
  config = glm5_tiny.get_config()
  config.data.batch_size = 8
  config.data.seq_len = 64
  for k, v in mesh.items():
    config.mesh[k] = v
  for k, v in train.items():
    config.train[k] = v
  return config


def lean(config):
  """The step without what a test's property does not involve: AdamW for Muon (its Newton-Schulz iterations over
  every matrix stack) and no MTP layer. The step then compiles in about half the time."""
  config.optimizer.name = "adamw"
  config.model.num_nextn_predict_layers = 0
  return config


def one_layer(config, *, dense: bool = False):
  """One layer, for a property every layer shows alike (its parameters' collectives, its expert exchange, its
  attention, the step's bytes): a stack of layers less to compile. A MoE layer, or (dense) a dense one where the
  experts are not the subject: its step compiles in less time still."""
  config.model.num_hidden_layers, config.model.first_k_dense_replace = 1, int(dense)
  return config


def shard_bytes(x, tiled: bool) -> int:
  """Bytes of one device's shard of a 32-bit ShapeDtypeStruct with a NamedSharding, from the shape and the spec:
  as is, or (tiled) with XLA:TPU's 32-bit tiles on every array ((8, 128) on the last two dimensions, 1024
  elements for a vector): XLA picks each buffer's layout, so the true size lies between the two."""
  spec, mesh = x.sharding.spec, x.sharding.mesh
  shape = list(x.shape)
  for i, entry in enumerate(spec):
    for axis in entry if isinstance(entry, tuple) else (entry,):
      if axis is not None:
        shape[i] //= mesh.shape[axis]
  assert np.dtype(x.dtype).itemsize == 4, x.dtype
  if tiled and len(shape) == 1:
    shape = [-(-shape[0] // 1024) * 1024]
  elif tiled and len(shape) >= 2:
    shape[-1] = -(-shape[-1] // 128) * 128
    shape[-2] = -(-shape[-2] // 8) * 8
  return math.prod(shape) * 4


def run_compile(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return run_script("launch/compile.py", *args, env=env, timeout=600)


@needs_libtpu
@pytest.mark.slow  # a TPU compile of the train step
def test_compile_prints_one_json_line_that_fits():
  out = run_compile(
    "--config=configs/glm5_tiny.py",
    "--topology=v5p:2x2x1",
    "--config.mesh.fsdp=2",
    "--config.mesh.expert=2",
    "--config.data.seq_len=64",
    "--config.data.batch_size=8",
    "--config.optimizer.name=adamw",
    "--config.model.num_nextn_predict_layers=0",
    "--config.model.num_hidden_layers=1",
    "--config.model.first_k_dense_replace=0",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["chips"] == 4 and report["device_kind"] == "TPU v5" and report["fits"] is True
  assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1}
  assert report["tokens_per_step"] == 8 * 64
  b = report["per_chip_bytes"]
  assert b["total"] == b["arguments"] + b["outputs"] + b["temporaries"] + b["generated_code"] - b["aliased"]
  assert report["hbm_usable_bytes"] - max(b["total"], b["peak"]) == pytest.approx(
    report["hbm_headroom_gib"] * (1 << 30), abs=0.01 * (1 << 30)
  )

  # The arguments are the train state, donated (the new state is written over it), and three batch arrays,
  # each sized here from the shapes and the config's shardings alone.
  config = one_layer(lean(tiny({"fsdp": 2, "expert": 2})))
  mesh = make_mesh(config.mesh, tpu_topology_devices("v5p:2x2x1"))
  make_state, _ = trainer.train_state_factory(config, model_config_for_stage(config))
  abstract, _ = abstract_sharded(make_state, lambda s: s.params, mesh)
  batch = jax.ShapeDtypeStruct((8, 64), np.int32, sharding=batch_sharding(mesh))
  for tiled, compare in ((False, lambda want, got: want <= got), (True, lambda want, got: got <= want)):
    state = sum(shard_bytes(x, tiled) for x in jax.tree.leaves(abstract))
    assert compare(state, b["aliased"]), (tiled, state, b)
    assert compare(3 * shard_bytes(batch, tiled), b["arguments"] - b["aliased"]), (tiled, b)


def test_bad_input_exits_2_with_its_message_and_no_output():
  """launch/compile.py's contract for bad input: exit status 2, nothing on stdout, the message on stderr (one process;
  the messages of the other bad inputs are checked in-process below)."""
  out = run_compile("--config=configs/glm5_tiny.py", "--topology=v9z:2x2")
  assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
  assert out.stdout == ""
  assert re.search(r"error: unknown TPU topology 'v9z:2x2'", out.stderr), out.stderr[-2000:]


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"mesh.fsdp": 3}, r"mesh: .*'fsdp': 3.* multiplies to 3, but there are 4 devices"),
    (
      {
        "mesh.fsdp": 1,
        "mesh.tensor": -1,
        "model.num_attention_heads": 2,
        "model.num_key_value_heads": 2,
      },
      r"size 2 is sharded over mesh axis 'tensor' of size 4",
    ),
    (
      {"train.xla_flags": "--xla_tpu_x=true xla_y=1"},
      r"train.xla_flags: 'xla_y=1' is not an XLA flag; valid: --xla_name=value",
    ),
  ],
)
@needs_libtpu
def test_bad_input_is_named_before_compiling(overrides, message):
  """What launch/compile.py runs for --topology=v5p:2x2x1 and these --config overrides, in-process: a ValueError
  naming the bad value (the script prints it and exits 2), raised before anything is compiled (a failed compile is
  returned, not raised)."""
  config = glm5_tiny.get_config()
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  devices = tpu_topology_devices(parse_topology("v5p:2x2x1").name)
  aot.check_sections(config)
  with pytest.raises(ValueError, match=message):
    aot.compile_train_step(config, devices)


@needs_libtpu
@pytest.mark.slow  # three TPU compiles of a one-dense-layer step
def test_xla_flags_reach_the_compiler():
  """train.xla_flags are the step's compiler options on TPU: with XLA:TPU's all-gather fusion some of the
  partitioner's all-gathers become asynchronous (a start, then continuations) on v5e, where libtpu supports it
  (and enables it unless told otherwise); turned off, none is; on v5p the compile refuses it beside async
  all-gathers, with the compiler's message. (glm5_744b's flags compile on v5p with its all-gathers synchronous:
  tests/sharding/test_hlo_cost.py's reduce-scatter test compiles its step with them.)"""

  def compile_step(flags, topology):
    config = one_layer(lean(tiny({"fsdp": 4})), dense=True)  # its weights' all-gathers are the property
    config.train.xla_flags = flags
    return aot.compile_train_step(config, tpu_topology_devices(topology))

  def all_gather_roles(flags, topology):
    result = compile_step(flags, topology)
    assert result.error is None, result.error[-2000:]
    return {o.role for o in hlo_cost.program_ops(result.compiled.as_text()) if o.kind == "all-gather"}

  fusion = "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
  assert {"start", "continue"} <= all_gather_roles(fusion, "v5e:2x2")
  assert all_gather_roles("--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false", "v5e:2x2") == {"sync"}
  refused = compile_step(f"{fusion} --xla_enable_async_all_gather=true", "v5p:2x2x1").error
  assert refused is not None and "Continuation fusion for AllGather" in refused


GROUPED_MATMUL = re.compile(r"jit\((t?gmm)\)/pallas_call")  # megablox's kernels, by the op name jax gives them


@needs_libtpu
@pytest.mark.slow  # a TPU compile of the train step on an expert mesh
def test_expert_parallel_step_sends_real_rows_to_grouped_matmul_kernels():
  """The train step on an expert mesh compiled for v5p: tokens travel by ragged all-to-all in blocks of 8 rows and
  the experts run megablox's grouped matmul kernels (forward and both gradients), no XLA matmul is sized for the
  dropless receive buffer (the dense exchange's worst case), and that buffer is allocated without a fill
  (AllocateBuffer) in the forward, its remat and the backward, as is the combine's; with model.moe_buffer_factor 2,
  a conditional picks between that buffer and a fast one of 2 x n x K rows, allocated the same way. The exchanged
  buffers are laid out as the grouped matmul reads them: no copy of one."""
  config = one_layer(lean(tiny({"expert": 4})))
  config.model.moe_buffer_factor = 2.0
  result = aot.compile_train_step(config, tpu_topology_devices("v5p:2x2x1"))
  assert result.error is None, result.error[-2000:]
  text = result.compiled.as_text()
  # dispatch and combine, forward and backward, sync or as async start/done pairs (XLA's choice)
  assert text.count("ragged-all-to-all(") + text.count("ragged-all-to-all-start(") >= 4
  kernels = {
    m.group(1)
    for m in map(
      GROUPED_MATMUL.search, re.findall(r'custom_call_target="tpu_custom_call".*op_name="([^"]*pallas_call)"', text)
    )
    if m
  }
  assert kernels == {"gmm", "tgmm"}, kernels
  n = config.data.batch_size * config.data.seq_len // 4  # tokens a device
  d, pairs = config.model.hidden_size, n * config.model.num_experts_per_tok
  experts, local = config.model.n_routed_experts, config.model.n_routed_experts // 4
  # Blocks of 8 rows, each sender's run of an expert padded to whole blocks: a send buffer holds a device's pairs
  # in at most `experts` runs, a receive buffer the 4 senders' pairs in at most `local` runs each.
  send = (pairs + experts * 7) // 8
  worst = 4 * ((pairs + local * 7) // 8)
  fast = 2 * pairs // 8  # 2 x n x K rows, a whole number of megablox's 256-row tiles here
  assert pairs % 128 == 0 and fast < worst
  shapes = re.findall(r"= \w+\[([\d,]*)\]\S* (?:dot|convolution|ragged-dot)\(", text)
  assert shapes and not [s for s in shapes if str(8 * worst) in s.split(",")], worst
  unfilled = re.findall(
    r'= \w+\[(\d+),8,(\d+)\]\S* custom-call\(\), custom_call_target="AllocateBuffer", '
    r'metadata=\{op_name="([^"]*)/empty"',
    text,
  )
  assert " conditional(" in text
  for shape in ((worst, d), (fast, d), (send, d)):  # dispatch's receive buffers, combine's; backward: gradients'
    where = {"backward" if "transpose(" in name else "forward" for b, c, name in unfilled if (int(b), int(c)) == shape}
    assert where == {"forward", "backward"}, (shape, unfilled)
  assert not re.findall(rf"= \w+\[{worst},8,{d}\]\S* broadcast\(", text)  # no fill of zeros
  exchanged = {f"[{b},8,{d}]" for b in (worst, fast, send)} | {f"[{8 * b},{d}]" for b in (worst, fast, send)}
  copies = [
    line for line in text.splitlines() if " copy(" in line and any(s in line.split(" copy(")[0] for s in exchanged)
  ]
  assert not copies, copies[:3]


def _reference_sparse_attention_hlo(config) -> str:
  """The sparse stage's attention site on the reference path, as the step runs it on a device: one MLA layer of
  config's model (attention_impl "reference"), its output and indexer KL differentiated (the stage's indexer_loss),
  over a device's rows (a quarter of the batch, which the step's 4 chips split), compiled for one v5p chip."""
  from flax import nnx

  from glm_jax.model.layers import dtype_of, rope_angles
  from glm_jax.model.mla import MLA, AttentionInputs
  from glm_jax.model.platform import target_platform
  from pallas_kernels.visibility import Visibility

  cfg = model_config_for_stage(config)
  b, t = config.data.batch_size // 4, config.data.seq_len
  on_chip = jax.sharding.SingleDeviceSharding(tpu_topology_devices("v5p:2x2x1")[0])
  graphdef, params = nnx.split(nnx.eval_shape(lambda: MLA(cfg, nnx.Rngs(0))))
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=on_chip), params)

  def loss(params, x_BTD, segments_BT):
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(t), (b, t)), cfg.qk_rope_head_dim, cfg.rope_theta)
    visibility = Visibility.self_attention(segments_BT)
    inp = AttentionInputs(cos=cos, sin=sin, visibility=visibility, mask=visibility.mask(t, t))
    out, aux = nnx.merge(graphdef, params)(x_BTD, inp, indexer_loss=True)
    return jnp.sum(jnp.square(out.astype(jnp.float32))) + aux["indexer_kl"]

  x = jax.ShapeDtypeStruct((b, t, cfg.hidden_size), dtype_of(cfg.dtype), sharding=on_chip)
  segments = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=on_chip)
  with target_platform("tpu"):
    return jax.jit(jax.grad(loss)).lower(params, x, segments).compile().as_text()


@needs_libtpu
@pytest.mark.slow  # a TPU compile of the sparse stage
def test_pallas_sparse_stage_compiles_the_kernels_for_tpu():
  """attention_impl="pallas" in the sparse stage, lowered on this CPU host for TPU devices: the DSA kernels go
  into the step as Mosaic kernels (indexer top-k, attention forward and backward, the KL target's head
  probabilities, at each attention call site: the decoder's stack and the MTP layer), not as interpret-mode
  emulations; and the index scores are never [B, T, S], as they are on the reference path. The reference path is
  compiled as the attention site alone (_reference_sparse_attention_hlo: the layer, its indexer KL and their
  gradient for a device's rows, not the rest of a step): the pattern finds its scores there, and no kernel."""
  scores = re.compile(r"f32\[\d+,96,96\]")  # a device's [B, T, S] fp32 scores at seq_len 96

  def dsa_kernels(text):
    return len(
      [
        name
        for name in re.findall(r'custom_call_target="tpu_custom_call".*op_name="([^"]*pallas_call)"', text)
        if not GROUPED_MATMUL.search(name)
      ]
    )

  config = tiny({"fsdp": 4}, dsa_stage="sparse")
  config.optimizer.name = "adamw"  # the optimizer does not touch attention; AdamW's step compiles faster
  config.data.seq_len = 96  # > index_topk 32, and no other dimension of glm5_tiny
  one_layer(config, dense=True)  # one dense layer and the MTP layer: 2 attention sites, every layer's attention alike
  config.model.attention_impl = "reference"
  text = _reference_sparse_attention_hlo(config)
  assert dsa_kernels(text) == 0 and scores.search(text)
  config.model.attention_impl = "pallas"
  result = aot.compile_train_step(config, tpu_topology_devices("v5p:2x2x1"))
  assert result.error is None, result.error[-2000:]
  text = result.compiled.as_text()
  kernels = dsa_kernels(text)
  assert kernels == 2 * 4, kernels  # indexer, attention forward, backward, head probs at each of the 2 sites
  assert not scores.search(text)


def test_step_figures_and_bounds_by_hand():
  """A made-up row: 512 chips at 400 TFLOP/s, 1e18 useful FLOPs and 2^20 tokens a step, 10 s of compute, 12 s
  scheduled, 1.25x compiled / useful FLOPs, realism factor 1.1."""
  chips, peak, useful, tokens = 512, 4e14, 1e18, 2**20
  cost = {
    "peaks": {"bf16_flops": peak},
    "useful_flops_per_step": useful,
    "calibration": {"realism_factor": 1.1},
    "routings": {
      "balanced": {
        "per_device_step": {"compute_seconds": 10.0},
        "estimated_step_seconds": 12.0,
        "compiled_over_useful_step": 1.25,
      }
    },
  }
  figures = aot.step_figures(12.0, cost["calibration"], useful, chips, tokens, peak)
  assert figures["calibrated_step_seconds"] == 13.2
  assert figures["calibrated_mfu"] == pytest.approx(1e18 / (512 * 4e14 * 13.2), rel=1e-4)  # 0.36993
  assert figures["calibrated_tokens_per_s_per_chip"] == pytest.approx(1048576 / 13.2 / 512, rel=1e-4)  # 155.15
  b = aot.step_bounds(cost, chips, tokens)
  assert b["exposed_collective_seconds"] == 2.0
  assert b["hidden_mfu"] == pytest.approx(1e18 / (512 * 4e14 * 11.0), rel=1e-4)  # the step = 10 s x 1.1
  assert b["hidden_tokens_per_s_per_chip"] == pytest.approx(1048576 / 11.0 / 512, rel=1e-4)
  assert b["no_recompute_mfu"] == pytest.approx(1e18 / (512 * 4e14 * 8.8), rel=1e-4)  # 10 / 1.25 = 8 s, x 1.1
  assert b["no_recompute_tokens_per_s_per_chip"] == pytest.approx(1048576 / 8.8 / 512, rel=1e-4)
