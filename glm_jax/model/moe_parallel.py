"""Expert parallelism for the MoE: experts split over the mesh's `expert` axis, tokens exchanged with
`jax.shard_map` + ragged all-to-all; computes exactly `grouped_ffn.grouped_ffn`.

Inside the shard_map each device holds n local tokens and E_l = E / P experts (P = the expert axis's size; its P
devices form a dispatch group). A device sorts its n*K (token, slot) pairs by expert, all-gathers the per-expert
counts over `expert`, sends each expert's rows to its shard with one ragged all-to-all (ragged_all_to_all.py; they
arrive expert-major and packed), runs its experts as grouped matmuls, and gets every row back by the reverse
exchange; each token's K rows are summed with the gate weights in fp32. Blocks: rows travel in blocks of BLOCK = 8,
each sender's run of an expert padded with zero rows (no output, no weight gradient). The receive buffer:
  dropless (capacity_factor 0, the default)  P*n*K rows (+ 7 E_l a sender), never filled: only its real rows are read
  capacity factor c                          each expert takes at most ceil(c * P*n*K / E) pairs of the group, the
                                             first senders' first; c*n*K rows (+ 7 P a local expert); the rest dropped
                                             (not sent, 0 on the way back) and counted
  buffer_factor f (model.moe_buffer_factor)  a fast path of f*n*K rows, taken when every shard's rows fit it
Numerics: rows travel in `dtype`. In fp32 the result equals grouped_ffn up to the order of the additions; in bf16
each expert output row (and, with a tensor axis, each partial row) is rounded to bf16 once more. With a capacity
factor and token axes besides `expert`, each dispatch group drops on its own, unlike grouped_ffn's one group.
The steps, the buffers' sizes and why blocks: docs/design.md, "Expert parallelism, as built".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from glm_jax.mesh_axes import BATCH_AXES, EXPERT, TENSOR
from glm_jax.model.grouped_ffn import expert_capacity, expert_swiglu, grouped_ffn, grouped_ffn_f32
from glm_jax.model.grouped_matmul import TPU_ROW_TILE as ROW_TILE
from glm_jax.model.ragged_all_to_all import exchange_rows, exclusive_cumsum

__all__ = ["expert_parallel_ffn", "expert_parallel_specs", "FAST_PATH"]

FAST_PATH = "moe_fast_buffer"  # the named scope of the fast path's ops (hlo_cost picks the branch a routing takes)
# Rows a block: the exchanged buffers are [blocks, BLOCK, D], so that XLA:TPU lays them out in the grouped matmul's
# (8, 128) tiles; [rows, D] rows travel one at a time, laid out row by row and copied to and from those tiles.
BLOCK = 8


def _most_blocks(rows: int, runs: int) -> int:
  """The most blocks `rows` rows take when cut into at most `runs` runs, each padded to whole blocks."""
  return (rows + runs * (BLOCK - 1)) // BLOCK


def _as_blocks(a: jax.Array) -> jax.Array:
  return a.reshape((a.shape[0] // BLOCK, BLOCK) + a.shape[1:])


def _as_rows(a: jax.Array) -> jax.Array:
  return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _resolved_axes(
  mesh: Mesh, expert_axis: str, token_axes: Sequence[str], tensor_axis: str | None
) -> tuple[tuple[str, ...], int, str | None]:
  """(token axes present in the mesh, with `expert` among them; expert axis size; tensor axis or None)."""
  names = tuple(mesh.axis_names)
  tokens = tuple(a for a in token_axes if a in names)
  n_expert = mesh.shape[expert_axis] if expert_axis in names else 1
  if expert_axis in names and expert_axis not in tokens:
    tokens = tokens + (expert_axis,)
  if tensor_axis is not None and (tensor_axis not in names or mesh.shape[tensor_axis] == 1):
    tensor_axis = None
  if tensor_axis is not None and (tensor_axis == expert_axis or tensor_axis in tokens):
    raise ValueError(
      f"expert_parallel_ffn: tensor_axis={tensor_axis!r} must differ from expert_axis="
      f"{expert_axis!r} and from the token axes {tokens}"
    )
  return tokens, n_expert, tensor_axis


def token_shards(mesh: Mesh, *, expert_axis: str = EXPERT, token_axes: Sequence[str] = BATCH_AXES) -> int:
  """How many ways expert_parallel_ffn splits the N tokens over `mesh` (N must be a multiple)."""
  tokens, _, _ = _resolved_axes(mesh, expert_axis, token_axes, None)
  return math.prod(mesh.shape[a] for a in tokens)


def expert_parallel_specs(
  mesh: Mesh, *, expert_axis: str = EXPERT, token_axes: Sequence[str] = BATCH_AXES, tensor_axis: str | None = TENSOR
) -> dict[str, P]:
  """The PartitionSpecs expert_parallel_ffn works in, by argument name (x, w, idx, gate, up, down, y).
  Inputs sharded otherwise are resharded by XLA at the shard_map boundary (e.g. fsdp-sharded D all-gathered)."""
  tokens, _, tensor = _resolved_axes(mesh, expert_axis, token_axes, tensor_axis)
  e = expert_axis if expert_axis in mesh.axis_names else None
  tok = P(tokens if tokens else None, None)
  return {
    "x": tok,
    "w": tok,
    "idx": tok,
    "y": tok,
    "gate": P(e, None, tensor),
    "up": P(e, None, tensor),
    "down": P(e, tensor, None),
  }


def expert_parallel_ffn(
  x_ND: jax.Array,
  w_NX: jax.Array,
  idx_NX: jax.Array,
  gate_EDI: jax.Array,
  up_EDI: jax.Array,
  down_EID: jax.Array,
  dtype: jnp.dtype,
  *,
  mesh: Mesh,
  capacity_factor: float = 0.0,
  buffer_factor: float = 0.0,
  expert_axis: str = EXPERT,
  token_axes: Sequence[str] = BATCH_AXES,
  tensor_axis: str | None = TENSOR,
) -> tuple[jax.Array, jax.Array]:
  """grouped_ffn(x, w, idx, gate, up, down, dtype) with the experts split over `expert_axis` of `mesh`.

  x_ND [N, D], w_NX [N, X] gate weights, idx_NX [N, X] int expert ids, gate_EDI / up_EDI [E, D, I],
  down_EID [E, I, D]; returns (y_ND [N, D] in `dtype`, the (token, slot) pairs dropped for capacity over the
  whole mesh: int32 scalar, 0 when dropless). Works in and out of jit, and under jax.grad.
  capacity_factor: 0 (dropless) or c >= 1 / K (see the module docstring).
  buffer_factor: 0, or f >= 1: a fast path whose receive buffer holds f x the balanced load n*K rows (rounded up
    to whole tiles of ROW_TILE), taken when every shard of the mesh receives no more; otherwise (or with 0) the
    worst-case buffer. The result is the same either way (see the module docstring).

  Shardings (inside the shard_map; see expert_parallel_specs):
    x, w, idx, y: P(token_axes, None): N split over the token axes that exist in the mesh, in the order given
      (`expert_axis` is appended when missing: expert parallelism splits tokens over it too). Pass the order
      the caller's N axis is actually sharded in (for B*T flattened from a batch split over ("data", "fsdp",
      "expert"), the default), else XLA reshards x and y at the boundary.
    gate, up: P(expert_axis, None, tensor_axis); down: P(expert_axis, tensor_axis, None). E is split over the
      expert axis; D is replicated (an fsdp-sharded D is all-gathered by XLA before the shard_map, in `dtype`,
      and its gradient reduce-scattered); I is split over `tensor_axis` when that axis is in the mesh with
      size > 1 (tensor-parallel experts: partial outputs summed with a psum over it), else all-gathered too.
  Requirements (ValueError otherwise): N divisible by the product of the token axis sizes, E by the expert
  axis size, I by the tensor axis size.

  An expert axis of size 1 (or absent) needs no exchange: each device runs grouped_ffn's computation on its
  own tokens with all experts. See the module docstring for the receive buffer's size (P * n_local * K rows when
  dropless).
  """
  n, k = idx_NX.shape
  n_experts, d, i = gate_EDI.shape
  tokens, n_shards, tensor = _resolved_axes(mesh, expert_axis, token_axes, tensor_axis)
  n_token_shards = math.prod(mesh.shape[a] for a in tokens)
  if x_ND.shape[0] != n or w_NX.shape != (n, k):
    raise ValueError(
      f"expert_parallel_ffn: x_ND {x_ND.shape}, w_NX {w_NX.shape} and idx_NX {idx_NX.shape} "
      "must agree on N (and w, idx on K)"
    )
  if n % n_token_shards:
    raise ValueError(
      f"expert_parallel_ffn: N={n} tokens must divide over the token axes {tokens} ({n_token_shards} shards)"
    )
  if (
    isinstance(buffer_factor, bool)
    or not isinstance(buffer_factor, (int, float))
    or not (buffer_factor == 0 or buffer_factor >= 1)
  ):
    raise ValueError(
      f"expert_parallel_ffn: buffer_factor={buffer_factor!r}; valid: 0 (the worst-case buffer only) or "
      "a number >= 1 (a fast path's buffer in multiples of the balanced load)"
    )
  if n_experts % n_shards:
    raise ValueError(
      f"expert_parallel_ffn: n_routed_experts={n_experts} must divide over mesh axis {expert_axis!r} of size {n_shards}"
    )
  if tensor is not None and i % mesh.shape[tensor]:
    raise ValueError(
      f"expert_parallel_ffn: moe_intermediate_size={i} must divide over mesh axis {tensor!r} "
      f"of size {mesh.shape[tensor]}"
    )
  e_local = n_experts // n_shards
  specs = expert_parallel_specs(mesh, expert_axis=expert_axis, token_axes=token_axes, tensor_axis=tensor_axis)

  def finish(y_nD, dropped):  # fp32 partial sums of the tensor shards -> y in dtype; dropped pairs of the mesh
    if tensor is not None:
      y_nD = jax.lax.psum(y_nD, tensor)
    return y_nD.astype(dtype), jax.lax.psum(dropped, tokens)

  def local(x, w, idx, gate, up, down):  # one expert shard: grouped_ffn on the local tokens
    return finish(*grouped_ffn_f32(x, w, idx, gate, up, down, dtype, capacity_factor))

  def exchange(x, w, idx, gate, up, down):
    flat_e = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True)  # my pairs by expert, token order within one: by destination shard
    counts = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)  # [E]
    sorted_start = exclusive_cumsum(counts)  # where each expert's pairs start in `order`
    all_counts = jax.lax.all_gather(counts, expert_axis)  # [P, E]: sender s's pairs of expert e
    kept_all = _kept(all_counts)  # [P, E]: how many of them expert e takes
    me = jax.lax.axis_index(expert_axis)
    kept = kept_all[me]
    # From here on in blocks of BLOCK rows: sender s sends expert e ceil(kept / BLOCK) blocks, the last one padded
    # with rows of zeros (module docstring, "Blocks").
    blocks_all = -(-kept_all // BLOCK)  # [P, E]
    blocks = blocks_all[me]
    padded_start = exclusive_cumsum(blocks)  # [E]: where expert e's blocks start in my send buffer
    totals = blocks_all.sum(0)  # [E]: the blocks each expert receives
    expert_start = exclusive_cumsum(totals.reshape(n_shards, e_local), axis=1).reshape(n_experts)
    before = exclusive_cumsum(blocks_all, axis=0)  # [P, E]: blocks of expert e from senders before s
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, me * e_local, e_local, axis=a.ndim - 1)  # my experts' columns

    back_from = (mine(expert_start)[None] + mine(before)).reshape(-1)  # where sender s's blocks of my experts sit
    back_to = mine(exclusive_cumsum(blocks_all, axis=1)).reshape(-1)  # where they sit in s's send buffer
    index = (
      padded_start,
      blocks,
      expert_start + before[me],
      mine(blocks_all).reshape(-1),
      mine(totals) * BLOCK,
      back_from,
      back_to,
    )
    # The send buffer: expert e's kept pairs (sorted order) from row padded_start[e] * BLOCK on, zeros after them.
    row = jnp.arange(send_blocks * BLOCK, dtype=jnp.int32)
    expert_of_row = jnp.minimum(
      jnp.searchsorted(jnp.cumsum(blocks) * BLOCK, row, side="right").astype(jnp.int32), n_experts - 1
    )
    rank = row - padded_start[expert_of_row] * BLOCK  # the row's place among its expert's pairs
    real = rank < kept[expert_of_row]
    token = order[jnp.where(real, sorted_start[expert_of_row] + rank, 0)] // k
    sent = jnp.where(real[:, None], x[token].astype(dtype), jnp.zeros((), dtype))
    if fast_rows is None:
      back = round_trip(rows // BLOCK, sent, gate, up, down, index)
    else:  # the busiest shard of every group (all_counts is the group's; pmax: every group takes the same branch)
      busiest = jax.lax.pmax(jnp.max(totals.reshape(n_shards, e_local).sum(1)), tuple(mesh.axis_names))
      back = fast_or_full(busiest * BLOCK <= fast_rows, sent, gate, up, down, index)
    # Pair (token, slot) -> its row in the send buffer's layout, where its expert's output came back; a pair its
    # expert dropped reads 0.
    slot = jnp.zeros((pairs,), jnp.int32).at[order].set(jnp.arange(pairs, dtype=jnp.int32))  # by (token, k)
    rank = slot - sorted_start[flat_e]
    at_row = jnp.where(rank < kept[flat_e], padded_start[flat_e] * BLOCK + rank, send_blocks * BLOCK)
    rows_NXD = back.at[at_row].get(mode="fill", fill_value=0).reshape(n_loc, k, d)
    y = jnp.einsum("nkd,nk->nd", rows_NXD, w.astype(jnp.float32), preferred_element_type=jnp.float32)
    return finish(y, jnp.sum(counts - kept))

  if n_shards == 1 and tensor is None and not tokens:
    return grouped_ffn(x_ND, w_NX, idx_NX, gate_EDI, up_EDI, down_EID, dtype, capacity_factor)
  n_loc = n // n_token_shards
  pairs = n_loc * k
  cap = expert_capacity(capacity_factor, n_shards * n_loc, k, n_experts)
  # Buffers in blocks: the send buffer holds my pairs, each expert's run padded to whole blocks; the receive buffer
  # the most a shard can be sent (dropless: every pair of its expert-parallel group; with a capacity, each of its
  # experts' cap pairs, P senders' runs).
  send_blocks = _most_blocks(pairs, min(n_experts, pairs))
  rows = BLOCK * n_shards * _most_blocks(pairs, e_local)
  if cap is not None:
    rows = min(rows, BLOCK * e_local * _most_blocks(cap, n_shards))

  def _kept(all_counts):  # [P, E] pairs -> [P, E] kept: an expert takes its first `cap` pairs, senders in order
    return all_counts if cap is None else jnp.clip(cap - exclusive_cumsum(all_counts, axis=0), 0, all_counts)

  # The fast path's receive buffer: buffer_factor x the balanced load, in whole tiles of megablox's rows.
  fast_rows = -(-math.ceil(buffer_factor * pairs) // ROW_TILE) * ROW_TILE if buffer_factor else None
  fast_rows = fast_rows if fast_rows is not None and fast_rows < rows else None

  def round_trip(buffer_blocks, sent, gate, up, down, index):
    """My send buffer's blocks to their experts' shards, through the experts, and back: [send rows, D] in `dtype`."""
    padded_start, blocks, dest, blocks_mine, group_rows, back_from, back_to = index
    # Dispatch: the blocks of expert e go to its shard, into expert e's run there after the senders before me:
    # every receiver gets its rows expert-major, ready for the grouped matmul (a group counts its padding rows,
    # zeros that give zeros). The receive buffer is not filled: its rows past the received ones are read only by
    # the grouped matmuls, which keep them out of the real rows and the weight gradients (expert_swiglu's
    # zero_past=False). The send buffer's rows past its blocks are not sent: their gradient is left undefined, and
    # the `where` that built them passes none of it on.
    xs = exchange_rows(
      _as_blocks(sent),
      buffer_blocks,
      padded_start,
      blocks,
      dest,
      blocks_mine,
      axis_name=expert_axis,
      zero_unwritten=False,
      zero_unsent=False,
    )
    out = expert_swiglu(_as_rows(xs), group_rows, gate, up, down, dtype, out_dtype=dtype, zero_past=False)
    # Combine: run (s, l), the blocks sender s sent my expert l, goes back to where they sat in s's send buffer.
    # Only the rows of kept pairs are read there (a dropped pair reads a 0 of its own), so the buffer needs no
    # fill. Each token's K rows are then gathered ([n, K, D], in `dtype`) and summed with the gate weights in fp32,
    # so the fp32 work (and the gradient flowing back into the exchanged rows) is n*K rows. The rows of `out` past
    # the received ones are not sent back: their gradient is left undefined (see above).
    return _as_rows(
      exchange_rows(
        _as_blocks(out),
        send_blocks,
        back_from,
        blocks_mine,
        back_to,
        blocks,
        axis_name=expert_axis,
        zero_unwritten=False,
        zero_unsent=False,
      )
    )

  def fast_round_trip(*args):
    with jax.named_scope(FAST_PATH):
      return round_trip(fast_rows // BLOCK, *args)

  @jax.custom_vjp
  def fast_or_full(fits, sent, gate, up, down, index):
    """round_trip through the fast buffer when every shard's rows fit it, else through the worst-case one. Its own
    backward: jax's would join the two branches' residuals, filling the fast branch's with zeros of the worst
    case's shapes (the fills this module avoids); this one keeps only the inputs and recomputes the branch."""
    return jax.lax.cond(
      fits, fast_round_trip, functools.partial(round_trip, rows // BLOCK), sent, gate, up, down, index
    )

  def fast_or_full_fwd(fits, sent, gate, up, down, index):
    return fast_or_full(fits, sent, gate, up, down, index), (fits, sent, gate, up, down, index)

  def fast_or_full_bwd(res, ct):
    fits, sent, gate, up, down, index = res

    def grads(trip):
      return lambda ct, *args: jax.vjp(lambda *a: trip(*a, index), *args)[1](ct)

    return (
      None,
      *jax.lax.cond(
        fits, grads(fast_round_trip), grads(functools.partial(round_trip, rows // BLOCK)), ct, sent, gate, up, down
      ),
      None,
    )

  fast_or_full.defvjp(fast_or_full_fwd, fast_or_full_bwd)

  body = exchange if n_shards > 1 else local
  # check_vma=False: megablox's pallas_call (the TPU grouped matmul) declares its outputs without the mesh axes
  # they vary over, which check_vma=True rejects. Values and gradients in this mode are what the 8-device CPU
  # tests compare against grouped_ffn (tests/model/test_moe_parallel.py).
  sharded = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(specs["x"], specs["w"], specs["idx"], specs["gate"], specs["up"], specs["down"]),
    out_specs=(specs["y"], P()),
    check_vma=False,
  )
  # Expert weights cast before the boundary, so any all-gather (fsdp-sharded D) moves `dtype`, not fp32.
  return sharded(x_ND, w_NX, idx_NX, gate_EDI.astype(dtype), up_EDI.astype(dtype), down_EID.astype(dtype))
