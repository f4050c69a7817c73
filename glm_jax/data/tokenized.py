"""The corpus as one flat token array, each document ended by eos, cached on disk after the first run.

tokens [num_tokens] int32 and offsets [num_docs + 1] int64: document d is tokens[offsets[d]:offsets[d + 1]].
The cache key is the corpus's text hashes and the tokenizer's serialized form, so a changed file or
tokenizer never reuses stale tokens.

Format "sft" (TokenizedExamples, cached the same way under "sft-<key>.npz", the key adding the format and the
jsonl fields): example i is tokens[offsets[i]:offsets[i + 1]] = encode(prompt) + encode(response) + [eos]
(prompt and response encoded apart, so no token spans the boundary), and prompt_lens[i] = len(encode(prompt)):
its loss mask is 0 on the first prompt_lens[i] tokens, 1 on the response tokens and the eos.

Format "chat" (TokenizedConversations, under "chat-<key>.npz", the key adding data.clear_thinking and the rendered
texts, so a change of the chat format's rendering is never served stale tokens): conversation i is
tokens[offsets[i]:offsets[i + 1]] with its loss mask loss_mask[offsets[i]:offsets[i + 1]], both from
glm_jax/data/conversations.py tokenize_conversation (1 on what the model writes in its assistant turns, their stop
tokens included; 0 on the head, system, user and tool messages and the role tokens).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import ml_collections
import numpy as np
from absl import logging

from glm_jax.data import conversations, sources
from glm_jax.data import tokenizer as tokenizer_lib

_FORMAT = 1  # bump when a cached layout changes (tokenize_conversation's included), so stale caches are not reused


@dataclass(frozen=True)
class TokenizedCorpus:
  tokens: np.ndarray  # [num_tokens] int32, every document followed by eos
  offsets: np.ndarray  # [num_docs + 1] int64
  train_idx: np.ndarray  # document indices of the training split, ascending
  eval_idx: np.ndarray  # document indices of the held-out split, ascending

  def doc(self, d: int) -> np.ndarray:
    return self.tokens[self.offsets[d] : self.offsets[d + 1]]

  def split_tokens(self, doc_idx: np.ndarray) -> np.ndarray:
    """The tokens of the given documents, concatenated."""
    if len(doc_idx) == 0:
      return np.zeros(0, np.int32)
    return np.concatenate([self.doc(d) for d in doc_idx])


_MEMO: dict[tuple[str, str], TokenizedCorpus] = {}


def tokenize_corpus(data_cfg: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> TokenizedCorpus:
  """The configured corpus tokenized by `tokenizer` (from data.cache_dir when it was done before)."""
  corpus = sources.load_corpus(data_cfg)
  key = hashlib.sha256(
    f"{sources.corpus_hash(corpus.hashes)}|{tokenizer.fingerprint}|{tokenizer.eos_id}|{_FORMAT}".encode()
  ).hexdigest()[:24]
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
    logging.info(
      "tokenized %d documents into %d tokens in %.2f s -> %s",
      len(corpus.docs),
      len(tokens),
      time.perf_counter() - start,
      path,
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, tokens=tokens, offsets=offsets)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
  result = TokenizedCorpus(tokens, offsets, corpus.train_idx, corpus.eval_idx)
  _MEMO.clear()
  _MEMO[memo_key] = result
  return result


@dataclass(frozen=True)
class TokenizedExamples:
  tokens: np.ndarray  # [num_tokens] int32: each example's prompt, response and eos tokens, end to end
  offsets: np.ndarray  # [num_examples + 1] int64
  prompt_lens: np.ndarray  # [num_examples] int64: how many of example i's tokens are its prompt's
  train_idx: np.ndarray  # example indices of the training split, ascending
  eval_idx: np.ndarray  # example indices of the held-out split, ascending

  def lengths(self, idx: np.ndarray) -> np.ndarray:
    """[len(idx)] int64: the token counts of the given examples (eos included, before any truncation)."""
    return self.offsets[idx + 1] - self.offsets[idx]

  def example(self, i: int, max_len: int) -> dict[str, np.ndarray]:
    """Example i's first max_len tokens: {"input_ids", "loss_mask"} [min(length, max_len)] int32, loss_mask 1
    on the response tokens and the eos."""
    start = self.offsets[i]
    stop = min(self.offsets[i + 1], start + max_len)
    mask = np.arange(stop - start) >= self.prompt_lens[i]
    return {"input_ids": self.tokens[start:stop], "loss_mask": mask.astype(np.int32)}

  def loss_tokens(self, idx: np.ndarray, max_len: int) -> np.ndarray:
    """The tokens with loss_mask 1 (response and eos) among the first max_len of each given example."""
    parts = [
      self.tokens[self.offsets[i] + self.prompt_lens[i] : min(self.offsets[i + 1], self.offsets[i] + max_len)]
      for i in idx
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


_EXAMPLES_MEMO: dict[tuple[str, str], dict[str, np.ndarray]] = {}


def _cached_arrays(memo: dict, key: str, path: str, names: tuple[str, ...], build, describe) -> dict[str, np.ndarray]:
  """The arrays `names` of the npz at `path` (whose name holds the cache `key`); when it is absent, `build()` makes
  them (logged with `describe(arrays)` and the time taken) and they are saved there. The last result stays in `memo`
  (one entry: a process tokenizes one configuration at a time)."""
  if (key, path) not in memo:
    if os.path.exists(path):
      with np.load(path) as f:
        arrays = {k: f[k] for k in names}
    else:
      start = time.perf_counter()
      arrays = build()
      logging.info("tokenized %s in %.2f s -> %s", describe(arrays), time.perf_counter() - start, path)
      _save_atomic(path, arrays)
    memo.clear()
    memo[(key, path)] = arrays
  return memo[(key, path)]


def tokenize_examples(data_cfg: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> TokenizedExamples:
  """The configured format-"sft" examples tokenized by `tokenizer` (from data.cache_dir when done before)."""
  ex = sources.load_examples(data_cfg)
  key = hashlib.sha256(
    f"sft|{data_cfg.source}|{data_cfg.prompt_field}|{data_cfg.response_field}|"
    f"{sources.corpus_hash(ex.hashes)}|{tokenizer.fingerprint}|{tokenizer.eos_id}|"
    f"{_FORMAT}".encode()
  ).hexdigest()[:24]
  arrays = _cached_arrays(
    _EXAMPLES_MEMO,
    key,
    os.path.join(tokenizer_lib.cache_dir(data_cfg), "tokenized", f"sft-{key}.npz"),
    ("tokens", "offsets", "prompt_lens"),
    lambda: _tokenize_examples(ex.prompts, ex.responses, tokenizer),
    lambda a: f"{len(ex.prompts)} examples into {len(a['tokens'])} tokens",
  )
  return TokenizedExamples(**arrays, train_idx=ex.train_idx, eval_idx=ex.eval_idx)


def _tokenize_examples(
  prompts: list[str], responses: list[str], tokenizer: tokenizer_lib.Tokenizer
) -> dict[str, np.ndarray]:
  enc_p, enc_r = tokenizer.encode_batch(prompts), tokenizer.encode_batch(responses)
  prompt_lens = np.array([len(e) for e in enc_p], dtype=np.int64)
  lengths = prompt_lens + np.array([len(e) + 1 for e in enc_r], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = np.empty(offsets[-1], dtype=np.int32)
  for p, r, start, n_p, end in zip(enc_p, enc_r, offsets[:-1], prompt_lens, offsets[1:]):
    tokens[start : start + n_p] = p
    tokens[start + n_p : end - 1] = r
    tokens[end - 1] = tokenizer.eos_id
  return {"tokens": tokens, "offsets": offsets, "prompt_lens": prompt_lens}


@dataclass(frozen=True)
class TokenizedConversations:
  """Format "chat"'s examples, with the interface of TokenizedExamples (lengths, example, loss_tokens)."""

  tokens: np.ndarray  # [num_tokens] int32: each conversation's tokens, end to end
  loss_mask: np.ndarray  # [num_tokens] uint8: tokenize_conversation's loss mask of those tokens
  offsets: np.ndarray  # [num_examples + 1] int64
  train_idx: np.ndarray  # conversation indices of the training split, ascending
  eval_idx: np.ndarray  # conversation indices of the held-out split, ascending

  def lengths(self, idx: np.ndarray) -> np.ndarray:
    """[len(idx)] int64: the token counts of the given conversations (before any truncation)."""
    return self.offsets[idx + 1] - self.offsets[idx]

  def example(self, i: int, max_len: int) -> dict[str, np.ndarray]:
    """Conversation i's first max_len tokens: {"input_ids", "loss_mask"} [min(length, max_len)] int32."""
    start = self.offsets[i]
    stop = min(self.offsets[i + 1], start + max_len)
    return {"input_ids": self.tokens[start:stop], "loss_mask": self.loss_mask[start:stop].astype(np.int32)}

  def loss_tokens(self, idx: np.ndarray, max_len: int) -> np.ndarray:
    """The tokens with loss_mask 1 among the first max_len of each given conversation."""
    parts = []
    for i in idx:
      start = self.offsets[i]
      stop = min(self.offsets[i + 1], start + max_len)
      parts.append(self.tokens[start:stop][self.loss_mask[start:stop] == 1])
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


