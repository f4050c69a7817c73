"""The tokenizer: lossless round trip, reserved special ids, the cache, a user tokenizer.json, check_vocab,
and unigram_entropy against hand-computed and numpy values."""

import math

import numpy as np
import pytest
import tokenizers

from glm_jax.data import SPECIAL_TOKENS, check_vocab, load_tokenizer, sources, tokenized, unigram_entropy
from glm_jax.data import tokenizer as tokenizer_lib


def test_round_trip_on_the_whole_corpus_and_odd_strings(kjv):
  cfg, tok = kjv
  tc = tokenized.tokenize_corpus(cfg, tok)
  docs = sources.load_corpus(cfg).docs
  decoded = tok.backend.decode_batch([tc.doc(d)[:-1].tolist() for d in range(len(docs))], skip_special_tokens=False)
  assert decoded == docs
  assert all(tc.doc(d)[-1] == tok.eos_id for d in range(len(docs)))
  for s in ["", " leading space", "tabs\tand\r\nCRLF", "naïve — 日本語 😀", "[MASK] <|endoftext|> <sop>"]:
    assert tok.decode(tok.encode(s)) == s
  # Special tokens written in a document are text, not control tokens.
  assert not set(tok.encode("[MASK] [gMASK] [sMASK] <sop> <eop> <|endoftext|> <|pad|>")) & set(tok.special_ids.values())


def test_trained_bpe_reserves_the_special_tokens(kjv):
  _, tok = kjv
  assert tok.vocab_size == 512
  assert list(tok.special_ids.values()) == [0, 1, 2, 3, 4, 5, 6]  # pad, eos, mask, gmask, sop, eop, smask
  assert [tok.backend.id_to_token(i) for i in range(7)] == list(SPECIAL_TOKENS)
  assert tok.decode([tok.gmask_id, tok.sop_id]) == "[gMASK]<sop>"


def test_trained_tokenizer_is_cached_by_corpus_and_vocab(make_cfg, write_jsonl, monkeypatch, tmp_path):
  words = "the quick brown fox jumps over the lazy dog and runs far away".split()
  docs = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
  cfg = make_cfg(source="jsonl", path=write_jsonl(docs), bpe_vocab_size=300)
  first = load_tokenizer(cfg)
  cached = list((tmp_path / "cache" / "tokenizers").iterdir())
  assert len(cached) == 1 and cached[0].name.startswith("bpe300-")

  def no_training(*args, **kwargs):
    raise AssertionError("trained again instead of reading the cache")

  monkeypatch.setattr(tokenizer_lib, "train_bpe", no_training)
  assert load_tokenizer(cfg).fingerprint == first.fingerprint
  monkeypatch.undo()
  cfg.bpe_vocab_size = 280
  assert load_tokenizer(cfg).vocab_size <= 280
  cfg.path = write_jsonl(docs[:-1], name="fewer.jsonl")  # another corpus: another cache entry
  load_tokenizer(cfg)
  assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 3


def test_user_tokenizer_json_keeps_its_ids_and_gains_missing_specials(make_cfg, tmp_path):
  # GLM-style names at ids 3..7, no pad token and no [sMASK]: both are added after the last id, in role order.
  vocab = {"hello": 0, "world": 1, "<unk>": 2}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.add_special_tokens(
    [tokenizers.AddedToken(name, special=True) for name in ["<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>"]]
  )
  path = tmp_path / "tokenizer.json"
  backend.save(str(path))
  tok = load_tokenizer(make_cfg(tokenizer=str(path)))
  assert (tok.eos_id, tok.mask_id, tok.gmask_id, tok.sop_id, tok.eop_id) == (3, 4, 5, 6, 7)
  assert tok.pad_id == 8 and tok.backend.id_to_token(8) == "<|pad|>"
  assert tok.smask_id == 9 and tok.backend.id_to_token(9) == "[sMASK]"
  assert tok.vocab_size == 10
  assert tok.encode("hello world hello") == [0, 1, 0]


def test_check_vocab_names_both_sizes(kjv):
  _, tok = kjv
  check_vocab(tok, 512)
  check_vocab(tok, 1024)
  with pytest.raises(ValueError, match=r"vocab_size=512.*model\.vocab_size=500"):
    check_vocab(tok, 500)


def test_unigram_entropy_hand_computed(make_cfg, write_jsonl, word_tokenizer):
  # Tokens: [a a b eos] [a eos] -> counts a 3, b 1, eos 2 of 6.
  cfg = make_cfg(
    source="jsonl", path=write_jsonl(["a a b", "a"]), tokenizer=word_tokenizer(["a", "b"]), eval_fraction=0.0
  )
  want = -(0.5 * math.log(0.5) + (1 / 6) * math.log(1 / 6) + (1 / 3) * math.log(1 / 3))
  assert unigram_entropy(cfg, load_tokenizer(cfg)) == pytest.approx(want, rel=1e-12)


def test_unigram_entropy_of_the_training_split_matches_numpy(kjv):
  cfg, tok = kjv
  corpus = sources.load_corpus(cfg)
  counts = np.zeros(tok.vocab_size)
  for d in corpus.train_idx:
    np.add.at(counts, tok.encode(corpus.docs[d]) + [tok.eos_id], 1)
  p = counts[counts > 0] / counts.sum()
  want = float(-(p * np.log(p)).sum())
  assert unigram_entropy(cfg, tok) == pytest.approx(want, rel=1e-12)
  assert 4.0 < want < math.log(tok.vocab_size)  # a real, non-uniform distribution over 512 tokens
