"""The Grain pipeline: documents, examples or conversations -> shuffle (seeded, new order each epoch) -> repeat
-> pack -> batch -> shard.

  MapDataset.source(documents' tokens + eos | examples' or conversations' tokens and loss masks, cut to seq_len)
    .shuffle(shuffle_seed).repeat().to_iter_dataset()   index-level shuffle, reseeded every epoch
    ConcatThenSplitIterDataset(seq_len)                "lm": documents end to end, a row cut every seq_len tokens
    | FirstFitPackIterDataset(seq_len, B bins)         "sft", "chat", objective "glm" (each piece corrupted first,
                                                       blank_infilling.py): whole examples, the rows padded
    .batch(global batch).map(to model batch).map(rows [p*B/P, (p+1)*B/P) of process p)
The batch: four [rows, seq_len] int32 arrays, input_ids (pad_id on padding), segment_ids (1, 2, ... for the
documents / examples of a row, 0 on padding), positions (0 at each segment start and on padding) and loss_mask. The
prediction at t of token t + 1 counts when segment_ids[t + 1] == segment_ids[t] != 0 and loss_mask[t + 1] == 1
(glm_jax/train/losses.py's shifted_targets). Objective "glm" adds targets, block_positions and prefix_end, and the
prediction at t of targets[t] counts where loss_mask[t] is 1 (no shift). Every process packs the same global stream
and keeps its own rows, so the batches do not depend on the process count. The iterator's state is a small JSON-able
dict, checkpointed with the model (glm_jax/data/__init__.py). Each format's packing and masks: docs/training.md,
"The data pipeline".
"""

from __future__ import annotations

import functools
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import logging
from grain.experimental import ConcatThenSplitIterDataset, FirstFitPackIterDataset

from glm_jax.data import blank_infilling
from glm_jax.data import config as config_lib
from glm_jax.data import tokenized
from glm_jax.data.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]  # "input_ids", "segment_ids", "positions", "loss_mask": [rows, seq_len] int32
EVAL_SEED = 0  # the held-out blanks' draws (objective "glm"), whatever data.shuffle_seed is


