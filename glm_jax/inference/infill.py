"""GLM's blank infilling at inference: fill each [MASK] / [sMASK] of a context, or continue after [gMASK].

The layout is the training objective's (glm_jax/data/blank_infilling.py): the context (part A, with one mask token
per blank) is prefilled with bidirectional attention, then each blank is generated causally after a <sop>, its
tokens at the mask's position with block positions 1, 2, ..., until <eop>. Blanks are filled left to right; a
filled blank stays in part B (<sop> and its tokens, the <eop> dropped, as in training) while the next is generated.

  filled, spans = fill_blanks(sampler, params, rest, context_ids, tokenizer.special_ids, key)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax

MASK_ROLES = ("mask", "smask", "gmask")


def blank_positions(context: Sequence[int], special_ids: Mapping[str, int]) -> list[int]:
  """Indices of the mask tokens ([MASK], [sMASK], [gMASK]) in a context, left to right."""
  masks = {special_ids[r] for r in MASK_ROLES if r in special_ids}
  return [i for i, t in enumerate(context) if int(t) in masks]


def infill_prompt(
  context: Sequence[int], filled: Sequence[Sequence[int]], special_ids: Mapping[str, int]
) -> tuple[list[int], list[int], list[int], int]:
  """The prompt that generates blank number len(filled) of `context`, the earlier ones filled with `filled`:
  (tokens, positions, block_positions, prefix_len). Raises ValueError when there is no such blank."""
  blanks = blank_positions(context, special_ids)
  if len(filled) >= len(blanks):
    raise ValueError(
      f"the context has {len(blanks)} blank(s) ([MASK], [sMASK] or [gMASK] tokens); asked for blank "
      f"number {len(filled) + 1}"
    )
  tokens, positions, blocks = list(map(int, context)), list(range(len(context))), [0] * len(context)
  sop = special_ids["sop"]
  for blank, span in zip(blanks, list(filled) + [[]]):
    part = [sop] + list(map(int, span))
    tokens += part
    positions += [blank] * len(part)
    blocks += list(range(1, len(part) + 1))
  return tokens, positions, blocks, len(context)


def fill_blanks(
  sampler, params, rest, context: Sequence[int], special_ids: Mapping[str, int], key: jax.Array
) -> tuple[list[int], list[list[int]]]:
  """Fills every blank of one context with `sampler` (a glm_jax.inference.Sampler whose stop_ids include <eop>):
  (the context with each mask token replaced by its span, the spans). A span ends at <eop> (not kept) or after
  the sampler's max_new_tokens."""
  if not blank_positions(context, special_ids):
    raise ValueError("the context has no [MASK], [sMASK] or [gMASK] token to fill")
  spans: list[list[int]] = []
  for _ in blank_positions(context, special_ids):
    tokens, positions, blocks, prefix = infill_prompt(context, spans, special_ids)
    key, sub = jax.random.split(key)
    out = sampler(
      params,
      rest,
      [tokens],
      sub,
      positions=[positions],
      block_positions=[blocks] if sampler.cfg.rope_2d else None,
      prefix_lens=[prefix],
    )
    start, end = len(tokens), int(out.lengths[0])
    span = [int(t) for t in out.tokens[0, start:end]]
    if span and span[-1] == special_ids["eop"]:
      span = span[:-1]
    spans.append(span)
  filled, blanks = [], blank_positions(context, special_ids)
  last = 0
  for blank, span in zip(blanks, spans):
    filled += list(map(int, context[last:blank])) + span
    last = blank + 1
  filled += list(map(int, context[last:]))
  return filled, spans
