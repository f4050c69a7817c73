"""MTP speculative decoding: the MTP layer drafts k tokens, the main model checks them all in one forward.

  sampler = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=64), speculate=4)   # k = 4 drafts a round
  out = sampler(params, rest, prompts, key)
  acceptance_length(out)          tokens a verification round produced, on average (1 to k + 1)

A round, for a row whose next token x_n is drawn: the first MTP layer drafts d_1..d_k recurrently (q_j, the draft's
distribution for slot n+j); the main model feeds [x_n, d_1, ..., d_k] in one forward (p_j for slot n+j+1); d_j is
kept with probability min(1, p_{j-1}(d_j) / q_j(d_j)) while every draft before it was, the first rejected slot drawn
from norm(max(p_{j-1} - q_j, 0)) (`residual`), or, all kept, the next token from p_k (Leviathan et al. 2023; Chen
et al. 2023). p and q are taken after temperature and top_p, so every token follows the main model's distribution;
greedy (temperature 0) keeps d_j while it equals argmax p_{j-1}: plain greedy output, token for token. The returned
log-probabilities are the main model's (tempered_log_softmax, as in plain decoding). The whole generation is one jit,
as in glm_jax/inference/sampler.py, with a cache k slots longer than the output. The round step by step and the two
caches: docs/serving.md, "MTP speculative decoding".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax.inference.sampling import (
  SampleOutput,
  draw_log_probs,
  draw_log_probs_rows,
  sample_token,
  tempered_log_softmax,
)
from glm_jax.model.config import ModelConfig
from glm_jax.model.transformer import check_draft


def check(cfg: ModelConfig, k) -> None:
  """A speculation depth k must be an integer >= 1 and the model must have an MTP layer to draft with."""
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"speculate={k!r}: the drafted tokens a round must be an integer >= 1 (0 or None: plain decoding)")
  check_draft(cfg)


def draw_probs(logits_BV: jax.Array, temperature: float, top_p: float) -> jax.Array:
  """The distribution a token is drawn from (temperature > 0): softmax(logits / temperature) restricted to the top_p
  nucleus and renormalized, as sample_token draws."""
  return jax.nn.softmax(draw_log_probs(logits_BV, temperature, top_p)[1], axis=-1)


def residual(p_V: jax.Array, q_V: jax.Array) -> jax.Array:
  """norm(max(p - q, 0)) over the last axis: where the token after a rejected draft is drawn from. Where p = q
  (a draft is then never rejected) the sum is 0 and p is returned."""
  r = jnp.maximum(p_V - q_V, 0.0)
  total = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_V)


def accept(
  p_logits_BJV: jax.Array,
  q_logits_BKV: jax.Array,
  drafts_BK: jax.Array,
  key: jax.Array,
  temperature: float,
  top_p: float,
) -> tuple[jax.Array, jax.Array]:
  """The acceptance rule (module docstring) for a round's k drafts: p_logits [B, k + 1, V] the main model's logits
  for the slots after x_n, q_logits [B, k, V] the draft's the drafts were drawn from. Returns (a [B]: the leading
  drafts kept, next [B] int32: the token drawn at slot n + a + 1)."""
  b, k = drafts_BK.shape
  rows = jnp.arange(b)
  if temperature == 0:
    best_BJ = jnp.argmax(p_logits_BJV, axis=-1).astype(jnp.int32)
    kept_B = jnp.sum(jnp.cumprod(drafts_BK == best_BJ[:, :k], axis=1), axis=1)
    return kept_B, best_BJ[rows, kept_B]
  k_u, k_next = jax.random.split(key)
  p_BJV = draw_probs(p_logits_BJV, temperature, top_p)
  q_BKV = draw_probs(q_logits_BKV, temperature, top_p)
  p_d = jnp.take_along_axis(p_BJV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  ok_BK = jax.random.uniform(k_u, (b, k)) * q_d < p_d  # u < p / q: probability min(1, p / q)
  kept_B = jnp.sum(jnp.cumprod(ok_BK, axis=1), axis=1)
  dist_BJV = jnp.concatenate([residual(p_BJV[:, :k], q_BKV), p_BJV[:, k:]], axis=1)
  nxt = jax.random.categorical(k_next, jnp.log(dist_BJV[rows, kept_B]), axis=-1).astype(jnp.int32)
  return kept_B, nxt


def accept_rows(
  p_logits_BJV: jax.Array,
  q_logits_BKV: jax.Array,
  drafts_BK: jax.Array,
  keys_B: jax.Array,
  temperature_B: jax.Array,
  top_p_B: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """`accept` with each row's own temperature (0: greedy), top_p and key, all traced (the serving engine's rows are
  different requests, glm_jax/serving/engine.py): (kept [B], next [B] int32), row b's by `accept`'s rule."""
  b, k = drafts_BK.shape
  rows = jnp.arange(b)
  best_BJ = jnp.argmax(p_logits_BJV, axis=-1).astype(jnp.int32)
  kept_greedy = jnp.sum(jnp.cumprod(drafts_BK == best_BJ[:, :k], axis=1), axis=1)

  def probs(logits):
    return jax.nn.softmax(draw_log_probs_rows(logits, temperature_B, top_p_B)[1], axis=-1)

  p_BJV, q_BKV = probs(p_logits_BJV), probs(q_logits_BKV)
  p_d = jnp.take_along_axis(p_BJV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  k_u, k_next = jnp.moveaxis(jax.vmap(jax.random.split)(keys_B), 1, 0)
  ok_BK = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(k_u) * q_d < p_d
  kept_drawn = jnp.sum(jnp.cumprod(ok_BK, axis=1), axis=1)
  greedy_B = temperature_B == 0
  kept_B = jnp.where(greedy_B, kept_greedy, kept_drawn)
  dist_BJV = jnp.concatenate([residual(p_BJV[:, :k], q_BKV), p_BJV[:, k:]], axis=1)
  drawn = jax.vmap(lambda key, d: jax.random.categorical(key, jnp.log(d)))(k_next, dist_BJV[rows, kept_B])
  return kept_B, jnp.where(greedy_B, best_BJ[rows, kept_B], drawn).astype(jnp.int32)


def generate(
  graphdef,
  params,
  rest,
  prompts_BT,
  prompt_lens_B,
  key,
  layout=None,
  *,
  sampling,
  k: int,
  cache_len: int,
  return_logits: bool,
  constrain_cache=None,
) -> SampleOutput:
  """The speculative generation, one jit: prompts [B, T] right-padded, prompt_lens [B] (layout: None, plain
  prompts; the sampler's signature); returns the SampleOutput of
  glm_jax/inference/sampler.py over cache_len slots, with `rounds` [B]: the verification rounds each row took
  part in. constrain_cache: lays the cache out on the mesh (Sampler(mesh=...))."""
  assert layout is None, "speculative decoding takes plain prompts"
  model = nnx.merge(graphdef, params, rest)
  b, p = prompts_BT.shape
  rows = jnp.arange(b)
  size = cache_len + k  # a row's last round may draft k slots past its last token
  logits_BTV, cache, h_BTD = model.prefill(prompts_BT, size, draft=True)
  if constrain_cache is not None:
    cache = constrain_cache(cache)
  t_, top_p, max_new = sampling.temperature, sampling.top_p, sampling.max_new_tokens
  stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)
  last = prompt_lens_B - 1
  key, sub = jax.random.split(key)
  first_BV = logits_BTV[rows, last]
  x_B, logp_B = sample_token(first_BV, sub, t_, top_p)  # the first token, at slot prompt_len: from the prefill
  tokens = jnp.full((b, size), sampling.pad_id, jnp.int32).at[:, :p].set(prompts_BT)
  tokens = jnp.where(jnp.arange(size)[None] < prompt_lens_B[:, None], tokens, sampling.pad_id)
  st = dict(
    tokens=tokens.at[rows, prompt_lens_B].set(x_B),
    logp=jnp.zeros((b, size), jnp.float32).at[rows, prompt_lens_B].set(logp_B),
    mask=jnp.zeros((b, size), bool).at[rows, prompt_lens_B].set(True),
    n=prompt_lens_B,
    x=x_B,
    h=h_BTD[rows, last],
    count=jnp.ones((b,), jnp.int32),
    stopped=jnp.isin(x_B, stop_ids),
    rounds=jnp.zeros((b,), jnp.int32),
    cache=cache,
    key=key,
  )
  st["done"] = st["stopped"] | (max_new <= 1)
  if return_logits:
    st["logits"] = jnp.zeros((b, size, first_BV.shape[-1]), jnp.float32).at[rows, prompt_lens_B].set(first_BV)

  def body(st):
    key, k_draft, k_accept = jax.random.split(st["key"], 3)
    n, live = st["n"], ~st["done"]

    def draft_step(carry, key_j):  # the MTP layer at one slot: (its input state, the token after it, the slot)
      g_B1D, tok_B, slot_B, cache = carry
      q_B1V, g_B1D, cache = model.draft(g_B1D, tok_B[:, None], slot_B, cache)
      d_B, _ = sample_token(q_B1V[:, 0], key_j, t_, top_p)
      return (g_B1D, d_B, slot_B + 1, cache), (d_B, q_B1V[:, 0])

    carry = (st["h"][:, None], st["x"], n - 1, st["cache"])
    (_, _, _, cache), (drafts_KB, q_KBV) = jax.lax.scan(draft_step, carry, jax.random.split(k_draft, k))
    drafts_BK, q_BKV = drafts_KB.T, jnp.moveaxis(q_KBV, 0, 1)
    p_BJV, h_BJD, cache = model.decode_tokens(jnp.concatenate([st["x"][:, None], drafts_BK], axis=1), n, cache)
    kept_B, next_B = accept(p_BJV, q_BKV, drafts_BK, k_accept, t_, top_p)
    # The MTP cache's slots n..n+k-1 from the main model's hidden states and the drafts (right where kept).
    _, _, cache = model.draft(h_BJD[:, :k], drafts_BK, n, cache)

    # The round's tokens: the kept drafts, then the drawn one, at slots n+1..n+a+1, up to a stop or max_new_tokens.
    j = jnp.arange(k + 1)
    cand_BJ = jnp.where(j == kept_B[:, None], next_B[:, None], jnp.pad(drafts_BK, ((0, 0), (0, 1))))
    is_stop = jnp.isin(cand_BJ, stop_ids)
    after_stop = (jnp.cumsum(is_stop, axis=1) - is_stop) > 0
    keep_BJ = live[:, None] & (j <= kept_B[:, None]) & (st["count"][:, None] + j < max_new) & ~after_stop
    slots_BJ = jnp.where(keep_BJ, n[:, None] + 1 + j, size)  # size: out of range, the write is dropped
    logp_BJ = jnp.take_along_axis(tempered_log_softmax(p_BJV, t_), cand_BJ[..., None], axis=-1)[..., 0]
    r = rows[:, None]
    count = st["count"] + jnp.sum(keep_BJ, axis=1)
    stopped = st["stopped"] | jnp.any(keep_BJ & is_stop, axis=1)
    new = dict(
      st,
      key=key,
      cache=cache,
      count=count,
      tokens=st["tokens"].at[r, slots_BJ].set(cand_BJ, mode="drop"),
      logp=st["logp"].at[r, slots_BJ].set(logp_BJ, mode="drop"),
      mask=st["mask"].at[r, slots_BJ].set(True, mode="drop"),
      stopped=stopped,
      done=stopped | (count >= max_new),
      n=jnp.where(live, n + kept_B + 1, n),
      x=jnp.where(live, next_B, st["x"]),
      h=jnp.where(live[:, None], h_BJD[rows, kept_B], st["h"]),
      rounds=st["rounds"] + live,
    )
    if return_logits:
      new["logits"] = st["logits"].at[r, slots_BJ].set(p_BJV, mode="drop")
    return new

  st = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), body, st)
  response_lens = jnp.sum(st["mask"], axis=-1).astype(jnp.int32)
  trim = lambda x: None if x is None else x[:, :cache_len]  # noqa: E731
  return SampleOutput(
    tokens=trim(st["tokens"]),
    logp=trim(st["logp"]),
    response_mask=trim(st["mask"]),
    prompt_lens=prompt_lens_B,
    lengths=prompt_lens_B + response_lens,
    finished=st["stopped"],
    logits=trim(st.get("logits")),
    rounds=st["rounds"],
  )


def acceptance_length(out) -> float:
  """Tokens a verification round produced, averaged over the batch's rounds: (response tokens - the first, which
  the prefill drew) / rounds. 1 means no draft was ever kept, k + 1 every one."""
  rounds = int(np.sum(np.asarray(out.rounds)))
  made = int(np.sum(np.asarray(out.lengths) - np.asarray(out.prompt_lens) - 1))
  return made / rounds if rounds else float("nan")
