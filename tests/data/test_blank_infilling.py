"""GLM's blank infilling (data.objective = "glm"): the corruption of hand-written documents against hand-computed
samples, the span draws' statistics against plain formulas, and the Grain pipeline on the embedded corpus (every
sample decodes back to a piece of a document, deterministic, resumable)."""

import json
import math

import numpy as np
import pytest

from glm_jax.data import blank_infilling as bi
from glm_jax.data import load_tokenizer, make_eval_batches, make_train_iterator, tokenized, validate_data_config

SPECIAL = {"pad": 0, "eos": 1, "mask": 2, "gmask": 3, "sop": 4, "eop": 5, "smask": 6}
DOC = list(range(10, 22))  # a 12-token document: x0 .. x11 = 10 .. 21


def attention(prefix_len, n):
  """Key j visible to query i when j <= i or j < prefix_len: GLM's rule, one line."""
  return np.array([[j <= i or j < prefix_len for j in range(n)] for i in range(n)])


def test_two_mask_spans_in_shuffled_order_by_hand():
  """Spans x2 x3 and x7, part B in the order (second, first)."""
  got = bi.corrupt(DOC, [(2, 4), (7, 8)], "mask", SPECIAL, order=[1, 0])
  assert got["input_ids"].tolist() == [10, 11, 2, 14, 15, 16, 2, 18, 19, 20, 21, 4, 17, 4, 12, 13]
  assert got["targets"].tolist() == [0] * 11 + [17, 5, 12, 13, 5]
  assert got["loss_mask"].tolist() == [0] * 11 + [1, 1, 1, 1, 1]
  assert got["positions"].tolist() == list(range(11)) + [6, 6, 2, 2, 2]
  assert got["block_positions"].tolist() == [0] * 11 + [1, 2, 1, 2, 3]
  assert got["prefix_len"] == 11
  mask = attention(got["prefix_len"], 16)
  assert mask[0, 10] and mask[3, 9] and not mask[3, 11] and not mask[10, 11]  # part A both ways, not into B
  assert mask[11].sum() == 12 and mask[15].all() and not mask[12, 13]  # B: all of A and the B before it


def test_gmask_span_at_the_end_by_hand():
  got = bi.corrupt(DOC, [(5, 12)], "gmask", SPECIAL)
  assert got["input_ids"].tolist() == [10, 11, 12, 13, 14, 3, 4, 15, 16, 17, 18, 19, 20, 21]
  assert got["targets"].tolist() == [0] * 6 + [15, 16, 17, 18, 19, 20, 21, 5]
  assert got["loss_mask"].tolist() == [0] * 6 + [1] * 8
  assert got["positions"].tolist() == [0, 1, 2, 3, 4, 5] + [5] * 8
  assert got["block_positions"].tolist() == [0] * 6 + [1, 2, 3, 4, 5, 6, 7, 8]
  assert got["prefix_len"] == 6


def test_smask_sentences_by_hand():
  """Two sentences (x0..x3 and x8..x11) blanked with [sMASK]; the sentence ranges from a table of ends."""
  ends = np.zeros(30, bool)
  ends[[13, 17]] = True  # x3 and x7 end sentences
  assert bi.sentences(np.asarray(DOC), ends) == [(0, 4), (4, 8), (8, 12)]
  got = bi.corrupt(DOC, [(0, 4), (8, 12)], "smask", SPECIAL)
  assert got["input_ids"].tolist() == [6, 14, 15, 16, 17, 6, 4, 10, 11, 12, 13, 4, 18, 19, 20, 21]
  assert got["targets"].tolist() == [0] * 6 + [10, 11, 12, 13, 5, 18, 19, 20, 21, 5]
  assert got["positions"].tolist() == list(range(6)) + [0] * 5 + [5] * 5
  assert got["block_positions"].tolist() == [0] * 6 + [1, 2, 3, 4, 5] * 2
  assert got["prefix_len"] == 6


def _cfg(**changes):
  cfg = bi.default_glm_config()
  cfg.update(changes)
  return cfg


def test_mask_draws():
  """Exactly ceil(0.15 n) tokens masked, spans inside the document with an unmasked token between two, and the
  span lengths' mean near the truncated Poisson(3)'s, a plain formula (spans not cut by the budget only)."""
  cfg = _cfg()
  rng = np.random.default_rng(0)
  lengths = []
  for n in (7, 20, 100, 250):
    for _ in range(300):
      spans = bi.draw_spans(rng, n, "mask", cfg)
      assert sum(e - s for s, e in spans) == math.ceil(0.15 * n)
      assert all(0 <= s < e <= n for s, e in spans)
      assert all(e1 < s2 for (_, e1), (s2, _) in zip(spans[:-1], spans[1:]))  # not touching
      if n == 250:
        lengths += [e - s for s, e in spans[:-1]]  # the last span may be cut to the budget
  pmf = [math.exp(-3) * 3**k / math.factorial(k) for k in range(1, 40)]
  mean = sum(k * p for k, p in zip(range(1, 40), pmf)) / sum(pmf)  # 3.157
  # n = 250: 38 masked tokens a draw, ~10 full spans, ~3000 lengths of std ~1.6: the standard error is ~0.03.
  assert abs(np.mean(lengths) - mean) < 0.15, (np.mean(lengths), mean)


