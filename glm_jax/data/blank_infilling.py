"""GLM's autoregressive blank infilling (data.objective = "glm"): a document -> a corrupted sample.

A document of n tokens (its eos dropped: <eop> ends the spans) loses k spans; each becomes one mask token in part A,
and the spans follow as part B, in a random order, each as <sop> s_1 .. s_L with targets s_1 .. s_L <eop>:

  document  x1 x2 x3 x4 x5 x6              spans (1, 3) and (4, 5), B order: the second first
  input     x1 [M] x4 [M] x6 | <sop> x5 | <sop> x2 x3          n + 2k tokens; part A = the first 5
  targets    0   0  0   0  0 |   x5 eop |   x2  x3  eop        (0 where loss_mask is 0)
  loss_mask  0   0  0   0  0 |   1   1  |   1   1   1
  positions  0   1  2   3  4 |   3   3  |   1   1   1          a span's tokens sit at its mask's position
  block pos  0   0  0   0  0 |   1   2  |   1   2   3          1..L+1 inside a span, 0 in part A
Attention is bidirectional over part A and causal after it: key j is visible to query i when j <= i or j < len(A)
(the model's `prefix_end`, glm_jax/model/transformer.py). The prediction at i of targets[i] counts where
loss_mask[i] is 1 (no shift; glm_jax/train/losses.py).

The three kinds of blank (data.glm; GLM, THUDM/GLM blocklm_utils.py, and the GLM-130B paper):
  mask   [MASK]: span lengths from Poisson(poisson_lambda) truncated to 1..max_span (renormalized), drawn until
         ceil(mask_ratio * n) tokens are masked (the last length cut to what remains, so exactly that many: GLM
         draws until at least 15%), placed uniformly at random among the arrangements that keep one unmasked token
         between two spans.
  smask  [sMASK]: whole sentences, chosen in a random order until ceil(mask_ratio * n) tokens are masked (the last
         sentence may pass the budget). A sentence ends after a token whose text ends with . ! or ? (quotes and
         brackets after them allowed).
  gmask  [gMASK]: one span at the end, its length uniform in [ceil(gmask_min * n), min(floor(gmask_max * n),
         n - 1)]: at least one context token stays.
Each document draws its kind with probabilities (mask_prob, smask_prob, gmask_prob): GLM-130B's 30% / 0 / 70%.
How many spans a document of n tokens can get: 1 for gmask, at most ceil(mask_ratio * n) for mask and smask (every
span has a token and the draws stop at the budget), so a sample never has more than n + 2 * that many tokens
(`max_piece_len` picks the longest document piece that fits a row).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import ml_collections
import numpy as np

KINDS = ("mask", "smask", "gmask")
FEATURES = ("input_ids", "targets", "loss_mask", "positions", "block_positions")  # the per-token arrays of a sample
_CLOSERS = "\"')]}’”»"  # may follow a sentence's final punctuation


def default_glm_config() -> ml_collections.ConfigDict:
  """data.glm: GLM-130B's mix and GLM's span statistics."""
  c = ml_collections.ConfigDict()
  c.mask_ratio = 0.15  # [MASK] / [sMASK]: the share of a document's tokens masked
  c.poisson_lambda = 3.0  # [MASK] span lengths: Poisson(lambda), truncated to 1..max_span
  c.max_span = 39
  c.gmask_min = 0.5  # [gMASK]: the span covers this share of the document at least...
  c.gmask_max = 1.0  # ... and at most (always leaving one context token)
  c.mask_prob = 0.3  # the kind of blank each document gets
  c.smask_prob = 0.0
  c.gmask_prob = 0.7
  return c


def check_glm_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the data.glm field, its value and what is valid."""

  def fail(field, valid):
    raise ValueError(f"data.glm.{field}={cfg[field]!r} is invalid; {valid}")

  def number(field):
    v = cfg[field]
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)

  if not number("mask_ratio") or not 0 < cfg.mask_ratio < 1:
    fail("mask_ratio", "expected a number in (0, 1)")
  if not number("poisson_lambda") or cfg.poisson_lambda <= 0:
    fail("poisson_lambda", "expected a number > 0")
  if isinstance(cfg.max_span, bool) or not isinstance(cfg.max_span, int) or cfg.max_span < 1:
    fail("max_span", "expected an integer >= 1")
  for field in ("gmask_min", "gmask_max"):
    if not number(field) or not 0 < cfg[field] <= 1:
      fail(field, "expected a number in (0, 1]")
  if cfg.gmask_min > cfg.gmask_max:
    fail("gmask_min", f"must be <= data.glm.gmask_max={cfg.gmask_max}")
  probs = [cfg[f"{k}_prob"] for k in KINDS]
  for k in KINDS:
    if not number(f"{k}_prob") or cfg[f"{k}_prob"] < 0:
      fail(f"{k}_prob", "expected a number >= 0")
  if abs(sum(probs) - 1) > 1e-6:
    raise ValueError(
      f"data.glm.mask_prob + smask_prob + gmask_prob = {sum(probs):g} (each document's kind of "
      f"blank, {dict(zip(KINDS, probs))}); they must sum to 1"
    )


