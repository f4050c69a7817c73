"""Agentic SFT examples (glm_jax/data/conversations.py) against hand-written chat text and the agent loop's layout:
the loss is on exactly what the model writes in each assistant turn, its stop token included."""

import numpy as np
import pytest

from glm_jax import chat
from glm_jax.data import default_data_config, load_tokenizer
from glm_jax.data.conversations import pack_conversations, tokenize_conversation
from glm_jax.rl.trajectory import Trajectory

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "37*91"}}}
CHAIN = [
  {"role": "user", "content": "What is 37*91?"},
  {"role": "assistant", "reasoning_content": "Use it.", "content": "", "tool_calls": [CALL]},
  {"role": "tool", "content": "3367"},
  {"role": "assistant", "reasoning_content": "Got it.", "content": "3367"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  cfg = default_data_config()
  cfg.cache_dir = str(tmp_path_factory.mktemp("cache"))
  return load_tokenizer(cfg)


def pieces_to(tok, pieces):
  ids, mask = [], []
  for text, m in pieces:
    piece = tok.encode_chat(text)
    ids += piece
    mask += [m] * len(piece)
  return ids, mask


def test_a_tool_chain_trains_on_the_models_turns_and_stops(tok):
  ids, mask = tokenize_conversation(tok, CHAIN, tools=[CALC])
  head = chat.render([], tools=[CALC])  # "[gMASK]<sop>" and the tools' system block
  want = pieces_to(
    tok,
    [
      (head + "<|user|>What is 37*91?<|assistant|><think>", 0),
      (
        "Use it.</think><tool_call>calc<arg_key>expr</arg_key><arg_value>37*91</arg_value></tool_call><|observation|>",
        1,
      ),
      ("<tool_response>3367</tool_response><|assistant|><think>", 0),
      ("Got it.</think>3367<|endoftext|>", 1),
    ],
  )
  assert (ids, mask) == want
  # The agent loop's layout for the same turns, sampled as these ids: the same sequence and loss mask.
  traj = Trajectory(tok, CHAIN[:1], tools=[CALC])
  n1 = len(tok.encode_chat(head + "<|user|>What is 37*91?<|assistant|><think>"))
  first = tok.encode_chat(
    "Use it.</think><tool_call>calc<arg_key>expr</arg_key><arg_value>37*91</arg_value></tool_call><|observation|>"
  )
  traj.add_sample(first, [0.0] * len(first))
  traj.add_observation(CHAIN[2:3])
  last = tok.encode_chat("Got it.</think>3367<|endoftext|>")
  traj.add_sample(last, [0.0] * len(last))
  assert traj.tokens == ids and traj.loss_mask == mask and traj.spans[0].end == n1


def test_earlier_reasoning_collapses_and_user_turns_are_masked(tok):
  convo = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "reasoning_content": "Part.", "content": "Goodbye"},
  ]
  ids, mask = tokenize_conversation(tok, convo)
  assert (ids, mask) == pieces_to(
    tok,
    [
      ("[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|>", 0),
      ("</think>Hello<|user|>", 1),  # its reasoning collapsed (before the last user message); <|user|> ends it
      ("Bye<|assistant|><think>", 0),
      ("Part.</think>Goodbye<|endoftext|>", 1),
    ],
  )
  kept, kept_mask = tokenize_conversation(tok, convo, clear_thinking=False)
  assert tok.decode([i for i, m in zip(kept, kept_mask) if m]).startswith("Greet.</think>Hello<|user|>")
  with pytest.raises(ValueError, match="without an assistant message"):
    tokenize_conversation(tok, convo[:2])
  with pytest.raises(ValueError, match=r"messages\[0\]\.role: 'bot' is not a role"):
    tokenize_conversation(tok, [{"role": "bot", "content": "x"}])


def test_packing_by_hand():
  examples = [([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1]), ([10, 11, 12, 13, 14, 15], [1] * 6), ([16], [1])]
  batch, used = pack_conversations(examples, batch_size=2, seq_len=5, pad_id=0)
  assert used == 3  # the 6-token example is cut to 5 and fills row 1; the last does not fit
  np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2, 2], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]])
