"""Format "sft": prompt/response examples from jsonl and from the embedded Bible, their tokens and loss masks,
first-fit packing against hand-written rows, truncation, bad lines and configs, the held-out split,
determinism, exact resume, unigram_entropy over the response tokens, and loss_mask in format "lm" batches."""

import json
import logging
import math

import numpy as np
import pytest

from glm_jax.data import load_tokenizer, make_eval_batches, make_train_iterator, sources, tokenized, unigram_entropy
from glm_jax.data import tokenizer as tokenizer_lib
from glm_jax.data.pipeline import packed_examples_dataset

KEYS = {"input_ids", "segment_ids", "positions", "loss_mask"}
# The word tokenizer's ids: 0..6 are the special tokens (pad 0, eos 1), then these words from 7 on.
WORDS = ["what", "is", "one", "two", "three", "four", "five", "six", "seven", "eight"]
ID = {w: 21 + i for i, w in enumerate(WORDS)}  # after the 21 special tokens (hand count: 7 roles + 14 chat)
EOS, PAD = 1, 0


@pytest.fixture
def write_sft(tmp_path):
  def write(examples, name="sft.jsonl", prompt="prompt", response="response"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({prompt: p, response: r}) + "\n" for p, r in examples))
    return str(path)

  return write


@pytest.fixture
def sft_cfg(make_cfg, write_sft, word_tokenizer):
  """make(examples, **overrides) -> (config, tokenizer) of format "sft" from a jsonl, with the word tokenizer."""

  def make(examples, **overrides):
    cfg = make_cfg(
      format="sft", source="jsonl", path=write_sft(examples), tokenizer=word_tokenizer(WORDS), eval_fraction=0.0
    )
    cfg.update(overrides)
    return cfg, load_tokenizer(cfg)

  return make


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_batches_equal(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys() == KEYS
    for k in w:
      np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def _segments(batches):
  """Every (input_ids, loss_mask) segment of the batches, as tuples, in row-major order."""
  out = []
  for b in batches:
    for ids, seg, mask in zip(b["input_ids"], b["segment_ids"], b["loss_mask"]):
      for s in range(1, seg.max() + 1):
        out.append((tuple(ids[seg == s].tolist()), tuple(mask[seg == s].tolist())))
  return out


def test_first_fit_packing_hand_computed_rows():
  # Example i has tokens 10 * (i + 1) + j; lengths 5, 6, 3, 2, 4, 3 with prompts of 2, 3, 1, 0, 3, 1 tokens.
  # First fit into 2 rows of 8: E0 -> row 0; E1 (6) does not fit beside it -> row 1; E2 (3) fills row 0; E3 (2)
  # fills row 1; E4 fits nowhere -> rows 0 and 1 are batch 1, and E4 opens batch 2 with E5 beside it. The
  # stream ends there: batch 2 is that row and a padding row.
  lengths, prompts = [5, 6, 3, 2, 4, 3], [2, 3, 1, 0, 3, 1]
  examples = [
    {
      "input_ids": np.arange(10 * (i + 1), 10 * (i + 1) + n, dtype=np.int32),
      "loss_mask": (np.arange(n) >= p).astype(np.int32),
    }
    for i, (n, p) in enumerate(zip(lengths, prompts))
  ]
  batches = list(packed_examples_dataset(examples, seq_len=8, batch_size=2, pad_id=99, shuffle_seed=None, repeat=False))
  assert len(batches) == 2
  cat = {k: np.concatenate([b[k] for b in batches]) for k in KEYS}
  np.testing.assert_array_equal(
    cat["input_ids"],
    [[10, 11, 12, 13, 14, 30, 31, 32], [20, 21, 22, 23, 24, 25, 40, 41], [50, 51, 52, 53, 60, 61, 62, 99], [99] * 8],
  )
  np.testing.assert_array_equal(
    cat["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2, 2, 0], [0] * 8]
  )
  np.testing.assert_array_equal(
    cat["positions"], [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 0, 1, 2, 0], [0] * 8]
  )
  np.testing.assert_array_equal(
    cat["loss_mask"],
    [
      [0, 0, 1, 1, 1, 0, 1, 1],
      [0, 0, 0, 1, 1, 1, 1, 1],  # E3's prompt is empty: all of it counts
      [0, 0, 0, 1, 0, 1, 1, 0],
      [0] * 8,
    ],
  )
  for b in batches:
    assert b.keys() == KEYS and all(v.dtype == np.int32 and v.shape == (2, 8) for v in b.values())


def test_jsonl_examples_tokens_and_train_rows_hand_computed(sft_cfg):
  # Three examples of a 2-word prompt and a 1-word response: 4 tokens each with eos; 2 fit a row of 8.
  examples = [("what is", "one"), ("is what", "two"), ("what what", "three")]
  cfg, tok = sft_cfg(examples, seq_len=8, batch_size=2)
  te = tokenized.tokenize_examples(cfg, tok)
  w = ID
  want = [
    [w["what"], w["is"], w["one"], EOS],
    [w["is"], w["what"], w["two"], EOS],
    [w["what"], w["what"], w["three"], EOS],
  ]
  np.testing.assert_array_equal(te.tokens, sum(want, []))
  np.testing.assert_array_equal(te.offsets, [0, 4, 8, 12])
  np.testing.assert_array_equal(te.prompt_lens, [2, 2, 2])

  batches = _take(make_train_iterator(cfg, tok), 3)
  for b in batches:  # whatever the shuffled order: two whole examples a row
    assert b.keys() == KEYS
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 2, 2, 2, 2]] * 2)
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(b["loss_mask"], [[0, 0, 1, 1, 0, 0, 1, 1]] * 2)
  # The first epoch is the first 3 examples packed: row 0 and the first half of row 1 of batch 1.
  first = batches[0]["input_ids"]
  got = sorted(tuple(x) for x in (first[0, :4], first[0, 4:], first[1, :4]))
  assert got == sorted(tuple(x) for x in want)