def kind_probs(cfg: ml_collections.ConfigDict) -> np.ndarray:
  p = np.asarray([cfg[f"{k}_prob"] for k in KINDS], np.float64)
  return p / p.sum()


def span_length_probs(cfg: ml_collections.ConfigDict) -> np.ndarray:
  """P(L = 1 .. max_span): Poisson(poisson_lambda) truncated to that range and renormalized."""
  lam = cfg.poisson_lambda
  p = np.asarray([math.exp(k * math.log(lam) - lam - math.lgamma(k + 1)) for k in range(1, cfg.max_span + 1)])
  return p / p.sum()


def max_spans(n: int, kind: str, cfg: ml_collections.ConfigDict) -> int:
  """The most spans a document of n tokens can get (see the module docstring)."""
  return 1 if kind == "gmask" else math.ceil(cfg.mask_ratio * n)


def _gmask_range(n: int, cfg) -> tuple[int, int]:
  return max(1, math.ceil(cfg.gmask_min * n)), min(math.floor(cfg.gmask_max * n), n - 1)


def fits(n: int, kind: str, cfg: ml_collections.ConfigDict) -> bool:
  """Whether every draw of `kind` succeeds on a document of n tokens."""
  if kind == "gmask":
    lo, hi = _gmask_range(n, cfg)
    return n >= 2 and lo <= hi
  budget = math.ceil(cfg.mask_ratio * n)
  return n >= 1 and 2 * budget - 1 <= n  # k <= budget spans of total length budget, one token between two


def kinds_used(cfg: ml_collections.ConfigDict) -> list[str]:
  return [k for k in KINDS if cfg[f"{k}_prob"] > 0]


def min_doc_len(cfg: ml_collections.ConfigDict) -> int:
  """The shortest document every kind in use can corrupt (shorter ones are left out of the data)."""
  n = 1
  while not all(fits(n, k, cfg) for k in kinds_used(cfg)):
    n += 1
    if n > 10_000:
      raise ValueError(f"data.glm={cfg.to_dict()}: no document length up to 10,000 tokens fits these draws")
  return n


def max_piece_len(seq_len: int, cfg: ml_collections.ConfigDict) -> int:
  """The longest document piece whose corrupted sample always fits a row of seq_len tokens."""
  n = seq_len
  while n > 0 and n + 2 * max(max_spans(n, k, cfg) for k in kinds_used(cfg)) > seq_len:
    n -= 1
  if n < min_doc_len(cfg):
    raise ValueError(
      f"data.seq_len={seq_len}: a row holds no corrupted document of data.glm's draws (pieces of "
      f"{n} tokens, and the draws need at least {min_doc_len(cfg)}); raise data.seq_len"
    )
  return n


def sentence_end_table(tokenizer) -> np.ndarray:
  """[vocab] bool: whether a token's text ends a sentence (ends with . ! or ?, closing quotes or brackets allowed).
  From the tokenizer's own decoding, so it works for any vocabulary; special tokens never end one."""
  table = np.zeros(tokenizer.vocab_size, bool)
  special = set(tokenizer.special_ids.values())
  for i in range(tokenizer.vocab_size):
    if i not in special:
      text = tokenizer.decode([i]).rstrip().rstrip(_CLOSERS)
      table[i] = text.endswith((".", "!", "?"))
  return table