def test_gmask_and_smask_draws():
  cfg = _cfg()
  rng = np.random.default_rng(1)
  for n in (2, 3, 12, 101):
    lens = {bi.draw_spans(rng, n, "gmask", cfg)[0] for _ in range(2000)}
    assert all(e == n and math.ceil(0.5 * n) <= e - s <= n - 1 for s, e in lens)
  assert {e - s for s, e in lens} == set(range(51, 101))  # n = 101: every length from 51 to 100 occurs (each is
  #                                                         missing from 2000 uniform draws with probability 3e-18)
  ranges = [(0, 4), (4, 8), (8, 9), (9, 20)]
  for _ in range(50):
    spans = bi.draw_spans(rng, 20, "smask", cfg, ranges)
    assert set(spans) <= set(ranges) and sum(e - s for s, e in spans) >= 3  # ceil(0.15 * 20) = 3


def test_bad_draws_name_the_field():
  with pytest.raises(ValueError, match=r"data.glm.mask_ratio=0.0 .*\(0, 1\)"):
    bi.check_glm_config(_cfg(mask_ratio=0))
  with pytest.raises(ValueError, match=r"data.glm.mask_ratio=1.5"):
    bi.check_glm_config(_cfg(mask_ratio=1.5))
  with pytest.raises(ValueError, match=r"gmask_min=0.9 .*gmask_max=0.6"):
    bi.check_glm_config(_cfg(gmask_min=0.9, gmask_max=0.6))
  with pytest.raises(ValueError, match=r"sum to 1"):
    bi.check_glm_config(_cfg(mask_prob=0.5))
  with pytest.raises(ValueError, match=r"data.glm.poisson_lambda=-1.0 .*> 0"):
    bi.check_glm_config(_cfg(poisson_lambda=-1))
  with pytest.raises(ValueError, match=r"a document of 1 tokens is too short for a \[gmask\] draw.*at least 2 tokens"):
    bi.draw_spans(np.random.default_rng(0), 1, "gmask", _cfg())
  with pytest.raises(ValueError, match=r"a document of 2 tokens is too short for a \[mask\].*n >= 3"):
    bi.draw_spans(np.random.default_rng(0), 2, "mask", _cfg(mask_ratio=0.6))
  with pytest.raises(ValueError, match=r"no 'sop' token"):
    bi.corrupt(DOC, [(1, 2)], "mask", {k: v for k, v in SPECIAL.items() if k != "sop"})
  with pytest.raises(ValueError, match=r"data.seq_len=3: a row holds no corrupted document"):
    bi.max_piece_len(3, _cfg())  # a one-token piece fits 3 tokens, but [gMASK] needs two


def test_piece_lengths_always_fit_a_row():
  """max_piece_len is the longest n with n + 2 * (the most spans n can get) <= seq_len, by brute force."""
  cfg = _cfg(smask_prob=0.1, mask_prob=0.2)
  for seq_len in (16, 64, 256, 1000):
    n = bi.max_piece_len(seq_len, cfg)
    worst = lambda m: m + 2 * max(1, math.ceil(0.15 * m))  # noqa: E731
    assert worst(n) <= seq_len < worst(n + 1)


# ---- the pipeline on the embedded corpus ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm_data(tmp_path_factory):
  from glm_jax.data import default_data_config

  cfg = default_data_config()
  cfg.cache_dir = str(tmp_path_factory.mktemp("cache"))
  cfg.seq_len, cfg.batch_size, cfg.objective = 128, 4, "glm"
  cfg.glm.update(mask_prob=0.3, smask_prob=0.4, gmask_prob=0.3)
  tok = load_tokenizer(cfg)
  return cfg, tok


