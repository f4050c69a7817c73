"""Format "chat" (agentic SFT): conversations in GLM-5's chat format from jsonl, tools included. The pipeline's rows
against tokenize_conversation's ids and loss masks computed here, the BPE's training texts, truncation, the held-out
split, clear_thinking, and every bad line and config named by file, line and field."""

import json
import logging
import math
import re

import ml_collections
import numpy as np
import pytest
import tokenizers

from glm_jax import chat
from glm_jax.data import (
  SPECIAL_TOKENS,
  load_tokenizer,
  make_eval_batches,
  make_train_iterator,
  sources,
  unigram_entropy,
)
from glm_jax.data import tokenizer as tokenizer_lib
from glm_jax.data.conversations import tokenize_conversation

KEYS = {"input_ids", "segment_ids", "positions", "loss_mask"}


def _tool(name, prop, kind="string"):
  params = {"type": "object", "properties": {prop: {"type": kind}}, "required": [prop]}
  return {"type": "function", "function": {"name": name, "description": f"{name} a {prop}", "parameters": params}}


def _call(name, arguments):
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


CALC, LOOKUP = _tool("calc", "expr"), _tool("lookup", "verse")
CONVERSATIONS = [
  {  # a tool chain after the user's question: reasoning before each call, kept (interleaved thinking)
    "messages": [
      {"role": "system", "content": "You are a careful assistant."},
      {"role": "user", "content": "What is 37*91, plus 5?"},
      {
        "role": "assistant",
        "reasoning_content": "Multiply first.",
        "content": "",
        "tool_calls": [_call("calc", {"expr": "37*91"})],
      },
      {"role": "tool", "content": "3367"},
      {
        "role": "assistant",
        "reasoning_content": "Now add five.",
        "content": "",
        "tool_calls": [
          _call("calc", '{"expr": "3367+5"}')  # arguments as a JSON string, as OpenAI sends them
        ],
      },
      {"role": "tool", "content": "3372"},
      {"role": "assistant", "reasoning_content": "Done.", "content": "37*91 + 5 = 3372."},
    ],
    "tools": [CALC],
  },
  {  # several user turns: the earlier turn's reasoning is collapsed, the last one's kept
    "messages": [
      {"role": "user", "content": "Hello there"},
      {"role": "assistant", "reasoning_content": "A greeting.", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a short fact."},
      {"role": "assistant", "reasoning_content": "Something true.", "content": "Water boils at 100 C at sea level."},
      {"role": "user", "content": "Thanks, bye"},
      {"role": "assistant", "reasoning_content": "Part kindly.", "content": "Goodbye!"},
    ],
  },
  {  # two calls in one turn, two tool results in a row (one <|observation|> before them)
    "messages": [
      {"role": "user", "content": "Quote Genesis 1:1 and compute 2**10."},
      {
        "role": "assistant",
        "reasoning_content": "Two tools at once.",
        "content": "",
        "tool_calls": [
          _call("lookup", {"verse": "Genesis 1:1"}),
          _call("calc", {"expr": "2**10"}),
        ],
      },
      {"role": "tool", "content": "In the beginning God created the heaven and the earth."},
      {"role": "tool", "content": "1024"},
      {"role": "assistant", "reasoning_content": "Both came back.", "content": "The verse: In the beginning. 1024."},
    ],
    "tools": [LOOKUP, CALC],
  },
  {  # no reasoning, no tools block, ends on a tool result (no eos: the last turn is the tool's)
    "messages": [
      {"role": "user", "content": "Look up John 3:16."},
      {"role": "assistant", "content": "Looking it up.", "tool_calls": [_call("lookup", {"verse": "John 3:16"})]},
      {"role": "tool", "content": "For God so loved the world."},
    ],
    "tools": None,
  },
]


@pytest.fixture
def write_chat(tmp_path):
  def write(lines, name="chat.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)

  return write


@pytest.fixture
def chat_cfg(make_cfg, write_chat):
  """make(**overrides) -> (config, tokenizer): the four conversations, a 300-token BPE trained on them."""

  def make(**overrides):
    cfg = make_cfg(format="chat", source="jsonl", path=write_chat(CONVERSATIONS), bpe_vocab_size=300)
    cfg.update({"eval_fraction": 0.0, **overrides})
    return cfg, load_tokenizer(cfg)

  return make


def _want(tok, clear_thinking=True):
  """(ids, loss mask) of each conversation as tuples: tokenize_conversation on the lines as written."""
  out = []
  for c in CONVERSATIONS:
    ids, mask = tokenize_conversation(tok, c["messages"], tools=c.get("tools"), clear_thinking=clear_thinking)
    out.append((tuple(ids), tuple(mask)))
  return out


def _segments(batches):
  """Every (input_ids, loss_mask) segment of the batches, each checked to be one contiguous run with positions
  0, 1, ... and padding after the last: as tuples, in row-major order."""
  out = []
  for b in batches:
    assert b.keys() == KEYS and all(v.dtype == np.int32 for v in b.values())
    for ids, seg, pos, mask in zip(b["input_ids"], b["segment_ids"], b["positions"], b["loss_mask"]):
      n = seg.max()
      starts = [int(np.flatnonzero(seg == s)[0]) for s in range(1, n + 1)]
      ends = starts[1:] + [int(np.sum(seg > 0))]
      for s, (a, e) in enumerate(zip(starts, ends), 1):
        np.testing.assert_array_equal(seg[a:e], s)
        np.testing.assert_array_equal(pos[a:e], np.arange(e - a))
        out.append((tuple(ids[a:e].tolist()), tuple(mask[a:e].tolist())))
      np.testing.assert_array_equal(seg[ends[-1] :] if n else seg, 0)
  return out


def test_rows_are_tokenize_conversations_outputs_whatever_the_order(chat_cfg):
  cfg, tok = chat_cfg()
  want = _want(tok)
  lengths = [len(ids) for ids, _ in want]
  # The loss is on assistant tokens only, so every conversation has masked and trained tokens.
  assert all(sum(m) > 0 and 0 in m for _, m in want)
  # 4 bins of the longest conversation's length: the first epoch's 4 conversations each fit an empty bin, so the
  # first batch holds all of them (and, where room is left, some of the second epoch's), every segment whole.
  cfg.update(seq_len=max(lengths), batch_size=4)
  batch = next(make_train_iterator(cfg, tok))
  segs = _segments([batch])
  assert set(segs) == set(want) and len(segs) >= 4
  assert (batch["input_ids"][batch["segment_ids"] == 0] == tok.pad_id).all()
  # All in one row: seq_len the sum of the lengths, one bin; segment ids 1..4 and positions restart at each.
  cfg.update(seq_len=sum(lengths), batch_size=1)  # exactly the first epoch
  batch = next(make_train_iterator(cfg, tok))
  np.testing.assert_array_equal(np.unique(batch["segment_ids"]), [1, 2, 3, 4])
  assert sorted(_segments([batch])) == sorted(want)
  # The packed concatenation itself, in the row's order: ids, segment ids, positions and loss mask token for token.
  order = [want.index(s) for s in _segments([batch])]
  assert sorted(order) == [0, 1, 2, 3]
  np.testing.assert_array_equal(batch["input_ids"][0], sum((list(want[i][0]) for i in order), []))
  np.testing.assert_array_equal(batch["loss_mask"][0], sum((list(want[i][1]) for i in order), []))
  np.testing.assert_array_equal(
    batch["segment_ids"][0], sum(([k + 1] * len(want[i][0]) for k, i in enumerate(order)), [])
  )
  np.testing.assert_array_equal(batch["positions"][0], sum((list(range(len(want[i][0]))) for i in order), []))


def test_loss_mask_covers_exactly_the_assistants_text(chat_cfg):
  # Independently of tokenize_conversation: decode the trained tokens of the two-tool-results conversation; they are
  # its assistant turns' text after "<|assistant|><think>" and the stop token that ends each turn.
  cfg, tok = chat_cfg()
  ids, mask = _want(tok)[2]
  trained = tok.decode([i for i, m in zip(ids, mask) if m])
  assert trained == (
    "Two tools at once.</think><tool_call>lookup<arg_key>verse</arg_key><arg_value>Genesis 1:1</arg_value></tool_call>"
    "<tool_call>calc<arg_key>expr</arg_key><arg_value>2**10</arg_value></tool_call><|observation|>"
    "Both came back.</think>The verse: In the beginning. 1024.<|endoftext|>"
  )
  ids, mask = _want(tok)[1]  # the earlier turns' reasoning collapsed to </think>, the last turn's kept
  assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
    "</think>Hello! How can I help?<|user|></think>Water boils at 100 C at sea level.<|user|>"
    "Part kindly.</think>Goodbye!<|endoftext|>"
  )


def test_long_conversation_is_truncated_and_logged(chat_cfg, caplog):
  cfg, tok = chat_cfg()
  want = _want(tok)
  longest = max(len(ids) for ids, _ in want)
  cfg.update(seq_len=longest - 5, batch_size=4)
  with caplog.at_level(logging.WARNING):
    batch = next(make_train_iterator(cfg, tok))
  cut = {(ids[: cfg.seq_len], m[: cfg.seq_len]) for ids, m in want}  # 4 bins: the first epoch is in the batch
  assert set(_segments([batch])) == cut and len(cut) == 4
  msgs = [r.getMessage() for r in caplog.records if "longer than data.seq_len" in r.getMessage()]
  n = sum(len(ids) > cfg.seq_len for ids, _ in want)
  assert msgs == [
    f"{n} of 4 training examples are longer than data.seq_len={cfg.seq_len} tokens (the longest has {longest}) and "
    f"are cut to their first {cfg.seq_len} tokens"
  ]


def test_held_out_conversation_and_the_bpe_learns_the_training_texts_between_special_tokens(chat_cfg):
  cfg, tok = chat_cfg(eval_fraction=0.25)
  convs = sources.load_conversations(cfg)
  assert len(convs.eval_idx) == 1 and sorted([*convs.train_idx, *convs.eval_idx]) == [0, 1, 2, 3]
  # The BPE learns the training conversations' rendered text, cut at the special tokens (a BPE trainer merges across
  # special tokens' characters otherwise): the same tokenizer as training it here on those texts.
  special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
  rendered = [chat.render(CONVERSATIONS[i]["messages"], tools=CONVERSATIONS[i].get("tools")) for i in convs.train_idx]
  texts = [t for text in rendered for t in special.split(text) if t]
  reference = tokenizer_lib.Tokenizer(tokenizer_lib.train_bpe(texts, 300), "reference")
  assert tok.fingerprint == reference.fingerprint
  # Trained on the whole rendered text, the BPE would spend merges on the tags' letters ("<arg_key>" -> "key"),
  # which encode_chat never meets as text.
  assert {"key", "arg", "val"} <= set(tokenizer_lib.train_bpe(rendered, 300).get_vocab())
  assert not {"key", "arg", "val"} & set(tok.backend.get_vocab())

  want = _want(tok)
  cfg.update(seq_len=max(len(ids) for ids, _ in want), batch_size=2)
  evals = make_eval_batches(cfg, tok)
  assert _segments(evals) == [want[convs.eval_idx[0]]]
  train = _segments([next(make_train_iterator(cfg, tok)) for _ in range(4)])
  assert set(train) == {want[i] for i in convs.train_idx}


def test_clear_thinking_false_keeps_every_turns_reasoning(chat_cfg):
  cfg, tok = chat_cfg(clear_thinking=False)
  want = _want(tok, clear_thinking=False)
  assert want[1] != _want(tok)[1]  # the multi-turn conversation's earlier reasoning is kept now
  cfg.update(seq_len=sum(len(ids) for ids, _ in want), batch_size=1)
  assert sorted(_segments([next(make_train_iterator(cfg, tok))])) == sorted(want)


def test_unigram_entropy_counts_assistant_tokens_only(chat_cfg):
  cfg, tok = chat_cfg()
  want = _want(tok)
  cfg.seq_len = max(len(ids) for ids, _ in want)  # nothing cut
  trained = [i for ids, mask in want for i, m in zip(ids, mask) if m]
  counts = np.bincount(trained)
  p = counts[counts > 0] / len(trained)
  assert unigram_entropy(cfg, tok) == pytest.approx(-sum(x * math.log(x) for x in p), rel=1e-12)


USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(
  "line,match",
  [
    ("{not json", r"data\.path: .*bad\.jsonl:2 is not valid JSON"),
    ('["hi"]', r"data\.path: .*bad\.jsonl:2 holds a list, expected an object \{\"messages\""),
    ({"tools": []}, r"data\.path: .*bad\.jsonl:2: \"messages\": no such field; expected a non-empty list"),
    ({"messages": "hi"}, r"data\.path: .*bad\.jsonl:2: \"messages\": got \"hi\"; expected a non-empty list"),
    ({"messages": []}, r"data\.path: .*bad\.jsonl:2: \"messages\": got \[\]; expected a non-empty list"),
    (
      {"messages": [USER, {"role": "bot", "content": "x"}]},
      r"data\.path: .*bad\.jsonl:2: messages\[1\]\.role: 'bot' is not a role of GLM-5's chat format",
    ),
    (
      {"messages": [USER, dict(ANSWER, tool_calls=[_call("search", {"q": "x"})])], "tools": [CALC]},
      r"data\.path: .*bad\.jsonl:2: messages\[1\]\.tool_calls\[0\]\.function\.name: 'search' is not an offered tool",
    ),
    (
      {"messages": [USER, dict(ANSWER, tool_calls=[_call("calc", "[1]")])]},
      r"data\.path: .*bad\.jsonl:2: messages\[1\]\.tool_calls\[0\]\.function\.arguments: expected an object",
    ),
    (
      {"messages": [USER, ANSWER], "tools": {"name": "calc"}},
      r"data\.path: .*bad\.jsonl:2: tools: expected a list of function definitions",
    ),
    (
      {"messages": [USER, ANSWER], "tools": [{"name": "calc", "parameters": {"type": "array"}}]},
      r"data\.path: .*bad\.jsonl:2: tools\[0\]\.parameters: expected a JSON schema of an object",
    ),
    (
      {"messages": [{"role": "system", "content": "s"}, USER]},
      r"data\.path: .*bad\.jsonl:2: \"messages\" has no assistant message \(roles: system, user\); the loss is on "
      r"assistant turns only",
    ),
  ],
)
def test_bad_lines_name_file_line_and_field(make_cfg, write_chat, line, match):
  cfg = make_cfg(format="chat", source="jsonl", path=write_chat([CONVERSATIONS[1], line], name="bad.jsonl"))
  with pytest.raises(ValueError, match=match):
    load_tokenizer(cfg)  # before any BPE is trained


def test_bad_sources_configs_and_tokenizers_are_refused(make_cfg, write_chat, tmp_path, chat_cfg):
  path = write_chat(CONVERSATIONS)
  with pytest.raises(ValueError, match=r"empty corpus: data\.source='jsonl' .* has no conversations"):
    load_tokenizer(make_cfg(format="chat", source="jsonl", path=write_chat(["", "  "], name="empty.jsonl")))
  with pytest.raises(ValueError, match=r"data\.format='chat' with data\.source='text': .*\('jsonl',\)"):
    load_tokenizer(make_cfg(format="chat", source="text", path=path))
  bad = make_cfg(format="chat", source="jsonl", path=path).to_dict()
  bad["clear_thinking"] = "no"  # a config rebuilt from JSON (a ConfigDict's own field refuses the string)
  with pytest.raises(ValueError, match=r"data\.clear_thinking='no': expected True .* or False"):
    load_tokenizer(ml_collections.ConfigDict(bad))
  with pytest.raises(ValueError, match=r"data\.format='chats': expected one of \('lm', 'sft', 'chat'\)"):
    load_tokenizer(make_cfg(format="chats", source="jsonl", path=path))
  with pytest.raises(ValueError, match=r"data\.objective='glm' with data\.format='chat'"):
    load_tokenizer(make_cfg(format="chat", objective="glm", source="jsonl", path=path))
  one = write_chat(CONVERSATIONS[:1], name="one.jsonl")
  with pytest.raises(ValueError, match=r"data\.eval_fraction=0\.02: .*one\.jsonl' has 1 conversation"):
    load_tokenizer(make_cfg(format="chat", source="jsonl", path=one))
  # A tokenizer.json without the chat format's tokens (only the 7 roles of glm_jax/data/special_tokens.py).
  vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS[:7] + ("hi", "hello"))}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.save(str(tmp_path / "plain.json"))
  cfg = make_cfg(format="chat", source="jsonl", path=path, tokenizer=str(tmp_path / "plain.json"), eval_fraction=0.0)
  with pytest.raises(
    ValueError, match=r"data\.format='chat' with data\.tokenizer='.*plain\.json': .* lacks the special tokens"
  ):
    next(make_train_iterator(cfg, load_tokenizer(cfg)))
  # Nothing to train on: every conversation's first assistant token at or past seq_len.
  cfg, tok = chat_cfg()
  first = min(m.index(1) for _, m in _want(tok))
  cfg.update(seq_len=first, batch_size=2)
  with pytest.raises(
    ValueError,
    match=rf"data\.seq_len={first} leaves no assistant token to train on: each of the 4 training conversations of "
    rf"data\.source='jsonl' \(data\.path='.*chat\.jsonl'\) has at least data\.seq_len tokens before its first "
    rf"assistant token \(the fewest: {first}\)",
  ):
    next(make_train_iterator(cfg, tok))
