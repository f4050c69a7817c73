"""The corpus as one flat token array, each document ended by eos, cached on disk after the first run.

tokens [num_tokens] int32 and offsets [num_docs + 1] int64: document d is tokens[offsets[d]:offsets[d + 1]].
The cache key is the corpus's text hashes and the tokenizer's serialized form, so a changed file or
tokenizer never reuses stale tokens.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import ml_collections
import numpy as np
from absl import logging

from glm_jax.data import sources
from glm_jax.data import tokenizer as tokenizer_lib

_FORMAT = 1


@dataclass(frozen=True)
class TokenizedCorpus:
  tokens: np.ndarray      # [num_tokens] int32, every document followed by eos
  offsets: np.ndarray     # [num_docs + 1] int64
  train_idx: np.ndarray   # document indices of the training split, ascending
  eval_idx: np.ndarray    # document indices of the held-out split, ascending

  def doc(self, d: int) -> np.ndarray:
    return self.tokens[self.offsets[d]:self.offsets[d + 1]]

  def split_tokens(self, doc_idx: np.ndarray) -> np.ndarray:
    """The tokens of the given documents, concatenated."""
    if len(doc_idx) == 0:
      return np.zeros(0, np.int32)
    return np.concatenate([self.doc(d) for d in doc_idx])


_MEMO: dict[tuple[str, str], TokenizedCorpus] = {}


def tokenize_corpus(data_cfg: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> TokenizedCorpus:
  """The configured corpus tokenized by `tokenizer` (from data.cache_dir when it was done before)."""
  corpus = sources.load_corpus(data_cfg)
  key = hashlib.sha256(f"{sources.corpus_hash(corpus.hashes)}|{tokenizer.fingerprint}|"
                       f"{tokenizer.eos_id}|{_FORMAT}".encode()).hexdigest()[:24]
  path = os.path.join(tokenizer_lib.cache_dir(data_cfg), "tokenized", f"{key}.npz")
  memo_key = (key, path)
  if memo_key in _MEMO:
    return _replace_split(_MEMO[memo_key], corpus)
  if os.path.exists(path):
    with np.load(path) as f:
      tokens, offsets = f["tokens"], f["offsets"]
  else:
    start = time.perf_counter()
    tokens, offsets = _tokenize(corpus.docs, tokenizer)
    logging.info("tokenized %d documents into %d tokens in %.2f s -> %s", len(corpus.docs), len(tokens),
                 time.perf_counter() - start, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, tokens=tokens, offsets=offsets)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
  result = TokenizedCorpus(tokens, offsets, corpus.train_idx, corpus.eval_idx)
  _MEMO.clear()
  _MEMO[memo_key] = result
  return result


def _replace_split(tc: TokenizedCorpus, corpus: sources.Corpus) -> TokenizedCorpus:
  return TokenizedCorpus(tc.tokens, tc.offsets, corpus.train_idx, corpus.eval_idx)


def _tokenize(docs: list[str], tokenizer: tokenizer_lib.Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  encoded = tokenizer.encode_batch(docs)
  lengths = np.array([len(e) + 1 for e in encoded], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  tokens = np.empty(offsets[-1], dtype=np.int32)
  for e, start, end in zip(encoded, offsets[:-1], offsets[1:]):
    tokens[start:end - 1] = e
    tokens[end - 1] = tokenizer.eos_id
  return tokens, offsets
