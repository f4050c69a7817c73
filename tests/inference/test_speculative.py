"""MTP speculative decoding (glm_jax/inference/speculative.py) against plain decoding and against the main model.

- The acceptance rule: an exact computation shows that keeping a draft d ~ q with probability min(1, p(d)/q(d)) and
  otherwise drawing from `residual(p, q)` gives p, for vectors with the awkward cases (q = 0 where p > 0, p = q);
  the rule as implemented (`accept`) draws p's distribution over 200,000 rows, with temperature and top-p.
- The multi-token verification (GlmMoeDsa.decode_tokens): T tokens a row at ragged slots give the full forward's
  logits, with DSA selecting, on the reference path and the kernels (interpret mode).
- The sampler: greedy speculative decoding is plain greedy decoding token for token (k = 1, 2, 4, ragged prompts,
  a stop token, DSA selecting) on a model trained for a few steps, so drafts are both kept and rejected; sampling,
  on an 8-token vocabulary, draws each of the round's tokens from the main model's distribution (computed exactly by
  enumerating the full forward), with the main model's log-probabilities.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams, acceptance_length
from glm_jax.inference.speculative import accept, accept_rows, residual
from glm_jax.model import GlmMoeDsa, ModelConfig

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]  # ragged: 5, 2 and 8 tokens


def tiny(**changes) -> ModelConfig:
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  return cfg.replace(index_topk=6, **changes)  # DSA selects past 6 keys


def nucleus(logits, temperature, top_p):
  """The distribution a token is drawn from, in float64 numpy: softmax(logits / T) cut to the smallest set of tokens
  whose mass reaches top_p (the better tokens first), renormalized."""
  z = np.asarray(logits, np.float64) / temperature
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  order = np.argsort(-p, axis=-1)
  sorted_p = np.take_along_axis(p, order, -1)
  inside = np.zeros_like(p, bool)
  np.put_along_axis(inside, order, (np.cumsum(sorted_p, -1) - sorted_p) < top_p, -1)
  p = np.where(inside, p, 0.0)
  return p / p.sum(-1, keepdims=True)


def test_the_residual_rule_gives_the_target_distribution_exactly():
  """P(token = v) = sum_d q(d) [a(d) [v = d] + (1 - a(d)) r(v)], a(d) = min(1, p(d)/q(d)), r = residual(p, q):
  equal to p(v), computed exactly (no sampling) for random pairs and the edge cases."""
  rng = np.random.default_rng(0)
  pairs = [rng.dirichlet(np.ones(6), 2) for _ in range(20)]
  pairs += [
    np.array([[0.5, 0.3, 0.2, 0, 0, 0], [0, 0.5, 0.5, 0, 0, 0]]),  # q has no mass where p has most
    np.array([[0.2, 0.2, 0.6, 0, 0, 0], [0.2, 0.2, 0.6, 0, 0, 0]]),
  ]  # p = q: nothing is rejected
  for p, q in pairs:
    r = np.asarray(residual(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)), np.float64)
    np.testing.assert_allclose(r.sum(), 1.0, atol=1e-6)
    keep = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 0.0)
    rejected = np.sum(q * (1 - keep))
    np.testing.assert_allclose(q * keep + rejected * r, p, atol=1e-6)
  # By hand: p - q = [0.3, -0.2, -0.1] keeps only token 0.
  np.testing.assert_allclose(residual(jnp.asarray([0.5, 0.3, 0.2]), jnp.asarray([0.2, 0.5, 0.3])), [1, 0, 0])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_accept_draws_the_main_models_distribution(temperature, top_p):
  """`accept` over 200,000 rows of one round (k = 2, fixed p_0, p_1, p_2 and drafts drawn from q_1, q_2): the first
  token (d_1 if kept, else the residual's draw) follows p_0; given d_1 kept, the second follows p_1; the rate d_1
  is kept is sum_v min(p_0(v), q_1(v)). p and q are taken after temperature and top-p (computed here in numpy)."""
  rng = np.random.default_rng(1)
  v, n, k = 6, 200_000, 2
  p_logits = rng.standard_normal((k + 1, v)) * 1.5
  q_logits = rng.standard_normal((k, v)) * 1.5
  p, q = nucleus(p_logits, temperature, top_p), nucleus(q_logits, temperature, top_p)
  kd, ka = jax.random.split(jax.random.key(2))
  drafts = jnp.stack(
    [
      jax.random.categorical(key, jnp.log(jnp.asarray(q[j], jnp.float32)), shape=(n,))
      for j, key in enumerate(jax.random.split(kd, k))
    ],
    axis=1,
  ).astype(jnp.int32)
  tile = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (n, *x.shape))  # noqa: E731
  kept, nxt = jax.jit(functools.partial(accept, temperature=temperature, top_p=top_p))(
    tile(p_logits), tile(q_logits), drafts, ka
  )
  kept, nxt, drafts = np.asarray(kept), np.asarray(nxt), np.asarray(drafts)
  first = np.where(kept >= 1, drafts[:, 0], nxt)
  tol = 5 * np.sqrt(0.25 / n)  # five standard deviations of a frequency
  np.testing.assert_allclose(np.bincount(first, minlength=v) / n, p[0], atol=tol)
  np.testing.assert_allclose(np.mean(kept >= 1), np.minimum(p[0], q[0]).sum(), atol=tol)
  second = np.where(kept >= 2, drafts[:, 1], nxt)[kept >= 1]
  np.testing.assert_allclose(np.bincount(second, minlength=v) / len(second), p[1], atol=5 * np.sqrt(0.25 / len(second)))
  assert 0 < np.mean(kept == 2) < 1 and np.mean(kept == 0) > 0  # every branch of the rule ran


@pytest.mark.slow  # a prefill, a 3-token verification and the full forward compiled (~15 s)
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_verifying_several_tokens_gives_the_full_forwards_logits(impl):
  """decode_tokens: 3 tokens a row at slots len_b.. after a ragged prefill (DSA selecting: index_topk 6 < the
  keys) equal the full forward over prompt + those tokens at the same positions; the hidden states are the full
  forward's last-layer states (what the MTP layer reads)."""
  cfg = tiny(initializer_range=0.2, attention_impl=impl)
  model = GlmMoeDsa(cfg, nnx.Rngs(0))
  oracle = GlmMoeDsa(cfg.replace(attention_impl="reference"), nnx.Rngs(0))
  lens = np.asarray([len(p) for p in PROMPTS])
  prompts = np.zeros((3, 8), np.int32)
  for b, p in enumerate(PROMPTS):
    prompts[b, : len(p)] = p
  new = np.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)

  @jax.jit
  def run(prompts, lens, new):
    _, cache = model.prefill(prompts, 12)
    logits, h, _ = model.decode_tokens(new, lens, cache)
    return logits, h

  logits, h = run(jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(new))
  # The oracle: the full forward over each prompt + its 3 tokens, right-padded to one width (causal: the padding
  # changes nothing before it); its normed last-layer states and their logits.
  full = np.zeros((3, 11), np.int32)
  for b, p in enumerate(PROMPTS):
    full[b, : len(p) + 3] = p + new[b].tolist()
  hidden = jax.jit(lambda x: oracle(x, compute_mtp=False, return_hidden=True).hidden)(jnp.asarray(full))
  want_logits = jax.jit(oracle.head)(hidden)
  for b, p in enumerate(PROMPTS):
    n = len(p)
    np.testing.assert_allclose(logits[b], want_logits[b, n : n + 3], atol=5e-5, rtol=1e-5)
    # The hidden states before the final norm: their norm is the full forward's normed state.
    np.testing.assert_allclose(jax.jit(model.norm)(h)[b], hidden[b, n : n + 3], atol=5e-5, rtol=1e-5)


