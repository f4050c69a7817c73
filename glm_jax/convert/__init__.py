"""Checkpoint format converters (Hugging Face GlmMoeDsaForCausalLM)."""
