"""The training iterator as the trainer sees it: per-process shards, determinism, exact resume from a
JSON-round-tripped state, an Orbax CheckpointManager round trip, and held-out batches."""

import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from glm_jax.data import load_tokenizer, make_eval_batches, make_train_iterator, sources


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_batches_equal(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for k in w:
      np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_process_shards_are_disjoint_slices_of_the_global_batch(kjv):
  cfg, tok = kjv
  global_batches = _take(make_train_iterator(cfg, tok), 4)
  for count in (2, 4):
    shards = [_take(make_train_iterator(cfg, tok, process_index=p, process_count=count), 4) for p in range(count)]
    for step, want in enumerate(global_batches):
      for k in want:
        parts = [shards[p][step][k] for p in range(count)]
        assert all(part.shape == (cfg.batch_size // count, cfg.seq_len) for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts), want[k])
      rows = [tuple(r) for p in range(count) for r in shards[p][step]["input_ids"]]
      assert len(set(rows)) == len(rows)  # no row is served to two processes


def test_same_config_same_batches_other_seed_other_batches(kjv):
  cfg, tok = kjv
  _assert_batches_equal(_take(make_train_iterator(cfg, tok), 10), _take(make_train_iterator(cfg, tok), 10))
  other = cfg.copy_and_resolve_references()
  other.shuffle_seed = cfg.shuffle_seed + 1
  assert not np.array_equal(
    next(make_train_iterator(other, tok))["input_ids"], next(make_train_iterator(cfg, tok))["input_ids"]
  )


@pytest.fixture
def short_docs(make_cfg, write_jsonl, word_tokenizer):
  """Documents of 1 to 7 words, seq_len 5: rows end inside documents and exactly at their ends, documents
  span rows, and epochs (25 tokens) wrap every few batches: every kind of packer state occurs."""
  words = [f"w{i}" for i in range(8)]
  docs = [" ".join(words[:n]) for n in (1, 3, 7, 2, 5)]
  cfg = make_cfg(
    source="jsonl", path=write_jsonl(docs), tokenizer=word_tokenizer(words), seq_len=5, batch_size=2, eval_fraction=0.0
  )
  return cfg, load_tokenizer(cfg)


@pytest.mark.parametrize("corpus", ["short_docs", "kjv"])
def test_set_state_after_json_round_trip_resumes_exactly(corpus, request):
  cfg, tok = request.getfixturevalue(corpus)
  it = make_train_iterator(cfg, tok)
  states, batches = [], []
  for _ in range(40):
    states.append(json.loads(json.dumps(it.get_state())))  # what grain's Orbax handler writes and reads
    batches.append(next(it))
  batches += _take(it, 3)
  for k, state in enumerate(states):
    resumed = make_train_iterator(cfg, tok)
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 3), batches[k : k + 3])
  if corpus == "short_docs":
    # grain's packer state with no remainder, [-1, -1] after JSON: the case pipeline._JsonSafeState fixes.
    assert any(
      s["remainder_slices"]["input_ids"] == [-1, -1] and s["elements_from_buffer_after_checkpoint"] for s in states
    )


def test_orbax_checkpoint_manager_round_trip(kjv, tmp_path):
  cfg, tok = kjv
  it = make_train_iterator(cfg, tok)
  _take(it, 5)
  params = {"w": np.arange(6, dtype=np.float32)}
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(
      5, args=ocp.args.Composite(params=ocp.args.StandardSave(params), data=grain.checkpoint.CheckpointSave(it))
    )
    want = _take(it, 4)  # the original moves on while the (async) save completes
    mngr.wait_until_finished()
  assert (tmp_path / "ckpt" / "5" / "data" / "process_0-of-1.json").exists()

  fresh = make_train_iterator(cfg, tok)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    assert mngr.latest_step() == 5
    restored = mngr.restore(
      5,
      args=ocp.args.Composite(params=ocp.args.StandardRestore(params), data=grain.checkpoint.CheckpointRestore(fresh)),
    )
  np.testing.assert_array_equal(restored.params["w"], params["w"])
  assert restored.data is fresh
  _assert_batches_equal(_take(fresh, 4), want)


def test_eval_batches_are_the_held_out_documents_in_order(kjv):
  cfg, tok = kjv
  cfg = cfg.copy_and_resolve_references()
  cfg.seq_len, cfg.batch_size, cfg.eval_batches = 256, 8, 1000  # more than the held-out tokens fill
  corpus = sources.load_corpus(cfg)
  held = [tok.encode(corpus.docs[d]) + [tok.eos_id] for d in corpus.eval_idx]
  n_held = sum(map(len, held))

  batches = make_eval_batches(cfg, tok)
  assert len(batches) == -(-n_held // (cfg.seq_len * cfg.batch_size))
  ids = np.concatenate([b["input_ids"] for b in batches]).ravel()
  seg = np.concatenate([b["segment_ids"] for b in batches]).ravel()
  np.testing.assert_array_equal(ids[:n_held], np.concatenate(held))
  assert (seg[:n_held] > 0).all() and (seg[n_held:] == 0).all() and (ids[n_held:] == tok.pad_id).all()
  _assert_batches_equal(make_eval_batches(cfg, tok), batches)  # deterministic

  # Held-out documents never appear in training: no training document equals a held-out one.
  train_docs = {corpus.docs[d] for d in corpus.train_idx}
  assert not train_docs & {corpus.docs[d] for d in corpus.eval_idx}

  cfg.eval_batches = 2
  _assert_batches_equal(make_eval_batches(cfg, tok), batches[:2])
  halves = [make_eval_batches(cfg, tok, process_index=p, process_count=2) for p in (0, 1)]
  for step in range(2):
    np.testing.assert_array_equal(np.concatenate([h[step]["input_ids"] for h in halves]), batches[step]["input_ids"])
