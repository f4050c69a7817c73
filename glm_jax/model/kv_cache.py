"""The decode cache: what GLM-5 keeps per token and layer, and nothing more.

  kv       [B, S, kv_lora_rank + qk_rope_head_dim]  the normed latent c_kv and the roped shared key k_rope,
                                                    concatenated: 512 + 64 = 576 numbers a token for GLM-5,
                                                    the single key (and, its first 512 columns, the value) of
                                                    the absorbed MQA form
  index_k  [B, S, index_head_dim]                   the lightning indexer's key (DSA only)
Slot s of a row holds the token at position s. Each stack of layers keeps one LayerCache with a leading layer
axis, the way its parameters are stacked. Slots past a row's current position hold stale values that no query
can see: the decode step masks keys beyond the query's position and writes slot `pos` before it attends.
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

  def write(self, pos_B: jax.Array, kv_BA: jax.Array, index_k_BZ: jax.Array | None) -> LayerCache:
    """One layer's cache with each row's new entry at slot pos[b]."""
    rows = jnp.arange(pos_B.shape[0])
    index_k = None if self.index_k is None else self.index_k.at[rows, pos_B].set(index_k_BZ.astype(self.index_k.dtype))
    return LayerCache(kv=self.kv.at[rows, pos_B].set(kv_BA.astype(self.kv.dtype)), index_k=index_k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """One LayerCache per stack of the decoder (None where the stack is empty). The MTP layers are not cached:
  decoding uses the main head only."""
  dense: LayerCache | None
  moe: LayerCache | None

  @property
  def length(self) -> int:
    return (self.dense or self.moe).length


def cache_bytes_per_token(cfg: ModelConfig) -> int:
  """Bytes the cache holds per token over all decoder layers, in the model's compute dtype."""
  width = cfg.kv_latent_dim + (cfg.index_head_dim if cfg.use_dsa else 0)
  return cfg.num_hidden_layers * width * dtype_of(cfg.dtype).itemsize