def make_train_iterator(
  data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
  """An endless iterator of this process's share of the training batches: [batch_size // process_count,
  seq_len] int32 arrays (see the module docstring). Deterministic given data.shuffle_seed; get_state() /
  set_state() resume exactly."""
  config_lib.validate_data_config(data_cfg)
  local = config_lib.check_process_split(data_cfg, process_index, process_count)
  ds = _split_dataset(data_cfg, tokenizer, train=True)
  ds = ds.map(functools.partial(_rows, start=process_index * local, stop=(process_index + 1) * local))
  return iter(ds)


def make_eval_batches(
  data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1
) -> list[Batch]:
  """The held-out documents (examples) in corpus order, packed like the training data: at most
  data.eval_batches batches (fewer when the held-out tokens run out, none when data.eval_fraction is 0) of the
  training batches' keys and shapes; the last one is completed with padding (segment id 0, input id pad_id,
  loss_mask 0)."""
  config_lib.validate_data_config(data_cfg)
  local = config_lib.check_process_split(data_cfg, process_index, process_count)
  if data_cfg.eval_batches == 0:
    return []
  ds = _split_dataset(data_cfg, tokenizer, train=False)
  if ds is None:
    return []
  it = iter(ds)
  batches = []
  for batch in it:
    batches.append(_rows(batch, start=process_index * local, stop=(process_index + 1) * local))
    if len(batches) == data_cfg.eval_batches:
      break
  return batches


def unigram_entropy(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> float:
  """H = -sum_v p_v ln p_v (nats/token) of the training split's token frequencies, eos included, pad
  excluded: the loss of the best model that ignores context, the baseline a trained model must beat.
  Format "sft" ("chat"): over the tokens the loss counts, the training examples' response tokens and eos (the
  conversations' assistant tokens; loss_mask 1) within each example's first seq_len tokens. Objective "glm": the
  same as "lm" (the documents' tokens), a rough baseline: the blanks' targets are document tokens plus one <eop> a
  span."""
  config_lib.validate_data_config(data_cfg)
  if data_cfg.format in config_lib.EXAMPLE_FORMATS:
    te = _tokenized_examples(data_cfg, tokenizer)
    tokens = te.loss_tokens(te.train_idx, data_cfg.seq_len)
  else:
    tc = tokenized.tokenize_corpus(data_cfg, tokenizer)
    tokens = tc.split_tokens(tc.train_idx)
  counts = np.bincount(tokens, minlength=tokenizer.vocab_size).astype(np.float64)
  counts[tokenizer.pad_id] = 0.0
  p = counts[counts > 0] / counts.sum()
  return float(-np.sum(p * np.log(p)))


def _split_dataset(
  data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, train: bool
) -> grain.IterDataset | None:
  """Global batches of the training split (shuffled, endless) or the held-out one (corpus order, finite; None
  when it is empty), in data.format."""
  common = dict(
    seq_len=data_cfg.seq_len,
    batch_size=data_cfg.batch_size,
    pad_id=tokenizer.pad_id,
    shuffle_seed=data_cfg.shuffle_seed if train else None,
    repeat=train,
  )
  if data_cfg.format in config_lib.EXAMPLE_FORMATS:
    te = _tokenized_examples(data_cfg, tokenizer)
    idx = te.train_idx if train else te.eval_idx
    if train:
      _check_trainable(te, idx, data_cfg)
    if len(idx) == 0:
      return None
    _log_truncated(te.lengths(idx), data_cfg.seq_len, "training" if train else "held-out")
    return packed_examples_dataset(_ExampleTokens(te, idx, data_cfg.seq_len), **common)
  tc = tokenized.tokenize_corpus(data_cfg, tokenizer)
  idx = tc.train_idx if train else tc.eval_idx
  if data_cfg.objective == "glm":
    source = _GlmPieces(tc, idx, data_cfg)
    if not len(source):
      return None
    return packed_blanks_dataset(
      source, tokenizer, data_cfg.glm, corrupt_seed=data_cfg.shuffle_seed if train else EVAL_SEED, **common
    )
  return packed_dataset(_DocTokens(tc, idx), **common) if len(idx) else None


def _tokenized_examples(
  data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer
) -> tokenized.TokenizedExamples | tokenized.TokenizedConversations:
  """Format "sft"'s examples or format "chat"'s conversations, tokenized (both have lengths, example, loss_tokens)."""
  if data_cfg.format == "chat":
    return tokenized.tokenize_conversations(data_cfg, tokenizer)
  return tokenized.tokenize_examples(data_cfg, tokenizer)


def _check_trainable(
  te: tokenized.TokenizedExamples | tokenized.TokenizedConversations,
  idx: np.ndarray,
  data_cfg: ml_collections.ConfigDict,
) -> None:
  """Raises ValueError when the training split of format-"sft" examples (format-"chat" conversations) has no token
  the loss counts: no example, or every response (assistant turn) cut off by data.seq_len (a run would train on
  nothing)."""
  where = f"data.source={data_cfg.source!r}" + (f" (data.path={data_cfg.path!r})" if data_cfg.path else "")
  if len(idx) == 0:
    what = "conversations" if data_cfg.format == "chat" else "prompt/response examples"
    raise ValueError(f"{where}: the training split has no example; SFT needs {what} to train on")
  if not len(te.loss_tokens(idx, data_cfg.seq_len)):
    if data_cfg.format == "chat":
      firsts = [int(np.argmax(te.loss_mask[te.offsets[i] : te.offsets[i + 1]])) for i in idx]
      raise ValueError(
        f"data.seq_len={data_cfg.seq_len} leaves no assistant token to train on: each of the {len(idx)} training "
        f"conversations of {where} has at least data.seq_len tokens before its first assistant token (the fewest: "
        f"{min(firsts)}); raise data.seq_len or shorten what comes before the first assistant turn"
      )
    lengths = te.lengths(idx)
    prompts = te.prompt_lens[idx]
    raise ValueError(
      f"data.seq_len={data_cfg.seq_len} leaves no response token to train on: each of the {len(idx)} training "
      f"examples of {where} has a prompt of at least data.seq_len tokens ({int(np.sum(lengths > data_cfg.seq_len))} "
      f"are cut; the shortest prompt has {int(prompts.min())} tokens); raise data.seq_len or shorten the prompts"
    )


def _log_truncated(lengths: np.ndarray, seq_len: int, split: str) -> None:
  n = int(np.sum(lengths > seq_len))
  if n:
    logging.warning(
      "%d of %d %s examples are longer than data.seq_len=%d tokens (the longest has %d) and are cut "
      "to their first %d tokens",
      n,
      len(lengths),
      split,
      seq_len,
      int(lengths.max()),
      seq_len,
    )


def packed_dataset(
  docs, *, seq_len: int, batch_size: int, pad_id: int, shuffle_seed: int | None, repeat: bool
) -> grain.IterDataset:
  """Global batches [batch_size, seq_len] packed from `docs` (a sequence of 1-D int32 token arrays).
  Without repeat, the last batch is completed with all-padding rows."""
  ds = grain.MapDataset.source(docs)
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed)
  if repeat:
    ds = ds.repeat(None)
  ds = ds.map(_as_features)
  # Reading a document is a slice of an in-memory array: no threads (and nothing to reorder).
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  it = _JsonSafeState(ConcatThenSplitIterDataset(it, length_struct={"input_ids": seq_len}))
  it = it.batch(batch_size, drop_remainder=repeat)
  return it.map(functools.partial(_model_batch, batch_size=batch_size, pad_id=pad_id))


class _DocTokens:
  """A random-access source of the tokens of the chosen documents (each already ends with eos)."""

  def __init__(self, tc: tokenized.TokenizedCorpus, doc_idx: np.ndarray):
    self._tc, self._doc_idx = tc, doc_idx

  def __len__(self) -> int:
    return len(self._doc_idx)

  def __getitem__(self, i: int) -> np.ndarray:
    return self._tc.doc(int(self._doc_idx[i]))


def packed_examples_dataset(
  examples, *, seq_len: int, batch_size: int, pad_id: int, shuffle_seed: int | None, repeat: bool
) -> grain.IterDataset:
  """Global batches [batch_size, seq_len] of whole examples, first-fit packed into batch_size bins (docs/training.md,
  "The data pipeline"). `examples`: a sequence of {"input_ids", "loss_mask"} 1-D int32 arrays of equal length; one
  longer than seq_len is cut to its first seq_len tokens. Without repeat, the last batch is completed with
  all-padding rows."""
  ds = grain.MapDataset.source(examples)
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed)
  if repeat:
    ds = ds.repeat(None)
  ds = ds.map(functools.partial(_truncate, seq_len=seq_len))
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  # num_packing_bins = batch_size: a packing round that ends before the stream does fills every bin (the example
  # that fits in none found no empty one), so each round is exactly one global batch and a batch boundary is
  # always a round boundary. Bins are emitted in order (shuffle_bins=False): the stream is shuffled already.
  it = FirstFitPackIterDataset(
    it,
    length_struct={"input_ids": seq_len, "loss_mask": seq_len},
    num_packing_bins=batch_size,
    shuffle_bins=False,
    padding_struct={"input_ids": pad_id, "loss_mask": 0},
  )
  it = it.batch(batch_size, drop_remainder=repeat)
  return it.map(functools.partial(_model_batch, batch_size=batch_size, pad_id=pad_id))


