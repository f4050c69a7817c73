"""safetensors files read tensor by tensor from a memory map, and written tensor by tensor.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the tensors' bytes.

Why not the safetensors package: its numpy and flax loaders cannot return FP8 (e4m3) tensors, which GLM-5's FP8
release stores, and it writes a file only from tensors all held in memory at once. Here a tensor is a read-only
view of the mapped file (nothing is read until used, and only the pages used), and a file is written from a
producer called once per tensor, so a shard never has to be held whole.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit


class SafetensorsFile:
  """One .safetensors file: its header is read and checked on construction (a truncated or corrupt file raises
  ValueError naming it), tensors are memory-mapped on demand."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        self._corrupt(f"{size} bytes, shorter than the 8-byte header length")
      (n,) = struct.unpack("<Q", head)
      if n > min(_MAX_HEADER, size - 8):
        self._corrupt(f"header length {n} past the file's {size} bytes")
      raw = f.read(n)
    try:
      header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      self._corrupt(f"header is not JSON: {e}")
    if not isinstance(header, dict):
      self._corrupt("header is not a JSON object")
    self.metadata = header.pop("__metadata__", None) or {}
    self._data_start = 8 + n
    self._entries = {}
    for name, entry in header.items():
      try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
      except (KeyError, TypeError, ValueError):
        self._corrupt(f"tensor {name}'s header entry is malformed: {entry!r}")
      if dtype not in DTYPES:
        self._corrupt(f"tensor {name} has unknown dtype {dtype!r}")
      if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or begin < 0:
        self._corrupt(f"tensor {name}: offsets {begin}..{end} do not hold {dtype} {list(shape)}")
      if self._data_start + end > size:
        self._corrupt(f"tensor {name} ends at byte {self._data_start + end}, past the file's {size} bytes")
      self._entries[name] = (dtype, shape, begin)

  def _corrupt(self, why: str):
    raise ValueError(f"{self.path}: cannot be read as safetensors (truncated or corrupt: {why})")

  def names(self) -> list[str]:
    return list(self._entries)

  def dtype(self, name: str) -> str:
    """The stored dtype's safetensors name ("BF16", "F8_E4M3", ...)."""
    return self._entries[name][0]

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][1]

  def offset(self, name: str) -> int:
    """Where the tensor's bytes start in the file (to read a checkpoint in file order)."""
    return self._data_start + self._entries[name][2]

  def read(self, name: str) -> np.ndarray:
    """The tensor in its stored dtype: a read-only view of the mapped file (copy or cast it to keep it)."""
    dtype, shape, begin = self._entries[name]
    if not math.prod(shape):
      return np.zeros(shape, DTYPES[dtype])
    return np.memmap(self.path, DTYPES[dtype], "r", offset=self._data_start + begin, shape=shape)


def write(
  path: str,
  specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
  produce: Callable[[str], np.ndarray],
  metadata: dict[str, str] | None = None,
) -> int:
  """Writes `path` with the tensors `specs` ((name, dtype, shape), in file order), asking `produce(name)` for each
  in turn, so only one tensor is held at a time. A produced array of another shape is an error naming it; it is
  cast to the spec's dtype. Returns the bytes of tensor data written."""
  header, offset = {}, 0
  for name, dtype, shape in specs:
    dtype = np.dtype(dtype)
    if dtype not in NAMES:
      raise ValueError(f"{path}: tensor {name} has dtype {dtype}, which safetensors cannot store")
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  if metadata:
    header["__metadata__"] = dict(metadata)
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name, dtype, shape in specs:
      value = np.asarray(produce(name))
      if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{path}: tensor {name} was produced with shape {list(value.shape)}, expected {list(shape)}")
      f.write(np.ascontiguousarray(value, np.dtype(dtype)).reshape(-1).view(np.uint8).data)
  return offset
