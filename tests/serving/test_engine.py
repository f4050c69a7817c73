"""The serving engine against the Sampler (each prompt alone, a contiguous cache) and the full forward pass."""

import jax
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.serving import Engine, EngineConfig

WIDTH, CACHE = 48, 96  # the Sampler's prompt width and cache: one compile for every prompt here
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
  # index_topk 8: DSA selects in prefill chunks and decode steps; a larger init keeps greedy argmaxes off near-ties.
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict()).replace(
    initializer_range=0.2, index_topk=8
  )
  model = GlmMoeDsa(cfg, nnx.Rngs(0))
  return cfg, model, nnx.split(model, nnx.Param, ...)


def engine(tiny, **changes) -> Engine:
  cfg, _, (graphdef, params, rest) = tiny
  config = dict(num_pages=64, page_size=8, max_running=8, prefill_chunk=16, max_seq_len=CACHE) | changes
  return Engine(graphdef, params, rest, cfg, EngineConfig(**config))


_samplers = {}


def sampler_alone(tiny, prompt, sampling=GREEDY, params=None):
  """The Sampler's response to the prompt alone: (tokens, log-probabilities)."""
  cfg, _, (graphdef, p, rest) = tiny
  if sampling not in _samplers:  # one Sampler (one compiled generation) for every prompt
    _samplers[sampling] = Sampler(graphdef, cfg, sampling, width=WIDTH, cache_len=CACHE)
  out = _samplers[sampling](p if params is None else params, rest, [prompt], jax.random.key(0))
  n = int(out.lengths[0])
  return np.asarray(out.tokens[0, len(prompt) : n]).tolist(), np.asarray(out.logp[0, len(prompt) : n])


def run(eng, arrivals):
  """Adds arrivals[step] (a list of (name, prompt, sampling)) before each step until all are done: {name: tokens},
  {name: log-probabilities}, {name: finish reason}, and the most requests that ran in one step."""
  ids, tokens, logps, reasons, busiest, step = {}, {}, {}, {}, 0, 0
  while step < len(arrivals) or eng.has_work():
    for name, prompt, sampling in arrivals[step] if step < len(arrivals) else []:
      ids[eng.add(prompt, sampling)] = name
    events = eng.step()
    busiest = max(busiest, eng.num_running + sum(1 for e in events if e.finish_reason))
    for ev in events:
      name = ids[ev.rid]
      if ev.token is not None:
        tokens.setdefault(name, []).append(ev.token)
        logps.setdefault(name, []).append(ev.logp)
      if ev.finish_reason:
        reasons[name] = ev.finish_reason
    step += 1
  return tokens, logps, reasons, busiest


@pytest.mark.parametrize("decode_steps", [pytest.param(1, marks=pytest.mark.slow), 3])  # 1: a compile more
def test_concurrent_requests_equal_the_sampler_alone(tiny, decode_steps):
  """16 requests of 3-40 prompt tokens and 4-10 new ones, two arriving a step, into 8 rows (mixing chunked
  prefill and decode; decoding a step at a time, or 3 steps a call, where requests end inside a call): each
  request's greedy tokens are the Sampler's for its prompt alone, log-probabilities within fp32 rounding, and the
  pages all come back."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 512, size=int(n)).tolist() for n in rng.integers(3, 41, size=16)]
  news = rng.integers(4, 11, size=16)
  arrivals = [[] for _ in range(8)]
  for i, (p, n) in enumerate(zip(prompts, news)):
    arrivals[i // 2].append((i, p, SamplingParams(max_new_tokens=int(n), temperature=0.0)))
  eng = engine(tiny, decode_steps=decode_steps)
  tokens, logps, reasons, busiest = run(eng, arrivals)
  assert busiest == 8  # continuous batching filled every row
  for i, (p, n) in enumerate(zip(prompts, news.tolist())):
    want, want_logp = sampler_alone(tiny, p)  # 10 tokens: greedy, its first n are the n-token response
    assert tokens[i] == want[:n], i
    np.testing.assert_allclose(logps[i], want_logp[:n], atol=5e-5)
    assert reasons[i] == "length"
  assert eng.stats["prefill_tokens"] == sum(len(p) for p in prompts)
  assert eng.stats["decode_tokens"] == sum(int(n) - 1 for n in news)
  assert eng.used_pages == 0 and eng.free_pages == 63


def test_shared_prefix_is_prefilled_once(tiny):
  """A GRPO group (4 copies of a 27-token prompt, added at once) prefills the prompt once: 27 tokens, then the last
  3 of each copy (24 = 3 whole pages of 8 shared). A second turn (the first turn's prompt, response and 5 new
  tokens) maps the pages of the whole first turn and prefills only the rest. Every response is the Sampler's."""
  rng = np.random.default_rng(1)
  prompt = rng.integers(1, 512, size=27).tolist()
  eng = engine(tiny)
  tokens, _, _, _ = run(eng, [[(g, prompt, GREEDY) for g in range(4)]])
  want, _ = sampler_alone(tiny, prompt)
  assert all(tokens[g] == want for g in range(4))
  assert eng.stats["prefill_tokens"] == 27 + 3 * 3
  assert eng.stats["prefix_cached_tokens"] == 3 * 24

  turn2 = prompt + want + rng.integers(1, 512, size=5).tolist()  # 27 + 10 + 5 = 42 tokens
  before = eng.stats["prefill_tokens"]
  tokens, _, _, _ = run(eng, [[("turn2", turn2, GREEDY)]])
  assert tokens["turn2"] == sampler_alone(tiny, turn2)[0]
  # The first turn wrote 36 slots (its last token was never fed): 4 whole pages = 32 tokens are cached.
  assert eng.stats["prefill_tokens"] - before == 42 - 32


