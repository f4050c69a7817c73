"""Pretraining losses, in fp32.

  LM:       mean over valid t of -log p(x_{t+1} | x_<=t)
  MTP:      depth k: mean over valid t of -log p_k(x_{t+1+k} | ...), averaged over depths
  balance:  alpha * sum_i f_i P_i per sequence (DSV3 sequence-wise balance), f_i = E / (K T) * count_i,
            P_i = mean_t s_i / sum_j s_j; averaged over sequences and MoE layers
A target is valid when it lies in the same packed document as its input token and that token is not
padding (segment id 0).

GLM's blank infilling (data.objective "glm", glm_jax/data/blank_infilling.py) gives the targets explicitly: the
prediction at t of targets[t] counts where loss_mask[t] is 1 (part B; a span's last token predicts <eop>, which is
no input). MTP depth k at t predicts targets[t + k] when the k inputs in between are the targets before it
(input_ids[t + j + 1] == targets[t + j], j < k: one span, not across the next span's <sop>) and every one of
loss_mask[t..t + k] is 1.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def shifted_targets(
  input_ids_BT: jax.Array, segment_ids_BT: jax.Array, shift: int, loss_mask_BT: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(targets [B, T], valid [B, T]): targets[t] = input_ids[t + shift], valid where t + shift is in the
  row, in the same segment as t, segment t is not padding and, given a loss mask (SFT: 1 on the response
  tokens), loss_mask[t + shift] is 1."""
  pad = [(0, 0), (0, shift)]
  targets = jnp.pad(input_ids_BT[:, shift:], pad)
  seg_next = jnp.pad(segment_ids_BT[:, shift:], pad, constant_values=-1)
  valid = (seg_next == segment_ids_BT) & (segment_ids_BT != 0)
  if loss_mask_BT is not None:
    valid = valid & (jnp.pad(loss_mask_BT[:, shift:], pad) != 0)
  return targets, valid


def explicit_targets(
  targets_BT: jax.Array, loss_mask_BT: jax.Array, input_ids_BT: jax.Array, segment_ids_BT, depth: int
) -> tuple[jax.Array, jax.Array]:
  """(targets [B, T], valid [B, T]) for prediction depth `depth` (0: the main head, k: MTP depth k) when the batch
  carries its targets (see the module docstring)."""
  t_len = targets_BT.shape[1]
  on = (loss_mask_BT != 0) & (segment_ids_BT != 0)
  valid, pad = on, [(0, 0), (0, depth)]
  for j in range(depth):  # the chain of teacher-forced inputs between t and t + depth
    follows = jnp.pad(input_ids_BT[:, j + 1 :], [(0, 0), (0, j + 1)], constant_values=-1) == jnp.pad(
      targets_BT[:, j:], [(0, 0), (0, j)], constant_values=-2
    )
    valid = valid & follows & jnp.pad(on[:, j + 1 :], [(0, 0), (0, j + 1)])
  return jnp.pad(targets_BT[:, depth:], pad)[:, :t_len], valid


