"""Inference: the KV-cache sampler."""

from glm_jax.inference.sampler import SampleOutput, Sampler, SamplingParams, sample_token

__all__ = ["SampleOutput", "Sampler", "SamplingParams", "sample_token"]
