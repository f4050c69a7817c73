"""Serving: the engine (continuous batching over a paged MLA cache) behind launch/serve.py."""

from glm_jax.serving.engine import Engine, EngineConfig, Event

__all__ = ["Engine", "EngineConfig", "Event"]
