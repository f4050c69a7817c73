"""IndexShare (GLM-5.2; model.indexer_types): "shared" layers attend over the previous full layer's top-k.

The oracle is transformers' GlmMoeDsaForCausalLM built with the same indexer_types (CPU torch, fp32): its shared
layers have no indexer at all. Pattern F S F S over 1 dense + 3 MoE layers, so a shared MoE layer reuses a dense
layer's selection (the carry crosses the two scanned stacks) as well as an MoE layer's.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from glm_jax.convert import hf, stream
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.train.trainer import restore_run
from tests.convert.test_hf import BASE, TOL, hf_logits, make_hf_model, max_diff, token_ids
from tests.convert.test_stream import VOCAB, all_tensors, run_config

TYPES = ["full", "shared", "full", "shared"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  model = make_hf_model(num_hidden_layers=4, indexer_types=TYPES)
  path = str(tmp_path_factory.mktemp("hf") / "index_share")
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def loaded(saved):
  return hf.load(saved[1])


def hf_selections(model, ids) -> dict[int, np.ndarray]:
  """{layer: its indexer's top-k [B, T, K]} for the layers that have an indexer (the full ones)."""
  got, hooks = {}, []
  for i, layer in enumerate(model.model.layers):
    if layer.self_attn.indexer is not None:
      hooks.append(
        layer.self_attn.indexer.register_forward_hook(lambda m, inp, out, i=i: got.__setitem__(i, out.numpy()))
      )
  hf_logits(model, ids)
  for h in hooks:
    h.remove()
  return got


def test_logits_and_selected_keys_match_transformers(saved, loaded):
  model, path = saved
  cfg, ours = loaded
  assert cfg.indexer_types == tuple(TYPES) and cfg.num_dense_layers == 1
  assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, False, True]
  ids = token_ids(1, 2, 24)  # 24 > index_topk = 8: the indexer selects
  out = ours(jnp.asarray(ids), compute_mtp=False)
  diff = max_diff(out.logits, hf_logits(model, ids))
  print(f"IndexShare parity (T=24, topk=8, FSFS): max |dlogit| = {diff:.2e}")
  assert diff <= TOL
  # Each layer attends over its own (full) or the previous full layer's (shared) selection, as transformers does.
  ref = hf_selections(model, ids)
  assert sorted(ref) == [0, 2]
  got = np.asarray(out.aux["topk_indices"])
  for layer, source in enumerate([0, 0, 2, 2]):
    for b in range(ids.shape[0]):
      for q in range(ids.shape[1]):
        assert {int(s) for s in ref[source][b, q] if s <= q} == {int(s) for s in got[layer, b, q] if s >= 0}, (
          layer,
          b,
          q,
        )
  # The sharing is real: the two full layers select differently somewhere.
  assert not np.array_equal(got[0], got[2])


def test_shared_layers_have_no_indexer_tensors_and_round_trip(saved, loaded, tmp_path):
  """hf.save writes no indexer for a shared layer and config.json's indexer_types; transformers loads it with no
  missing weight (and nothing unexpected but the MTP layer, which it does not model) and gives the same logits."""
  model, _ = saved
  cfg, ours = loaded
  out = str(tmp_path / "out")
  hf.save(cfg, ours, out)
  names = hf.Reader(out).names()
  for i, kind in enumerate(TYPES):
    has = any(n.startswith(f"model.layers.{i}.self_attn.indexer.") for n in names)
    assert has == (kind == "full"), i
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["indexer_types"] == TYPES
  back, info = GlmMoeDsaForCausalLM.from_pretrained(out, output_loading_info=True)
  assert not info["missing_keys"]
  assert info["unexpected_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])  # MTP
  back.config._attn_implementation = "eager"
  ids = token_ids(2, 2, 24)
  assert max_diff(hf_logits(back.eval(), ids), hf_logits(model, ids)) <= TOL


@pytest.mark.parametrize(
  "hf_fields",
  [
    dict(index_topk_freq=2, index_skip_topk_offset=1),
    dict(index_topk_freq=3),
    dict(index_topk_pattern="FSFFSS"),
    dict(index_topk_freq=1),
  ],
  ids=["freq2-offset1", "freq3", "pattern", "freq1"],
)
def test_indexer_types_derived_as_transformers_derives_them(hf_fields):
  """A config.json without indexer_types (the freq / offset schedule or the pattern) reads as transformers reads it."""
  fields = {**BASE, "num_hidden_layers": 6, **hf_fields}
  want = GlmMoeDsaConfig(**fields).indexer_types
  got = ModelConfig.from_hf_dict({"model_type": "glm_moe_dsa", **fields}).shared_indexer_layers
  assert got == tuple(t == "shared" for t in want)


@pytest.mark.parametrize(
  "value, message",
  [
    ("SFFF", "the first layer must be 'full'"),
    ("FSF", "one entry per decoder layer: 3 given, num_hidden_layers=4"),
    ("FXFF", "a pattern of 'F' (full) and 'S' (shared)"),
    (("full", "shared", "full", "partial"), "each entry 'full' or 'shared', not ['partial']"),
  ],
)
def test_bad_indexer_types_are_named(value, message):
  with pytest.raises(ValueError, match=r"model config: indexer_types=.* is invalid; ") as e:
    ModelConfig(num_hidden_layers=4, indexer_types=value)
  assert message in str(e.value)


def test_pattern_string_equals_the_list_form():
  a = ModelConfig(num_hidden_layers=4, indexer_types="FSFS")
  assert a == ModelConfig(num_hidden_layers=4, indexer_types=TYPES) and a.indexer_types == tuple(TYPES)
  assert a.shared_indexer_layers == (False, True, False, True) and a.index_share
  assert not ModelConfig(num_hidden_layers=4).index_share


@pytest.mark.slow  # two gradients of the whole model compiled
def test_indexer_loss_counts_full_layers_only(loaded):
  """The warm-up and sparse stages' indexer KL: one entry a full layer (then the MTP layer); layer 0's equals the
  KL of the same model without sharing (its input is the same), and a shared layer's indexer gets no gradient."""
  cfg, ours = loaded
  graphdef, state = nnx.split(ours)
  plain = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(cfg.replace(indexer_types=None), nnx.Rngs(0))))
  plain_kl = jax.jit(lambda s, ids: nnx.merge(plain, s)(ids, indexer_loss=True).aux["indexer_kl"])
  ids = jnp.asarray(token_ids(3, 2, 24))
  for seq in (8, 24):  # 8 = index_topk: dense attention (the warm-up); 24: sparse
    kl_plain = plain_kl(state, ids[:, :seq])

    def loss(s):
      kl = nnx.merge(graphdef, s)(ids[:, :seq], indexer_loss=True).aux["indexer_kl"]
      return jnp.sum(kl), kl

    grads, kl = jax.jit(jax.grad(loss, has_aux=True))(state)
    assert kl.shape == (2 + cfg.num_nextn_predict_layers,)
    np.testing.assert_allclose(kl[0], kl_plain[0], rtol=1e-6)
    for stack, j, shared in (
      ("dense_layers", 0, False),
      ("moe_layers", 0, True),
      ("moe_layers", 1, False),
      ("moe_layers", 2, True),
    ):
      g = grads[stack]["self_attn"]["indexer"]["wk"][...][j]
      assert bool(jnp.all(g == 0)) == shared, (seq, stack, j)