def prediction_targets(batch: dict, depth: int) -> tuple[jax.Array, jax.Array]:
  """(targets, valid) of a model batch at prediction depth `depth` (0: next token; k: MTP depth k): the shifted
  inputs, or the batch's own "targets" when it has them (blank infilling)."""
  if "targets" in batch:
    return explicit_targets(batch["targets"], batch["loss_mask"], batch["input_ids"], batch["segment_ids"], depth)
  return shifted_targets(batch["input_ids"], batch["segment_ids"], depth + 1, batch.get("loss_mask"))


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, valid_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of -log p(target) over valid tokens, number of valid tokens), fp32."""
  logits = logits_BTV.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  nll = jnp.where(valid_BT, logz - picked, 0.0)
  return jnp.sum(nll), jnp.sum(valid_BT).astype(jnp.float32)


def chunked_cross_entropy(
  head: Callable[[jax.Array], jax.Array],
  x_BTD: jax.Array,
  targets_BT: jax.Array,
  valid_BT: jax.Array,
  chunk: int,
  with_argmax: bool = False,
):
  """cross_entropy(head(x), targets, valid) without the [B, T, V] logits: (nll sum, count), plus the argmax
  [B, T] with with_argmax. head maps normed hidden states [B, c, D] to fp32 logits [B, c, V]; it runs on `chunk`
  tokens of each row at a time in a scan whose steps are rematerialized, so the forward and the backward hold one
  chunk's logits. The chunks are strided (chunk i holds tokens i, i + T/chunk, i + 2 T/chunk, ...): a sequence
  sharded in contiguous pieces (a context mesh axis) gives every chunk the same number of tokens on each shard.
  chunk 0 or >= T: one chunk (plain cross_entropy)."""
  b, t_len, d = x_BTD.shape
  if chunk <= 0 or chunk >= t_len:
    logits = head(x_BTD)
    out = cross_entropy(logits, targets_BT, valid_BT)
    return (*out, jnp.argmax(logits, axis=-1).astype(jnp.int32)) if with_argmax else out
  if t_len % chunk:
    raise ValueError(
      f"train.loss_chunk={chunk} does not divide the sequence length {t_len}; use a divisor of it "
      "(or 0: the whole sequence at once)"
    )
  n = t_len // chunk
  strided = lambda a: jnp.moveaxis(a.reshape(b, chunk, n, *a.shape[2:]), 2, 0)  # noqa: E731  [n, B, chunk, ...]

  @jax.checkpoint
  def one(carry, xs):
    x, targets, valid = xs
    logits = head(x)
    nll, count = cross_entropy(logits, targets, valid)
    return (carry[0] + nll, carry[1] + count), jnp.argmax(logits, axis=-1).astype(jnp.int32) if with_argmax else None

  zero = jnp.zeros((), jnp.float32)
  (nll, count), pred = jax.lax.scan(one, (zero, zero), (strided(x_BTD), strided(targets_BT), strided(valid_BT)))
  if with_argmax:
    return nll, count, jnp.moveaxis(pred, 0, 2).reshape(b, t_len)
  return nll, count


def lm_and_mtp_losses(
  logits_BTV: jax.Array,
  mtp_logits_MBTV: jax.Array | None,
  batch: dict,
  *,
  head: Callable[[jax.Array], jax.Array] | None = None,
  chunk: int = 0,
) -> dict[str, jax.Array]:
  """{"lm_loss", "mtp_loss", "tokens"} of a model batch (input_ids, segment_ids, optionally loss_mask and
  targets: see prediction_targets); mtp_loss is 0 without MTP logits. loss_mask (SFT) keeps the targets it
  marks. With `head` (normed hidden states -> fp32 logits), the first two arguments are the normed hidden states
  [B, T, D] and [n_mtp, B, T, D] and every loss is computed `chunk` tokens of a row at a time
  (chunked_cross_entropy): no [B, T, V] array."""

  def nll(x, targets, valid):
    return cross_entropy(x, targets, valid) if head is None else chunked_cross_entropy(head, x, targets, valid, chunk)

  targets, valid = prediction_targets(batch, 0)
  total, count = nll(logits_BTV, targets, valid)
  out = {"lm_loss": total / jnp.maximum(count, 1.0), "tokens": count, "mtp_loss": jnp.zeros((), jnp.float32)}
  if mtp_logits_MBTV is not None:
    losses = []
    for k in range(mtp_logits_MBTV.shape[0]):
      targets, valid = prediction_targets(batch, k + 1)
      nll_k, count_k = nll(mtp_logits_MBTV[k], targets, valid)
      losses.append(nll_k / jnp.maximum(count_k, 1.0))
    out["mtp_loss"] = jnp.mean(jnp.stack(losses))
  return out


def exact_spans(
  predicted_BT: jax.Array, targets_BT: jax.Array, valid_BT: jax.Array, block_positions_BT: jax.Array
) -> dict[str, jax.Array]:
  """{"spans": the blank-infilling spans of the batch, "spans_exact": those whose every valid target is the
  model's prediction there (predicted: the argmax of the logits [B, T])}. A span starts where block_positions is
  1 (its <sop>) and runs to the next start."""
  starts = (block_positions_BT == 1) & valid_BT
  span_BT = jnp.cumsum(starts, axis=1)  # 1, 2, ... within a row; 0 before its first span
  wrong = valid_BT & (predicted_BT != targets_BT)
  rows = jnp.arange(span_BT.shape[0])[:, None]
  wrong_span = jnp.zeros((span_BT.shape[0], span_BT.shape[1] + 1), bool).at[rows, span_BT].max(wrong)
  has_span = jnp.zeros_like(wrong_span).at[rows, span_BT].max(starts)
  return {
    "spans": jnp.sum(has_span).astype(jnp.float32),
    "spans_exact": jnp.sum(has_span & ~wrong_span).astype(jnp.float32),
  }


def sequence_balance_loss(expert_counts_LBE: jax.Array, expert_probs_LBE: jax.Array, top_k: int) -> jax.Array:
  """sum_i f_i P_i per sequence and layer, averaged; 1.0 when routing is perfectly balanced."""
  n_experts = expert_counts_LBE.shape[-1]
  tokens_LB1 = jnp.sum(expert_counts_LBE, axis=-1, keepdims=True) / top_k
  f_LBE = n_experts / top_k * expert_counts_LBE / jnp.maximum(tokens_LB1, 1.0)
  return jnp.mean(jnp.sum(f_LBE * expert_probs_LBE, axis=-1))


def expert_load_entropy(expert_counts_LBE: jax.Array) -> jax.Array:
  """Per-layer entropy (nats) of the share of routed tokens each expert got; ln(E) is perfectly even."""
  load_LE = jnp.sum(expert_counts_LBE, axis=1).astype(jnp.float32)
  share = load_LE / jnp.maximum(jnp.sum(load_LE, axis=-1, keepdims=True), 1.0)
  return -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.where(share > 0, share, 1.0)), 0.0), axis=-1)


def expert_bias_update(bias_LE: jax.Array, expert_counts_LBE: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing (DSV3): b_i -= rate where expert i got more than the mean load, += where less."""
  load_LE = jnp.sum(expert_counts_LBE, axis=1).astype(jnp.float32)
  return bias_LE - rate * jnp.sign(load_LE - jnp.mean(load_LE, axis=-1, keepdims=True))