def test_long_example_is_truncated_and_logged(sft_cfg, caplog):
  # 2 prompt tokens + 7 response tokens + eos = 10 > seq_len 6: the row keeps the first 6 (no eos).
  cfg, tok = sft_cfg([("what is", "one two three four five six seven")], seq_len=6, batch_size=2)
  with caplog.at_level(logging.WARNING):
    batch = next(make_train_iterator(cfg, tok))
  w = ID
  np.testing.assert_array_equal(
    batch["input_ids"], [[w["what"], w["is"], w["one"], w["two"], w["three"], w["four"]]] * 2
  )
  np.testing.assert_array_equal(batch["segment_ids"], [[1] * 6] * 2)
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 4, 5]] * 2)
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1, 1, 1]] * 2)
  msgs = [r.getMessage() for r in caplog.records if "longer than data.seq_len" in r.getMessage()]
  assert msgs == [
    "1 of 1 training examples are longer than data.seq_len=6 tokens (the longest has 10) and are "
    "cut to their first 6 tokens"
  ]


def test_jsonl_bad_lines_name_file_line_and_field(make_cfg, tmp_path):
  good = json.dumps({"prompt": "p", "response": "r"})
  cases = [
    (
      [good, "", json.dumps({"prompt": "p"})],
      r"data\.response_field='response': .*bad\.jsonl:3 has no such field "
      r"\(keys: \['prompt'\]\)",
    ),
    (
      [good, json.dumps({"prompt": 7, "response": "r"})],
      r"data\.prompt_field='prompt': .*bad\.jsonl:2 holds a int, "
      r"expected a string",
    ),
    (
      [json.dumps({"prompt": "p", "response": None})],
      r"data\.response_field='response': .*bad\.jsonl:1 holds a "
      r"NoneType",
    ),
    ([good, json.dumps(["p", "r"])], r"data\.prompt_field='prompt': .*bad\.jsonl:2 has no such field \(keys: list\)"),
    ([good, "{not json"], r"data\.path: .*bad\.jsonl:2 is not valid JSON"),
  ]
  for lines, match in cases:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
      load_tokenizer(make_cfg(format="sft", source="jsonl", path=str(path)))
  # Named fields: the message names the configured field.
  path = tmp_path / "qa.jsonl"
  path.write_text(json.dumps({"question": "q", "reply": "a"}) + "\n" + json.dumps({"question": "q"}) + "\n")
  with pytest.raises(ValueError, match=r"data\.response_field='answer': .*qa\.jsonl:1 has no such field"):
    sources.load_examples(
      make_cfg(
        format="sft",
        source="jsonl",
        path=str(path),
        prompt_field="question",
        response_field="answer",
        eval_fraction=0.0,
      )
    )
  with pytest.raises(ValueError, match=r"data\.response_field='reply': .*qa\.jsonl:2 has no such field"):
    sources.load_examples(
      make_cfg(
        format="sft", source="jsonl", path=str(path), prompt_field="question", response_field="reply", eval_fraction=0.0
      )
    )
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(ValueError, match=r"empty corpus: data\.source='jsonl' .* has no examples"):
    sources.load_examples(make_cfg(format="sft", source="jsonl", path=str(tmp_path / "empty.jsonl")))