@pytest.mark.slow  # six requests one at a time, about 4 s
def test_a_full_pool_queues_requests(tiny):
  """A pool of 9 usable pages and requests of 30 + 10 tokens (39 slots written: 5 pages each) run one at a time:
  six added at once all finish, each the Sampler's response."""
  rng = np.random.default_rng(2)
  prompts = [rng.integers(1, 512, size=30).tolist() for _ in range(6)]
  eng = engine(tiny, num_pages=10)
  tokens, _, reasons, busiest = run(eng, [[(i, p, GREEDY) for i, p in enumerate(prompts)]])
  assert busiest == 1 and len(reasons) == 6
  for i, p in enumerate(prompts):
    assert tokens[i] == sampler_alone(tiny, p)[0]


def test_abort_frees_pages(tiny):
  eng = engine(tiny, decode_steps=1)  # a token a step: both requests still run after 4 steps
  rng = np.random.default_rng(3)
  running = eng.add(rng.integers(1, 512, size=20).tolist(), SamplingParams(max_new_tokens=40, temperature=0.0))
  other = eng.add(rng.integers(1, 512, size=20).tolist(), GREEDY)
  for _ in range(4):
    eng.step()
  assert eng.free_pages == 63 - 8 - 4  # 20 + 40 - 1 slots = 8 pages, 20 + 10 - 1 = 4 pages
  waiting = eng.add([1, 2, 3], GREEDY)
  assert eng.abort(running) and eng.abort(waiting)
  events = eng.step()
  assert {(e.rid, e.finish_reason) for e in events if e.finish_reason == "abort"} == {
    (running, "abort"),
    (waiting, "abort"),
  }
  assert eng.free_pages == 63 - 4 and eng.num_running == 1
  assert not eng.abort(running)
  while eng.has_work():
    eng.step()
  assert eng.free_pages == 63 and other not in eng._by_id


def test_sampled_requests_do_not_depend_on_their_batch(tiny):
  """A request drawn at temperature 0.8 / top_p 0.9 with seed 7 gives the same tokens alone and among 5 others
  (log-probabilities within fp32 rounding), and each token's log-probability is log_softmax(logits / 0.8) of the
  full forward over its prefix."""
  cfg, model, _ = tiny
  rng = np.random.default_rng(4)
  prompt = rng.integers(1, 512, size=13).tolist()
  sampling = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9)

  def draw(others):
    eng = engine(tiny)
    for o in others:
      eng.add(o, SamplingParams(max_new_tokens=6, temperature=1.0), seed=1)
    rid = eng.add(prompt, sampling, seed=7)
    out = []
    while eng.has_work():
      out += [(e.token, e.logp) for e in eng.step() if e.rid == rid and e.token is not None]
    return out

  alone = draw([])
  batched = draw([rng.integers(1, 512, size=int(n)).tolist() for n in (5, 30, 2, 17, 9)])
  assert [t for t, _ in batched] == [t for t, _ in alone]
  np.testing.assert_allclose([lp for _, lp in batched], [lp for _, lp in alone], atol=1e-5)  # the MoE's row
  # grouping differs with the batch: the same products, summed in another order
  seq = np.asarray(prompt + [t for t, _ in alone])[None]
  logits = model(seq, compute_mtp=False).logits[0, len(prompt) - 1 : -1]
  want = jax.nn.log_softmax(logits / 0.8)[np.arange(10), seq[0, len(prompt) :]]
  np.testing.assert_allclose([lp for _, lp in alone], want, atol=5e-5)


def test_update_weights_drops_the_prefix_cache(tiny):
  cfg, _, (graphdef, params, rest) = tiny
  prompt = list(range(1, 30))
  eng = engine(tiny)
  run(eng, [[("a", prompt, GREEDY)]])
  new = jax.tree.map(lambda x: x * 1.1, params)
  eng.update_weights(new, rest, version=1)
  before = eng.stats["prefill_tokens"]
  tokens, _, _, _ = run(eng, [[("b", prompt, GREEDY)]])
  assert eng.stats["prefill_tokens"] - before == 29 and eng.version == 1
  assert tokens["b"] == sampler_alone(tiny, prompt, params=new)[0]


