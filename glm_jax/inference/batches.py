"""Many prompts, several samples each, through one Sampler in batches of one shape, timed.

  out = sample_batches(Sampler(graphdef, cfg, sampling, width=longest), params, rest, prompts, jax.random.key(0),
                       num_samples=4, batch_size=32)
  out.rows[i * 4 + j]        prompt i's sample j: its tokens (prompt, then response) and whether it stopped
  out.generated / out.seconds   tokens/s of the generation alone (compile excluded: out.compile_seconds)

The rows are the prompts, each repeated num_samples times (prompt-major), cut into batches of batch_size rows; the
last batch is filled up with copies of its last row (their samples are dropped), so that every batch has one shape.
With a Sampler whose width is the longest prompt, the whole generation is one compiled program: it is compiled first
(Sampler.compile), then each batch is generated and timed. Batch b draws with the key `key` for b = 0 and
fold_in(key, b) after it, so one prompt and one sample draw exactly as Sampler(...)(params, rest, [prompt], key).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from glm_jax.inference.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class Row:
  tokens: list[int]  # the prompt, then the response (its stop token included when it stopped)
  prompt_len: int
  finished: bool  # it emitted a stop token (else it ran out of max_new_tokens)

  @property
  def response(self) -> list[int]:
    return self.tokens[self.prompt_len :]


@dataclasses.dataclass(frozen=True)
class Batches:
  rows: list[Row]  # prompt-major: prompt i's sample j is rows[i * num_samples + j]
  generated: int  # response tokens of the rows kept (stop tokens included)
  seconds: float  # the generation's wall time (prefill and decode, every batch), compile excluded
  compile_seconds: float
  batches: int
  batch_rows: int  # rows a batch (fill included)
  made: int = 0  # speculative decoding: tokens the verification rounds produced and the rounds they took
  rounds: int = 0  # (glm_jax/inference/speculative.py acceptance_length, over every batch)


def sample_batches(
  sampler: Sampler,
  params,
  rest,
  prompts: Sequence[Sequence[int]],
  key: jax.Array,
  *,
  num_samples: int = 1,
  batch_size: int = 32,
) -> Batches:
  """Every prompt sampled num_samples times, batch_size rows a call (module docstring)."""
  for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} is invalid; must be an integer >= 1")
  rows = [list(p) for p in prompts for _ in range(num_samples)]
  if not rows:
    raise ValueError("prompts: empty; need at least one prompt")
  size = min(batch_size, len(rows))
  batches = [rows[i : i + size] for i in range(0, len(rows), size)]
  batches[-1] = batches[-1] + [batches[-1][-1]] * (size - len(batches[-1]))
  t0 = time.perf_counter()
  sampler.compile(params, rest, batches[0], key)
  compile_seconds = time.perf_counter() - t0
  kept, seconds, made, rounds = [], 0.0, 0, 0
  for b, batch in enumerate(batches):
    t0 = time.perf_counter()
    out = sampler(params, rest, batch, key if b == 0 else jax.random.fold_in(key, b))
    out = jax.device_get(out)
    seconds += time.perf_counter() - t0
    real = min(size, len(rows) - b * size)
    for r in range(real):
      length, prompt_len = int(out.lengths[r]), int(out.prompt_lens[r])
      kept.append(Row(np.asarray(out.tokens[r, :length]).tolist(), prompt_len, bool(out.finished[r])))
      if out.rounds is not None:
        made += length - prompt_len - 1
        rounds += int(out.rounds[r])
  generated = sum(len(r.response) for r in kept)
  return Batches(kept, generated, seconds, compile_seconds, len(batches), size, made, rounds)
