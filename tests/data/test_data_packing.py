"""Packing: segment ids and positions against hand-computed rows, and every training token exactly once an
epoch (counts and whole documents) against an independent tokenization of the training split."""

import collections

import numpy as np
import pytest

from glm_jax.data import load_tokenizer, make_train_iterator, sources
from glm_jax.data.pipeline import packed_dataset


def test_pack_hand_computed_rows_split_documents_and_padding():
  # Documents of lengths 5, 3, 9, 2; token j of document i is 10 * (i + 1) + j. seq_len 8, 2 rows a batch.
  docs = [np.arange(10 * (i + 1), 10 * (i + 1) + n, dtype=np.int32) for i, n in enumerate([5, 3, 9, 2])]
  batches = list(packed_dataset(docs, seq_len=8, batch_size=2, pad_id=99, shuffle_seed=None, repeat=False))
  assert len(batches) == 2
  ids = np.concatenate([b["input_ids"] for b in batches])
  seg = np.concatenate([b["segment_ids"] for b in batches])
  pos = np.concatenate([b["positions"] for b in batches])
  np.testing.assert_array_equal(
    ids,
    [
      [10, 11, 12, 13, 14, 20, 21, 22],
      [30, 31, 32, 33, 34, 35, 36, 37],  # the 9-token document fills a row ...
      [38, 40, 41, 99, 99, 99, 99, 99],  # ... and its last token opens the next one
      [99] * 8,
    ],
  )  # the final batch is completed with a padding row
  np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 1, 2, 2, 2], [1] * 8, [1, 2, 2, 0, 0, 0, 0, 0], [0] * 8])
  np.testing.assert_array_equal(
    pos,
    [
      [0, 1, 2, 3, 4, 0, 1, 2],
      [0, 1, 2, 3, 4, 5, 6, 7],
      [0, 0, 1, 0, 0, 0, 0, 0],  # the piece of a split document restarts at position 0
      [0] * 8,
    ],
  )
  np.testing.assert_array_equal(
    np.concatenate([b["loss_mask"] for b in batches]),
    [
      [1] * 8,  # format "lm": every real token counts ...
      [1] * 8,
      [1, 1, 1, 0, 0, 0, 0, 0],  # ... the padding does not
      [0] * 8,
    ],
  )
  for b in batches:
    assert b.keys() == {"input_ids", "segment_ids", "positions", "loss_mask"}
    assert all(v.dtype == np.int32 and v.shape == (2, 8) for v in b.values())


def test_train_iterator_hand_computed_segments(make_cfg, write_jsonl, word_tokenizer):
  # Three documents of 3 words + eos = 4 tokens, seq_len 6: whatever the shuffled order, row r holds stream
  # tokens [6r, 6r + 6), so a document boundary falls after 4 tokens in even rows and after 2 in odd rows.
  words = ["a", "b", "c"]
  tok_path = word_tokenizer(words)
  cfg = make_cfg(
    source="jsonl",
    path=write_jsonl(["a b c", "b c a", "c a b"]),
    tokenizer=tok_path,
    seq_len=6,
    batch_size=2,
    eval_fraction=0.0,
  )
  tok = load_tokenizer(cfg)
  it = make_train_iterator(cfg, tok)
  batches = [next(it) for _ in range(3)]
  for b in batches:
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 2, 2], [1, 1, 2, 2, 2, 2]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 3]])
    eos = b["input_ids"] == tok.eos_id
    np.testing.assert_array_equal(eos, [[0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 1]])
  # The first 12 tokens (one epoch) are the three documents, each once.
  stream = np.concatenate([b["input_ids"].ravel() for b in batches])
  firsts = sorted(tuple(stream[i : i + 3]) for i in range(0, 12, 4))
  want = sorted(tuple(tok.encode(d)) for d in ["a b c", "b c a", "c a b"])
  assert firsts == want


def _reference_segments(ids_RT: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and positions from the tokens alone: a segment starts at each row start and after each eos."""
  starts = np.zeros(ids_RT.shape, bool)
  starts[:, 0] = True
  starts[:, 1:] = ids_RT[:, :-1] == eos_id
  seg = np.cumsum(starts, axis=1)
  t = np.arange(ids_RT.shape[1])
  pos = t - np.maximum.accumulate(np.where(starts, t, 0), axis=1)
  return seg, pos


@pytest.mark.slow  # a whole epoch of the corpus
def test_every_training_token_once_per_epoch_on_embedded_corpus(kjv):
  cfg, tok = kjv
  cfg = cfg.copy_and_resolve_references()
  cfg.seq_len, cfg.batch_size = 512, 32
  corpus = sources.load_corpus(cfg)
  train_docs = [tok.encode(corpus.docs[d]) + [tok.eos_id] for d in corpus.train_idx]
  n_epoch = sum(len(d) for d in train_docs)
  want_counts = np.bincount(np.concatenate(train_docs), minlength=tok.vocab_size)

  it = make_train_iterator(cfg, tok)
  per_batch = cfg.seq_len * cfg.batch_size
  batches = [next(it) for _ in range(2 * n_epoch // per_batch + 2)]
  ids = np.concatenate([b["input_ids"] for b in batches])
  seg = np.concatenate([b["segment_ids"] for b in batches])
  pos = np.concatenate([b["positions"] for b in batches])

  want_seg, want_pos = _reference_segments(ids, tok.eos_id)
  np.testing.assert_array_equal(seg, want_seg)
  np.testing.assert_array_equal(pos, want_pos)
  assert (seg > 0).all() and not (ids == tok.pad_id).any()  # training rows carry no padding

  stream = ids.ravel()
  epochs = [stream[:n_epoch], stream[n_epoch : 2 * n_epoch]]
  for epoch in epochs:
    np.testing.assert_array_equal(np.bincount(epoch, minlength=tok.vocab_size), want_counts)
    # ... and as whole documents: split at eos, the epoch is a permutation of the training documents.
    ends = np.flatnonzero(epoch == tok.eos_id) + 1
    got_docs = collections.Counter(tuple(d) for d in np.split(epoch, ends)[:-1])
    assert got_docs == collections.Counter(tuple(d) for d in train_docs)
  # Each epoch has its own order.
  assert not np.array_equal(epochs[0][:per_batch], epochs[1][:per_batch])
