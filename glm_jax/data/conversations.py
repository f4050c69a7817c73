"""Conversations in GLM-5's chat format as training examples: token ids and the loss mask of agentic SFT.

  ids, mask = tokenize_conversation(tokenizer, messages, tools=tools)
  batch, used = pack_conversations([(ids, mask), ...], batch_size=8, seq_len=512, pad_id=tokenizer.pad_id)

The conversation is rendered as the released template renders it (glm_jax/chat.py: interleaved reasoning kept after
the last user message, collapsed before it unless clear_thinking=False), one piece a message, each piece encoded
with `Tokenizer.encode_chat` (every piece starts at a format token, so the pieces' ids are the whole text's). The
loss is on what the model writes in an assistant turn and nothing else: after the turn's `<|assistant|>` (and the
`<think>` that opens it, which the generation prompt supplies at sampling time), its reasoning, `</think>`, content
and tool calls, and the token that ends the turn when it is a stop token of the format (`<|observation|>` before
tool results, `<|user|>` before a user message; `<|endoftext|>` is appended after a final assistant turn). System,
user and tool messages, the tools' system block and role tokens are masked. This is the agent loop's layout
(glm_jax/rl/agent_loop.py): a trajectory's loss mask and this one agree token for token on the same turns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm_jax import chat
from glm_jax.data.tokenizer import Tokenizer


def tokenize_conversation(
  tokenizer: Tokenizer,
  messages: Sequence[dict],
  *,
  tools: list[dict] | None = None,
  clear_thinking: bool = True,
) -> tuple[list[int], list[int]]:
  """(ids, loss mask) of one conversation (module docstring); ValueError naming a message the chat format refuses,
  or a conversation without an assistant turn (nothing to learn)."""
  pieces = chat.render_pieces(list(messages), tools=tools, clear_thinking=clear_thinking)
  roles = [None] + [m["role"] for m in messages]  # piece 0 is the head
  if "assistant" not in roles:
    raise ValueError("a conversation without an assistant message has no token to train on")
  ids: list[int] = []
  mask: list[int] = []
  stops = {tokenizer.chat_ids[s] for s in ("<|observation|>", "<|user|>")}
  for k, (piece, role) in enumerate(zip(pieces, roles)):
    piece_ids = tokenizer.encode_chat(piece)
    if role == "assistant":
      lead = 1 + (len(piece_ids) > 1 and piece_ids[1] == tokenizer.chat_ids["<think>"])
      piece_mask = [0] * lead + [1] * (len(piece_ids) - lead)
      if k + 1 == len(pieces):  # the conversation ends on this turn: the model learns to stop
        piece_ids, piece_mask = piece_ids + [tokenizer.eos_id], piece_mask + [1]
    else:
      piece_mask = [0] * len(piece_ids)
      if k > 0 and roles[k - 1] == "assistant" and piece_ids and piece_ids[0] in stops:
        piece_mask[0] = 1  # the stop token the model writes to end its turn
    ids += piece_ids
    mask += piece_mask
  return ids, mask


def pack_conversations(
  examples: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int, seq_len: int, pad_id: int
) -> tuple[dict[str, np.ndarray], int]:
  """Examples packed greedily, in order, into batch_size rows of seq_len tokens: input_ids, segment_ids (1, 2, ...
  per example in a row, 0 on padding), positions (restarting at each example) and loss_mask, int32. An example
  longer than seq_len is cut to its first seq_len tokens. Returns (batch, how many examples it holds: those after
  them did not fit)."""
  input_ids = np.full((batch_size, seq_len), pad_id, np.int32)
  segment_ids = np.zeros((batch_size, seq_len), np.int32)
  positions = np.zeros((batch_size, seq_len), np.int32)
  loss_mask = np.zeros((batch_size, seq_len), np.int32)
  row, col, seg, used = 0, 0, 0, 0
  for ids, mask in examples:
    n = min(len(ids), seq_len)
    if col + n > seq_len:
      row, col, seg = row + 1, 0, 0
    if row == batch_size:
      break
    seg += 1
    input_ids[row, col : col + n] = ids[:n]
    loss_mask[row, col : col + n] = mask[:n]
    segment_ids[row, col : col + n] = seg
    positions[row, col : col + n] = np.arange(n)
    col += n
    used += 1
  return {"input_ids": input_ids, "segment_ids": segment_ids, "positions": positions, "loss_mask": loss_mask}, used