def reconstruct(batch, row, seg, ids):
  """The original piece of one packed sample: part A with each mask replaced by the span whose B tokens sit at its
  position. Checks the layout's invariants on the way."""
  idx = np.flatnonzero(batch["segment_ids"][row] == seg)
  start, end = idx[0], idx[-1] + 1
  pe = batch["prefix_end"][row, idx]
  assert (pe == pe[0]).all() and start < pe[0] < end
  a = batch["input_ids"][row, start : pe[0]].tolist()
  assert batch["positions"][row, start : pe[0]].tolist() == list(range(pe[0] - start))
  assert not batch["loss_mask"][row, start : pe[0]].any() and not batch["block_positions"][row, start : pe[0]].any()
  spans = {}
  t = pe[0]
  while t < end:
    assert batch["input_ids"][row, t] == ids["sop"] and batch["block_positions"][row, t] == 1
    u = t + 1
    while u < end and batch["block_positions"][row, u] > 1:
      u += 1
    mask_pos = batch["positions"][row, t]
    assert (batch["positions"][row, t:u] == mask_pos).all()
    assert batch["block_positions"][row, t:u].tolist() == list(range(1, u - t + 1))
    assert a[mask_pos] in (ids["mask"], ids["smask"], ids["gmask"])
    body = batch["input_ids"][row, t + 1 : u].tolist()
    assert batch["targets"][row, t:u].tolist() == body + [ids["eop"]] and batch["loss_mask"][row, t:u].all()
    spans[mask_pos] = body
    t = u
  assert sorted(spans) == [i for i, x in enumerate(a) if x in (ids["mask"], ids["smask"], ids["gmask"])]
  out = []
  for i, x in enumerate(a):
    out += spans[i] if i in spans else [x]
  return out


def test_pipeline_samples_are_corrupted_pieces_of_documents(glm_data):
  cfg, tok = glm_data
  tc = tokenized.tokenize_corpus(cfg, tok)
  docs = [tc.doc(int(d))[:-1].tobytes() for d in tc.train_idx]
  ids = tok.special_ids
  it = make_train_iterator(cfg, tok)
  kinds = set()
  for _ in range(8):  # ~32 samples: every kind occurs (a kind missing from all: < 0.7^32 = 1e-5)
    batch = next(it)
    assert set(batch) == {
      "input_ids",
      "targets",
      "loss_mask",
      "segment_ids",
      "positions",
      "block_positions",
      "prefix_end",
    }
    assert all(v.shape == (4, 128) and v.dtype == np.int32 for v in batch.values())
    for row in range(4):
      segs = [s for s in np.unique(batch["segment_ids"][row]) if s > 0]
      for seg in segs:
        piece = np.asarray(reconstruct(batch, row, seg, ids), np.int32).tobytes()
        assert any(d.find(piece) % 4 == 0 for d in docs if piece in d)  # a contiguous run of one document
        kinds |= {
          x
          for x in batch["input_ids"][row][batch["segment_ids"][row] == seg]
          if x in (ids["mask"], ids["smask"], ids["gmask"])
        }
      pad = batch["segment_ids"][row] == 0
      assert (batch["input_ids"][row][pad] == tok.pad_id).all() and not batch["prefix_end"][row][pad].any()
  assert kinds == {ids["mask"], ids["smask"], ids["gmask"]}


def test_pipeline_is_deterministic_and_resumes(glm_data):
  cfg, tok = glm_data
  first = [next(make_train_iterator(cfg, tok)) for _ in range(1)][0]
  it = make_train_iterator(cfg, tok)
  batches = [next(it) for _ in range(2)]
  for k in first:
    np.testing.assert_array_equal(first[k], batches[0][k])
  state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores
  after = [next(it) for _ in range(2)]
  again = make_train_iterator(cfg, tok)
  again.set_state(state)
  for want in after:
    got = next(again)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  other = cfg.copy_and_resolve_references()
  other.shuffle_seed = 1
  assert not np.array_equal(next(make_train_iterator(other, tok))["input_ids"], first["input_ids"])
  # The held-out blanks do not depend on the training seed.
  for a, b in zip(make_eval_batches(cfg, tok), make_eval_batches(other, tok)):
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_bad_data_configs_name_the_field(glm_data):
  cfg, _ = glm_data
  bad = cfg.copy_and_resolve_references()
  bad.objective = "bert"
  with pytest.raises(ValueError, match=r"data.objective='bert'"):
    validate_data_config(bad)
  bad = cfg.copy_and_resolve_references()
  bad.format = "sft"
  with pytest.raises(ValueError, match=r"data.objective='glm' with data.format='sft'"):
    validate_data_config(bad)
  bad = cfg.copy_and_resolve_references()
  bad.glm.mask_ratio = 1.0
  with pytest.raises(ValueError, match=r"data.glm.mask_ratio=1.0"):
    validate_data_config(bad)
  bad = cfg.copy_and_resolve_references()
  bad.seq_len = 2
  with pytest.raises(ValueError, match=r"data.seq_len=2: a row holds no corrupted document"):
    validate_data_config(bad)
