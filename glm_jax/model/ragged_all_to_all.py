"""`jax.lax.ragged_all_to_all` on every backend: the collective itself on TPU, an exact emulation elsewhere.

The contract is jax's (see its docstring): every caller sends slice i of its `operand`,
operand[input_offsets[i] : input_offsets[i] + send_sizes[i]], to device i // S of `axis_name` (S = the slices per
device, len(input_offsets) / axis size), which writes it at rows output_offsets[i] of its `output`; recv_sizes[i]
is the size of the slice i it receives from device i // S. Rows of `output` no slice writes keep their value.
On TPU only the real rows travel. XLA:CPU cannot run the collective, so elsewhere `dense_ragged_all_to_all` gives the
same values and gradients with the dense `jax.lax.all_to_all` (P times the bytes on the wire), and the CPU tests of
expert parallelism (moe_parallel.py) run the TPU program's index arithmetic. `exchange_rows` is the collective into
a buffer of its own, with a backward of its own; with `unwritten` neither the buffer nor its gradient is filled (its
caller reads only the real rows: jax.lax.empty, XLA's AllocateBuffer on TPU). How the emulation packs its buffer,
and what a fill would cost: docs/design.md, "Expert parallelism, as built".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm_jax.model.platform import current_platform

__all__ = ["ragged_all_to_all", "dense_ragged_all_to_all", "exchange_rows", "exclusive_cumsum", "unwritten"]


def ragged_all_to_all(
  operand: jax.Array,
  output: jax.Array,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  *,
  axis_name: str,
) -> jax.Array:
  """jax.lax.ragged_all_to_all(...) where the traced-for backend has it (TPU), dense_ragged_all_to_all elsewhere.
  Call inside a shard_map over `axis_name`."""
  args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  if current_platform() == "tpu":
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)
  return dense_ragged_all_to_all(*args, axis_name=axis_name)


def unwritten(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
  """A buffer whose values are undefined: jax.lax.empty, allocated without a fill on TPU and GPU (zeros on the
  CPU). For buffers no row of which is read before it is written. The tests swap `_UNWRITTEN` for a NaN fill to
  prove that (tests/model/test_moe_parallel.py)."""
  return _UNWRITTEN(tuple(shape), jnp.dtype(dtype))


_UNWRITTEN = jax.lax.empty


def exchange_rows(
  operand: jax.Array,
  rows: int,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  *,
  axis_name: str,
  zero_unwritten: bool = True,
  zero_unsent: bool = True,
) -> jax.Array:
  """ragged_all_to_all(operand, <a new [rows, ...] buffer>, ...), differentiable in `operand`.

  zero_unwritten: rows of the result no slice writes are 0; False: undefined (the buffer is `unwritten`).
  zero_unsent: the gradient of the rows of `operand` no slice sends is 0; False: undefined, for a caller whose
  operand rows are all sent or whose unsent rows' gradient is never read. The gradient is the reverse exchange,
  as jax's transpose rule of ragged_all_to_all computes it, into a buffer filled or not by `zero_unsent`."""
  return _exchange(
    operand,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    rows,
    operand.shape[0],
    axis_name,
    zero_unwritten,
    zero_unsent,
  )