class _ExampleTokens:
  """A random-access source of the chosen examples' {"input_ids", "loss_mask"}, cut to max_len tokens."""

  def __init__(self, te: tokenized.TokenizedExamples, idx: np.ndarray, max_len: int):
    self._te, self._idx, self._max_len = te, idx, max_len

  def __len__(self) -> int:
    return len(self._idx)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return self._te.example(int(self._idx[i]), self._max_len)


def packed_blanks_dataset(
  pieces,
  tokenizer: Tokenizer,
  glm_cfg: ml_collections.ConfigDict,
  *,
  seq_len: int,
  batch_size: int,
  pad_id: int,
  shuffle_seed: int | None,
  repeat: bool,
  corrupt_seed: int,
) -> grain.IterDataset:
  """Global batches [batch_size, seq_len] of blank-infilling samples (the module docstring): `pieces`, a sequence of
  1-D int32 document pieces, each corrupted by blank_infilling.corrupt_document with a generator grain seeds from
  corrupt_seed and the piece's index in the (shuffled, repeated) stream, then packed whole, first fit."""
  ends = blank_infilling.sentence_end_table(tokenizer) if glm_cfg.smask_prob > 0 else None
  special = tokenizer.special_ids
  ds = grain.MapDataset.source(pieces)
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed)
  if repeat:
    ds = ds.repeat(None)
  ds = ds.random_map(
    lambda piece, rng: blank_infilling.corrupt_document(piece, rng, glm_cfg, special, ends), seed=corrupt_seed
  )
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  keys = blank_infilling.FEATURES + ("prefix_len",)
  it = FirstFitPackIterDataset(
    it,
    length_struct={k: seq_len for k in keys},
    num_packing_bins=batch_size,
    shuffle_bins=False,
    padding_struct={k: pad_id if k == "input_ids" else 0 for k in keys},
  )
  it = it.batch(batch_size, drop_remainder=repeat)
  return it.map(functools.partial(_blanks_batch, batch_size=batch_size, pad_id=pad_id))