_CONVERSATIONS_MEMO: dict[tuple[str, str], dict[str, np.ndarray]] = {}


def tokenize_conversations(
  data_cfg: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer
) -> TokenizedConversations:
  """The configured format-"chat" conversations tokenized by `tokenizer` (from data.cache_dir when done before).
  Raises ValueError naming data.tokenizer when it lacks the chat format's special tokens."""
  convs = sources.load_conversations(data_cfg)
  try:
    tokenizer.chat_ids  # noqa: B018 - refuses a tokenizer without the format's tokens, by name
  except ValueError as e:
    raise ValueError(f"data.format='chat' with data.tokenizer={data_cfg.tokenizer!r}: {e}") from e
  key = hashlib.sha256(
    f"chat|{data_cfg.source}|{bool(data_cfg.clear_thinking)}|{sources.corpus_hash(convs.hashes)}|"
    f"{sources.corpus_hash(sources.document_hashes(convs.rendered))}|{tokenizer.fingerprint}|{tokenizer.eos_id}|"
    f"{_FORMAT}".encode()
  ).hexdigest()[:24]
  arrays = _cached_arrays(
    _CONVERSATIONS_MEMO,
    key,
    os.path.join(tokenizer_lib.cache_dir(data_cfg), "tokenized", f"chat-{key}.npz"),
    ("tokens", "loss_mask", "offsets"),
    lambda: _tokenize_conversations(convs, tokenizer, data_cfg.clear_thinking),
    lambda a: (
      f"{len(convs.messages)} conversations into {len(a['tokens'])} tokens ({int(a['loss_mask'].sum())} in the loss)"
    ),
  )
  return TokenizedConversations(**arrays, train_idx=convs.train_idx, eval_idx=convs.eval_idx)


