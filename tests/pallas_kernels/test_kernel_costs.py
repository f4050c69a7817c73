"""The cost_estimate each DSA Pallas kernel declares, as XLA:TPU receives it (compile only, for one v5p device).

XLA sees nothing inside a Pallas kernel: the FLOPs, transcendentals and HBM bytes it and the project's cost
report (glm_jax/sharding/hlo_cost.py) use are what the pallas_call declares, read back here from the compiled
HLO's tpu_custom_call backend_config. Each expected number is written out from the kernel's documented tiling
(padding included), not computed by the kernels' own _cost functions. Needs libtpu (skipped without it).
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from glm_jax.sharding.topology import tpu_topology_devices
from pallas_kernels.visibility import Visibility
from pallas_kernels.lightning_indexer import IndexerBlockSizes, lightning_indexer_topk
from pallas_kernels.sparse_mla_attention import (
  SparseAttentionBlockSizes,
  sparse_attention_head_probs,
  sparse_mla_attention,
)
from tests.helpers import needs_libtpu


_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)","bytes_accessed":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _compiled_costs(fn, *shapes) -> dict[str, tuple[int, int, int]]:
  """{op_name: (flops, transcendentals, bytes_accessed)} of every Mosaic kernel in fn compiled for one v5p chip."""
  sharding = SingleDeviceSharding(tpu_topology_devices("v5p:2x2x1")[0])
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
  text = jax.jit(fn).lower(*args).compile().as_text()
  costs = {}
  for line in text.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      cost, name = _COST.search(line), _OP_NAME.search(line)
      assert cost is not None, f"a Pallas kernel without a cost_estimate: {line[:300]}"
      costs[name.group(1)] = tuple(int(x) for x in cost.groups())
  return costs


def _only(costs, pattern):
  hits = [v for k, v in costs.items() if re.search(pattern, k)]
  assert len(hits) == 1, (pattern, list(costs))
  return hits[0]


# --- lightning indexer ----------------------------------------------------------------------------------------


@needs_libtpu
def test_indexer_cost_causal_padded():
  # B=2, T=200 -> 2 query blocks of 128 (T_pad=256), S=1000 -> 4 key blocks of 256 (S_pad=1024), H=4, D=128 bf16,
  # topk=50 -> Kp=64. Causal with a traced offset: every tile of the grid counted (what it statically visits).
  def indexer(q, k, w):
    vis = Visibility(q_offset=800)
    return lightning_indexer_topk(
      q, k, w, topk=50, visibility=vis, block_sizes=IndexerBlockSizes(128, 256), interpret=False
    )

  costs = _compiled_costs(
    indexer, ((2, 200, 4, 128), jnp.bfloat16), ((2, 1000, 128), jnp.bfloat16), ((2, 200, 4), jnp.float32)
  )
  flops = 2 * 2 * 4 * 128 * 256 * 1024  # 2 B H D T_pad S_pad: one [256, 128] @ [128, 128] per head and tile
  q_bytes = 2 * 256 * 4 * 128 * 2  # q [B, T_pad, H, D] bf16, once per (batch, query block)
  w_bytes = 2 * 256 * 4 * 4  # w [B, T_pad, H] fp32, the same
  k_bytes = (2 * 2 * 4) * 256 * 128 * 2  # a [256, 128] bf16 key block at each of the B * 2 * 4 grid steps
  out_bytes = 2 * (2 * 256 * 64 * 4)  # indices (int32) and scores (fp32) [B, T_pad, Kp]
  assert _only(costs, "_indexer_topk") == (flops, 0, q_bytes + w_bytes + k_bytes + out_bytes + 4)  # + q_offset
  assert (flops, q_bytes + w_bytes + k_bytes + out_bytes + 4) == (536_870_912, 1_843_204)


@needs_libtpu
def test_indexer_cost_one_key_block_segments():
  # B=1, T=100 -> one query block of 104, S=200 -> one key block of 256 (fetched once: its index never changes),
  # H=2, D=64 fp32, topk=16 -> Kp=16, non-causal, with segment ids.
  def indexer(q, k, w, q_seg, kv_seg):
    vis = Visibility(q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=False)
    return lightning_indexer_topk(q, k, w, topk=16, visibility=vis, interpret=False)

  costs = _compiled_costs(
    indexer,
    ((1, 100, 2, 64), jnp.float32),
    ((1, 200, 64), jnp.float32),
    ((1, 100, 2), jnp.float32),
    ((1, 100), jnp.int32),
    ((1, 200), jnp.int32),
  )
  flops = 2 * 1 * 2 * 64 * 104 * 256
  q_side = 104 * (2 * 64 * 4 + 2 * 4 + 4)  # q fp32, w fp32, query segment ids int32
  k_side = 256 * (64 * 4 + 4)  # keys fp32 and their segment ids, once
  out_bytes = 2 * (104 * 16 * 4)
  assert _only(costs, "_indexer_topk") == (flops, 0, q_side + k_side + out_bytes + 4)


# --- sparse MLA attention: forward, backward, head probabilities -----------------------------------------------


@needs_libtpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sparse_attention_costs(dtype):
  # B=2, T=20 -> T_pad=24 (block_t=8), H=16, D=576, v=512, S=300, K=100 -> Kp=128 (block_kv=32, 4 key blocks).
  blocks = SparseAttentionBlockSizes(8, 32)

  def fwd_bwd(q, kv, idx):
    (o, lse), vjp = jax.vjp(
      lambda q, kv: sparse_mla_attention(q, kv, idx, sm_scale=0.1, v_dim=512, block_sizes=blocks, interpret=False),
      q,
      kv,
    )
    probs = sparse_attention_head_probs(q, kv, idx, lse, sm_scale=0.1, block_sizes=blocks, interpret=False)
    return o, vjp((o, jnp.zeros_like(lse))), probs

  costs = _compiled_costs(fwd_bwd, ((2, 20, 16, 576), dtype), ((2, 300, 576), dtype), ((2, 20, 100), jnp.int32))
  item = jnp.dtype(dtype).itemsize  # q, do, o, dq; bf16 kv rows travel packed (2 bytes a column), fp32 as fp32
  slots = 2 * 24 * 128  # B * T_pad * Kp
  queries = 2 * 24 * 16  # B * T_pad * H
  common = (
    2 * slots * 4  # the indices, SMEM and VMEM blocks
    + queries * 576 * item  # q
    + slots * 576 * item
  )  # one gathered kv row a slot
  fwd = (
    2 * slots * 16 * (576 + 512),  # scores + p @ v
    queries * (128 + 4 + 1),  # exp of each score, exp of alpha per key block, log per query
    common + queries * 512 * item + queries * 4,
  )  # o, lse
  probs = (2 * slots * 16 * 576, slots * 16, common + queries * 4 + slots * 4)  # scores; exp; lse in, p out
  bwd = (
    2 * slots * 16 * (3 * 576 + 2 * 512),  # scores, dp, dq, dkv key part, dkv value part
    slots * 16,  # exp
    common
    + (queries * 576 * item if dtype == jnp.bfloat16 else 0)  # unsplit q (packed only)
    + queries * 512 * item
    + 2 * queries * 4  # do, lse, delta
    + queries * 576 * item  # dq
    + 2 * (2 * 20 * 100) * 576 * 4,
  )  # dkv fp32 row read + written per real slot (B * T * K)
  assert _only(costs, r"/jvp\(\)/pallas_call") == fwd
  assert _only(costs, r"_head_probs") == probs
  assert _only(costs, r"transpose\(jvp\(\)\)/pallas_call") == bwd
  if dtype == jnp.bfloat16:
    assert (fwd, probs, bwd) == (
      (213_909_504, 102_144, 8_801_280),
      (113_246_208, 98_304, 8_039_424),
      (541_065_216, 98_304, 29_005_824),
    )
