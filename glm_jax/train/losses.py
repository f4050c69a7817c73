"""Pretraining losses, in fp32.

  LM:       mean over valid t of -log p(x_{t+1} | x_<=t)
  MTP:      depth k: mean over valid t of -log p_k(x_{t+1+k} | ...), averaged over depths
  balance:  alpha * sum_i f_i P_i per sequence (DSV3 sequence-wise balance), f_i = E / (K T) * count_i,
            P_i = mean_t s_i / sum_j s_j; averaged over sequences and MoE layers
A target is valid when it lies in the same packed document as its input token and that token is not
padding (segment id 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shifted_targets(input_ids_BT: jax.Array, segment_ids_BT: jax.Array, shift: int,
                    loss_mask_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
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


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, valid_BT: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """(sum of -log p(target) over valid tokens, number of valid tokens), fp32."""
  logits = logits_BTV.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  nll = jnp.where(valid_BT, logz - picked, 0.0)
  return jnp.sum(nll), jnp.sum(valid_BT).astype(jnp.float32)


def lm_and_mtp_losses(logits_BTV: jax.Array, mtp_logits_MBTV: jax.Array | None, input_ids_BT: jax.Array,
                      segment_ids_BT: jax.Array, loss_mask_BT: jax.Array | None = None) -> dict[str, jax.Array]:
  """{"lm_loss", "mtp_loss", "tokens"}; mtp_loss is 0 without MTP logits. loss_mask (SFT) keeps the targets
  it marks."""
  targets, valid = shifted_targets(input_ids_BT, segment_ids_BT, 1, loss_mask_BT)
  nll, count = cross_entropy(logits_BTV, targets, valid)
  out = {"lm_loss": nll / jnp.maximum(count, 1.0), "tokens": count, "mtp_loss": jnp.zeros((), jnp.float32)}
  if mtp_logits_MBTV is not None:
    losses = []
    for k in range(mtp_logits_MBTV.shape[0]):
      targets, valid = shifted_targets(input_ids_BT, segment_ids_BT, k + 2, loss_mask_BT)
      nll_k, count_k = cross_entropy(mtp_logits_MBTV[k], targets, valid)
      losses.append(nll_k / jnp.maximum(count_k, 1.0))
    out["mtp_loss"] = jnp.mean(jnp.stack(losses))
  return out


def sequence_balance_loss(expert_counts_LBE: jax.Array, expert_probs_LBE: jax.Array, top_k: int
                          ) -> jax.Array:
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
