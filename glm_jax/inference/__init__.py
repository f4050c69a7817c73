"""Inference: the KV-cache sampler, with MTP speculative decoding."""

from glm_jax.inference.sampler import Sampler
from glm_jax.inference.sampling import SampleOutput, SamplingParams, sample_token
from glm_jax.inference.speculative import acceptance_length

__all__ = ["SampleOutput", "Sampler", "SamplingParams", "acceptance_length", "sample_token"]
