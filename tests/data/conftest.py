"""Fixtures for the data tests: configs whose cache lives in tmp_path, small corpora, a word-level tokenizer
whose token counts are known by hand, and the embedded corpus with its trained BPE (once per module)."""

import json

import pytest
import tokenizers

from glm_jax.data import SPECIAL_TOKENS, default_data_config, load_tokenizer


@pytest.fixture
def make_cfg(tmp_path):
  def make(**overrides):
    cfg = default_data_config()
    cfg.cache_dir = str(tmp_path / "cache")
    cfg.update(overrides)
    return cfg

  return make


@pytest.fixture
def write_jsonl(tmp_path):
  def write(docs, name="corpus.jsonl", field="text"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return str(path)

  return write


@pytest.fixture
def word_tokenizer(tmp_path):
  """A tokenizer.json splitting on whitespace, one id per word: ids 0..20 are SPECIAL_TOKENS, then `words`."""

  def make(words, name="words.json"):
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(words))}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path / name
    backend.save(str(path))
    return str(path)

  return make


@pytest.fixture(scope="module")
def kjv(tmp_path_factory):
  """(config, tokenizer) of the embedded corpus with the default 512-token BPE, cached in a temp dir."""
  cfg = default_data_config()
  cfg.cache_dir = str(tmp_path_factory.mktemp("cache"))
  cfg.seq_len, cfg.batch_size = 64, 8
  return cfg, load_tokenizer(cfg)
