"""The KV-cache sampler against the full forward pass (the oracle: GlmMoeDsa.__call__ over the whole sequence)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.inference.sampling import sample_rows, sample_token, tempered_log_softmax
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model.kv_cache import cache_bytes_per_token

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]  # ragged: 5, 2 and 8 tokens


def tiny(**changes) -> ModelConfig:
  # A larger init than the default makes the logits far from uniform, so greedy argmaxes are not near-ties.
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  return cfg.replace(initializer_range=0.2, **changes)


def split(cfg):
  model = GlmMoeDsa(cfg, nnx.Rngs(0))
  return (model, *nnx.split(model, nnx.Param, ...))


def full_forward(model, out):
  """The full forward over every row's prompt + response (+ padding, which no earlier position sees): a function
  of the row giving the logits that predicted each response token and those tokens."""
  logits_all = jax.jit(lambda tokens: model(tokens, compute_mtp=False).logits)(out.tokens)

  def row(b):
    p, n = int(out.prompt_lens[b]), int(out.lengths[b])
    return logits_all[b, p - 1 : n - 1], out.tokens[b, p:n]

  return row


@pytest.mark.parametrize(
  "index_topk,impl",
  [
    pytest.param(64, "reference", marks=pytest.mark.slow),  # the longest compile of the three
    pytest.param(6, "reference", marks=pytest.mark.slow),  # a compile of the prefill and the decode loop
    pytest.param(6, "pallas", marks=pytest.mark.slow),  # the kernels in interpret mode
  ],
  ids=["dense", "dsa", "dsa-pallas"],
)
def test_cached_greedy_decoding_equals_full_forward(index_topk, impl):
  """Greedy tokens identical and logits within fp32 rounding. index_topk=6 makes DSA select during the prefill
  (the 8-token prompt) and in every decode step past position 6; 64 never does. The pallas case runs the
  kernels (interpret mode) against the cache, the oracle is the reference model."""
  cfg = tiny(index_topk=index_topk, attention_impl=impl)
  _, graphdef, params, rest = split(cfg)
  oracle = GlmMoeDsa(cfg.replace(attention_impl="reference"), nnx.Rngs(0))
  out = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=10, temperature=0.0), return_logits=True)(
    params, rest, PROMPTS, jax.random.key(0)
  )
  np.testing.assert_array_equal(out.prompt_lens, [5, 2, 8])
  np.testing.assert_array_equal(out.lengths, [15, 12, 18])  # no stop ids: every row runs max_new_tokens
  forward = full_forward(oracle, out)
  for b in range(len(PROMPTS)):
    np.testing.assert_array_equal(out.tokens[b, : len(PROMPTS[b])], PROMPTS[b])
    logits, response = forward(b)
    np.testing.assert_array_equal(np.argmax(logits, -1), response)
    p, n = len(PROMPTS[b]), int(out.lengths[b])
    np.testing.assert_allclose(out.logits[b, p:n], logits, atol=5e-5, rtol=1e-5)
    np.testing.assert_allclose(out.logp[b, p:n], jax.nn.log_softmax(logits)[jnp.arange(n - p), response], atol=5e-5)
    assert out.response_mask[b].sum() == n - p and out.response_mask[b, p:n].all()
    assert (out.tokens[b, n:] == 0).all()


@pytest.mark.slow  # a generation with top-p compiled, and the full forward
def test_sampling_log_probs_temperature_and_top_p():
  """Sampled tokens: logp = log_softmax(full logits / T)[token]; with top_p every token lies in the nucleus
  computed here from the full forward's logits."""
  cfg = tiny(index_topk=6)
  model, graphdef, params, rest = split(cfg)
  temperature, top_p = 0.7, 0.6
  sampler = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=8, temperature=temperature, top_p=top_p), width=8)
  out = sampler(params, rest, PROMPTS * 2, jax.random.key(3))
  forward = full_forward(model, out)
  for b in range(len(PROMPTS) * 2):
    logits, response = forward(b)
    logp_all = np.asarray(jax.nn.log_softmax(logits / temperature), np.float64)
    p, n = int(out.prompt_lens[b]), int(out.lengths[b])
    np.testing.assert_allclose(out.logp[b, p:n], logp_all[np.arange(n - p), response], atol=5e-5)
    for t, tok in enumerate(np.asarray(response)):
      order = np.argsort(-logp_all[t])
      mass_before = np.cumsum(np.exp(logp_all[t][order])) - np.exp(logp_all[t][order])
      nucleus = set(order[mass_before < top_p].tolist())
      assert tok in nucleus, (b, t, tok, sorted(nucleus))
  # Prompts of other lengths (same batch size, fixed width 8) reuse the one compiled generation: no trace per
  # token, none per prompt length.
  sampler(params, rest, [[1, 2, 3]] * 3 + [[1, 2, 3, 4, 5, 6]] * 3, jax.random.key(4))
  (jitted,) = sampler._jitted.values()
  assert jitted._cache_size() == 1


