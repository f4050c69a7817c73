"""GLM's blank infilling through the KV-cache sampler: cached greedy generation after [gMASK] and into a [MASK]
equals the full forward's greedy tokens (the oracle: GlmMoeDsa.__call__ over the whole GLM layout, the context
attended both ways), with DSA selecting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.inference import Sampler, SamplingParams
from glm_jax.inference.infill import blank_positions, fill_blanks, infill_prompt
from glm_jax.model import GlmMoeDsa
from tests.inference.test_sampler import tiny

SPECIAL = {"pad": 0, "eos": 1, "mask": 2, "gmask": 3, "sop": 4, "eop": 5, "smask": 6}


def test_infill_prompt_layout_by_hand():
  """Context a [MASK] b [MASK] c, the first blank filled with x y: the second blank's prompt."""
  context = [10, 2, 11, 2, 12]
  tokens, positions, blocks, prefix = infill_prompt(context, [[20, 21]], SPECIAL)
  assert tokens == [10, 2, 11, 2, 12, 4, 20, 21, 4]
  assert positions == [0, 1, 2, 3, 4, 1, 1, 1, 3]
  assert blocks == [0, 0, 0, 0, 0, 1, 2, 3, 1]
  assert prefix == 5
  assert blank_positions(context + [3], SPECIAL) == [1, 3, 5]
  with pytest.raises(ValueError, match="has 2 blank"):
    infill_prompt(context, [[20], [21]], SPECIAL)


@pytest.mark.parametrize(
  "context, filled",
  [
    ([7, 8, 9, 10, 11, 12, 13, 14, 3], []),  # continue after [gMASK]
    ([7, 2, 9, 10, 11, 2, 13, 14], [[15, 16, 17]]),  # the second [MASK]
  ],
  ids=["gmask", "mask"],
)
@pytest.mark.slow  # a generation and the full forward compiled (about 5 s each)
def test_cached_infilling_equals_the_full_forward(context, filled):
  cfg = tiny(index_topk=6, rope_2d=True, num_nextn_predict_layers=0)  # DSA selects past 6 keys
  model = GlmMoeDsa(cfg, nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens, positions, blocks, prefix = infill_prompt(context, filled, SPECIAL)
  new = 8
  out = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=new, temperature=0.0), return_logits=True)(
    params, rest, [tokens], jax.random.key(0), positions=[positions], block_positions=[blocks], prefix_lens=[prefix]
  )
  p, n = len(tokens), int(out.lengths[0])
  assert n == p + new
  generated = np.asarray(out.tokens[0, p:n])
  # The oracle's layout: every generated token continues the blank (the mask's position, block positions on).
  full_pos = positions + [positions[-1]] * new
  full_blocks = blocks + list(range(blocks[-1] + 1, blocks[-1] + 1 + new))
  full = model(
    out.tokens[:, :n],
    positions=jnp.asarray([full_pos[:n]]),
    block_positions=jnp.asarray([full_blocks[:n]]),
    prefix_end=jnp.full((1, n), prefix, jnp.int32),
    compute_mtp=False,
  )
  logits = np.asarray(full.logits[0, p - 1 : n - 1])
  np.testing.assert_array_equal(np.argmax(logits, -1), generated)
  np.testing.assert_allclose(np.asarray(out.logits[0, p:n]), logits, atol=5e-5, rtol=1e-5)
  assert np.asarray(full.aux["topk_indices"]).shape[-1] == 6


@pytest.mark.slow  # two generations compiled
def test_fill_blanks_fills_left_to_right():
  """Each blank is what the sampler generates for infill_prompt with the blanks before it filled."""
  cfg = tiny(index_topk=64, rope_2d=True, num_nextn_predict_layers=0)
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
  sampler = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=3, temperature=0.0, stop_ids=(5,)))
  context = [7, 2, 9, 10, 2, 13]
  filled, spans = fill_blanks(sampler, params, rest, context, SPECIAL, jax.random.key(0))
  assert len(spans) == 2 and filled == [7] + spans[0] + [9, 10] + spans[1] + [13]
  for i, span in enumerate(spans):
    tokens, positions, blocks, prefix = infill_prompt(context, spans[:i], SPECIAL)
    out = sampler(
      params, rest, [tokens], jax.random.key(1), positions=[positions], block_positions=[blocks], prefix_lens=[prefix]
    )
    want = [int(t) for t in out.tokens[0, len(tokens) : int(out.lengths[0])]]
    assert span == [t for t in want if t != 5]
  with pytest.raises(ValueError, match="no \\[MASK\\], \\[sMASK\\] or \\[gMASK\\]"):
    fill_blanks(sampler, params, rest, [7, 8], SPECIAL, jax.random.key(0))


def test_sample_py_encodes_the_literal_blanks_as_special_tokens():
  """launch/sample.py --infill: "[MASK]", "[sMASK]", "[gMASK]" in the prompt become the special tokens (text
  elsewhere stays text); a prompt without one gets [gMASK] appended."""
  import tokenizers

  from glm_jax.data import SPECIAL_TOKENS, Tokenizer
  from glm_jax.launch.sample import encode_with_blanks

  words = ["a", "b", "c"]
  vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + words)}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok = Tokenizer(backend, "words")
  a, b, c = (vocab[w] for w in words)
  assert encode_with_blanks(tok, "a [MASK] b [sMASK] c") == [a, tok.mask_id, b, tok.smask_id, c]
  assert encode_with_blanks(tok, "a b [gMASK]") == [a, b, tok.gmask_id]
  assert encode_with_blanks(tok, "a b") == [a, b, tok.gmask_id]