class _GlmPieces:
  """The chosen documents cut into pieces that fit a row once corrupted (eos dropped; too-short documents left
  out): a random-access source of 1-D int32 arrays."""

  def __init__(self, tc: tokenized.TokenizedCorpus, doc_idx: np.ndarray, data_cfg: ml_collections.ConfigDict):
    max_len = blank_infilling.max_piece_len(data_cfg.seq_len, data_cfg.glm)
    self._tc, self._pieces = tc, []
    for d in doc_idx:
      n = len(tc.doc(int(d))) - 1  # without its eos
      self._pieces += [(int(d), a, b) for a, b in blank_infilling.pieces(n, max_len, data_cfg.glm)]

  def __len__(self) -> int:
    return len(self._pieces)

  def __getitem__(self, i: int) -> np.ndarray:
    d, a, b = self._pieces[i]
    return self._tc.doc(d)[a:b]


def _blanks_batch(packed: dict[str, np.ndarray], *, batch_size: int, pad_id: int) -> Batch:
  """The packer's rows of blank-infilling samples -> the model batch (the module docstring)."""
  seg = packed["input_ids_segment_ids"].astype(np.int32)
  real = seg > 0
  start = np.arange(seg.shape[1])[None, :] - packed["input_ids_positions"]  # each token's sample's first index
  batch = {
    "input_ids": np.where(real, packed["input_ids"], pad_id),
    "segment_ids": seg,
    "prefix_end": np.where(real, start + packed["prefix_len"], 0),
  }
  for k in ("targets", "loss_mask", "positions", "block_positions"):
    batch[k] = np.where(real, packed[k], 0)
  batch = {k: v.astype(np.int32) for k, v in batch.items()}
  missing = batch_size - seg.shape[0]
  if missing:  # the end of a finite (held-out) stream: complete the batch with padding rows
    batch = {
      k: np.concatenate([v, np.full((missing, v.shape[1]), pad_id if k == "input_ids" else 0, np.int32)])
      for k, v in batch.items()
    }
  return batch


def _truncate(example: dict[str, np.ndarray], *, seq_len: int) -> dict[str, np.ndarray]:
  return {k: np.asarray(v, np.int32)[:seq_len] for k, v in example.items()}


def _as_features(tokens: np.ndarray) -> dict[str, np.ndarray]:
  return {"input_ids": tokens}


def _model_batch(packed: dict[str, np.ndarray], *, batch_size: int, pad_id: int) -> Batch:
  """The packer's rows -> the model batch. loss_mask: the packed examples' ("sft"), else (segment_ids > 0)."""
  seg = packed["input_ids_segment_ids"].astype(np.int32)
  mask = packed["loss_mask"] if "loss_mask" in packed else seg > 0
  batch = {
    "input_ids": np.where(seg > 0, packed["input_ids"], pad_id).astype(np.int32),
    "segment_ids": seg,
    "positions": np.where(seg > 0, packed["input_ids_positions"], 0).astype(np.int32),
    "loss_mask": np.where(seg > 0, mask, 0).astype(np.int32),
  }
  missing = batch_size - seg.shape[0]
  if missing:  # the end of a finite (held-out) stream: complete the batch with padding rows
    fill = {"input_ids": pad_id, "segment_ids": 0, "positions": 0, "loss_mask": 0}
    batch = {k: np.concatenate([v, np.full((missing, v.shape[1]), fill[k], np.int32)]) for k, v in batch.items()}
  return batch


def _rows(batch: Batch, *, start: int, stop: int) -> Batch:
  return {k: v[start:stop] for k, v in batch.items()}


class _JsonSafeState(grain.IterDataset):
  """Passes its parent through, turning lists in a restored state back into tuples.

  grain 0.2.18's ConcatThenSplit iterator keeps (start, stop) slices as tuples and compares them with the
  tuple sentinel (-1, -1); after the JSON round trip of grain's Orbax CheckpointHandler they come back as
  lists, the comparison fails and a restore resumes from an empty slice (tested in tests/data)."""

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonSafeStateIterator(self._parent.__iter__())


class _JsonSafeStateIterator(grain.DatasetIterator):
  def __next__(self) -> Any:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_lists_to_tuples(state))


def _lists_to_tuples(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _lists_to_tuples(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return tuple(_lists_to_tuples(v) for v in x)
  return x