def sentences(tokens: np.ndarray, ends_sentence: np.ndarray) -> list[tuple[int, int]]:
  """The document's sentences as half-open token ranges covering it (the last may lack its punctuation)."""
  cuts = (np.flatnonzero(ends_sentence[tokens]) + 1).tolist()
  bounds = [0] + [c for c in cuts if c < len(tokens)] + [len(tokens)]
  return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def draw_spans(
  rng: np.random.Generator,
  n: int,
  kind: str,
  cfg: ml_collections.ConfigDict,
  sentence_ranges: Sequence[tuple[int, int]] | None = None,
) -> list[tuple[int, int]]:
  """The blanks of a document of n tokens, half-open, sorted by start (see the module docstring for each kind).
  Raises ValueError when the document is too short for the draw."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}; one of {KINDS}")
  if not fits(n, kind, cfg):
    need = (
      "at least 2 tokens, one of them context, and a span of gmask_min..gmask_max of them"
      if kind == "gmask"
      else f"its {math.ceil(cfg.mask_ratio * n)} masked tokens (ceil(mask_ratio * n)) with an unmasked token "
      f"between two spans: n >= {2 * math.ceil(cfg.mask_ratio * n) - 1}"
    )
    raise ValueError(
      f"a document of {n} tokens is too short for a [{kind}] draw of data.glm (mask_ratio="
      f"{cfg.mask_ratio}, gmask_min={cfg.gmask_min}, gmask_max={cfg.gmask_max}): it needs {need}"
    )
  if kind == "gmask":
    lo, hi = _gmask_range(n, cfg)
    length = int(rng.integers(lo, hi + 1))
    return [(n - length, n)]
  budget = math.ceil(cfg.mask_ratio * n)
  if kind == "smask":
    if sentence_ranges is None:
      raise ValueError("draw_spans: kind 'smask' needs the document's sentence ranges")
    chosen, masked = [], 0
    for i in rng.permutation(len(sentence_ranges)):
      if masked >= budget:
        break
      chosen.append(tuple(sentence_ranges[i]))
      masked += sentence_ranges[i][1] - sentence_ranges[i][0]
    return sorted(chosen)
  probs, lengths = span_length_probs(cfg), []
  while sum(lengths) < budget:
    lengths.append(min(int(rng.choice(len(probs), p=probs)) + 1, budget - sum(lengths)))
  k = len(lengths)
  free = n - sum(lengths) - (k - 1)  # unmasked tokens beyond the one between two spans
  bars = np.sort(rng.choice(free + k, size=k, replace=False))  # gaps: a uniform composition of `free` into k + 1
  before = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  return [(int(b + s), int(b + s + length)) for b, s, length in zip(bars, before, lengths)]


def corrupt(
  tokens: Sequence[int],
  spans: Sequence[tuple[int, int]],
  kind: str,
  special_ids: Mapping[str, int],
  order: Sequence[int] | None = None,
) -> dict[str, np.ndarray | int]:
  """The sample of a document with these spans blanked by `kind`'s mask token, part B in `order` (indices into
  spans; None: as given): the FEATURES as [n + 2k] int32 arrays and prefix_len = len(part A)."""
  tokens = [int(t) for t in tokens]
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}; one of {KINDS}")
  for role in (kind, "sop", "eop"):
    if special_ids.get(role) is None:
      raise ValueError(
        f"the tokenizer has no {role!r} token (special ids {dict(special_ids)}); GLM's objective "
        "needs [MASK], [sMASK], [gMASK], <sop> and <eop>"
      )
  last, part_a, mask_at = 0, [], []
  for s, e in spans:
    if not last <= s < e <= len(tokens):
      raise ValueError(
        f"spans {list(spans)}: each must be non-empty, sorted, non-overlapping and inside the "
        f"document's {len(tokens)} tokens"
      )
    part_a += tokens[last:s]
    mask_at.append(len(part_a))
    part_a.append(special_ids[kind])
    last = e
  part_a += tokens[last:]
  a = len(part_a)
  out = {
    "input_ids": list(part_a),
    "targets": [0] * a,
    "loss_mask": [0] * a,
    "positions": list(range(a)),
    "block_positions": [0] * a,
  }
  for i in range(len(spans)) if order is None else order:
    s, e = spans[i]
    span = tokens[s:e]
    out["input_ids"] += [special_ids["sop"]] + span
    out["targets"] += span + [special_ids["eop"]]
    out["loss_mask"] += [1] * (len(span) + 1)
    out["positions"] += [mask_at[i]] * (len(span) + 1)
    out["block_positions"] += list(range(1, len(span) + 2))
  result: dict[str, np.ndarray | int] = {k: np.asarray(v, np.int32) for k, v in out.items()}
  result["prefix_len"] = a
  return result


def corrupt_document(
  tokens: np.ndarray,
  rng: np.random.Generator,
  cfg: ml_collections.ConfigDict,
  special_ids: Mapping[str, int],
  ends_sentence: np.ndarray | None,
) -> dict[str, np.ndarray]:
  """One draw for one document: its kind, its spans, part B's order; the sample's FEATURES plus "prefix_len" as a
  per-token array (the packer carries per-token arrays only)."""
  kind = KINDS[int(rng.choice(len(KINDS), p=kind_probs(cfg)))]
  ranges = sentences(tokens, ends_sentence) if kind == "smask" else None
  spans = draw_spans(rng, len(tokens), kind, cfg, ranges)
  sample = corrupt(tokens, spans, kind, special_ids, order=rng.permutation(len(spans)))
  n = len(sample["input_ids"])
  sample["prefix_len"] = np.full(n, sample["prefix_len"], np.int32)
  return sample


def pieces(doc_len: int, max_len: int, cfg: ml_collections.ConfigDict) -> list[tuple[int, int]]:
  """A document of doc_len tokens cut into the fewest pieces of at most max_len, of near-equal lengths, keeping those
  every kind of blank in use can corrupt (a too-short document gives none)."""
  if doc_len < 1:
    return []
  count = -(-doc_len // max_len)
  bounds = np.linspace(0, doc_len, count + 1).round().astype(int)
  return [
    (int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if all(fits(int(b - a), k, cfg) for k in kinds_used(cfg))
  ]
