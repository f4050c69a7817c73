"""The tokenizer: lossless round trip, reserved special ids, the cache, a user tokenizer.json, check_vocab,
unigram_entropy against hand-computed and numpy values, and chat encoding against transformers' tokenizer."""

import math

import numpy as np
import pytest
import tokenizers

from glm_jax import chat
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
  assert [tok.backend.id_to_token(i) for i in range(21)] == list(SPECIAL_TOKENS)
  assert SPECIAL_TOKENS[7:] == chat.FORMAT_TOKENS and len(SPECIAL_TOKENS) == 21
  assert tok.decode([tok.gmask_id, tok.sop_id]) == "[gMASK]<sop>"


CONVERSATION = [  # a tool chain after the user's question, with text that looks like the format inside a message
  {"role": "system", "content": "Answer briefly."},
  {"role": "user", "content": "What is 37*91? Write <think> if you must."},
  {
    "role": "assistant",
    "reasoning_content": "Use the calculator.",
    "tool_calls": [{"function": {"name": "calc", "arguments": {"expr": "37*91", "digits": 3}}}],
  },
  {"role": "tool", "content": "3367"},
  {"role": "tool", "content": "and [MASK] again"},
]


def test_chat_tokens_are_one_id_each_as_transformers_reads_them(kjv):
  from transformers import PreTrainedTokenizerFast

  _, tok = kjv
  assert tok.chat_ids == {
    t: SPECIAL_TOKENS.index(t) for t in ("[gMASK]", "<sop>", "<|endoftext|>", *chat.FORMAT_TOKENS)
  }
  reference = PreTrainedTokenizerFast(tokenizer_file=tok.name)  # the released tokenizer's reading of a template
  text = chat.render(CONVERSATION, add_generation_prompt=True)
  ids = tok.encode_chat(text)
  assert ids == reference(text, add_special_tokens=False)["input_ids"]
  assert tok.decode(ids) == text
  for token, i in tok.chat_ids.items():
    assert tok.encode_chat(token) == [i] and len(tok.encode(token)) > 1  # one id in chat, spelled out as text
  assert ids.count(tok.chat_ids["<tool_response>"]) == 2 and ids.count(tok.chat_ids["<think>"]) == 3
  assert ids[:3] == [tok.gmask_id, tok.sop_id, tok.chat_ids["<|system|>"]]


def test_a_tokenizer_without_the_format_tokens_is_refused_for_chat_by_name(make_cfg, tmp_path):
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 0, "<unk>": 1}, unk_token="<unk>"))
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ["<|user|>", "<|assistant|>"]])
  backend.save(str(tmp_path / "tokenizer.json"))
  tok = load_tokenizer(make_cfg(tokenizer=str(tmp_path / "tokenizer.json")))
  assert tok.encode("hi") == [0]  # plain text still encodes
  with pytest.raises(ValueError, match=r"tokenizer\.json.*cannot encode GLM-5's chat format.*'<\|system\|>'"):
    tok.encode_chat("<|user|>hi")


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
