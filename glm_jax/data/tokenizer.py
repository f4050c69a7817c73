"""The tokenizer: a byte-level BPE trained on the corpus (cached), or any Hugging Face tokenizer.json.

Special tokens are reserved from the start, for the objectives that come later (GLM's blank infilling):
  <|pad|> (id 0 in the trained BPE), <|endoftext|> (eos, ends every document), [MASK], [gMASK], <sop>, <eop>,
  [sMASK] (ids 0..6).
A tokenizer.json given by path keeps its own ids for the tokens it has (GLM's "<|endoftext|>", "[MASK]",
"[gMASK]", "[sMASK]", "<sop>", "<eop>"; "</s>", "<eos>", "<pad>", "[PAD]", "[sop]", "[eop]" are accepted as the same
roles); those it lacks are ADDED as new special tokens at the end of its vocabulary (logged), so the ids are
always distinct. Text is always encoded as text: a literal "[MASK]" inside a document is spelled out, never
turned into the special token, so decode(encode(s)) == s for every string.

Chat (glm_jax/chat.py renders GLM-5's format as text): `encode_chat` reads every special token of the tokenizer in
the text as its id, as the released tokenizer does when a chat template is applied, and the rest as `encode` does;
`chat_ids` says which id each of the format's tokens has. The trained BPE has them (ids 7..20); a tokenizer.json
that lacks any of them is refused for chat by name (GLM-4.5 and later releases have them all).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence

import ml_collections
import tokenizers
from absl import logging

from glm_jax.chat import FORMAT_TOKENS
from glm_jax.data import config as config_lib
from glm_jax.data import sources
from glm_jax.data.special_tokens import ROLES, SPECIAL_TOKENS

_BPE_FORMAT = 2  # bump when the trained tokenizer's recipe changes, so stale caches are not reused.


class Tokenizer:
  """encode / decode plus the special ids. `backend` is the underlying tokenizers.Tokenizer."""

  def __init__(self, backend: tokenizers.Tokenizer, name: str):
    self.backend = backend
    self.name = name
    missing = [tok for tok, names in ROLES.values() if all(backend.token_to_id(n) is None for n in names)]
    if missing:
      logging.warning("tokenizer %s lacks %s; adding them as special tokens", name, missing)
      backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])
    ids = {
      role: next(backend.token_to_id(n) for n in names if backend.token_to_id(n) is not None)
      for role, (_, names) in ROLES.items()
    }
    self.pad_id, self.eos_id = ids["pad"], ids["eos"]
    self.mask_id, self.gmask_id, self.sop_id, self.eop_id = ids["mask"], ids["gmask"], ids["sop"], ids["eop"]
    self.smask_id = ids["smask"]
    if len(set(ids.values())) != len(ids):
      raise ValueError(f"data.tokenizer={name!r}: special tokens share ids {ids}; each role needs its own token")
    backend.encode_special_tokens = True  # text is text (see the module docstring)
    self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    self.fingerprint = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
    self._chat_backend = None  # built on the first encode_chat: a copy that reads special tokens as their ids

  @property
  def chat_ids(self) -> dict[str, int]:
    """{token: id} of GLM-5's chat format's special tokens (chat.FORMAT_TOKENS and [gMASK], <sop>, <|endoftext|>);
    raises ValueError naming those this tokenizer lacks."""
    tokens = ("[gMASK]", "<sop>", "<|endoftext|>", *FORMAT_TOKENS)
    ids = {t: self.backend.token_to_id(t) for t in tokens}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
      raise ValueError(
        f"tokenizer {self.name!r} cannot encode GLM-5's chat format: it lacks the special tokens {missing} (the BPE "
        "trained here has them all, and so do the tokenizers of GLM-4.5 and later)"
      )
    return ids

  def encode_chat(self, text: str) -> list[int]:
    """The ids of a rendered conversation (glm_jax/chat.py render): each special token of the tokenizer in `text`
    is its one id (the format's tokens above all), the text between them is encoded as `encode` does. A literal
    format token inside a message is read as the token too, as the released tokenizer reads it."""
    if self._chat_backend is None:
      self.chat_ids  # noqa: B018 - refuses a tokenizer without the format's tokens, by name
      backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
      backend.encode_special_tokens = False
      self._chat_backend = backend
    return self._chat_backend.encode(text, add_special_tokens=False).ids

  @property
  def special_ids(self) -> dict[str, int]:
    return {
      "pad": self.pad_id,
      "eos": self.eos_id,
      "mask": self.mask_id,
      "gmask": self.gmask_id,
      "sop": self.sop_id,
      "eop": self.eop_id,
      "smask": self.smask_id,
    }

  def encode(self, text: str) -> list[int]:
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

  def record(self) -> dict:
    """What a checkpoint saves of this tokenizer (from_record rebuilds it): name, sha256, vocab_size, json."""
    return {"name": self.name, "sha256": self.fingerprint, "vocab_size": self.vocab_size, "json": self.backend.to_str()}

  @classmethod
  def from_record(cls, record: dict) -> "Tokenizer":
    """The tokenizer a checkpoint recorded (see record); raises ValueError when the record does not rebuild it."""
    tok = cls(tokenizers.Tokenizer.from_str(record["json"]), record["name"])
    if tok.fingerprint != record["sha256"]:
      raise ValueError(
        f"recorded tokenizer {record['name']!r}: its JSON hashes to {tok.fingerprint[:12]}, the record "
        f"says {record['sha256'][:12]}"
      )
    return tok

  def __repr__(self) -> str:
    return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, special_ids={self.special_ids})"


def load_tokenizer(data_cfg: ml_collections.ConfigDict) -> Tokenizer:
  """data.tokenizer's tokenizer.json, or (when "") the BPE trained on the corpus's training split, cached
  under data.cache_dir by corpus identity, vocabulary size and special tokens. What it learns from:
  sources.bpe_training_documents (for format "sft" from jsonl, the training examples' prompt + response; the
  embedded source's chapters in both formats)."""
  config_lib.validate_data_config(data_cfg)
  if data_cfg.tokenizer:
    return _from_file(data_cfg.tokenizer)
  train_docs, train_hashes = sources.bpe_training_documents(data_cfg)
  key = hashlib.sha256(
    json.dumps(
      {
        "corpus": sources.corpus_hash(train_hashes),
        "vocab_size": data_cfg.bpe_vocab_size,
        "special_tokens": SPECIAL_TOKENS,
        "format": _BPE_FORMAT,
      }
    ).encode()
  ).hexdigest()[:24]
  path = os.path.join(cache_dir(data_cfg), "tokenizers", f"bpe{data_cfg.bpe_vocab_size}-{key}.json")
  if os.path.exists(path):
    return Tokenizer(tokenizers.Tokenizer.from_file(path), path)
  start = time.perf_counter()
  backend = train_bpe(train_docs, data_cfg.bpe_vocab_size)
  logging.info(
    "trained a %d-token byte-level BPE on %d documents of %s in %.2f s -> %s",
    data_cfg.bpe_vocab_size,
    len(train_docs),
    sources.corpus_version(data_cfg),
    time.perf_counter() - start,
    path,
  )
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  backend.save(tmp)
  os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
  return Tokenizer(backend, path)


def train_bpe(docs: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE (GPT-2 style pre-tokenization, all 256 bytes in the alphabet, no unknown token) with
  SPECIAL_TOKENS as ids 0..6."""
  backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL_TOKENS),
    show_progress=False,
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
  )
  backend.train_from_iterator(docs, trainer, length=len(docs))
  return backend


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises ValueError when the tokenizer can emit ids the model's embedding does not have."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
      f"tokenizer vocab_size={tokenizer.vocab_size} ({tokenizer.name}) is larger than "
      f"model.vocab_size={model_vocab_size}; raise model.vocab_size to at least "
      f"{tokenizer.vocab_size} or lower data.bpe_vocab_size"
    )


def cache_dir(data_cfg: ml_collections.ConfigDict) -> str:
  return os.path.expanduser(data_cfg.cache_dir or os.path.join("~", ".cache", "glm_jax"))


def _from_file(path: str) -> Tokenizer:
  expanded = os.path.expanduser(path)
  if not os.path.isfile(expanded):
    raise FileNotFoundError(f"data.tokenizer={path!r}: no such file (expected a Hugging Face tokenizer.json)")
  try:
    backend = tokenizers.Tokenizer.from_file(expanded)
  except Exception as e:  # tokenizers raises a bare Exception for a malformed file.
    raise ValueError(f"data.tokenizer={path!r} is not a valid tokenizer.json: {e}") from e
  return Tokenizer(backend, path)
