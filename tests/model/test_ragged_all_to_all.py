"""The CPU emulation of jax.lax.ragged_all_to_all (glm_jax/model/ragged_all_to_all.py) against numpy running the
pseudo-code of jax's docstring, on 4 simulated devices (in tests/test_multi_device.py's session): one and two slices
a device, empty slices, gaps in the operand, rows of the output no slice writes; its gradient against the same loop
transposed. (The TPU program's
use of the real collective is checked by tests/train/test_aot.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from glm_jax.model.ragged_all_to_all import dense_ragged_all_to_all
from tests import helpers

DEVICES, ROWS_IN, ROWS_OUT, WIDTH = 4, 10, 12, 3


def layout(rng, sizes, rows):
  """Offsets for blocks of `sizes` in a buffer of `rows` rows: in a random order, with random gaps."""
  offsets, free = np.zeros(len(sizes), np.int32), rows - int(np.sum(sizes))
  assert free >= 0
  at = 0
  for i in rng.permutation(len(sizes)):
    gap = int(rng.integers(0, free + 1)) if free else 0
    free -= gap
    at += gap
    offsets[i] = at
    at += sizes[i]
  return offsets


def case(seed: int, per_device: int):
  """Per device d: operand, output, input_offsets, send_sizes, output_offsets, recv_sizes (numpy, stacked on d)."""
  rng = np.random.default_rng(seed)
  n = DEVICES * per_device
  while True:  # sizes[d, i]: rows device d sends as its slice i (to device i // per_device)
    sizes = rng.integers(0, 4, (DEVICES, n)).astype(np.int32)
    received = [sizes[:, q * per_device : (q + 1) * per_device].sum() for q in range(DEVICES)]
    if sizes.sum(1).max() <= ROWS_IN and max(received) <= ROWS_OUT:
      break
  input_offsets = np.stack([layout(rng, sizes[d], ROWS_IN) for d in range(DEVICES)])
  output_offsets = np.zeros_like(sizes)
  for q in range(DEVICES):  # where each slice sent to q lands in q's output
    cols = slice(q * per_device, (q + 1) * per_device)
    output_offsets[:, cols] = layout(rng, sizes[:, cols].reshape(-1), ROWS_OUT).reshape(DEVICES, per_device)
  # recv_sizes[q, d * per_device + l]: the size of slice l that device d sends to q
  recv_sizes = np.stack([sizes[:, q * per_device : (q + 1) * per_device].reshape(-1) for q in range(DEVICES)])
  operand = rng.standard_normal((DEVICES, ROWS_IN, WIDTH)).astype(np.float32)
  output = rng.standard_normal((DEVICES, ROWS_OUT, WIDTH)).astype(np.float32)
  return operand, output, input_offsets, sizes, output_offsets, recv_sizes


def numpy_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, per_device):
  """jax's docstring: device d sends operand[d][input_offsets[d, i]:][:send_sizes[d, i]] to device i // per_device,
  which writes it at output_offsets[d, i]. Also the transpose for a cotangent of the result, as a function."""
  result = output.copy()
  for d in range(DEVICES):
    for i in range(send_sizes.shape[1]):
      q, a, b, m = i // per_device, input_offsets[d, i], output_offsets[d, i], send_sizes[d, i]
      result[q, b : b + m] = operand[d, a : a + m]

  def transpose(ct):
    d_operand, d_output = np.zeros_like(operand), ct.copy()
    for d in range(DEVICES):
      for i in range(send_sizes.shape[1]):
        q, a, b, m = i // per_device, input_offsets[d, i], output_offsets[d, i], send_sizes[d, i]
        d_operand[d, a : a + m] += ct[q, b : b + m]
        d_output[q, b : b + m] = 0
    return d_operand, d_output

  return result, transpose


@functools.cache
def exchange():
  """Jitted (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, cotangent) -> (result, its
  gradient of the operand and of the output) of dense_ragged_all_to_all in a shard_map over DEVICES devices, each
  argument stacked on the device axis: one compile for each number of slices a device."""
  mesh = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:DEVICES])

  def local(operand, output, in_off, sizes, out_off, recv):  # one device's view: drop the stacked axis
    r = dense_ragged_all_to_all(operand[0], output[0], in_off[0], sizes[0], out_off[0], recv[0], axis_name="x")
    return r[None]

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))

  @jax.jit
  def run(operand, output, in_off, sizes, out_off, recv, ct):
    result, pull = jax.vjp(lambda a, b: fn(a, b, in_off, sizes, out_off, recv), operand, output)
    return result, *pull(ct)

  return run


def check(seed: int, per_device: int) -> dict:
  operand, output, in_off, sizes, out_off, recv = case(seed, per_device)
  ct = np.random.default_rng(seed + 1).standard_normal(output.shape).astype(np.float32)  # the result's shape
  args = (operand, output, in_off, sizes, out_off, recv, ct)
  result, d_operand, d_output = exchange()(*(jnp.asarray(a) for a in args))
  want, transpose = numpy_ragged_all_to_all(operand, output, in_off, sizes, out_off, per_device)
  want_d_operand, want_d_output = transpose(ct)
  return {
    "result": float(np.max(np.abs(np.asarray(result) - want))),
    "d_operand": float(np.max(np.abs(np.asarray(d_operand) - want_d_operand))),
    "d_output": float(np.max(np.abs(np.asarray(d_output) - want_d_output))),
    "rows_sent": int(sizes.sum()),
    "empty_slices": int((sizes == 0).sum()),
    "rows_kept": int(ROWS_OUT * DEVICES - sizes.sum()),
  }


@helpers.multi_device(DEVICES)
@pytest.mark.parametrize("seed, per_device", [(0, 2), (0, 1), (1, 1), (1, 2)])
def test_dense_emulation_follows_jax_contract(seed, per_device):
  got = check(seed, per_device)
  assert got["rows_sent"] > 0 and got["empty_slices"] > 0 and got["rows_kept"] > 0, got  # the case has all three
  assert got["result"] == 0.0 and got["d_operand"] == 0.0 and got["d_output"] == 0.0, got  # rows are moved