@pytest.mark.parametrize(
  "overrides,match",
  [
    (dict(format="chats"), r"data\.format='chats': expected one of \('lm', 'sft', 'chat'\)"),
    (dict(format="sft", source="text"), r"data\.format='sft' with data\.source='text': .* \('embedded', 'jsonl'\)"),
    (
      dict(format="sft", source="arrayrecord"),
      r"data\.format='sft' with data\.source='arrayrecord': .* "
      r"\('embedded', 'jsonl'\)",
    ),
    (dict(format="sft", source="jsonl", prompt_field=""), r"data\.prompt_field='': name the jsonl field"),
    (
      dict(format="sft", source="jsonl", prompt_field="x", response_field="x"),
      r"data\.prompt_field='x' and data\.response_field='x' name the same field",
    ),
  ],
)
def test_bad_format_and_source_refused_before_any_work(make_cfg, overrides, match):
  cfg = make_cfg(path="/nonexistent.jsonl", **overrides)
  for fn in (
    load_tokenizer,
    lambda c: make_train_iterator(c, None),
    lambda c: make_eval_batches(c, None),
    lambda c: unigram_entropy(c, None),
  ):
    with pytest.raises(ValueError, match=match):
      fn(cfg)


def test_embedded_examples_are_the_verses():
  pairs = sources.embedded_examples()
  assert len(pairs) == 31_102  # the verses of the KJV
  assert pairs[0] == ("Genesis 1:1\n", "In the beginning God created the heavens and the earth.")
  assert pairs[2] == ("Genesis 1:3\n", "And God said, Let there be light: and there was light.")
  by_prompt = dict(pairs)
  assert len(by_prompt) == len(pairs)  # no reference twice
  # A row of two verses ("1:14-15") is split at the second verse number ...
  assert by_prompt["Genesis 1:14\n"].endswith("and for days, and years:")
  assert by_prompt["Genesis 1:15\n"].startswith("And let them be for lights")
  # ... also across a chapter ("6:30-7:1"); a verse's second paragraph follows after a space.
  assert by_prompt["Exodus 6:30\n"].endswith("how shall Pharaoh hearken unto me?")
  assert by_prompt["Exodus 7:1\n"].startswith("And the LORD said unto Moses, See, I have made thee a god")
  assert by_prompt["Revelation 22:20\n"] == (
    "He which testifieth these things saith, Surely I come quickly. Amen. Even so, come, Lord Jesus."
  )
  assert pairs[-1] == ("Revelation 22:21\n", "The grace of our Lord Jesus Christ be with you all. Amen.")
  assert not any(any(c.isdigit() for c in r) for _, r in pairs)  # no verse number left in a response


@pytest.fixture(scope="module")
def kjv_sft(kjv):
  cfg, tok = kjv
  cfg = cfg.copy_and_resolve_references()
  cfg.format, cfg.seq_len = "sft", 256  # the longest verse is 245 tokens: none is cut
  return cfg, tok