@pytest.mark.parametrize(
  "prompt,sampling,match",
  [
    ([], GREEDY, "prompt is empty"),
    ([1, 512], GREEDY, "token id 512 is outside the vocabulary"),
    (list(range(90)), GREEDY, "engine.max_seq_len=96"),
    (list(range(60)), GREEDY, "more pages than the pool has"),
  ],
)
def test_bad_requests_are_refused_by_name(tiny, prompt, sampling, match):
  eng = engine(tiny, num_pages=8)
  with pytest.raises(ValueError, match=match):
    eng.add(prompt, sampling)
  assert not eng.has_work()


@pytest.mark.parametrize(
  "changes,match",
  [
    (dict(page_size=0), "engine.page_size=0"),
    (dict(num_pages=1), "engine.num_pages=1"),
    (dict(max_seq_len=4096), "model.max_position_embeddings=2048"),
  ],
)
def test_bad_engine_configs_are_refused_by_name(tiny, changes, match):
  with pytest.raises(ValueError, match=match):
    engine(tiny, **changes)


@pytest.mark.slow  # a few training steps, and the engine's speculative round compiled
def test_speculative_decoding_is_plain_decoding():
  """engine.speculate=2 on a model whose MTP drafts are often, not always, right (tests/inference/
  test_speculative.py's train_on_a_cycle): 8 greedy requests of ragged prompts, arriving at different steps, give the
  Sampler's plain greedy tokens and log-probabilities, in as many rounds as the Sampler's speculative decoding of each
  prompt alone takes (within 5%: the same drafts, up to rounding). A request sampled at
  temperature 0.8 gets each token's log-probability under the main model (the full forward over its prefix)."""
  from tests.inference.test_speculative import train_on_a_cycle

  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict()).replace(
    index_topk=6, vocab_size=16
  )
  graphdef, params, rest = train_on_a_cycle(cfg, steps=10)  # drafts often right, not always
  rng = np.random.default_rng(5)
  # A 1-token prompt, and three copies of a 9-token one: the 2nd and 3rd find its first page (8 tokens) cached and
  # have one token left to feed, which must still give their drafts a hidden state to start from.
  prompts = [rng.integers(0, 16, size=int(n)).tolist() for n in (5, 1, 8, 12, 9, 7)]
  prompts += [prompts[4]] * 2
  greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
  config = EngineConfig(num_pages=64, page_size=8, max_running=4, prefill_chunk=8, max_seq_len=48, speculate=2)
  eng = Engine(graphdef, params, rest, cfg, config)
  tokens, logps, reasons, _ = run(
    eng, [[(i, p, greedy)] for i, p in enumerate(prompts[:6])] + [[(6, prompts[6], greedy), (7, prompts[7], greedy)]]
  )
  plain = Sampler(graphdef, cfg, greedy, width=12, cache_len=32)
  drafting = Sampler(graphdef, cfg, greedy, width=12, cache_len=32, speculate=2)
  rounds = 0
  for i, p in enumerate(prompts):
    out = plain(params, rest, [p], jax.random.key(0))
    assert tokens[i] == np.asarray(out.tokens[0, len(p) : len(p) + 20]).tolist(), i
    np.testing.assert_allclose(logps[i], np.asarray(out.logp[0, len(p) : len(p) + 20]), atol=1e-5)
    rounds += int(drafting(params, rest, [p], jax.random.key(0)).rounds[0])
  # The drafts of the Sampler's speculative decoding of each prompt alone: as many rounds, within 5%. (The MTP layer's
  # prompt entries are made a chunk at a time here and in one forward there; the rounding can flip a near-tie draft.
  # What the requests emit is checked exactly above.)
  assert abs(eng.stats["spec_rounds"] - rounds) <= 0.05 * rounds and reasons == {i: "length" for i in range(8)}
  assert 0 < eng.stats["spec_drafts_kept"] < 2 * rounds, dict(eng.stats)  # drafts were kept, and rejected
  assert eng.stats["prefix_cached_tokens"] == 2 * 8 and np.isfinite(np.asarray(eng._cache.mtp.kv)).all()

  sampled = SamplingParams(max_new_tokens=12, temperature=0.8)
  eng = Engine(graphdef, params, rest, cfg, config)
  tokens, logps, _, _ = run(eng, [[("s", prompts[2], sampled)]])
  seq = np.asarray(prompts[2] + tokens["s"])[None]
  logits = nnx.merge(graphdef, params, rest)(seq, compute_mtp=False).logits[0, len(prompts[2]) - 1 : -1]
  want = jax.nn.log_softmax(logits / 0.8)[np.arange(12), seq[0, len(prompts[2]) :]]
  np.testing.assert_allclose(logps["s"], want, atol=5e-5)
