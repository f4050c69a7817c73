"""Parity with the public reference: transformers' GlmMoeDsaForCausalLM (CPU torch, fp32).

Random tiny HF models are built with transformers, saved, loaded with hf.load, and their logits compared.
Weights are drawn at initializer_range 0.1 so the logits are unit-scale (std ~0.8) and 1e-4 is a real bound.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from glm_jax.convert import hf

TOL = 1e-4  # max abs logit difference, fp32 on CPU

BASE = dict(
  vocab_size=128,
  hidden_size=64,
  intermediate_size=96,
  moe_intermediate_size=32,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=4,
  n_routed_experts=8,
  num_experts_per_tok=2,
  kv_lora_rank=32,
  q_lora_rank=32,
  qk_rope_head_dim=8,
  v_head_dim=16,
  qk_nope_head_dim=16,
  index_topk=8,
  index_head_dim=16,
  index_n_heads=8,
  first_k_dense_replace=1,
  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
  initializer_range=0.1,
)


def make_hf_model(seed=0, **overrides):
  torch.manual_seed(seed)
  config = GlmMoeDsaConfig(**{**BASE, **overrides})
  config._attn_implementation = "eager"
  model = GlmMoeDsaForCausalLM(config).eval()
  with torch.no_grad():  # a non-zero expert bias, so bias-corrected selection is exercised
    for module in model.modules():
      if hasattr(module, "e_score_correction_bias"):
        module.e_score_correction_bias.normal_(0.0, 0.1)
  return model


def hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(ids))).logits.numpy()


def hf_topk_indices(model, ids):
  """Each layer's indexer output, recorded with forward hooks: [L, B, T, K]."""
  got = []
  hooks = [
    layer.self_attn.indexer.register_forward_hook(lambda m, i, o: got.append(o.numpy())) for layer in model.model.layers
  ]
  hf_logits(model, ids)
  for h in hooks:
    h.remove()
  return np.stack(got)


def token_ids(seed, batch, seq, vocab=BASE["vocab_size"]):
  return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


def max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """The main reference model (dense + MoE layers), saved once in transformers' default format."""
  model = make_hf_model()
  path = str(tmp_path_factory.mktemp("hf") / "tiny")
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def loaded(saved):
  _, path = saved
  return hf.load(path)


@pytest.mark.slow  # two models forward, ours and transformers'
def test_logits_match_with_sparse_attention(saved, loaded):
  model, _ = saved
  cfg, ours = loaded
  ids = token_ids(1, 2, 24)  # 24 > index_topk = 8: the indexer really selects
  assert cfg.num_dense_layers == 1 and cfg.num_moe_layers == 2
  out = ours(jnp.asarray(ids), return_index_scores=True)
  # Top-k ties are broken differently by torch; make sure this input has none at the boundary.
  scores = np.sort(np.asarray(out.aux["index_scores"]), axis=-1)[..., ::-1]
  k = cfg.index_topk
  assert np.all(scores[..., k - 1][..., k:] > scores[..., k][..., k:]), "tie at the top-k boundary"
  diff = max_diff(out.logits, hf_logits(model, ids))
  print(f"parity sparse (T=24, topk=8): max |dlogit| = {diff:.2e}")
  assert diff <= TOL


@pytest.mark.slow  # transformers' indexer and ours on every layer, about 4.5 s
def test_selected_keys_match_reference_indexer(saved, loaded):
  model, _ = saved
  _, ours = loaded
  ids = token_ids(2, 2, 24)
  ref = hf_topk_indices(model, ids)  # [L, B, T, K], HF picks masked keys too for early queries
  got = np.asarray(ours(jnp.asarray(ids)).aux["topk_indices"])
  t = np.arange(ids.shape[1])[None, None, :, None]
  for layer in range(ref.shape[0]):
    for b in range(ids.shape[0]):
      for q in range(ids.shape[1]):
        ref_set = {int(s) for s in ref[layer, b, q] if s <= q}
        assert ref_set == {int(s) for s in got[layer, b, q] if s >= 0}, (layer, b, q)
  assert np.all((got < 0) | (got <= t))


@pytest.mark.slow  # the sparse case above is the fast tier's parity check
def test_logits_match_dense_when_sequence_fits_topk(saved, loaded):
  model, _ = saved
  _, ours = loaded
  ids = token_ids(3, 2, 8)  # T = index_topk: plain causal MLA
  diff_mha = max_diff(ours(jnp.asarray(ids)).logits, hf_logits(model, ids))
  diff_abs = max_diff(ours(jnp.asarray(ids), form="absorbed").logits, hf_logits(model, ids))
  print(f"parity dense (T=8): mha {diff_mha:.2e}, absorbed {diff_abs:.2e}")
  assert diff_mha <= TOL and diff_abs <= TOL