@pytest.mark.slow  # the kernels in interpret mode
def test_kernel_path_equals_reference(loaded):
  cfg, ours = loaded
  _, state = nnx.split(ours)
  kernels = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(cfg.replace(attention_impl="pallas"), nnx.Rngs(0))))
  ids = jnp.asarray(token_ids(4, 2, 32))
  forward = jax.jit(lambda g, s: nnx.merge(g, s)(ids, compute_mtp=False), static_argnums=0)
  ref, got = forward(nnx.graphdef(ours), state), forward(kernels, state)
  np.testing.assert_array_equal(np.sort(got.aux["topk_indices"], -1), np.sort(ref.aux["topk_indices"], -1))
  np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # a prefill and a decode loop compiled
def test_cached_greedy_decoding_equals_full_forward(loaded):
  """The KV-cache sampler reuses the full layers' selections in the shared layers as the full forward does: the
  same greedy tokens and logits, with DSA selecting in the prefill (12 > index_topk = 8) and in every decode step."""
  cfg, ours = loaded
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
  prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 4, 5]]
  out = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=8, temperature=0.0), return_logits=True)(
    params, rest, prompts, jax.random.key(0)
  )
  logits_all = ours(jnp.asarray(out.tokens), compute_mtp=False).logits
  for b, prompt in enumerate(prompts):
    p, n = len(prompt), int(out.lengths[b])
    np.testing.assert_array_equal(np.argmax(logits_all[b, p - 1 : n - 1], -1), out.tokens[b, p:n])
    np.testing.assert_allclose(out.logits[b, p:n], logits_all[b, p - 1 : n - 1], atol=5e-5, rtol=1e-5)


def test_hf_logits_differ_without_sharing(saved):
  """The oracle itself depends on the sharing: the same weights with every layer running its own indexer (those of
  the shared layers drawn afresh) give other logits, so the parity above is not vacuous."""
  model, _ = saved
  torch.manual_seed(1)
  full = make_hf_model(num_hidden_layers=4)
  missing = full.load_state_dict(model.state_dict(), strict=False).missing_keys
  assert missing and all(".self_attn.indexer." in k for k in missing)
  ids = token_ids(1, 2, 24)
  assert max_diff(hf_logits(full, ids), hf_logits(model, ids)) > 100 * TOL


@pytest.mark.slow  # two conversions and a restore
def test_streaming_conversion_both_ways(tmp_path):
  """launch/convert.py's path: the HF directory converts to Orbax (a shared layer's unused indexer slice written as
  zeros), restores through launch/sample.py's loading path with transformers' logits, and converts back to the same
  tensors, none for the shared layers' indexers."""
  model = make_hf_model(vocab_size=VOCAB, num_hidden_layers=4, indexer_types=TYPES)
  src = str(tmp_path / "hf")
  model.save_pretrained(src)
  config = run_config(hf.load_config(src))
  stream.hf_to_orbax(src, str(tmp_path / "orbax"), config)
  run = restore_run(config, str(tmp_path / "orbax"))
  assert run.model_cfg.indexer_types == tuple(TYPES)
  wk = run.state.params["moe_layers"]["self_attn"]["indexer"]["wk"][...]  # MoE layers 1, 2, 3: shared, full, shared
  assert bool(jnp.all(wk[0] == 0)) and bool(jnp.all(wk[2] == 0)) and not bool(jnp.all(wk[1] == 0))
  ours = nnx.merge(run.graphdef, run.state.params, run.state.rest)
  ids = token_ids(5, 2, 24, VOCAB)
  assert max_diff(ours(jnp.asarray(ids), compute_mtp=False).logits, hf_logits(model, ids)) <= TOL
  stream.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"), dtype="float32")
  original, back = all_tensors(src), all_tensors(str(tmp_path / "back"))
  assert {n for n in back if not n.startswith("model.layers.4.")} == set(original)  # layer 4: MTP, initialized
  for name, value in original.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