@pytest.mark.parametrize("temperature", [1e-9, 1e-30])
def test_a_tiny_temperature_draws_the_greedy_token_with_log_probability_zero(temperature):
  """jit(log_softmax(logits / T)) is not finite for T <= 1e-9 on XLA:CPU, and the sampler used to return token 0
  with a log-probability of +-inf. Every draw is now the argmax, with probability one; below 1e-30 (where fp32's
  subnormals flush to zero) SamplingParams refuses the temperature by name."""
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((64, 50)) * 5, jnp.float32)
  old = jax.jit(lambda x: jax.nn.log_softmax(x / temperature, axis=-1))(logits)
  assert not np.all(np.isfinite(np.asarray(old)))
  for top_p in (1.0, 0.5):
    tok, logp = sample_token(logits, jax.random.key(1), temperature, top_p)
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(logp), 0.0)
  with pytest.raises(ValueError, match=r"temperature=1e-42; must be 0 \(greedy\) or at least 1e-30"):
    SamplingParams(max_new_tokens=4, temperature=1e-42)


@pytest.mark.parametrize(
  "rows",
  [
    [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)],  # every row greedy: no draw, no nucleus
    [(0.0, 0.3), (0.0, 0.9), (0.0, 1.0)],  # greedy rows that name a top_p: still no nucleus
    [(0.8, 1.0), (1.0, 1.0), (0.0, 0.5)],  # draws, no nucleus
    [(0.7, 0.5), (0.0, 1.0), (1.3, 0.9), (1.0, 1.0)],  # draws, some from a nucleus
  ],
)
def test_sample_rows_is_sample_token_row_by_row(rows):
  """The serving engine's per-row sampling: row b's token and log-probability are sample_token's for that row's
  logits, key, temperature and top_p alone (whichever of its branches, draws and nucleus, the batch needs)."""
  rng = np.random.default_rng(2)
  b = len(rows)
  logits = jnp.asarray(rng.standard_normal((b, 40)) * 3, jnp.float32)
  keys = jax.random.split(jax.random.key(3), b)
  temp, top_p = (jnp.asarray(x, jnp.float32) for x in zip(*rows))
  tok, logp = jax.jit(sample_rows)(logits, keys, temp, top_p)
  for i, (t, p) in enumerate(rows):
    want_tok, want_logp = sample_token(logits[i : i + 1], keys[i], t, p)
    assert int(tok[i]) == int(want_tok[0]), (i, t, p)
    np.testing.assert_allclose(float(logp[i]), float(want_logp[0]), rtol=1e-6, atol=1e-6)


def test_tempered_log_softmax_is_the_plain_formula_where_that_is_finite():
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 30)) * 5, jnp.float32)
  for temperature in (0.05, 0.7, 1.0, 3.0):
    want = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64) / temperature, axis=-1))
    np.testing.assert_allclose(np.asarray(tempered_log_softmax(logits, temperature)), want, atol=2e-5)