def train_on_a_cycle(cfg, steps: int, seed: int = 0):
  """The tiny model fitted for `steps` Adam steps to sequences that follow a fixed permutation of the vocabulary
  (with 10% noise), main and MTP heads both: a model whose MTP drafts are often, not always, right."""
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(seed)), nnx.Param, ...)
  rng = np.random.default_rng(seed)
  perm = rng.permutation(cfg.vocab_size)

  def batch():
    x = np.zeros((8, 32), np.int32)
    x[:, 0] = rng.integers(0, cfg.vocab_size, 8)
    for i in range(1, 32):
      x[:, i] = perm[x[:, i - 1]]
    return jnp.asarray(np.where(rng.random(x.shape) < 0.1, rng.integers(0, cfg.vocab_size, x.shape), x))

  def loss(params, x):
    out = nnx.merge(graphdef, params, rest)(x)
    ce = optax.softmax_cross_entropy_with_integer_labels
    return ce(out.logits[:, :-1], x[:, 1:]).mean() + ce(out.mtp_logits[0][:, :-2], x[:, 2:]).mean()

  opt = optax.adam(1e-2)

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(loss)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for _ in range(steps):
    params, state = step(params, state, batch())
  return graphdef, params, rest


@pytest.mark.slow  # a few training steps and seven generations compiled
def test_speculative_greedy_decoding_is_plain_greedy_decoding():
  cfg = tiny(vocab_size=16)
  graphdef, params, rest = train_on_a_cycle(cfg, steps=25)

  def same(sampling, ks, plain=None):
    if plain is None:
      plain = Sampler(graphdef, cfg, sampling, return_logits=True)(params, rest, PROMPTS, jax.random.key(0))
    lengths = {}
    for k in ks:
      out = Sampler(graphdef, cfg, sampling, return_logits=True, speculate=k)(params, rest, PROMPTS, jax.random.key(0))
      for name in ("tokens", "response_mask", "lengths", "finished", "prompt_lens"):
        np.testing.assert_array_equal(
          np.asarray(getattr(out, name)), np.asarray(getattr(plain, name)), err_msg=f"{name}, k={k}"
        )
      mask = np.asarray(plain.response_mask)
      np.testing.assert_allclose(np.asarray(out.logp)[mask], np.asarray(plain.logp)[mask], atol=1e-5)
      np.testing.assert_allclose(np.asarray(out.logits)[mask], np.asarray(plain.logits)[mask], atol=1e-4, rtol=1e-5)
      lengths[k] = acceptance_length(out)
    return plain, lengths

  plain, lengths = same(SamplingParams(max_new_tokens=20, temperature=0.0), (1, 2, 4))
  # Drafts were kept (a length above 1) and rejected (below k + 1), and deeper drafts kept more tokens a round.
  assert 1.2 < lengths[1] < 2 and lengths[1] < lengths[2] < lengths[4] < 5, lengths
  # A stop token ends rows inside a round: row 1's sixth token, which the other rows reach at other rounds.
  stop = int(plain.tokens[1, 2 + 5])
  # Plain greedy decoding with the stop token, computed here from the run without it (greedy decoding is
  # deterministic: each row is the same up to its first stop token, which it keeps, then padding), not compiled again.
  sampling = SamplingParams(max_new_tokens=20, temperature=0.0, stop_ids=(stop,))
  tokens, mask = np.asarray(plain.tokens), np.asarray(plain.response_mask)
  hits = mask & (tokens == stop)
  finished = hits.any(1)
  lengths = np.where(finished, hits.argmax(1) + 1, np.asarray(plain.lengths))
  keep = np.arange(tokens.shape[1])[None] < lengths[:, None]
  mask = mask & keep
  cut = dataclasses.replace(
    plain,
    tokens=jnp.asarray(np.where(keep, tokens, sampling.pad_id)),
    response_mask=jnp.asarray(mask),
    lengths=jnp.asarray(lengths, np.asarray(plain.lengths).dtype),
    finished=jnp.asarray(finished),
    logp=jnp.where(mask, plain.logp, 0.0),
    logits=jnp.where(mask[..., None], plain.logits, 0.0),
  )
  with_stop, _ = same(sampling, (4,), plain=cut)  # the deepest drafts (k = 2 runs the same stop logic)
  assert np.asarray(with_stop.finished).all() and int(with_stop.lengths[1]) == 2 + 6


