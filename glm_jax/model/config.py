"""The model's configuration: HF GlmMoeDsaConfig names, validated once at construction.

Configs are written as ml_collections ConfigDicts (configs/*.py); `ModelConfig.from_dict` turns the
`model` field into this frozen dataclass and rejects impossible values with a message that names the field,
its value and what is valid. Field names follow transformers' GlmMoeDsaConfig wherever one exists, so a
released config.json maps one to one (see `ModelConfig.from_hf_dict`); fields after the marked line are ours.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

ATTENTION_IMPLS = ("reference", "pallas")
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims", "offload_layer_inputs")
NORM_STYLES = ("prenorm", "deepnorm")
DTYPES = ("float32", "bfloat16", "float16")


def _hf(default: Any) -> Any:
  """A field of transformers' GlmMoeDsaConfig: to_hf_dict writes it to config.json under its own name."""
  return dataclasses.field(default=default, metadata={"hf": True})


def _runtime(default: Any) -> Any:
  """A field that changes how the model runs, not its parameters (ModelConfig.runtime_fields)."""
  return dataclasses.field(default=default, metadata={"runtime": True})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # --- HF GlmMoeDsaConfig fields (defaults are the released GLM-5 744B-A40B numbers) ---
  vocab_size: int = _hf(154880)
  hidden_size: int = _hf(6144)
  intermediate_size: int = _hf(12288)  # dense MLP width (first_k_dense_replace layers)
  moe_intermediate_size: int = _hf(2048)  # width of each routed expert and of each shared expert
  num_hidden_layers: int = _hf(78)
  num_attention_heads: int = _hf(64)
  num_key_value_heads: int = _hf(64)  # MLA: every head has its own k/v, so this must equal num_attention_heads
  n_shared_experts: int = _hf(1)
  n_routed_experts: int = _hf(256)
  routed_scaling_factor: float = _hf(2.5)
  kv_lora_rank: int = _hf(512)
  q_lora_rank: int = _hf(2048)
  qk_rope_head_dim: int = _hf(64)
  v_head_dim: int = _hf(256)
  qk_nope_head_dim: int = _hf(192)
  n_group: int = _hf(1)
  topk_group: int = _hf(1)
  num_experts_per_tok: int = _hf(8)
  norm_topk_prob: bool = _hf(True)
  hidden_act: str = _hf("silu")
  max_position_embeddings: int = _hf(202752)
  initializer_range: float = _hf(0.02)
  rms_norm_eps: float = _hf(1e-5)
  tie_word_embeddings: bool = _hf(False)
  rope_theta: float = 1e6  # HF keeps it in rope_parameters["rope_theta"]
  attention_bias: bool = _hf(False)
  index_topk: int = _hf(2048)
  index_head_dim: int = _hf(128)
  index_n_heads: int = _hf(32)
  first_k_dense_replace: int = _hf(3)
  num_nextn_predict_layers: int = _hf(1)  # MTP depth; released as layer index num_hidden_layers
  bos_token_id: int | None = _hf(0)
  eos_token_id: int | None = _hf(1)
  pad_token_id: int | None = _hf(None)
  indexer_types: tuple[str, ...] | None = _hf(None)  # per layer, "full" (runs its indexer) or "shared" (GLM-5.2's
  #   IndexShare: reuses the previous full layer's top-k; its indexer's weights are unused); None: all "full".
  #   Also taken as a pattern string, "FSS" = ("full", "shared", "shared") (a flag: --config.model.indexer_types=FSS)
  # --- ours (no HF field); _runtime marks those that change how the model runs, not its parameters, so a resumed
  #     run may change them (glm_jax/train/checkpoint.py) ---
  rope_interleave: bool = True  # MLA rope on interleaved pairs (GLM-5, DeepSeek); False = half split
  indexer_rope_interleave: bool = True  # GLM-5 True; DeepSeek-V3.2's indexer uses the half split
  mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (HF builds them with eps 1e-6)
  index_norm_eps: float = 1e-6  # the indexer's k LayerNorm
  use_dsa: bool = _runtime(True)  # False: every layer is plain causal MLA, the indexer is still built and scored
  attention_impl: str = _runtime("reference")  # DSA: "reference" (pure jnp, the oracle) or "pallas" (dsa.py)
  dtype: str = _runtime("float32")  # activations and matmul inputs; softmax, router and norms run in fp32
  param_dtype: str = "float32"
  moe_capacity_factor: float = _runtime(0.0)  # 0: dropless (GLM-5); c > 0: each expert takes at most
  #   ceil(c * G * K / E) of the (token, slot) pairs of a dispatch group of G tokens, the rest dropped
  moe_buffer_factor: float = _runtime(0.0)  # expert parallelism's fast path (moe_parallel.py): a receive buffer of
  #   f x the balanced load, taken when every shard's rows fit it (dropless either way); 0: off
  attention_chunk: int = _runtime(0)  # dense attention (and the DSA warm-up's KL) this many query rows at a time
  #   when the sequence is longer, never [B, H, T, S] (glm_jax/model/blockwise.py); 0 = all at once
  remat_policy: str = _runtime("none")  # per scanned layer: none | full | dots | dots_with_no_batch_dims |
  #   offload_layer_inputs (full, with each layer's input kept in host memory)
  scan_unroll: bool = _runtime(False)  # unroll the layer scans: compile time grows with depth, XLA's cost
  #   analysis then counts every layer (it counts a loop body once)
  # GLM-130B's options (glm_jax/model/deepnorm.py, docs/design.md "GLM-130B's ideas"):
  norm_style: str = "prenorm"  # "prenorm" (GLM-5: x + f(norm(x))) or "deepnorm" (GLM-130B: Post-LN,
  #                              norm(alpha x + f(x)), alpha = (2N)^1/2, Xavier init with beta = (2N)^-1/2)
  rope_2d: bool = False  # GLM's two position ids: half the rope pairs rotate by the position, half by the
  #                        block position (GLM-130B's 2-D rotary; glm_jax/model/layers.py rope_angles_2d)

  def __post_init__(self):
    _validate(self)

  # Derived sizes.
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def kv_latent_dim(self) -> int:
    """Width of the absorbed (MQA-form) key: the kv latent plus the shared rope key (576 for GLM-5)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  def dsa_selects(self, seq_len: int) -> bool:
    """DSA's top-k changes anything only when a query can see more than index_topk keys."""
    return self.use_dsa and seq_len > self.index_topk

  @property
  def shared_indexer_layers(self) -> tuple[bool, ...]:
    """Per decoder layer: True where it reuses the previous full layer's top-k (IndexShare)."""
    return tuple(t == "shared" for t in self.indexer_types or ("full",) * self.num_hidden_layers)

  @property
  def index_share(self) -> bool:
    """Some layer reuses another's top-k selection (model.indexer_types has a "shared" layer)."""
    return any(self.shared_indexer_layers)

  @property
  def num_dense_layers(self) -> int:
    return min(self.first_k_dense_replace, self.num_hidden_layers)

  @property
  def num_moe_layers(self) -> int:
    return self.num_hidden_layers - self.num_dense_layers

  @property
  def softmax_scale(self) -> float:
    return self.qk_head_dim**-0.5

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    """From a mapping (a ConfigDict's `model` field); an unknown key is an error that lists the valid ones."""
    d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"model config: unknown field(s) {unknown}; valid fields are: {', '.join(sorted(names))}")
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def runtime_fields(cls) -> frozenset[str]:
    """The fields declared _runtime: a run resumed from a checkpoint may change them."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("runtime"))

  @classmethod
  def hf_fields(cls) -> tuple[str, ...]:
    """The fields declared _hf: transformers' GlmMoeDsaConfig has each under the same name."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("hf"))

  @classmethod
  def defaults(cls) -> dict[str, Any]:
    """Every field's default (the released GLM-5's numbers for the HF fields)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}

  @classmethod
  def from_hf_dict(cls, hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """From a HF GlmMoeDsaConfig dict (config.json). HF fields that change the math and that this codebase
    does not implement are rejected by name; purely bookkeeping fields (architectures, dtype, ...) are ignored."""
    hf = dict(hf)
    if hf.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
      raise ValueError(f"config.json: model_type={hf['model_type']!r}; expected 'glm_moe_dsa'")
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in hf.items():
      if k in names:
        kwargs[k] = v
    rope = hf.get("rope_parameters") or {}
    if "rope_theta" in hf:
      kwargs["rope_theta"] = hf["rope_theta"]
    if rope:
      rope_type = rope.get("rope_type", rope.get("type", "default"))
      if rope_type != "default":
        raise ValueError(
          f"config.json: rope_parameters.rope_type={rope_type!r}; only 'default' (no YaRN scaling) is implemented"
        )
      if "rope_theta" in rope:
        kwargs["rope_theta"] = rope["rope_theta"]
    kwargs["indexer_types"] = _hf_indexer_types(hf, kwargs.get("num_hidden_layers", cls.num_hidden_layers))
    if isinstance(kwargs.get("eos_token_id"), list):
      kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    _check_hf_supported(hf, kwargs)
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_dict(self) -> dict[str, Any]:
    """The HF GlmMoeDsaConfig dict for this config (what `hf.save` writes as config.json)."""
    for field, plain in (("norm_style", "prenorm"), ("rope_2d", False)):
      if getattr(self, field) != plain:
        raise ValueError(
          f"model config: {field}={getattr(self, field)!r} has no counterpart in transformers' "
          f"glm_moe_dsa (its layers are {plain!r}-only); such a model cannot be written as a HF "
          "checkpoint"
        )
    d = {k: getattr(self, k) for k in self.hf_fields()}  # ours stay out of config.json
    d.update(
      model_type="glm_moe_dsa",
      architectures=["GlmMoeDsaForCausalLM"],
      rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
      mlp_layer_types=["dense"] * self.num_dense_layers + ["sparse"] * self.num_moe_layers,
      indexer_types=[("shared" if s else "full") for s in self.shared_indexer_layers],
      head_dim=self.qk_rope_head_dim,
      dtype=self.param_dtype,
    )
    return d


def _check_hf_supported(hf: Mapping[str, Any], kwargs: dict[str, Any]) -> None:
  """Rejects, by name, config.json settings that change the math in ways this codebase does not implement."""
  for key, supported in (
    ("scoring_func", "sigmoid"),
    ("topk_method", "noaux_tc"),
    ("rope_scaling", None),
    ("quantization_config", None),
  ):
    if key in hf and hf[key] not in (supported, None):
      what = f"only {supported!r}" if supported else "only none (load a bf16/fp32 checkpoint)"
      raise ValueError(f"config.json: {key}={hf[key]!r}; {what} is implemented")
  n = kwargs.get("num_hidden_layers", ModelConfig.num_hidden_layers)
  k = min(kwargs.get("first_k_dense_replace", ModelConfig.first_k_dense_replace), n)
  mlp_types = hf.get("mlp_layer_types")
  if mlp_types is not None and list(mlp_types) != ["dense"] * k + ["sparse"] * (n - k):
    raise ValueError(
      f"config.json: mlp_layer_types={mlp_types}; only first_k_dense_replace={k} dense layers followed by "
      "MoE layers is implemented"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' is implemented")


def _hf_indexer_types(hf: Mapping[str, Any], n_layers: int) -> tuple[str, ...] | None:
  """config.json's per-layer indexer modes as transformers' GlmMoeDsaConfig reads them: `indexer_types`, else the
  pattern `index_topk_pattern` ("F" full, "S" shared), else every `index_topk_freq`-th layer from
  `index_skip_topk_offset` runs its indexer. None (all full) when the file says nothing."""
  if hf.get("indexer_types") is not None:
    return tuple(hf["indexer_types"])
  pattern = hf.get("index_topk_pattern")
  if pattern is not None:
    codes = {"F": "full", "S": "shared"}
    if any(p not in codes for p in pattern):
      raise ValueError(f"config.json: index_topk_pattern={pattern!r}; each entry is 'F' (full) or 'S' (shared)")
    return tuple(codes[p] for p in pattern)
  freq, offset = hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset", 2)
  if not isinstance(freq, int) or not isinstance(offset, int):
    raise ValueError(f"config.json: index_topk_freq={freq!r}, index_skip_topk_offset={offset!r}; integers")
  if max(freq, 1) == 1:
    return None
  return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))


def _validate(c: ModelConfig) -> None:
  def fail(field: str, valid: str):
    raise ValueError(f"model config: {field}={getattr(c, field)!r} is invalid; {valid}")

  for f in dataclasses.fields(c):  # NaN compares false with everything: refused first, by name
    v = getattr(c, f.name)
    if isinstance(v, float) and not math.isfinite(v):
      fail(f.name, "must be a finite number")
  for f in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "max_position_embeddings",
  ):
    v = getattr(c, f)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      fail(f, "must be a positive integer")
  for f in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "attention_chunk"):
    v = getattr(c, f)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      fail(f, "must be a non-negative integer")
  if c.num_key_value_heads != c.num_attention_heads:
    fail("num_key_value_heads", f"MLA needs it equal to num_attention_heads={c.num_attention_heads}")
  if c.num_experts_per_tok > c.n_routed_experts:
    fail("num_experts_per_tok", f"must be <= n_routed_experts={c.n_routed_experts}")
  if c.n_routed_experts % c.n_group:
    fail("n_group", f"must divide n_routed_experts={c.n_routed_experts}")
  if c.topk_group > c.n_group:
    fail("topk_group", f"must be <= n_group={c.n_group}")
  if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
    fail("n_group", "group-limited routing scores a group by its top-2 experts, so each group needs >= 2 experts")
  if c.n_group > 1 and c.num_experts_per_tok > c.topk_group * (c.n_routed_experts // c.n_group):
    fail(
      "num_experts_per_tok",
      f"must be <= topk_group * experts per group = {c.topk_group * (c.n_routed_experts // c.n_group)}",
    )
  if c.qk_rope_head_dim % 2:
    fail("qk_rope_head_dim", "must be even (rope rotates pairs)")
  if c.index_head_dim < c.qk_rope_head_dim:
    fail("index_head_dim", f"must be >= qk_rope_head_dim={c.qk_rope_head_dim} (rope covers its first part)")
  for f in ("routed_scaling_factor", "rope_theta", "rms_norm_eps", "mla_norm_eps", "index_norm_eps"):
    v = getattr(c, f)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
      fail(f, "must be a number > 0")
  ir = c.initializer_range
  if isinstance(ir, bool) or not isinstance(ir, (int, float)) or not ir >= 0:
    fail("initializer_range", "must be a number >= 0 (the initializers' standard deviation)")
  if c.hidden_act != "silu":
    fail("hidden_act", "only 'silu' (SwiGLU) is implemented")
  if c.attention_bias:
    fail("attention_bias", "only False is implemented (GLM-5 has no attention bias)")
  if c.attention_impl not in ATTENTION_IMPLS:
    fail("attention_impl", f"one of {ATTENTION_IMPLS}")
  cf = c.moe_capacity_factor
  if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not (cf == 0 or cf >= 1 / c.num_experts_per_tok):
    fail(
      "moe_capacity_factor",
      f"0 (dropless) or a number >= 1 / num_experts_per_tok = "
      f"{1 / c.num_experts_per_tok:.4g} (below that an expert could not even take its share of one slot)",
    )
  bf = c.moe_buffer_factor
  if isinstance(bf, bool) or not isinstance(bf, (int, float)) or not (bf == 0 or bf >= 1):
    fail(
      "moe_buffer_factor",
      "0 (the worst-case receive buffer only) or a number >= 1 (the fast path's buffer in "
      "multiples of the balanced load)",
    )
  if c.norm_style not in NORM_STYLES:
    fail("norm_style", f"one of {NORM_STYLES}")
  if not isinstance(c.rope_2d, bool):
    fail("rope_2d", "True or False")
  if c.rope_2d and c.qk_rope_head_dim % 4:
    fail("qk_rope_head_dim", "must be a multiple of 4 with rope_2d (each position id rotates half of the pairs)")
  if c.remat_policy not in REMAT_POLICIES:
    fail("remat_policy", f"one of {REMAT_POLICIES}")
  for f in ("dtype", "param_dtype"):
    if getattr(c, f) not in DTYPES:
      fail(f, f"one of {DTYPES}")
  if c.indexer_types is not None:
    types = c.indexer_types
    if isinstance(types, str):  # the pattern form of transformers' index_topk_pattern: "FSSF..."
      if set(types) - {"F", "S"}:
        fail(
          "indexer_types",
          "None, a pattern of 'F' (full) and 'S' (shared) such as 'FSS', or a sequence of "
          "'full' / 'shared', one per decoder layer",
        )
      types = ["full" if t == "F" else "shared" for t in types]
    if not all(isinstance(t, str) for t in types):
      fail("indexer_types", "None, a pattern such as 'FSS', or a sequence of 'full' / 'shared', one per layer")
    object.__setattr__(c, "indexer_types", tuple(types))  # hashable, whatever form it came in
    if len(c.indexer_types) != c.num_hidden_layers:
      fail(
        "indexer_types",
        f"one entry per decoder layer: {len(c.indexer_types)} given, num_hidden_layers={c.num_hidden_layers}",
      )
    bad = sorted({t for t in c.indexer_types if t not in ("full", "shared")})
    if bad:
      fail("indexer_types", f"each entry 'full' or 'shared', not {bad}")
    if c.indexer_types[0] != "full":
      fail(
        "indexer_types",
        "the first layer must be 'full': a 'shared' layer reuses the previous full layer's "
        "top-k, and layer 0 has none before it",
      )
    if "shared" not in c.indexer_types:  # every layer full: the same model as None, and equal to it
      object.__setattr__(c, "indexer_types", None)
  for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
    v = getattr(c, f)
    if v is not None and not 0 <= v < c.vocab_size:
      fail(f, f"must be None or in [0, vocab_size={c.vocab_size})")
