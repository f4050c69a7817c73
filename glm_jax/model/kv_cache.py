"""The decode cache: what GLM-5 keeps per token and layer, and nothing more.

  kv       [B, S, kv_lora_rank + qk_rope_head_dim]  the normed latent c_kv and the roped shared key k_rope,
                                                    concatenated: 512 + 64 = 576 numbers a token for GLM-5,
                                                    the single key (and, its first 512 columns, the value) of
                                                    the absorbed MQA form
  index_k  [B, S, index_head_dim]                   the lightning indexer's key (DSA only)
Slot s of a row holds the token at position s. Each stack of layers keeps one LayerCache with a leading layer
axis, the way its parameters are stacked. Slots past a row's current position hold stale values that no query
can see: the decode step masks keys beyond each query's position and writes its tokens' slots before it attends.
So a speculative round needs no rollback: drafts the main model rejects leave entries past the row's new
position, which the next round overwrites before any query can reach them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from glm_jax.model.config import ModelConfig
from glm_jax.model.layers import dtype_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  kv: jax.Array  # [(L,) B, S, kv_lora_rank + qk_rope_head_dim]
  index_k: jax.Array | None  # [(L,) B, S, index_head_dim]; None without DSA

  @property
  def length(self) -> int:
    return self.kv.shape[-2]

  def write(self, pos_B: jax.Array, kv_BTA: jax.Array, index_k_BTZ: jax.Array | None) -> LayerCache:
    """One layer's cache with row b's T new entries at slots pos[b], ..., pos[b] + T - 1."""
    b, t = kv_BTA.shape[:2]
    rows, slots = jnp.arange(b)[:, None], pos_B[:, None] + jnp.arange(t)
    index_k = None if self.index_k is None else self.index_k.at[rows, slots].set(index_k_BTZ.astype(self.index_k.dtype))
    return LayerCache(kv=self.kv.at[rows, slots].set(kv_BTA.astype(self.kv.dtype)), index_k=index_k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """One LayerCache per stack of the decoder (None where the stack is empty), and `mtp`: the first MTP layer's
  [B, S, W] cache (no layer axis) when the cache serves speculative decoding (GlmMoeDsa.prefill(draft=True)),
  else None. Slot s of the MTP cache holds the MTP layer's entry for the main model's hidden state at s and the
  token at s + 1 (glm_jax/inference/speculative.py)."""

  dense: LayerCache | None
  moe: LayerCache | None
  mtp: LayerCache | None = None

  @property
  def length(self) -> int:
    return (self.dense or self.moe).length


def cache_bytes_per_token(cfg: ModelConfig) -> int:
  """Bytes the cache holds per token over all decoder layers, in the model's compute dtype."""
  width = cfg.kv_latent_dim + (cfg.index_head_dim if cfg.use_dsa else 0)
  return cfg.num_hidden_layers * width * dtype_of(cfg.dtype).itemsize