def test_accept_rows_is_accept_row_by_row():
  """accept_rows (the serving engine's: each row its own temperature, top_p and key) gives each row what `accept`
  (tested above against the target distribution) gives that row alone with its key, greedy rows included."""
  rng = np.random.default_rng(3)
  rows, k, v = 64, 3, 7
  p_logits = jnp.asarray(rng.standard_normal((rows, k + 1, v)) * 2, jnp.float32)
  q_logits = jnp.asarray(rng.standard_normal((rows, k, v)) * 2, jnp.float32)
  drafts = jnp.asarray(rng.integers(0, v, (rows, k)), jnp.int32)
  temps = np.tile([0.0, 1.0, 0.7, 1.3], rows // 4).astype(np.float32)
  top_ps = np.tile([1.0, 1.0, 0.9, 0.8], rows // 4).astype(np.float32)
  keys = jax.random.split(jax.random.key(4), rows)
  kept, nxt = jax.jit(accept_rows)(p_logits, q_logits, drafts, keys, jnp.asarray(temps), jnp.asarray(top_ps))
  for b in range(rows):
    want = accept(
      p_logits[b : b + 1], q_logits[b : b + 1], drafts[b : b + 1], keys[b], float(temps[b]), float(top_ps[b])
    )
    assert (int(kept[b]), int(nxt[b])) == (int(want[0][0]), int(want[1][0])), b
  assert len(set(np.asarray(kept).tolist())) > 1  # kept counts differ between rows: several branches ran


@pytest.mark.slow  # the full forward over every continuation and a 2,048-row generation
def test_speculative_sampling_draws_from_the_main_model():
  """One prompt, 2,048 rows, temperature 0.8, k = 2, three new tokens: x_1 from the prefill, x_2 and x_3 from the
  first round (drafts kept or the residual's draw) or x_3 from the second. Their frequencies match the main model's
  marginals, computed exactly over all 8 x 8 continuations of the full forward; every token's log-probability is
  the full forward's tempered one."""
  cfg = tiny(vocab_size=8)
  graphdef, params, rest = train_on_a_cycle(cfg, steps=10, seed=1)
  model = nnx.merge(graphdef, params, rest)
  temperature, rows, prompt = 0.8, 2048, [3, 1, 4, 1, 5, 2, 6]
  out = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=3, temperature=temperature), speculate=2)(
    params, rest, [prompt] * rows, jax.random.key(7)
  )
  gen = np.asarray(out.tokens)[:, 7:10]
  assert (np.asarray(out.lengths) == 10).all()
  # Exact: P(x1, x2, x3) = p(x1) p(x2 | x1) p(x3 | x1, x2), from the full forward over all 64 (x1, x2) prefixes.
  v = cfg.vocab_size
  x1, x2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
  seqs = np.concatenate([np.tile(prompt, (v * v, 1)), x1.reshape(-1, 1), x2.reshape(-1, 1)], axis=1)
  logits = np.asarray(jax.jit(lambda s: model(s, compute_mtp=False).logits)(jnp.asarray(seqs)), np.float64)
  probs = nucleus(logits, temperature, 1.0)  # [64, 9, V]
  p1 = probs[0, 6]
  p2 = probs[::v, 7]  # [x1, V]: p(x2 | x1), from the rows with x2 = 0 (position 7 reads only x1)
  p3 = probs[:, 8].reshape(v, v, v)  # [x1, x2, V]
  want = [p1, p1 @ p2, np.einsum("a,ab,abc->c", p1, p2, p3)]
  tol = 5 * np.sqrt(0.25 / rows)
  for i in range(3):
    np.testing.assert_allclose(np.bincount(gen[:, i], minlength=v) / rows, want[i], atol=tol, err_msg=f"x{i + 1}")
  # The pairs (x1, x2) too: 64 cells.
  joint = np.bincount(gen[:, 0] * v + gen[:, 1], minlength=v * v) / rows
  np.testing.assert_allclose(joint, (p1[:, None] * p2).reshape(-1), atol=tol)
  # Log-probabilities: the main model's, log_softmax(logits / T) of the drawn token.
  logp_all = np.log(probs)
  idx = gen[:, 0] * v + gen[:, 1]
  want_logp = np.stack([logp_all[0, 6][gen[:, 0]], logp_all[idx, 7, gen[:, 1]], logp_all[idx, 8, gen[:, 2]]], 1)
  np.testing.assert_allclose(np.asarray(out.logp)[:, 7:10], want_logp, atol=2e-4)
  assert 1 < acceptance_length(out) < 3


