"""The GLM-5 model, one file per idea of the paper: layers (norms, rope, MLP), mla, indexer and dsa (DSA), moe
(routing; grouped_ffn.py and moe_parallel.py run the experts), transformer (the stacks and MTP), kv_cache (decoding).
`param_counts` sizes a config from abstract shapes.

Shape suffixes. An array's name may end in its shape, one capital a dimension (`x_BTD` is [batch, query
positions, hidden_size]); `1` marks a dimension of size one. Each letter has one meaning throughout glm_jax:

  B  batch (rows: sequences, or sampled answers in RL)     T  query positions (tokens of a row)
  S  key positions (T in training, a decode cache's slots)  D  hidden_size
  V  vocab_size                                             L  layers of a stack (scanned)
  M  MTP depth (num_nextn_predict_layers)
  H  attention heads                                        P  a head's query/key width, qk_nope + qk_rope_head_dim
  O  a head's value / output width, v_head_dim              R  qk_rope_head_dim (the rope part)
  F  rope frequencies, qk_rope_head_dim / 2                 Q  q_lora_rank (the query latent c_q)
  C  kv_lora_rank (the kv latent c_kv; the absorbed form's value)
  A  the absorbed (MQA) key: kv_lora_rank + qk_rope_head_dim, 576 for GLM-5
  J  indexer heads (index_n_heads)                          Z  index_head_dim
  K  keys DSA selects for a query (index_topk)
  E  routed experts                                         I  an expert's width (moe_intermediate_size)
  X  experts a token is routed to (num_experts_per_tok)     G  expert groups (n_group)
  N  tokens flattened for routing (B * T)

The kernels in pallas_kernels/ are generic in their feature widths and write them D (q [B, T, H, D] there is the
indexer's [B, T, J, Z] or the absorbed [B, T, H, A] here); einsum subscripts are local to their einsum.
"""

from glm_jax.model.config import ModelConfig
from glm_jax.model.params import param_counts
from glm_jax.model.transformer import GlmMoeDsa, ModelOutput

__all__ = ["GlmMoeDsa", "ModelConfig", "ModelOutput", "param_counts"]
