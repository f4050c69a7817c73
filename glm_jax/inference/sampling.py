"""What a generation is asked for and gives back, and how a token is drawn from logits: the primitives the KV-cache
sampler (glm_jax/inference/sampler.py), speculative decoding (speculative.py) and the RL trainers' recomputed
log-probabilities (glm_jax/rl/step.py) share.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


MIN_TEMPERATURE = 1e-30  # the smallest temperature > 0: tempered_log_softmax is finite down to fp32's normal range


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_new_tokens: int
  temperature: float = 1.0  # 0: greedy
  top_p: float = 1.0  # nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p
  stop_ids: tuple[int, ...] = ()  # a row ends after emitting one of these (it is part of the response)
  pad_id: int = 0  # fills the rows past their end

  def __post_init__(self):
    # Every comparison below is written so that NaN fails it (NaN compares false with everything).
    if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r}; must be a positive integer")
    if self.temperature == math.inf:
      raise ValueError(
        f"temperature={self.temperature!r}; must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (an "
        "infinite one divides every logit to 0: a uniform draw, whatever the model says)"
      )
    if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
      raise ValueError(
        f"temperature={self.temperature!r}; must be 0 (greedy) or at least {MIN_TEMPERATURE} (smaller "
        "ones are not normal fp32 numbers: XLA flushes them to zero)"
      )
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r}; must be in (0, 1]")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
  tokens: jax.Array  # [B, S] int32: prompt, response, then pad_id
  logp: jax.Array  # [B, S] fp32: log-probability of tokens[b, s] where response_mask, else 0
  response_mask: jax.Array  # [B, S] bool: the generated tokens (a stop token included)
  prompt_lens: jax.Array  # [B] int32
  lengths: jax.Array  # [B] int32: prompt + response
  finished: jax.Array  # [B] bool: the row emitted a stop token (else it ran out of max_new_tokens)
  logits: jax.Array | None  # [B, S, V] fp32 with return_logits: the logits tokens[b, s] was drawn from
  rounds: jax.Array | None = None  # [B] int32, speculative decoding only: the verification rounds the row took part
  # in (glm_jax/inference/speculative.py's acceptance_length)


def tempered_log_softmax(logits: jax.Array, temperature: float) -> jax.Array:
  """log_softmax(logits / temperature) over the last axis, in fp32; temperature 0 (greedy) and 1 give
  log_softmax(logits). The logits are shifted by their maximum before the division, which changes nothing
  mathematically but keeps logits / temperature from overflowing: for temperature 1e-30 the result is 0 at the
  largest logit and -inf (or a huge negative) elsewhere, the greedy choice, where the plain division gives NaN."""
  logits = logits.astype(jnp.float32)
  if temperature in (0, 1):
    return jax.nn.log_softmax(logits, axis=-1)
  shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  return jax.nn.log_softmax(shifted / temperature, axis=-1)


def sample_token(logits_BV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
  """(token [B] int32, its log-probability [B] fp32 under softmax(logits / temperature))."""
  logp_BV, draw_BV = draw_log_probs(logits_BV, temperature, top_p)
  if temperature == 0:
    tok = jnp.argmax(logp_BV, axis=-1).astype(jnp.int32)
  else:
    tok = jax.random.categorical(key, draw_BV, axis=-1).astype(jnp.int32)
  return tok, jnp.take_along_axis(logp_BV, tok[:, None], axis=-1)[:, 0]


def draw_log_probs(logits_BV: jax.Array, temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
  """(log_softmax(logits / temperature) [..., V], the log-weights a token is drawn from: the same inside the
  top_p nucleus and -inf outside it, not renormalized)."""
  logp_BV = tempered_log_softmax(logits_BV, temperature)
  if temperature == 0 or top_p == 1:
    return logp_BV, logp_BV
  return logp_BV, nucleus(logp_BV, top_p)


def sample_rows(
  logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """sample_token with each row's own temperature (0: greedy), top_p and key, all traced (the serving engine's
  rows are different requests): (token [B] int32, its log-probability [B] fp32), row b's the same numbers as
  sample_token(logits[b:b+1], keys[b], temperature[b], top_p[b]) gives."""
  logp_BV, draw_BV = draw_log_probs_rows(logits_BV, temperature_B, top_p_B)
  # The draws only when a row draws (each row's from its own key, so skipping them changes no row's token).
  drawn = jax.lax.cond(
    jnp.any(temperature_B > 0),
    lambda: jax.vmap(lambda k, d: jax.random.categorical(k, d))(keys_B, draw_BV),
    lambda: jnp.zeros(temperature_B.shape, jnp.int32),
  )
  tok = jnp.where(temperature_B == 0, jnp.argmax(logp_BV, axis=-1), drawn).astype(jnp.int32)
  return tok, jnp.take_along_axis(logp_BV, tok[:, None], axis=-1)[:, 0]


def draw_log_probs_rows(logits_B_V: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array):
  """draw_log_probs with each row's own temperature and top_p (traced): logits [B, ..., V] -> (the tempered
  log-probabilities, the log-weights drawn from), both [B, ..., V]; row b's are draw_log_probs(logits[b],
  temperature[b], top_p[b])'s (temperature 0: the log-probabilities at temperature 1, as greedy decoding returns)."""
  shape = (-1,) + (1,) * (logits_B_V.ndim - 1)
  scale = jnp.where(temperature_B == 0, 1.0, temperature_B).reshape(shape)
  logits = logits_B_V.astype(jnp.float32)
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
  logp = jax.nn.log_softmax(jnp.where(scale == 1.0, logits, shifted / scale), axis=-1)
  # The nucleus (a sort over the vocabulary: most of a small model's decode step on a CPU) only when a row draws
  # from one: top_p < 1 at a temperature above 0 (a greedy row's draw is its log-probabilities, as in draw_log_probs).
  cut_B = (top_p_B < 1) & (temperature_B > 0)
  return logp, jax.lax.cond(
    jnp.any(cut_B), lambda: jnp.where(cut_B.reshape(shape), nucleus(logp, top_p_B.reshape(shape)), logp), lambda: logp
  )


def nucleus(logp_BV: jax.Array, top_p) -> jax.Array:
  """logp inside the smallest set of tokens whose probability reaches top_p (a float or [B, 1]), -inf outside."""
  sorted_BV = jnp.flip(jnp.sort(logp_BV, axis=-1), axis=-1)
  before_BV = jnp.cumsum(jnp.exp(sorted_BV), axis=-1) - jnp.exp(sorted_BV)  # mass of the better tokens
  cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logp_BV >= cutoff_B1, logp_BV, -jnp.inf)