def test_bad_speculation_is_refused_by_name():
  cfg = tiny()
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
  greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
  for k in (-1, 1.5, True):
    with pytest.raises(ValueError, match=rf"speculate={k!r}: the drafted tokens a round must be an integer >= 1"):
      Sampler(graphdef, cfg, greedy, speculate=k)
  no_mtp = cfg.replace(num_nextn_predict_layers=0)
  with pytest.raises(ValueError, match="drafts with the MTP layer, but model.num_nextn_predict_layers=0"):
    Sampler(graphdef, no_mtp, greedy, speculate=2)
  with pytest.raises(ValueError, match="model.num_nextn_predict_layers=0"):
    GlmMoeDsa(no_mtp, nnx.Rngs(0)).prefill(jnp.ones((1, 3), jnp.int32), 8, draft=True)
  with pytest.raises(
    ValueError,
    match=r"cache_len=2046 \+ speculate=4 draft slots exceeds "
    r"model.max_position_embeddings=2048",
  ):
    Sampler(graphdef, cfg, greedy, cache_len=2046, speculate=4)(params, rest, [[1, 2]], jax.random.key(0))
  with pytest.raises(ValueError, match="speculative decoding takes plain prompts"):
    Sampler(graphdef, cfg, greedy, speculate=2)(params, rest, [[1, 2]], jax.random.key(0), prefix_lens=[1])
