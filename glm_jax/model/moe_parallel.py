"""Expert parallelism for the dropless MoE: experts split over the mesh's `expert` axis, tokens exchanged with
`jax.shard_map` + all-to-all; computes exactly `grouped_ffn.grouped_ffn` (docs/design.md, "Core decisions").

Inside the shard_map every device holds n local tokens (the token axes, `expert` among them, split N) and
E_l = E / P experts (P = size of the expert axis). Per device:
  1. sort its n*K (token, slot) pairs by expert; expert e lives on shard e // E_l, so this also sorts them by
     destination shard;
  2. dispatch: an all-to-all over `expert` of a [P, C, D] buffer, slot q holding the pairs for shard q (C = n*K),
     plus one of the [P, E_l] per-expert counts, so each device learns how many rows of each of its experts
     every sender sent;
  3. reorder the received rows (sender-major, expert-minor) into expert-major order and run the SwiGLU experts
     as `jax.lax.ragged_dot` over the E_l local groups, as grouped_ffn does;
  4. combine: the reverse all-to-all returns every row to the device that owns its token, which gathers each
     token's K rows ([n, K, D], in `dtype`) and sums them with the gate weights in fp32, as grouped_ffn does.

Dropless with static shapes: no capacity factor, no token is ever dropped, for any routing. The price is that
every buffer is sized for the worst case: a sender may route all its n*K pairs to one shard (C = n*K rows per
destination slot), and a receiver may get all P*n*K pairs of its expert group. Activation memory per device per
MoE layer is therefore ~ P*n*K*D (send) + P*n*K*D (receive) + P*n*K*D (sorted) + P*n*K*D (expert outputs) in
`dtype`, plus the fp32 expert intermediates P*n*K*2*I_local, i.e. P times what balanced routing actually needs,
and the dense all-to-all moves P*n*K*D elements each way however few rows are real. Everything [P*n*K, D] stays
in `dtype` (its gradients too); only the n*K real rows are weighted in fp32. For glm5_744b on v5p-1024 (P = 8,
n = 4096, K = 8, D = 6144) one such buffer is 3 GiB; bound P*n (fewer tokens per device or a smaller expert
axis) or give up droplessness with a capacity to go further.

Why the dense `jax.lax.all_to_all` and not `jax.lax.ragged_all_to_all`: with jax 0.10.2 the ragged collective
does not run on CPU ("UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
ThunkEmitter"), and docs/design.md requires everything to run (and be tested) on CPU meshes. Note that
ragged_all_to_all would only shrink the send buffer and the bytes on the wire: a dropless receiver still needs
a statically sized P*n*K-row buffer.

Numerics: rows travel in `dtype` both ways. For dtype float32 the result equals grouped_ffn up to the order of
the fp32 additions. For bf16 one difference: each expert output row is rounded to bf16 for the return trip
before the fp32 weighted sum (grouped_ffn keeps it fp32), and, with a tensor axis, each tensor shard's partial
row is rounded too; both are at the level of bf16 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from glm_jax.mesh_axes import BATCH_AXES, EXPERT, TENSOR
from glm_jax.model.grouped_ffn import expert_swiglu, grouped_ffn, grouped_ffn_f32

__all__ = ["expert_parallel_ffn", "expert_parallel_specs"]


def _exclusive_cumsum(a: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def _resolved_axes(mesh: Mesh, expert_axis: str, token_axes: Sequence[str], tensor_axis: str | None
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
    raise ValueError(f"expert_parallel_ffn: tensor_axis={tensor_axis!r} must differ from expert_axis="
                     f"{expert_axis!r} and from the token axes {tokens}")
  return tokens, n_expert, tensor_axis


def expert_parallel_specs(mesh: Mesh, *, expert_axis: str = EXPERT, token_axes: Sequence[str] = BATCH_AXES,
                          tensor_axis: str | None = TENSOR) -> dict[str, P]:
  """The PartitionSpecs expert_parallel_ffn works in, by argument name (x, w, idx, gate, up, down, y).
  Inputs sharded otherwise are resharded by XLA at the shard_map boundary (e.g. fsdp-sharded D all-gathered)."""
  tokens, _, tensor = _resolved_axes(mesh, expert_axis, token_axes, tensor_axis)
  e = expert_axis if expert_axis in mesh.axis_names else None
  tok = P(tokens if tokens else None, None)
  return {"x": tok, "w": tok, "idx": tok, "y": tok,
          "gate": P(e, None, tensor), "up": P(e, None, tensor), "down": P(e, tensor, None)}


def expert_parallel_ffn(x_ND: jax.Array, w_NX: jax.Array, idx_NX: jax.Array, gate_EDI: jax.Array,
                        up_EDI: jax.Array, down_EID: jax.Array, dtype: jnp.dtype, *, mesh: Mesh,
                        expert_axis: str = EXPERT, token_axes: Sequence[str] = BATCH_AXES,
                        tensor_axis: str | None = TENSOR) -> jax.Array:
  """grouped_ffn(x, w, idx, gate, up, down, dtype) with the experts split over `expert_axis` of `mesh`.

  x_ND [N, D], w_NX [N, X] gate weights, idx_NX [N, X] int expert ids, gate_EDI / up_EDI [E, D, I],
  down_EID [E, I, D]; returns y_ND [N, D] in `dtype`. Works in and out of jit, and under jax.grad.

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
  own tokens with all experts. See the module docstring for the worst-case buffer sizes this dropless scheme
  allocates (P * n_local * K rows) and why it uses the dense all-to-all.
  """
  n, k = idx_NX.shape
  n_experts, d, i = gate_EDI.shape
  tokens, n_shards, tensor = _resolved_axes(mesh, expert_axis, token_axes, tensor_axis)
  n_token_shards = math.prod(mesh.shape[a] for a in tokens)
  if x_ND.shape[0] != n or w_NX.shape != (n, k):
    raise ValueError(f"expert_parallel_ffn: x_ND {x_ND.shape}, w_NX {w_NX.shape} and idx_NX {idx_NX.shape} "
                     "must agree on N (and w, idx on K)")
  if n % n_token_shards:
    raise ValueError(f"expert_parallel_ffn: N={n} tokens must divide over the token axes {tokens} "
                     f"({n_token_shards} shards)")
  if n_experts % n_shards:
    raise ValueError(f"expert_parallel_ffn: n_routed_experts={n_experts} must divide over mesh axis "
                     f"{expert_axis!r} of size {n_shards}")
  if tensor is not None and i % mesh.shape[tensor]:
    raise ValueError(f"expert_parallel_ffn: moe_intermediate_size={i} must divide over mesh axis {tensor!r} "
                     f"of size {mesh.shape[tensor]}")
  e_local = n_experts // n_shards
  specs = expert_parallel_specs(mesh, expert_axis=expert_axis, token_axes=token_axes, tensor_axis=tensor_axis)

  def finish(y_nD):  # fp32 partial sums of the tensor shards -> y in dtype
    if tensor is not None:
      y_nD = jax.lax.psum(y_nD, tensor)
    return y_nD.astype(dtype)

  def local(x, w, idx, gate, up, down):  # one expert shard: grouped_ffn on the local tokens
    return finish(grouped_ffn_f32(x, w, idx, gate, up, down, dtype))

  def exchange(x, w, idx, gate, up, down):
    n_loc = idx.shape[0]
    cap = n_loc * k  # rows per destination slot: all local pairs may go to one shard
    rows = n_shards * cap  # rows a device may receive: all pairs of its expert group may come to it
    flat_e = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True)  # pairs by expert = by destination shard
    token_of = order // k
    counts_by_shard = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32).reshape(n_shards, e_local)
    send_sizes = counts_by_shard.sum(1)
    send_start = _exclusive_cumsum(send_sizes)

    # Dispatch: slot (q, j) of the send buffer holds sorted pair send_start[q] + j while j < send_sizes[q].
    j = jnp.arange(cap, dtype=jnp.int32)
    send_valid = j[None, :] < send_sizes[:, None]  # [P, C]
    src = jnp.where(send_valid, send_start[:, None] + j[None, :], 0)
    tok = token_of[src]  # [P, C]
    send = jnp.where(send_valid[..., None], x[tok].astype(dtype), 0)  # [P, C, D]
    recv = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)  # recv[s]: the rows shard s sent here
    recv_counts = jax.lax.all_to_all(counts_by_shard, expert_axis, 0, 0, tiled=True)  # [P, E_l]: from s for expert l

    # Received rows are sender-major, expert-minor; ragged_dot wants them expert-major. Row (s, j) has local
    # expert l (j within s's block for l) and goes to expert_start[l] + (rows of l from senders < s) + offset.
    group_sizes = recv_counts.sum(0)  # [E_l]
    expert_start = _exclusive_cumsum(group_sizes)
    before_s = _exclusive_cumsum(recv_counts, axis=0)  # [P, E_l]
    block_start = _exclusive_cumsum(recv_counts, axis=1)  # [P, E_l]: where (s, l) starts in s's block
    l_of = jax.vmap(lambda ends: jnp.searchsorted(ends, j, side="right"))(block_start + recv_counts)  # [P, C]
    recv_valid = l_of < e_local  # l_of == E_l: past everything s sent
    l_c = jnp.minimum(l_of, e_local - 1)
    s_idx = jnp.arange(n_shards)[:, None]
    pos = expert_start[l_c] + before_s[s_idx, l_c] + j[None, :] - block_start[s_idx, l_c]  # [P, C]
    pos = jnp.where(recv_valid, pos, 0).reshape(-1)
    # The inverse permutation, so that data moves by gathers (whose gradients are scatter-adds).
    from_row = jnp.zeros((rows,), jnp.int32).at[jnp.where(recv_valid.reshape(-1), pos, rows)].set(
        jnp.arange(rows, dtype=jnp.int32), mode="drop")
    m = jnp.arange(rows, dtype=jnp.int32)
    xs = jnp.where((m < group_sizes.sum())[:, None], recv.reshape(rows, d)[from_row], 0)

    out = expert_swiglu(xs, group_sizes, gate, up, down, dtype, out_dtype=dtype)  # [rows, D], expert-major

    # Combine: back to sender-major order, the reverse all-to-all, then each token's K rows gathered (sorted pair
    # p sits in slot (its shard, p - send_start[shard])) and summed with the gate weights in fp32. Gathering
    # [n, K, D] rather than weighting the whole [P, C, D] buffer keeps the fp32 work (and the gradient that
    # flows back into the buffer, in `dtype`) at the n*K real rows.
    back = jnp.where(recv_valid.reshape(-1)[:, None], out[pos], 0).reshape(n_shards, cap, d)
    back = jax.lax.all_to_all(back, expert_axis, 0, 0, tiled=True)  # back[q, j]: result for slot (q, j) sent
    shard_of = flat_e[order] // e_local  # [n*K]: destination shard of each sorted pair
    p = jnp.arange(n_loc * k, dtype=jnp.int32)
    slot_of_sorted = shard_of * cap + p - send_start[shard_of]
    slot = jnp.zeros((n_loc * k,), jnp.int32).at[order].set(slot_of_sorted)  # by (token, k)
    rows_NXD = back.reshape(n_shards * cap, d)[slot].reshape(n_loc, k, d)
    y = jnp.einsum("nkd,nk->nd", rows_NXD, w.astype(jnp.float32), preferred_element_type=jnp.float32)
    return finish(y)

  if n_shards == 1 and tensor is None and not tokens:
    return grouped_ffn(x_ND, w_NX, idx_NX, gate_EDI, up_EDI, down_EID, dtype)
  body = exchange if n_shards > 1 else local
  sharded = jax.shard_map(
      body, mesh=mesh,
      in_specs=(specs["x"], specs["w"], specs["idx"], specs["gate"], specs["up"], specs["down"]),
      out_specs=specs["y"], check_vma=True)
  # Expert weights cast before the boundary, so any all-gather (fsdp-sharded D) moves `dtype`, not fp32.
  return sharded(x_ND, w_NX, idx_NX, gate_EDI.astype(dtype), up_EDI.astype(dtype), down_EID.astype(dtype))
