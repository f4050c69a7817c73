"""Pallas kernels for DeepSeek Sparse Attention and their pure-jnp references.

This package imports nothing from glm_jax. Each kernel's reference lives beside it and is the oracle its
tests compare against; the model's `attention_impl="reference"` path calls the references directly.
"""
