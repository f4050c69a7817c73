"""The GLM-5 model, one file per idea of the paper: layers (norms, rope, MLP), mla, indexer (DSA), moe,
transformer (the stacks and MTP). `param_counts` sizes a config from abstract shapes."""

from glm_jax.model.config import ModelConfig
from glm_jax.model.params import param_counts
from glm_jax.model.transformer import GlmMoeDsa, ModelOutput

__all__ = ["GlmMoeDsa", "ModelConfig", "ModelOutput", "param_counts"]