@pytest.mark.slow  # a generation compiled for each of the two samplers
def test_tiny_temperature_sampling_equals_greedy_and_non_finite_logits_raise():
  """The sampler at T = 1e-30 generates greedy decoding's tokens, each with log-probability 0; with a NaN in the
  LM head it raises, naming the rows, instead of returning tokens drawn from NaN logits."""
  cfg = tiny(index_topk=6)
  _, graphdef, params, rest = split(cfg)
  run = lambda temperature, params: Sampler(
    graphdef, cfg, SamplingParams(max_new_tokens=5, temperature=temperature), width=8
  )(params, rest, PROMPTS, jax.random.key(5))
  greedy, cold = run(0.0, params), run(1e-30, params)
  np.testing.assert_array_equal(np.asarray(cold.tokens), np.asarray(greedy.tokens))
  np.testing.assert_array_equal(np.asarray(cold.logp)[np.asarray(cold.response_mask)], 0.0)
  broken = jax.tree.map(lambda x: x, params)
  broken["lm_head"] = nnx.Param(broken["lm_head"][...].at[0, 0].set(jnp.nan))
  with pytest.raises(FloatingPointError, match=r"rows \[0, 1, 2\] drew tokens with a non-finite log-probability"):
    run(1e-30, broken)


@pytest.mark.slow  # two generations compiled (~30 s on 2 cores)
def test_stop_tokens_end_rows():
  cfg = tiny(index_topk=6)
  _, graphdef, params, rest = split(cfg)
  greedy = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=6, temperature=0.0))(
    params, rest, PROMPTS, jax.random.key(0)
  )
  stop = int(greedy.tokens[1, 2 + 1])  # row 1's second generated token
  out = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=6, temperature=0.0, stop_ids=(stop,), pad_id=0))(
    params, rest, PROMPTS, jax.random.key(0)
  )
  for b in range(3):
    p = len(PROMPTS[b])
    gen = np.asarray(greedy.tokens[b, p : p + 6]).tolist()
    n_resp = gen.index(stop) + 1 if stop in gen else 6  # up to and including the first stop token
    assert int(out.lengths[b]) == p + n_resp
    assert bool(out.finished[b]) == (stop in gen)
    np.testing.assert_array_equal(out.tokens[b, p : p + n_resp], gen[:n_resp])
    assert (out.tokens[b, p + n_resp :] == 0).all() and not out.response_mask[b, p + n_resp :].any()
    np.testing.assert_array_equal(out.logp[b, p + n_resp :], 0.0)
  assert int(out.lengths[1]) == 2 + 2 and bool(out.finished[1])


def test_cache_layout():
  """The cache holds kv_lora_rank + qk_rope_head_dim numbers a token and layer (576 for GLM-5) plus the
  indexer key (128): 78 layers x 704 x 2 bytes in bf16."""
  cfg = tiny(index_topk=6)
  model, *_ = split(cfg)
  _, cache = model.prefill(jnp.asarray([[5, 6, 7]]), cache_len=10)
  assert cache.dense.kv.shape == (1, 1, 10, 32 + 8) and cache.moe.kv.shape == (2, 1, 10, 32 + 8)
  assert cache.moe.index_k.shape == (2, 1, 10, 16)
  glm5 = ModelConfig()  # the released GLM-5 numbers are the defaults
  assert glm5.kv_lora_rank + glm5.qk_rope_head_dim == 576
  assert cache_bytes_per_token(glm5.replace(dtype="bfloat16")) == 78 * (576 + 128) * 2
  assert cache_bytes_per_token(cfg.replace(use_dsa=False)) == 3 * 40 * 4


def test_bad_prompts():
  cfg = tiny()
  _, graphdef, params, rest = split(cfg)
  sampler = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=4), cache_len=8)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r"plus max_new_tokens=4 needs 9 cache slots; the cache has cache_len=8"):
    sampler(params, rest, [[1, 2, 3, 4, 5]], key)
  with pytest.raises(ValueError, match=r"prompts\[1\]: token id 512 is outside the vocabulary \[0, 512\)"):
    sampler(params, rest, [[1], [2, 512]], key)
  with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
    sampler(params, rest, [[]], key)
  with pytest.raises(ValueError, match="exceeds model.max_position_embeddings=2048"):
    Sampler(graphdef, cfg, SamplingParams(max_new_tokens=4), cache_len=4096)(params, rest, [[1]], key)
  for bad, field in (
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature=-1.0"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p=0.0"),
  ):
    with pytest.raises(ValueError, match=field):
      SamplingParams(**bad)
