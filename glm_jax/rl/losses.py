"""Post-training objectives (GLM-5 Eq. 1-5; docs/glm5_facts.md section 5), pure jnp, fp32.

Shapes: N sequences, T response positions. logp_BT is the trainable policy's log-prob of each sampled token;
old_logp_BT the training engine's log-prob before the update (pi_train_old); rollout_logp_BT the inference
engine's log-prob at sampling time (pi_infer_old); mask_BT marks the tokens that are trained on.

Aggregation (shared by every loss, `masked_sequence_mean`): per-sequence mean over its mask tokens, then the
plain mean over all N sequences,

  agg(x) = (1/N) sum_i (1/|y_i|) sum_{t in y_i} x_it,   |y_i| = number of mask tokens of row i.

A row with no mask tokens contributes 0 but still counts in the 1/N.

  GRPO + IcePop (Eq. 1):
    L = -agg( w_it * min(r_it A_it, clip(r_it, 1-eps_low, 1+eps_high) A_it) ) [+ kl_coef * agg(k3_ref)]
    r = exp(logp - old_logp), rho = exp(old_logp - rollout_logp) (train/inference mismatch), w from rho:
      icepop:    w = rho if 1/beta <= rho <= beta else 0
      truncated: w = min(rho, tis_cap)
      none:      w = 1
    k3_ref = exp(ref - logp) - (ref - logp) - 1 (Schulman's k3 estimator of KL(pi_theta || pi_ref)).
  Distillation (Eq. 2): A_it = sg(log pi_teacher - log pi_theta), fed into Eq. 1.
  Asynchronous agentic RL (Eq. 3-5): r = exp(logp - rollout_logp); tokens with sg(r) outside the open interval
    (1-eps_low, 1+eps_high) are removed; L = -agg_kept(r A), |y_i| = kept tokens of row i.
  Group advantages: A_i = (R_i - mean_group R) / (std_group R + 1e-6), sample std (ddof=1) as in slime.

Hyperparameters (eps_low, eps_high, icepop_beta, tis_cap, kl_coef, is_correction) are meant to be Python
numbers; they are validated when concrete and skipped from validation when traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IS_CORRECTIONS = ("icepop", "truncated", "none")
STD_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------
# validation helpers (Python-level, on static shapes and values)


def _f32(x) -> jax.Array:
  return jnp.asarray(x).astype(jnp.float32)


def _concrete(value) -> bool:
  return not isinstance(value, jax.core.Tracer)


def _check_2d(name: str, x, shape: tuple[int, ...] | None = None, like: str = "logp") -> tuple[int, int]:
  s = tuple(jnp.shape(x))
  if shape is None:
    if len(s) != 2:
      raise ValueError(f"{name} must be [N, T] (sequences x response positions), got shape {s}")
    return s
  if s != tuple(shape):
    raise ValueError(f"{name} must have the shape of {like} {tuple(shape)}, got shape {s}")
  return s


def _advantages_BT(advantages, shape: tuple[int, int]) -> jax.Array:
  n, t = shape
  s = tuple(jnp.shape(advantages))
  if s == (n,):
    a = jnp.broadcast_to(jnp.asarray(advantages, jnp.float32)[:, None], (n, t))
  elif s == (n, t):
    a = jnp.asarray(advantages, jnp.float32)
  else:
    raise ValueError(f"advantages must be [N]={[n]} (one per sequence) or [N, T]={[n, t]}, got shape {s}")
  return jax.lax.stop_gradient(a)


def _check_eps(eps_low, eps_high) -> None:
  if _concrete(eps_low) and not 0.0 <= float(eps_low) < 1.0:
    raise ValueError(f"eps_low must lie in [0, 1), got {eps_low}")
  if _concrete(eps_high) and not float(eps_high) >= 0.0:
    raise ValueError(f"eps_high must be >= 0, got {eps_high}")


def _valid(mask, shape: tuple[int, int], like: str = "logp") -> jax.Array:
  _check_2d("mask", mask, shape, like)
  m = jnp.asarray(mask)
  return m if m.dtype == jnp.bool_ else m != 0


def _token_mean(x_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
  """sum over valid tokens of x / max(number of valid tokens, 1): a metric over all valid tokens (not per row)."""
  total = jnp.sum(jnp.where(valid_BT, x_BT.astype(jnp.float32), 0.0))
  return total / jnp.maximum(jnp.sum(valid_BT).astype(jnp.float32), 1.0)


# ----------------------------------------------------------------------------------------------------------------
# aggregation


def masked_sequence_mean(x, mask) -> jax.Array:
  """(1/N) sum_i [ sum_t m_it x_it / max(sum_t m_it, 1) ]: per-row mean over the mask, then mean over rows.

  x and mask are [N, T]; mask is bool or 0/1. A row with no mask tokens contributes 0 and still counts in 1/N.
  Masked-out entries of x are selected away (jnp.where), so inf/nan there neither leak into the value nor the
  gradient.
  """
  shape = _check_2d("x", x)
  valid = _valid(mask, shape, "x")
  x = jnp.asarray(x).astype(jnp.float32)
  count_B = jnp.sum(valid, axis=1).astype(jnp.float32)
  sum_B = jnp.sum(jnp.where(valid, x, 0.0), axis=1)
  return jnp.mean(sum_B / jnp.maximum(count_B, 1.0))


# ----------------------------------------------------------------------------------------------------------------
# GRPO + IcePop (GLM-5 Eq. 1)


def grpo_loss(
  logp,
  old_logp,
  rollout_logp,
  advantages,
  mask,
  *,
  eps_low: float = 0.2,
  eps_high: float = 0.28,
  icepop_beta: float = 2.0,
  is_correction: str = "icepop",
  tis_cap: float = 2.0,
  ref_logp=None,
  kl_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GLM-5 Eq. 1: (loss, metrics).

    L = -(1/N) sum_i (1/|y_i|) sum_t w_it * min(r_it A_it, clip(r_it, 1-eps_low, 1+eps_high) A_it)
        + kl_coef * (1/N) sum_i (1/|y_i|) sum_t [exp(ref_it - logp_it) - (ref_it - logp_it) - 1]

  r = exp(logp - sg(old_logp)); rho = exp(sg(old_logp) - sg(rollout_logp)); the weight w (a constant) is
    icepop:    rho where 1/icepop_beta <= rho <= icepop_beta, else 0 (IcePop "pops" the token);
    truncated: min(rho, tis_cap). slime's vanilla_tis_function computes clamp(rho, tis_clip_low, tis_clip) with
               --tis-clip-low defaulting to 0, which is a no-op for rho > 0, so no lower clamp is applied here;
    none:      1.
  The min is taken as: the clipped branch is active where clip(r) A < r A strictly (then d/dlogp = 0), otherwise
  the unclipped branch r A is used (d/dlogp = w r A / (N |y_i|)). logp, old_logp, rollout_logp, mask: [N, T];
  advantages: [N] (broadcast over tokens) or [N, T]; advantages, old_logp, rollout_logp, ref_logp are constants.
  A row with no mask tokens contributes 0 and still counts in N. The KL term is added only when kl_coef > 0 (then
  ref_logp is required).

  Metrics (fp32 scalars; token-level means over all valid tokens unless noted):
    pg_loss           the policy term (sequence aggregation), without KL
    kl_ref            agg(k3_ref) (sequence aggregation) when ref_logp is given, else 0 (reported also at kl_coef 0)
    clip_frac         fraction of tokens where clipping changed the min (clip(r) A < r A)
    icepop_drop_frac  fraction of tokens with rho outside [1/beta, beta] (reported for every is_correction)
    is_weight_mean    mean w
    ratio_mean        mean r
    mismatch_kl       mean of k3 for KL(pi_rollout || pi_old) on rollout samples: rho - 1 - log rho, with
                      rho = pi_old / pi_rollout (unbiased since E_rollout[rho] = 1; each term >= 0)
  """
  shape = _check_2d("logp", logp)
  _check_2d("old_logp", old_logp, shape)
  _check_2d("rollout_logp", rollout_logp, shape)
  valid = _valid(mask, shape)
  adv_BT = _advantages_BT(advantages, shape)
  _check_eps(eps_low, eps_high)
  if _concrete(icepop_beta) and not float(icepop_beta) > 1.0:
    raise ValueError(f"icepop_beta must be > 1 (the kept band is [1/beta, beta]), got {icepop_beta}")
  if is_correction not in IS_CORRECTIONS:
    raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {is_correction!r}")
  if _concrete(tis_cap) and not float(tis_cap) > 0.0:
    raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
  if _concrete(kl_coef) and not float(kl_coef) >= 0.0:
    raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
  use_kl = not _concrete(kl_coef) or float(kl_coef) > 0.0
  if use_kl and ref_logp is None:
    raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logp (the reference policy's log-probs, [N, T]); got None")
  if ref_logp is not None:
    _check_2d("ref_logp", ref_logp, shape)

  logp_BT = _f32(logp)
  old_BT = jax.lax.stop_gradient(_f32(old_logp))
  roll_BT = jax.lax.stop_gradient(_f32(rollout_logp))

  # Exponents are zeroed at masked positions so padding garbage cannot overflow (and 0 * inf cannot reach grads).
  r_BT = jnp.exp(jnp.where(valid, logp_BT - old_BT, 0.0))
  r_clip_BT = jnp.clip(r_BT, 1.0 - eps_low, 1.0 + eps_high)
  surr_BT = r_BT * adv_BT
  surr_clip_BT = r_clip_BT * adv_BT
  clipped_BT = surr_clip_BT < surr_BT
  obj_BT = jnp.where(clipped_BT, surr_clip_BT, surr_BT)

  log_rho_BT = jnp.where(valid, old_BT - roll_BT, 0.0)
  rho_BT = jnp.exp(log_rho_BT)
  in_band_BT = (rho_BT >= 1.0 / icepop_beta) & (rho_BT <= icepop_beta)
  if is_correction == "icepop":
    w_BT = jnp.where(in_band_BT, rho_BT, 0.0)
  elif is_correction == "truncated":
    w_BT = jnp.minimum(rho_BT, tis_cap)
  else:
    w_BT = jnp.ones_like(rho_BT)
  w_BT = jax.lax.stop_gradient(w_BT)

  pg_loss = -masked_sequence_mean(w_BT * obj_BT, valid)
  loss = pg_loss
  kl_ref = jnp.zeros((), jnp.float32)
  if ref_logp is not None:
    d_BT = jnp.where(valid, jax.lax.stop_gradient(_f32(ref_logp)) - logp_BT, 0.0)
    kl_ref = masked_sequence_mean(jnp.exp(d_BT) - d_BT - 1.0, valid)
    if use_kl:
      loss = loss + kl_coef * kl_ref

  sg = jax.lax.stop_gradient
  metrics = {
    "pg_loss": sg(pg_loss),
    "kl_ref": sg(kl_ref),
    "clip_frac": _token_mean(clipped_BT, valid),
    "icepop_drop_frac": _token_mean(~in_band_BT, valid),
    "is_weight_mean": _token_mean(w_BT, valid),
    "ratio_mean": _token_mean(sg(r_BT), valid),
    "mismatch_kl": _token_mean(rho_BT - 1.0 - log_rho_BT, valid),
  }
  return loss, metrics


# ----------------------------------------------------------------------------------------------------------------
# asynchronous agentic RL (GLM-5 Eq. 3-5)


def async_policy_loss(
  logp, rollout_logp, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GLM-5 Eq. 3-5 (no separate old-policy pass): (loss, metrics).

    r_it = exp(logp_it - sg(rollout_logp_it)),  keep_it = m_it and 1-eps_low < sg(r_it) < 1+eps_high
    L = -(1/N) sum_i (1/|k_i|) sum_t keep_it r_it A_it,  |k_i| = number of kept tokens of row i

  Tokens outside the open interval are removed from the loss entirely (neither numerator nor denominator), so
  |y_i| is the kept-token count; a row with no kept tokens contributes 0 and still counts in N. The gradient on
  a kept token is r A / (N |k_i|), and exactly 0 on removed ones.
  Metrics: "pg_loss" (= loss), "async_masked_frac" (fraction of valid tokens removed), "ratio_mean" (mean r over
  valid tokens).
  """
  shape = _check_2d("logp", logp)
  _check_2d("rollout_logp", rollout_logp, shape)
  valid = _valid(mask, shape)
  adv_BT = _advantages_BT(advantages, shape)
  _check_eps(eps_low, eps_high)
  if _concrete(eps_low) and _concrete(eps_high) and float(eps_low) + float(eps_high) <= 0.0:
    raise ValueError(
      f"eps_low + eps_high must be > 0 (the kept interval (1-eps_low, 1+eps_high) is empty), "
      f"got eps_low={eps_low}, eps_high={eps_high}"
    )

  logp_BT = _f32(logp)
  roll_BT = jax.lax.stop_gradient(_f32(rollout_logp))
  r_BT = jnp.exp(jnp.where(valid, logp_BT - roll_BT, 0.0))
  r_sg = jax.lax.stop_gradient(r_BT)
  keep_BT = valid & (r_sg > 1.0 - eps_low) & (r_sg < 1.0 + eps_high)
  loss = -masked_sequence_mean(r_BT * adv_BT, keep_BT)
  metrics = {
    "pg_loss": jax.lax.stop_gradient(loss),
    "async_masked_frac": _token_mean(valid & ~keep_BT, valid),
    "ratio_mean": _token_mean(r_sg, valid),
  }
  return loss, metrics


# ----------------------------------------------------------------------------------------------------------------
# advantages


def group_advantages(rewards, group_size: int) -> jax.Array:
  """A_i = (R_i - mean_g R) / (std_g R + 1e-6) over consecutive groups of group_size; returns [N] fp32.

  std is the sample standard deviation (ddof=1, Bessel-corrected), following slime: slime/ray/rollout.py,
  RolloutManager._post_process_rewards, reshapes rewards to [-1, n_samples_per_prompt], subtracts the mean and
  divides by `rewards.std(dim=-1, keepdim=True) + 1e-6` (torch's default std is unbiased). group_size 1 gives
  zero advantages (R - mean is 0; the ddof=1 std would be undefined). A group whose rewards are all equal gives
  zeros. No gradient flows (advantages are constants).
  """
  s = tuple(jnp.shape(rewards))
  if len(s) != 1:
    raise ValueError(f"rewards must be [N] (one scalar per sequence), got shape {s}")
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
  n = s[0]
  if n % group_size != 0:
    raise ValueError(f"rewards length N={n} must be a multiple of group_size={group_size}")
  grouped = jax.lax.stop_gradient(jnp.asarray(rewards).astype(jnp.float32)).reshape(n // group_size, group_size)
  centered = grouped - jnp.mean(grouped, axis=1, keepdims=True)
  if group_size == 1:
    return jnp.zeros((n,), jnp.float32)
  std = jnp.sqrt(jnp.sum(centered * centered, axis=1, keepdims=True) / (group_size - 1))
  return (centered / (std + STD_EPS)).reshape(n)


def distill_advantages(teacher_logp, student_logp) -> jax.Array:
  """GLM-5 Eq. 2: A_it = sg(log pi_teacher(y_t | ...) - log pi_theta(y_t | ...)), [N, T] fp32, no gradient."""
  shape = _check_2d("teacher_logp", teacher_logp)
  _check_2d("student_logp", student_logp, shape, "teacher_logp")
  return jax.lax.stop_gradient(_f32(teacher_logp) - _f32(student_logp))
