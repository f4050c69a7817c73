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
from typing import Any

import ml_dtypes
import numpy as np

from glm_jax import paths

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
_MAX_DEPTH = 3  # {name: {"shape": [...]}}


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _short(value: Any, limit: int = 80) -> str:
  """repr(value), cut to `limit` characters (an untrusted value can be megabytes long)."""
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


class SafetensorsFile:
  """One .safetensors file: its header is read and checked on construction, tensors are memory-mapped on demand.

  The file must be a regular one (a FIFO or a device is refused, never waited on), and its header must be the
  format's: a JSON object (no key twice, so nested no deeper than the format's 3 levels) of tensors {"dtype": one of
  DTYPES, "shape": [non-negative integers], "data_offsets": [begin, end], integers with 0 <= begin <= end within
  the file, end - begin the bytes of that dtype and shape}, no two tensors' bytes overlapping, and an optional
  "__metadata__" object of strings. Anything else raises ValueError naming the file (and the tensor)."""

  def __init__(self, path: str):
    self.path = path
    with paths.open_regular(path) as f:
      size = os.fstat(f.fileno()).st_size
      head = f.read(8)
      if len(head) < 8:
        self._corrupt(f"{size} bytes, shorter than the 8-byte header length")
      (n,) = struct.unpack("<Q", head)
      if n > min(_MAX_HEADER, size - 8):
        self._corrupt(f"header length {n} past the file's {size} bytes")
      raw = f.read(n)
    header = self._parse(raw)
    self.metadata = self._checked_metadata(header.pop("__metadata__", None))
    self._data_start = 8 + n
    self._entries = {name: self._checked_entry(name, entry, size - self._data_start) for name, entry in header.items()}
    self._check_no_overlap()

  def _parse(self, raw: bytes) -> dict:
    try:
      header = json.loads(raw, object_pairs_hook=paths.strict_object, parse_constant=paths.refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      self._corrupt(f"header is not JSON: {e}")
    except RecursionError:
      self._corrupt(f"header nests deeper than the format's {_MAX_DEPTH} levels")
    except ValueError as e:  # a key twice, NaN
      self._corrupt(f"header is not strict JSON: {e}")
    if not isinstance(header, dict):
      self._corrupt("header is not a JSON object")
    return header

  def _checked_metadata(self, metadata: Any) -> dict[str, str]:
    if metadata is None:
      return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
      self._corrupt(f"__metadata__={_short(metadata)} is not an object of strings")
    return metadata

  def _checked_entry(self, name: str, entry: Any, data_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, checked (the entry's offsets count from the data start)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
      self._corrupt(f"tensor {name}'s header entry {_short(entry)} is not an object of dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
      self._corrupt(f"tensor {name} has unknown dtype {_short(dtype)}; one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
      self._corrupt(f"tensor {name}: shape={_short(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
      self._corrupt(f"tensor {name}: data_offsets={_short(offsets)} is not two integers [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end:
      self._corrupt(f"tensor {name}: data_offsets={offsets} is not [begin, end] with 0 <= begin <= end")
    if end > data_bytes:
      self._corrupt(
        f"tensor {name} ends at byte {self._data_start + end}, past the file's {self._data_start + data_bytes} bytes"
      )
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
      self._corrupt(f"tensor {name}: offsets {begin}..{end} do not hold {dtype} {list(shape)}")
    return dtype, tuple(shape), begin, end

  def _check_no_overlap(self):
    """No two tensors share a byte (else one would silently read another's data)."""
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in self._entries.items() if end > begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
      if b1 < e0:
        self._corrupt(f"tensors {n0} (bytes {b0}..{e0}) and {n1} (bytes {b1}..{e1}) overlap")

  def _corrupt(self, why: str):
    raise ValueError(f"{self.path}: cannot be read as safetensors (truncated or corrupt: {why})")

  def names(self) -> list[str]:
    return list(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

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
    dtype, shape, begin, _ = self._entries[name]
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