def _tokenize_conversations(
  convs: sources.Conversations, tokenizer: tokenizer_lib.Tokenizer, clear_thinking: bool
) -> dict[str, np.ndarray]:
  ids, masks = [], []
  for messages, tools, where in zip(convs.messages, convs.tools, convs.where):
    try:
      i, m = conversations.tokenize_conversation(tokenizer, messages, tools=tools, clear_thinking=clear_thinking)
    except ValueError as e:  # read_conversations checked the rendering; this is a guard for what it cannot see
      raise ValueError(f"data.path: {where}: {e}") from e
    ids.append(np.asarray(i, np.int32))
    masks.append(np.asarray(m, np.uint8))
  offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int64)
  return {"tokens": np.concatenate(ids), "loss_mask": np.concatenate(masks), "offsets": offsets}


def _save_atomic(path: str, arrays: dict[str, np.ndarray]) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}.npz"
  np.savez(tmp, **arrays)
  os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none


def _replace_split(tc: TokenizedCorpus, corpus: sources.Corpus) -> TokenizedCorpus:
  return TokenizedCorpus(tc.tokens, tc.offsets, corpus.train_idx, corpus.eval_idx)


def _tokenize(docs: list[str], tokenizer: tokenizer_lib.Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  encoded = tokenizer.encode_batch(docs)
  lengths = np.array([len(e) + 1 for e in encoded], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  tokens = np.empty(offsets[-1], dtype=np.int32)
  for e, start, end in zip(encoded, offsets[:-1], offsets[1:]):
    tokens[start : end - 1] = e
    tokens[end - 1] = tokenizer.eos_id
  return tokens, offsets
