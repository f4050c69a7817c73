"""Quantization: one quantizer for training's fake quantization and for packing (quantizer.py), the packed weight
and its matmuls (packed.py)."""

from glm_jax.quant.quantizer import dequantize, fake_quant, pack_int4, quantize, unpack_int4

__all__ = ["quantize", "dequantize", "fake_quant", "pack_int4", "unpack_int4"]
