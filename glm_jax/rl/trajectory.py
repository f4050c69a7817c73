"""A multi-turn episode as one token sequence, built by appending (GLM-5's agentic RL keeps what the model sampled).

  traj = Trajectory(tokenizer, [{"role": "user", "content": "What is 37*91?"}], tools=TOOLS, version=7)
  traj.tokens                                  # the rendered prompt, ending with the generation prompt
  turn = traj.add_sample(ids, logprobs)        # the model's ids (its stop token included): loss mask 1
  traj.add_observation([{"role": "tool", "content": "3367"}])   # the tools' answers + generation prompt: mask 0
  traj.tokens, traj.loss_mask, traj.logprobs, traj.spans

The model's ids are kept as sampled, with their sampler log-probabilities, and never re-tokenized (re-tokenizing a
history after the fact drifts from what was sampled, and the policy gradient then trains on tokens the policy never
chose: docs/glm5_facts.md section 8). Everything else (the prompt, the observations, the generation prompts) is the
chat format's own text (glm_jax/chat.py `render`), appended incrementally and checked:
- the conversation renders append-only: rendering it with the new messages extends its rendering without them
  (with clear_thinking=True, a user message after an assistant turn collapses that turn's reasoning, so a
  trajectory that goes on past a user reply needs clear_thinking=False);
- each appended piece starts with one of the format's special tokens (`<|observation|>`, `<tool_response>`,
  `<|user|>`, `<|assistant|>`) or follows the model's stop token (one of them too), and `Tokenizer.encode_chat`
  reads text on either side of a special token independently, so appending it cannot change an earlier token: the
  sequence equals the tokenization of its text, piece by piece.
A violation raises NotAppendOnly naming the turn. When the model's ids are the tokenizer's own reading of their
text (a scripted policy; most of a trained model's samples), `tokens == encode_chat(text)` for the whole episode.

The model stops at one of chat.STOP_STRINGS; when it stopped at the token that the observation would open with
(`<|observation|>` before tool results, `<|user|>` before a user reply), that token is not appended twice.
`version` tags the episode with the policy version that sampled it, for the asynchronous trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from glm_jax import chat
from glm_jax.data.tokenizer import Tokenizer

# What an appended piece may start with: a format token that encode_chat reads as one id (module docstring).
_OPENERS = ("<|observation|>", "<tool_response>", "<|user|>", "<|assistant|>", "<|system|>")


class NotAppendOnly(ValueError):
  """Appending the messages would change what the sequence already holds."""


@dataclasses.dataclass(frozen=True)
class Span:
  """tokens[start:end] of an episode: "prompt" (turn 0), "sample" (the model's turn `turn`, 1-based) or
  "observation" (what followed sample `turn`: tool results or a user reply, then the generation prompt)."""

  kind: str
  turn: int
  start: int
  end: int


class Trajectory:
  """One episode (module docstring). `messages` is the conversation so far, the model's turns as parsed;
  `text` is the decoded sequence, byte for byte what the model saw and wrote."""

  def __init__(
    self,
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    *,
    tools: list[dict] | None = None,
    enable_thinking: bool = True,
    clear_thinking: bool = True,
    version: int = 0,
  ):
    self.tokenizer, self.tools, self.version = tokenizer, tools, version
    self._render = dict(tools=tools, enable_thinking=enable_thinking, clear_thinking=clear_thinking)
    self.messages: list[dict] = [dict(m) for m in messages]
    self.text = chat.render(self.messages, add_generation_prompt=True, **self._render)
    self.tokens: list[int] = tokenizer.encode_chat(self.text)
    self.loss_mask: list[int] = [0] * len(self.tokens)
    self.logprobs: list[float] = [0.0] * len(self.tokens)
    self.spans: list[Span] = [Span("prompt", 0, 0, len(self.tokens))]
    self.turns = 0  # the model's turns so far
    self.stop: str | None = None  # the stop string that ended the last sample, None when it ran out of tokens
    self._stops = {tokenizer.chat_ids[s]: s for s in chat.STOP_STRINGS}

  def add_sample(self, ids: Sequence[int], logprobs: Sequence[float]) -> dict:
    """Appends the model's turn: its sampled ids (up to and including its stop token, when it emitted one) with
    the sampler's log-probabilities, loss mask 1. Returns the turn parsed (chat.parse_assistant: reasoning, content,
    tool calls, malformed calls under "errors"), which joins `messages` without "errors"."""
    ids = [int(i) for i in ids]
    if len(ids) != len(logprobs):
      raise ValueError(f"turn {self.turns + 1}: {len(ids)} sampled ids but {len(logprobs)} log-probabilities")
    if not ids:
      raise ValueError(f"turn {self.turns + 1}: no sampled ids")
    if self.spans[-1].kind == "sample":
      raise NotAppendOnly(f"turn {self.turns + 1}: a sample follows sample {self.turns} with no observation between")
    self.stop = self._stops.get(ids[-1])
    body = self.tokenizer.decode(ids[:-1] if self.stop else ids)
    parsed = chat.parse_assistant(body, tools=self.tools)
    self.turns += 1
    start = len(self.tokens)
    self.tokens += ids
    self.loss_mask += [1] * len(ids)
    self.logprobs += [float(x) for x in logprobs]
    self.text += body + (self.stop or "")
    self.spans.append(Span("sample", self.turns, start, len(self.tokens)))
    self.messages.append({k: v for k, v in parsed.items() if k != "errors"})
    return parsed

  def add_observation(self, messages: Sequence[dict], max_ids: int | None = None) -> list[int] | None:
    """Appends what answers the model's last turn (tool messages, or a user reply) and the generation prompt,
    loss mask 0; returns the ids appended. With `max_ids`, an observation of more ids than that is not appended
    (None is returned; the agent loop's cache has no room for it). Raises NotAppendOnly naming the turn when the
    conversation does not render append-only, or when the piece would not start at a format token (module
    docstring)."""
    piece, ids, new = self._observation(messages)
    if max_ids is not None and len(ids) > max_ids:
      return None
    start = len(self.tokens)
    self.tokens += ids
    self.loss_mask += [0] * len(ids)
    self.logprobs += [0.0] * len(ids)
    self.text += piece
    self.messages += new
    self.spans.append(Span("observation", self.turns, start, len(self.tokens)))
    return ids

  def _observation(self, messages: Sequence[dict]) -> tuple[str, list[int], list[dict]]:
    if self.spans[-1].kind != "sample":
      raise NotAppendOnly(f"turn {self.turns}: an observation must follow a sample of the model")
    new = [dict(m) for m in messages]
    if not new:
      raise ValueError(f"turn {self.turns}: no messages to append")
    before = chat.render(self.messages, **self._render)
    after = chat.render(self.messages + new, add_generation_prompt=True, **self._render)
    where = f"turn {self.turns} (messages[{len(self.messages)}:{len(self.messages) + len(new)}])"
    if not after.startswith(before):
      at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
      hint = (
        "; with clear_thinking=True a user message collapses the reasoning of earlier assistant turns: use "
        "clear_thinking=False for an episode that goes on past a user reply"
        if self._render["clear_thinking"]
        else ""
      )
      raise NotAppendOnly(
        f"{where}: the conversation does not render append-only: its text changes at character {at} "
        f"({before[max(at - 20, 0) : at + 20]!r} becomes {after[max(at - 20, 0) : at + 20]!r}){hint}"
      )
    piece = after[len(before) :]
    follows_stop = bool(self.stop) and piece.startswith(self.stop)
    if follows_stop:
      piece = piece[len(self.stop) :]  # the model already wrote it, as its stop token (a format token too)
    if not (follows_stop or piece.startswith(_OPENERS)):
      raise NotAppendOnly(
        f"{where}: the appended text {piece[:40]!r} does not start at a format token (one of {list(_OPENERS)}), so "
        "its first tokens could merge with the model's last ones"
      )
    return piece, self.tokenizer.encode_chat(piece), new

  def arrays(self, length: int | None = None, pad_id: int | None = None) -> dict[str, np.ndarray]:
    """tokens, loss_mask and logprobs as arrays, right-padded to `length` (pad id, mask 0); the loss mask is on
    the token's own slot (a trainer predicting token t from slot t - 1 shifts it)."""
    n = len(self.tokens)
    length = n if length is None else length
    if length < n:
      raise ValueError(f"length={length} is shorter than the episode's {n} tokens")
    pad = self.tokenizer.pad_id if pad_id is None else pad_id
    out: dict[str, Any] = {
      "tokens": np.full(length, pad, np.int32),
      "loss_mask": np.zeros(length, np.int32),
      "logprobs": np.zeros(length, np.float32),
    }
    out["tokens"][:n], out["loss_mask"][:n], out["logprobs"][:n] = self.tokens, self.loss_mask, self.logprobs
    return out
