"""Block-wise FP8 weights as DeepSeek-V3's and GLM-5's FP8 releases store them.

A quantized linear weight W [out, in] is stored as `<name>` in float8 e4m3 and `<name>_scale_inv` in float32 with
one number per block of `weight_block_size` (128 x 128): W[i, j] = q[i, j] * scale_inv[i // 128, j // 128] (the
last blocks of a dimension that 128 does not divide are partial). Tensors without a `_scale_inv` companion
(norms, the router, embeddings, the head, the indexer's weights_proj) are stored unquantized and pass through.
config.json carries {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
128], "activation_scheme": "dynamic"}}; anything else is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)


def block_size(quantization_config: Mapping[str, Any] | None, where: str) -> tuple[int, int] | None:
  """The (rows, cols) block of a config.json's quantization_config (None when there is none); a scheme other than
  block-wise e4m3 FP8 raises ValueError naming `where` (the config file), the field and its value."""
  if quantization_config is None:
    return None
  qc = quantization_config
  if not isinstance(qc, Mapping):
    raise ValueError(f"{where}: quantization_config={qc!r}; expected an object")
  method = qc.get("quant_method")
  if method != "fp8":
    raise ValueError(
      f"{where}: quantization_config.quant_method={method!r}; only 'fp8' (block-wise e4m3, "
      "DeepSeek-V3's format) is read; load a BF16 checkpoint otherwise"
    )
  if qc.get("fmt", "e4m3") != "e4m3":
    raise ValueError(f"{where}: quantization_config.fmt={qc['fmt']!r}; only 'e4m3' is read")
  block = qc.get("weight_block_size")
  if (
    not isinstance(block, (list, tuple))
    or len(block) != 2
    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
  ):
    raise ValueError(
      f"{where}: quantization_config.weight_block_size={block!r}; expected two positive integers "
      "such as [128, 128] (per-tensor or per-channel FP8 is not read)"
    )
  return int(block[0]), int(block[1])


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "tensor") -> np.ndarray:
  """q [out, in] (e4m3) times its per-block scale_inv, in float32, one block row at a time (so nothing but the
  result is held at full size). A scale of the wrong shape is an error naming `name`."""
  if q.ndim != 2:
    raise ValueError(f"{name}: an FP8 weight must be 2-D [out, in], found shape {list(q.shape)}")
  want = scale_shape(q.shape, block)
  if tuple(scale_inv.shape) != want:
    raise ValueError(
      f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}; a {list(q.shape)} weight in "
      f"{block[0]} x {block[1]} blocks needs {list(want)}"
    )
  out = np.empty(q.shape, np.float32)
  scale = np.asarray(scale_inv, np.float32)
  for i in range(want[0]):
    rows = slice(i * block[0], (i + 1) * block[0])
    out[rows] = np.asarray(q[rows], np.float32) * np.repeat(scale[i], block[1])[: q.shape[1]]
  return out