@pytest.mark.slow  # tokenizes the embedded SFT set
def test_embedded_sft_batches_hold_whole_verses_with_their_masks(kjv_sft):
  cfg, tok = kjv_sft
  # The trained BPE is the pretraining one (the chapters), so SFT can start from a pretraining checkpoint.
  assert load_tokenizer(cfg).fingerprint == tok.fingerprint
  ex = sources.load_examples(cfg)
  assert len(ex.eval_idx) == round(cfg.eval_fraction * 31_102)
  enc, keys = {}, []  # (the example's ids, cut to seq_len) -> its loss mask
  for ids_p, ids_r in zip(tok.encode_batch(ex.prompts), tok.encode_batch(ex.responses)):
    keys.append(tuple((ids_p + ids_r + [tok.eos_id])[: cfg.seq_len]))
    enc[keys[-1]] = tuple(([0] * len(ids_p) + [1] * (len(ids_r) + 1))[: cfg.seq_len])
  assert len(enc) == len(keys)
  held = {keys[i] for i in ex.eval_idx}

  batches = _take(make_train_iterator(cfg, tok), 20)
  segs = _segments(batches)
  assert len(segs) > 20 * cfg.batch_size
  for ids, mask in segs:
    assert enc[ids] == mask and ids not in held  # a whole training verse, its mask 0 on the reference
  for b in batches:
    seg = b["segment_ids"]
    assert ((b["input_ids"] == tok.pad_id) == (seg == 0)).all()
    assert (b["loss_mask"][seg == 0] == 0).all() and (b["positions"][seg == 0] == 0).all()

  evals = make_eval_batches(cfg, tok)
  assert len(evals) == cfg.eval_batches
  assert all(b.keys() == KEYS and all(v.shape == (cfg.batch_size, cfg.seq_len) for v in b.values()) for b in evals)
  assert all(ids in held and enc[ids] == mask for ids, mask in _segments(evals))


