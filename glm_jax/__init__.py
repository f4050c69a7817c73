"""glm-jax: GLM-5 (MoE + MLA + DeepSeek Sparse Attention + MTP) in JAX / Flax NNX."""
