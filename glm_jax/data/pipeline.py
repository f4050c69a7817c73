"""The Grain pipeline: documents -> shuffle (seeded, new order each epoch) -> repeat -> pack -> batch -> shard.

  MapDataset.source(documents' tokens, each ended by eos)
    .shuffle(shuffle_seed).repeat()               index-level shuffle, reseeded every epoch
    .to_iter_dataset()
    ConcatThenSplitIterDataset(seq_len)           grain's concat-then-split packer (no padding in training)
    .batch(global batch).map(to model batch)      rows -> {"input_ids", "segment_ids", "positions"}
    .map(this process's rows)                     process p keeps rows [p*B/P, (p+1)*B/P) of every batch

Packing: documents are laid end to end; a row is cut every seq_len tokens. Within a row, segment_ids
number the documents 1, 2, ... and positions restart at 0 at each document start. A document cut by a row
boundary (and a document longer than seq_len, cut into several pieces) continues in the next row as a new
segment whose positions restart at 0. Padding (segment id 0, input id pad_id) appears only in the last
held-out batch.

Sharding: every process packs the same global stream and keeps its own rows, so the global batch does not
depend on the number of processes (resume on a different host count sees the same data), at the cost of each
host packing the whole global batch: cheap next to a training step for the in-memory corpora here.

The iterator's state is a small JSON-able dict; it goes into the checkpoint with the model through grain's
Orbax handler (see glm_jax/data/__init__.py).
"""

from __future__ import annotations

import functools
from typing import Any

import grain
import ml_collections
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from glm_jax.data import config as config_lib
from glm_jax.data import tokenized
from glm_jax.data.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]  # "input_ids", "segment_ids", "positions": [rows, seq_len] int32


def make_train_iterator(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
  """An endless iterator of this process's share of the training batches: [batch_size // process_count,
  seq_len] int32 arrays. Deterministic given data.shuffle_seed; get_state() / set_state() resume exactly."""
  config_lib.validate_data_config(data_cfg)
  local = config_lib.check_process_split(data_cfg, process_index, process_count)
  tc = tokenized.tokenize_corpus(data_cfg, tokenizer)
  ds = packed_dataset(_DocTokens(tc, tc.train_idx), seq_len=data_cfg.seq_len, batch_size=data_cfg.batch_size,
                      pad_id=tokenizer.pad_id, shuffle_seed=data_cfg.shuffle_seed, repeat=True)
  ds = ds.map(functools.partial(_rows, start=process_index * local, stop=(process_index + 1) * local))
  return iter(ds)


def make_eval_batches(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, process_index: int = 0,
                      process_count: int = 1) -> list[Batch]:
  """The held-out documents in corpus order, packed like the training data: at most data.eval_batches
  batches (fewer when the held-out tokens run out, none when data.eval_fraction is 0); the last one is
  completed with padding (segment id 0, input id pad_id)."""
  config_lib.validate_data_config(data_cfg)
  local = config_lib.check_process_split(data_cfg, process_index, process_count)
  tc = tokenized.tokenize_corpus(data_cfg, tokenizer)
  if data_cfg.eval_batches == 0 or len(tc.eval_idx) == 0:
    return []
  it = iter(packed_dataset(_DocTokens(tc, tc.eval_idx), seq_len=data_cfg.seq_len,
                           batch_size=data_cfg.batch_size, pad_id=tokenizer.pad_id, shuffle_seed=None,
                           repeat=False))
  batches = []
  for batch in it:
    batches.append(_rows(batch, start=process_index * local, stop=(process_index + 1) * local))
    if len(batches) == data_cfg.eval_batches:
      break
  return batches


def unigram_entropy(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> float:
  """H = -sum_v p_v ln p_v (nats/token) of the training split's token frequencies, eos included, pad
  excluded: the loss of the best model that ignores context, the baseline a trained model must beat."""
  config_lib.validate_data_config(data_cfg)
  tc = tokenized.tokenize_corpus(data_cfg, tokenizer)
  counts = np.bincount(tc.split_tokens(tc.train_idx), minlength=tokenizer.vocab_size).astype(np.float64)
  counts[tokenizer.pad_id] = 0.0
  p = counts[counts > 0] / counts.sum()
  return float(-np.sum(p * np.log(p)))


def packed_dataset(docs, *, seq_len: int, batch_size: int, pad_id: int, shuffle_seed: int | None,
                   repeat: bool) -> grain.IterDataset:
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


def _as_features(tokens: np.ndarray) -> dict[str, np.ndarray]:
  return {"input_ids": tokens}


def _model_batch(packed: dict[str, np.ndarray], *, batch_size: int, pad_id: int) -> Batch:
  seg = packed["input_ids_segment_ids"].astype(np.int32)
  batch = {"input_ids": np.where(seg > 0, packed["input_ids"], pad_id).astype(np.int32),
           "segment_ids": seg,
           "positions": packed["input_ids_positions"].astype(np.int32)}
  missing = batch_size - seg.shape[0]
  if missing:  # the end of a finite (held-out) stream: complete the batch with padding rows
    fill = {"input_ids": pad_id, "segment_ids": 0, "positions": 0}
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