def test_held_out_examples_in_corpus_order_and_padding(sft_cfg):
  # 40 distinct examples of 3 to 7 response words; 10 held out by hash. seq_len 16 fits every one (<= 9 tokens).
  examples = [(WORDS[i % 2], " ".join(WORDS[2 : 3 + i % 5] + [WORDS[i // 10], WORDS[i % 10]])) for i in range(40)]
  cfg, tok = sft_cfg(examples, seq_len=16, batch_size=4, eval_fraction=0.25, eval_batches=100)
  ex = sources.load_examples(cfg)
  assert len(ex.eval_idx) == 10 and set(ex.eval_idx).isdisjoint(ex.train_idx)
  want = [
    (
      tuple(tok.encode(examples[i][0]) + tok.encode(examples[i][1]) + [EOS]),
      tuple([0] + [1] * (len(examples[i][1].split()) + 1)),
    )
    for i in ex.eval_idx
  ]
  batches = make_eval_batches(cfg, tok)
  got = _segments(batches)
  assert sorted(got) == sorted(want)
  # First fit of corpus order: the first row starts with the first held-out example.
  assert got[0] == want[0]
  last = batches[-1]
  assert all(b.keys() == KEYS and all(v.shape == (4, 16) for v in b.values()) for b in batches)
  np.testing.assert_array_equal(last["loss_mask"][last["segment_ids"] == 0], 0)
  np.testing.assert_array_equal(last["input_ids"][last["segment_ids"] == 0], PAD)
  _assert_batches_equal(make_eval_batches(cfg, tok), batches)
  # No held-out example in training.
  train = _segments(_take(make_train_iterator(cfg, tok), 10))
  assert not set(train) & set(want) and set(train) <= {
    (tuple(tok.encode(p) + tok.encode(r) + [EOS]), tuple([0] + [1] * (len(r.split()) + 1))) for p, r in examples
  }


@pytest.fixture
def varied(sft_cfg):
  """Seven examples of 3 to 9 tokens, seq_len 8 (one is truncated), 2 rows a batch: rows close with and without
  room left, and epochs wrap inside packing rounds."""
  examples = [
    ("what", "one"),
    ("what is", "one two three four five"),
    ("is", "two three"),
    ("what is is", "four five six seven eight"),
    ("is is", "six"),
    ("what", "seven eight"),
    ("is", "one two three four"),
  ]
  return sft_cfg(examples, seq_len=8, batch_size=2)


def test_same_seed_same_batches_other_seed_other_batches(varied, kjv_sft):
  for cfg, tok in (varied, kjv_sft):
    _assert_batches_equal(_take(make_train_iterator(cfg, tok), 10), _take(make_train_iterator(cfg, tok), 10))
    other = cfg.copy_and_resolve_references()
    other.shuffle_seed = cfg.shuffle_seed + 1
    a, b = _take(make_train_iterator(other, tok), 3), _take(make_train_iterator(cfg, tok), 3)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))


@pytest.mark.parametrize("corpus", ["varied", "kjv_sft"])
def test_set_state_after_json_round_trip_resumes_exactly(corpus, request):
  cfg, tok = request.getfixturevalue(corpus)
  it = make_train_iterator(cfg, tok)
  states, batches = [], []
  for _ in range(30):
    states.append(json.loads(json.dumps(it.get_state())))  # what grain's Orbax handler writes and reads
    batches.append(next(it))
  batches += _take(it, 3)
  for k, state in enumerate(states):
    resumed = make_train_iterator(cfg, tok)
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 3), batches[k : k + 3])


def test_process_shards_are_slices_of_the_global_batch(varied):
  cfg, tok = varied
  want = _take(make_train_iterator(cfg, tok), 5)
  halves = [_take(make_train_iterator(cfg, tok, process_index=p, process_count=2), 5) for p in (0, 1)]
  for step in range(5):
    for k in KEYS:
      np.testing.assert_array_equal(np.concatenate([halves[0][step][k], halves[1][step][k]]), want[step][k])


def test_unigram_entropy_counts_response_tokens_only(sft_cfg):
  # Loss tokens: [one one two eos] [one eos] -> one 3, two 1, eos 2 of 6; the prompts never count.
  cfg, tok = sft_cfg([("what is", "one one two"), ("is", "one")])
  want = -(0.5 * math.log(0.5) + (1 / 6) * math.log(1 / 6) + (1 / 3) * math.log(1 / 3))
  assert unigram_entropy(cfg, tok) == pytest.approx(want, rel=1e-12)
  # seq_len 4 keeps [what is one one] of the first example: one 3, eos 1 of 4.
  cfg.seq_len = 4
  assert unigram_entropy(cfg, tok) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), rel=1e-12)


def test_trained_bpe_of_a_jsonl_learns_the_training_examples(make_cfg, write_sft):
  examples = [(f"question {i}: ", f"the answer is {i * 7} and more words follow") for i in range(30)]
  cfg = make_cfg(format="sft", source="jsonl", path=write_sft(examples), bpe_vocab_size=300, eval_fraction=0.1)
  tok = load_tokenizer(cfg)
  ex = sources.load_examples(cfg)
  want = tokenizer_lib.train_bpe([examples[i][0] + examples[i][1] for i in ex.train_idx], 300)
  assert tok.fingerprint == tokenizer_lib.Tokenizer(want, "reference").fingerprint


def test_lm_batches_carry_loss_mask_of_real_tokens(kjv):
  cfg, tok = kjv
  cfg = cfg.copy_and_resolve_references()
  cfg.eval_batches = 1000  # every held-out batch, down to the padded last one
  evals = make_eval_batches(cfg, tok)
  for b in _take(make_train_iterator(cfg, tok), 3) + evals:
    assert b.keys() == KEYS and b["loss_mask"].dtype == np.int32
    np.testing.assert_array_equal(b["loss_mask"], (b["segment_ids"] > 0).astype(np.int32))
  assert (evals[-1]["loss_mask"] == 0).any()  # the padding of the last held-out batch does not count