@pytest.mark.slow  # a second transformers model
def test_logits_match_with_group_limited_routing(tmp_path):
  model = make_hf_model(seed=4, n_group=4, topk_group=2, num_experts_per_tok=3)
  model.save_pretrained(tmp_path)
  cfg, ours = hf.load(str(tmp_path))
  assert (cfg.n_group, cfg.topk_group) == (4, 2)
  ids = token_ids(5, 2, 20)
  diff = max_diff(ours(jnp.asarray(ids)).logits, hf_logits(model, ids))
  print(f"parity group-limited routing: max |dlogit| = {diff:.2e}")
  assert diff <= TOL


@pytest.mark.slow  # three more checkpoints through transformers
def test_fused_and_sharded_checkpoints_load(tmp_path):
  model = make_hf_model(seed=6)
  model.save_pretrained(tmp_path / "fused", save_original_format=False)
  model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
  names = json.load(open(tmp_path / "sharded" / hf.INDEX_FILE))["weight_map"]
  assert len(set(names.values())) > 1
  assert "model.layers.1.mlp.experts.gate_up_proj" in _safetensor_names(tmp_path / "fused")
  ids = token_ids(7, 1, 16)
  ref = hf_logits(model, ids)
  for sub in ("fused", "sharded"):
    _, ours = hf.load(str(tmp_path / sub))
    assert max_diff(ours(jnp.asarray(ids)).logits, ref) <= TOL, sub


def test_round_trip_through_transformers(saved, loaded, tmp_path):
  model, _ = saved
  cfg, ours = loaded
  out = tmp_path / "ours"
  hf.save(cfg, ours, str(out), max_shard_bytes=200_000)
  assert os.path.exists(out / hf.INDEX_FILE)
  back = GlmMoeDsaForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
  ids = token_ids(8, 2, 24)
  diff = max_diff(hf_logits(back, ids), hf_logits(model, ids))
  print(f"round trip hf.load -> hf.save -> transformers: max |dlogit| = {diff:.2e}")
  assert diff <= TOL
  # and our own reader recovers every tensor bit for bit, MTP layer included
  cfg2, ours2 = hf.load(str(out))
  assert cfg2 == cfg
  a, b = _flat(ours), _flat(ours2)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_save_refuses_to_overwrite(loaded, tmp_path):
  cfg, ours = loaded
  (tmp_path / "keep.txt").write_text("precious")
  with pytest.raises(FileExistsError, match="path=.* exists and is not empty; pass overwrite=True to replace it"):
    hf.save(cfg, ours, str(tmp_path))
  assert (tmp_path / "keep.txt").read_text() == "precious"


def _flat(model):
  from flax import nnx

  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


def _safetensor_names(path):
  from safetensors import safe_open

  names = set()
  for f in os.listdir(path):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(path, f), framework="numpy") as h:
        names |= set(h.keys())
  return names


# --- bad checkpoints: each error names the tensor and both shapes, and nothing is loaded half-way ---


def _rewrite(src, dst, edit):
  """Copy a single-file checkpoint, editing its tensor dict."""
  from safetensors.torch import load_file, save_file

  os.makedirs(dst, exist_ok=True)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  edit(tensors)
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
    g.write(f.read())
  return str(dst)


def test_missing_tensor_is_named(saved, tmp_path):
  _, path = saved
  bad = _rewrite(path, tmp_path / "bad", lambda t: t.pop("model.layers.2.self_attn.indexer.wk.weight"))
  with pytest.raises(
    ValueError,
    match=r"missing tensor model\.layers\.2\.self_attn\.indexer\.wk\.weight "
    r"\(expected shape \[16, 64\]\)",
  ):
    hf.load(bad)


def test_extra_tensor_is_named(saved, tmp_path):
  _, path = saved
  bad = _rewrite(path, tmp_path / "bad", lambda t: t.update({"model.layers.0.surprise.weight": torch.ones(3)}))
  with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['model\.layers\.0\.surprise\.weight'\]"):
    hf.load(bad)


def test_wrong_shape_is_named(saved, tmp_path):
  _, path = saved
  name = "model.layers.1.mlp.experts.3.down_proj.weight"
  bad = _rewrite(path, tmp_path / "bad", lambda t: t.update({name: torch.ones(64, 31)}))
  with pytest.raises(ValueError, match=rf"tensor {name} has shape \[64, 31\], expected \[64, 32\]"):
    hf.load(bad)


def test_unsupported_config_is_named(saved, tmp_path):
  _, path = saved
  bad = tmp_path / "bad"
  bad.mkdir()
  cfg = json.load(open(os.path.join(path, "config.json")))
  cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    hf.load(str(bad))


def test_missing_directory_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load(str(tmp_path / "nowhere"))