def _buffer(shape, dtype, zero: bool) -> jax.Array:
  return jnp.zeros(shape, dtype) if zero else unwritten(shape, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _exchange(
  operand,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  rows,
  operand_rows,
  axis_name,
  zero_unwritten,
  zero_unsent,
):
  del operand_rows, zero_unsent
  out = _buffer((rows,) + operand.shape[1:], operand.dtype, zero_unwritten)
  return ragged_all_to_all(operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def _exchange_fwd(
  operand,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  rows,
  operand_rows,
  axis_name,
  zero_unwritten,
  zero_unsent,
):
  out = _exchange(
    operand,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    rows,
    operand_rows,
    axis_name,
    zero_unwritten,
    zero_unsent,
  )
  return out, (input_offsets, send_sizes, output_offsets, recv_sizes)


def _exchange_bwd(rows, operand_rows, axis_name, zero_unwritten, zero_unsent, res, ct):
  """Each receiver sends back the rows it got, from where they sit in its buffer (the senders' output offsets,
  gathered with an all_to_all) to where they came from (the senders' input offsets, likewise)."""
  del rows, zero_unwritten
  input_offsets, send_sizes, output_offsets, recv_sizes = res
  where_received = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  where_sent_from = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
  d_operand = ragged_all_to_all(
    ct,
    _buffer((operand_rows,) + ct.shape[1:], ct.dtype, zero_unsent),
    where_received,
    recv_sizes,
    where_sent_from,
    send_sizes,
    axis_name=axis_name,
  )
  return d_operand, None, None, None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exclusive_cumsum(a: jax.Array, axis: int = -1) -> jax.Array:
  """Sums of the entries before each one along `axis` (the offsets of blocks of those sizes laid end to end)."""
  return jnp.cumsum(a, axis=axis) - a


def _slice_of_row(sizes_PS: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """For row j of each device's packed block (the slices of block p laid end to end): (its slice [P, rows], its
  offset inside that slice [P, rows], whether j holds data [P, rows])."""
  starts_PS = exclusive_cumsum(sizes_PS)
  j = jnp.arange(rows, dtype=sizes_PS.dtype)
  slice_PR = jax.vmap(lambda ends: jnp.searchsorted(ends, j, side="right"))(starts_PS + sizes_PS)
  valid_PR = slice_PR < sizes_PS.shape[1]
  slice_PR = jnp.minimum(slice_PR, sizes_PS.shape[1] - 1)
  within_PR = j[None, :] - jnp.take_along_axis(starts_PS, slice_PR, axis=1)
  return slice_PR, within_PR, valid_PR


def dense_ragged_all_to_all(
  operand: jax.Array,
  output: jax.Array,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  *,
  axis_name: str,
) -> jax.Array:
  """jax.lax.ragged_all_to_all's result computed with one dense all_to_all of the rows and one of the offsets."""
  p = jax.lax.axis_size(axis_name)
  n = input_offsets.shape[0]
  if n % p or not (send_sizes.shape == output_offsets.shape == recv_sizes.shape == (n,)):
    raise ValueError(
      f"ragged_all_to_all: offsets and sizes must all have one length divisible by the size {p} of "
      f"axis {axis_name!r}; got {input_offsets.shape}, {send_sizes.shape}, {output_offsets.shape}, "
      f"{recv_sizes.shape}"
    )
  s = n // p
  cap = min(operand.shape[0], output.shape[0])  # rows one device can send to one other

  # Pack: slot (q, j) holds row j of the slices for device q laid end to end.
  slice_PC, within_PC, valid_PC = _slice_of_row(send_sizes.reshape(p, s), cap)
  src_PC = input_offsets.reshape(p, s)[jnp.arange(p)[:, None], slice_PC] + within_PC
  src_PC = jnp.where(valid_PC, src_PC, 0)
  mask = valid_PC.reshape(valid_PC.shape + (1,) * (operand.ndim - 1))
  send = jnp.where(mask, operand[src_PC], jnp.zeros((), operand.dtype))
  recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # recv[r]: what device r packed for this one
  offsets_PS = jax.lax.all_to_all(output_offsets.reshape(p, s), axis_name, 0, 0, tiled=True)

  # Unpack: row j from device r belongs to its slice l and goes to offsets_PS[r, l] + (j's place in that slice).
  slice_PC, within_PC, valid_PC = _slice_of_row(recv_sizes.reshape(p, s), cap)
  dst_PC = jnp.take_along_axis(offsets_PS, slice_PC, axis=1) + within_PC
  dst = jnp.where(valid_PC, dst_PC, output.shape[0]).reshape(-1)  # out of range: dropped by the scatter
  return output.at[dst].set(recv.reshape((p * cap,) + operand.shape[1:]).astype(output.dtype), mode="drop")
