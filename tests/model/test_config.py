"""ModelConfig: impossible values fail at construction, naming the field, the value and what is valid."""

import re

import pytest

from glm_jax.model.config import ModelConfig

SMALL = dict(
  vocab_size=64,
  hidden_size=16,
  intermediate_size=24,
  moe_intermediate_size=8,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=4,
  n_routed_experts=8,
  num_experts_per_tok=2,
  q_lora_rank=12,
  kv_lora_rank=10,
  qk_nope_head_dim=6,
  qk_rope_head_dim=4,
  v_head_dim=5,
  index_topk=4,
  index_n_heads=2,
  index_head_dim=8,
)


def test_small_config_is_valid_and_derives_sizes():
  c = ModelConfig(**SMALL)
  assert c.qk_head_dim == 10 and c.kv_latent_dim == 14
  assert c.softmax_scale == pytest.approx(10**-0.5)
  assert (c.num_dense_layers, c.num_moe_layers) == (2, 0)  # first_k_dense_replace=3 > 2 layers: all dense
  assert ModelConfig().softmax_scale == 1 / 16  # GLM-5: qk head dim 256


@pytest.mark.parametrize(
  "changes,pattern",
  [
    ({"index_topk": 0}, "index_topk=0 is invalid; must be a positive integer"),
    ({"index_topk": -2048}, "index_topk=-2048 is invalid"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is invalid; must be <= n_routed_experts=8"),
    ({"n_group": 2, "topk_group": 3}, "topk_group=3 is invalid; must be <= n_group=2"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 is invalid; MLA needs it equal to num_attention_heads=4"),
    ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 is invalid; must be even"),
    ({"attention_impl": "flash"}, "attention_impl='flash' is invalid; one of ('reference'"),
    ({"remat_policy": "some"}, "remat_policy='some' is invalid"),
    ({"dtype": "float64"}, "dtype='float64' is invalid"),
    ({"n_group": 3}, "n_group=3 is invalid; must divide n_routed_experts=8"),
    ({"index_head_dim": 2}, "index_head_dim=2 is invalid; must be >= qk_rope_head_dim=4"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace=-1 is invalid; must be a non-negative integer"),
    ({"hidden_size": 16.0}, "hidden_size=16.0 is invalid; must be a positive integer"),
    ({"eos_token_id": 64}, "eos_token_id=64 is invalid; must be None or in [0, vocab_size=64)"),
  ],
)
def test_invalid_values_fail_at_construction(changes, pattern):
  with pytest.raises(ValueError, match=re.escape(pattern)):
    ModelConfig(**{**SMALL, **changes})


def test_replace_validates_too():
  with pytest.raises(ValueError, match=re.escape("index_topk=0")):
    ModelConfig(**SMALL).replace(index_topk=0)


def test_from_dict_rejects_unknown_fields_and_lists_the_valid_ones():
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['hiden_size'\]; valid fields are: .*\bhidden_size\b"):
    ModelConfig.from_dict({**SMALL, "hiden_size": 16})
  assert ModelConfig.from_dict(SMALL) == ModelConfig(**SMALL)


def test_from_hf_dict_maps_rope_theta_and_fields():
  hf = {
    **SMALL,
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
    "eos_token_id": [7, 9],
  }
  c = ModelConfig.from_hf_dict(hf)
  assert c.rope_theta == 8e6 and c.eos_token_id == 7 and c.index_topk == 4
  assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c.replace(eos_token_id=7)


def test_from_hf_dict_rejects_yarn():
  hf = {**SMALL, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
  with pytest.raises(ValueError, match=re.escape("rope_parameters.rope_type='yarn'")):
    ModelConfig.from_hf_dict(hf)


def test_from_hf_dict_reads_shared_indexer_types_and_names_bad_ones():
  """GLM-5.2's IndexShare (tests/model/test_index_share.py has the model and the schedules transformers derives)."""
  assert ModelConfig.from_hf_dict({**SMALL, "indexer_types": ["full", "shared"]}).shared_indexer_layers == (False, True)
  assert ModelConfig.from_hf_dict({**SMALL, "index_topk_pattern": "FS"}).indexer_types == ("full", "shared")
  assert ModelConfig.from_hf_dict({**SMALL, "indexer_types": ["full", "full"]}).indexer_types is None  # = no sharing
  with pytest.raises(ValueError, match="indexer_types=.*the first layer must be 'full'"):
    ModelConfig.from_hf_dict({**SMALL, "indexer_types": ["shared", "full"]})
  with pytest.raises(ValueError, match=re.escape("config.json: index_topk_pattern='FX'; each entry is 'F'")):
    ModelConfig.from_hf_dict({**SMALL, "index_topk_pattern": "FX"})


# A valid other value for each field declared runtime-only; the test below checks the model's state under each.
RUNTIME_ALTERNATIVES = {
  "use_dsa": False,
  "attention_impl": "pallas",
  "dtype": "bfloat16",
  "moe_capacity_factor": 1.0,
  "moe_buffer_factor": 2.0,
  "attention_chunk": 16,
  "remat_policy": "full",
  "scan_unroll": True,
}


def _state_shapes(cfg: ModelConfig) -> dict:
  import jax
  from flax import nnx

  from glm_jax.model.transformer import GlmMoeDsa

  state = nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))))
  return {jax.tree_util.keystr(path): (leaf.shape, leaf.dtype) for path, leaf in jax.tree.leaves_with_path(state)}


def test_runtime_fields_change_no_state_and_the_others_do():
  """A checkpoint may be resumed under another value of a runtime field (glm_jax/train/checkpoint.py), so none may
  change the model's state; param_dtype, declared otherwise, changes every parameter's dtype."""
  assert ModelConfig.runtime_fields() == set(RUNTIME_ALTERNATIVES)  # a new runtime field needs an entry above
  base = ModelConfig(**SMALL, first_k_dense_replace=1)
  shapes = _state_shapes(base)
  for field, value in RUNTIME_ALTERNATIVES.items():
    assert getattr(base, field) != value
    assert _state_shapes(base.replace(**{field: value})) == shapes, field
  assert _state_shapes(base.replace(param_dtype="bfloat16")) != shapes


def test_hf_fields_are_transformers_fields():
  """to_hf_dict writes the fields declared _hf under their own names: each is a field of transformers'
  GlmMoeDsaConfig, and none of ours (runtime or not) reaches config.json."""
  transformers = pytest.importorskip("transformers")
  # num_nextn_predict_layers is in the released config.json (docs/glm5_facts.md); transformers' class keeps it as
  # an extra attribute rather than declaring it
  theirs = set(transformers.GlmMoeDsaConfig().to_dict()) | {"num_nextn_predict_layers"}
  fields = set(ModelConfig.defaults())
  assert set(ModelConfig.hf_fields()) <= theirs
  # every field both have, but dtype: theirs is the weights' dtype (to_hf_dict writes our param_dtype there), ours
  # the activations'
  assert set(ModelConfig.hf_fields()) == fields & theirs - {"dtype"}
  written = ModelConfig(**SMALL, rope_theta=8e6).to_hf_dict()
  assert set(written) <= theirs | {"architectures", "model_type", "rope_parameters"}
  assert written["rope_parameters"]["rope_theta"] == 8e6 and written["dtype"] == "float32"


def test_every_remat_policy_name_has_its_checkpoint_policy():
  from glm_jax.model.config import REMAT_POLICIES
  from glm_jax.model.transformer import CHECKPOINT_POLICIES

  assert set(CHECKPOINT_POLICIES) == set(REMAT_POLICIES) - {"none"}
