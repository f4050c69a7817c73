"""Verifiable rewards for the task problems of glm_jax/rl/tasks.py, and a failure-tolerant scorer.

A reward function takes the Problem and the response: the generated token ids after the prompt (possibly
ending with eos; pads removed) and returns a real number.

  reward_fn = make_reward_fn("exact_match", CharVocab())      # or "my_tasks:make_reward": a factory of your own
  rewards, failures = score(reward_fn, problems, responses, sample_ids)   # float32 [n], list[str]

`score` never lets one bad sample stop a training step: a reward function that raises, or returns something
that is not a finite real number, gives that sample 0.0, is logged with its sample id, and is listed in the
returned failures.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from glm_jax.rl.tasks import CharVocab, Problem, registered_or_imported

RewardFn = Callable[[Problem, list[int]], float]


def exact_match(vocab: CharVocab) -> RewardFn:
  """Reward 1.0 when the response spells exactly `problem.answer` and then ends with eos, else 0.0.

  Only the tokens up to the first eos count; anything after it is ignored. A response without eos (cut off by
  the generation length limit) gets 0.0 even if its digits equal the answer: the model must learn to stop.
  Ids that are not characters of the vocabulary (pad, or ids beyond vocab.vocab_size that a larger model
  vocabulary can produce) before the eos make the answer wrong (0.0), not an error.
  """

  def reward(problem: Problem, response: list[int]) -> float:
    ids = [int(i) for i in response]
    if vocab.eos_id not in ids:
      return 0.0
    body = ids[: ids.index(vocab.eos_id)]
    if any(not vocab.num_special <= i < vocab.vocab_size for i in body):
      return 0.0
    return 1.0 if vocab.decode(body) == problem.answer else 0.0

  return reward


def _describe_bad_value(value: object) -> str | None:
  """None if `value` is a finite real number, else what is wrong with it."""
  if isinstance(value, numbers.Real):
    try:
      with np.errstate(over="ignore"):
        as_float32 = np.float32(float(value))
    except OverflowError:  # an int too large for a float
      as_float32 = np.float32(np.inf)
    if math.isfinite(float(as_float32)):
      return None
    return f"returned {value!r}, not a finite float32 number"
  return f"returned {value!r} of type {type(value).__name__}, not a finite real number"


def score(
  reward_fn: RewardFn, problems: Sequence[Problem], responses: Sequence[Sequence[int]], sample_ids: Sequence[object]
) -> tuple[np.ndarray, list[str]]:
  """Rewards float32 [n] of `reward_fn` on each (problem, response), and the list of failures.

  A call that raises, or returns a non-finite or non-real value, scores 0.0 and adds one entry
  "sample <id>: <what went wrong>" to the failures (also logged as a warning). ValueError only when the three
  sequences have different lengths.
  """
  n = len(problems)
  if len(responses) != n or len(sample_ids) != n:
    raise ValueError(
      f"score: problems, responses and sample_ids must have the same length, got "
      f"{n}, {len(responses)} and {len(sample_ids)}"
    )
  rewards = np.zeros((n,), dtype=np.float32)
  failures: list[str] = []
  for k, (problem, response, sid) in enumerate(zip(problems, responses, sample_ids)):
    try:
      value = reward_fn(problem, list(response))
    except Exception as e:  # noqa: BLE001 -- a reward bug must not stop training; it is reported instead.
      problem_text = f"{type(e).__name__}: {e}"
      msg = f"sample {sid}: reward function raised {problem_text}"
    else:
      bad = _describe_bad_value(value)
      if bad is None:
        rewards[k] = float(value)
        continue
      msg = f"sample {sid}: reward function {bad}"
    failures.append(msg)
    logging.warning("reward scored 0.0 for %s", msg)
  return rewards, failures


REWARD_FNS: dict[str, Callable[[CharVocab], RewardFn]] = {"exact_match": exact_match}


def make_reward_fn(name: str, vocab: CharVocab) -> RewardFn:
  """The reward function registered under `name` (see REWARD_FNS), or made by the factory at the import path
  `name` ("package.module:make_reward", a function of the vocabulary returning a RewardFn), built for `vocab`."""
  valid = (
    f"a registered name {sorted(REWARD_FNS)} or an import path 'package.module:factory' to a function of the "
    "vocabulary that returns a reward function (problem, response ids) -> float"
  )
  factory = registered_or_imported("make_reward_fn", "reward", name, REWARD_FNS, valid)
  try:
    reward_fn = factory(vocab) if callable(factory) else None
  except (TypeError, ValueError) as e:  # e.g. a reward function itself named instead of its factory
    raise ValueError(f"make_reward_fn: {name!r} cannot be called with the vocabulary ({e}); valid: {valid}") from e
  if not callable(reward_fn):
    raise ValueError(f"make_reward_fn: {name!r} is {factory!r}, which does not make a reward function; valid: {valid}")
  return reward_fn
