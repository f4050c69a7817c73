"""Post-training objectives against hand arithmetic and a numpy loop: GRPO + IcePop / truncated IS / no IS
(GLM-5 Eq. 1) with its KL term, analytic gradients, the asynchronous token-masking loss (Eq. 3-5), group
advantages (slime's sample std), distillation advantages (Eq. 2), the aggregation helper and every ValueError."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.rl import losses

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 2.0

# ---------------------------------------------------------------------------------------------------------------
# The hand example: N=2 sequences, T=3 positions; row 1's last token is masked (with garbage log-probs that
# would overflow exp if they leaked). Ratios r = pi/pi_old and mismatch rho = pi_old/pi_rollout per token:
#   row 0, A=+1:  t0 r=1.5 (> 1.28: clipped branch 1.28 active)  rho=1.2 (in [0.5, 2])
#                 t1 r=0.9 (inside)                              rho=2.5 (popped; truncated to 2.0)
#                 t2 r=0.5 (< 0.8, but A>0: min picks r A=0.5)   rho=0.8
#   row 1, A=-2:  t0 r=0.6 (< 0.8, A<0: min(-1.2,-1.6) = -1.6, clipped active)  rho=0.4 (popped; truncated 0.4)
#                 t1 r=1.5 (> 1.28, A<0: min(-3.0,-2.56) = -3.0, unclipped)     rho=1.0
#                 t2 masked
R = [[1.5, 0.9, 0.5], [0.6, 1.5, 1.0]]
RHO = [[1.2, 2.5, 0.8], [0.4, 1.0, 1.0]]
OLD = [[-1.0, -2.0, -0.5], [-3.0, -0.25, -50.0]]
ADV = [1.0, -2.0]
MASK = [[True, True, True], [True, True, False]]


def hand_inputs():
  old = np.array(OLD, np.float64)
  logp = old + np.log(np.array(R))
  rollout = old - np.log(np.array(RHO))
  logp[1, 2] = 80.0  # masked garbage: exp(80 - (-50)) would overflow fp32
  rollout[1, 2] = -90.0
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return f32(logp), f32(old), f32(rollout), f32(ADV), jnp.asarray(MASK)


def test_grpo_hand_example_icepop():
  logp, old, rollout, adv, mask = hand_inputs()
  loss, m = losses.grpo_loss(logp, old, rollout, adv, mask)
  # w = rho inside [0.5, 2], else 0:  row 0: [1.2, 0, 0.8]; row 1: [0, 1.0]
  row0 = (1.2 * 1.28 * 1.0 + 0.0 * 0.9 * 1.0 + 0.8 * 0.5 * 1.0) / 3  # (1.536 + 0 + 0.4) / 3
  row1 = (0.0 * 0.8 * -2.0 + 1.0 * 1.5 * -2.0) / 2  # (0 - 3.0) / 2
  expected = -(row0 + row1) / 2  # = 0.427333...
  np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
  np.testing.assert_allclose(float(m["pg_loss"]), expected, rtol=1e-6)
  assert float(m["kl_ref"]) == 0.0
  np.testing.assert_allclose(float(m["clip_frac"]), 2 / 5, rtol=1e-6)  # row0 t0, row1 t0
  np.testing.assert_allclose(float(m["icepop_drop_frac"]), 2 / 5, rtol=1e-6)  # rho 2.5 and 0.4
  np.testing.assert_allclose(float(m["is_weight_mean"]), (1.2 + 0 + 0.8 + 0 + 1.0) / 5, rtol=1e-6)
  np.testing.assert_allclose(float(m["ratio_mean"]), (1.5 + 0.9 + 0.5 + 0.6 + 1.5) / 5, rtol=1e-6)
  kl_terms = [rho - 1 - math.log(rho) for rho in (1.2, 2.5, 0.8, 0.4, 1.0)]
  np.testing.assert_allclose(float(m["mismatch_kl"]), sum(kl_terms) / 5, rtol=1e-5)
  for v in m.values():
    assert v.shape == () and v.dtype == jnp.float32


def test_grpo_hand_example_truncated_and_none():
  logp, old, rollout, adv, mask = hand_inputs()
  loss_t, m_t = losses.grpo_loss(logp, old, rollout, adv, mask, is_correction="truncated", tis_cap=2.0)
  # w = min(rho, 2): row 0: [1.2, 2.0, 0.8]; row 1: [0.4, 1.0]
  row0 = (1.2 * 1.28 + 2.0 * 0.9 + 0.8 * 0.5) / 3  # 3.736 / 3
  row1 = (0.4 * -1.6 + 1.0 * -3.0) / 2  # -3.64 / 2
  np.testing.assert_allclose(float(loss_t), -(row0 + row1) / 2, rtol=1e-6)
  np.testing.assert_allclose(float(m_t["is_weight_mean"]), (1.2 + 2.0 + 0.8 + 0.4 + 1.0) / 5, rtol=1e-6)
  np.testing.assert_allclose(float(m_t["icepop_drop_frac"]), 2 / 5, rtol=1e-6)

  loss_n, m_n = losses.grpo_loss(logp, old, rollout, adv, mask, is_correction="none")
  row0 = (1.28 + 0.9 + 0.5) / 3  # 2.68 / 3
  row1 = (-1.6 - 3.0) / 2  # -2.3
  np.testing.assert_allclose(float(loss_n), -(row0 + row1) / 2, rtol=1e-6)
  np.testing.assert_allclose(float(m_n["is_weight_mean"]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(m_n["icepop_drop_frac"]), 2 / 5, rtol=1e-6)


def test_grpo_mask_dtype_advantage_shape_and_jit_agree():
  logp, old, rollout, adv, mask = hand_inputs()
  ref, _ = losses.grpo_loss(logp, old, rollout, adv, mask)
  float_mask, _ = losses.grpo_loss(logp, old, rollout, adv, mask.astype(jnp.float32))
  adv_NT, _ = losses.grpo_loss(logp, old, rollout, jnp.broadcast_to(adv[:, None], (2, 3)), mask)
  jitted, _ = jax.jit(lambda *a: losses.grpo_loss(*a, is_correction="icepop"))(logp, old, rollout, adv, mask)
  assert float(float_mask) == float(ref) == float(adv_NT)
  np.testing.assert_allclose(float(jitted), float(ref), rtol=1e-6)


def test_grpo_empty_row_counts_in_n():
  logp, old, rollout, adv, _ = hand_inputs()
  mask = jnp.asarray([[True, True, True], [False, False, False]])
  loss, _ = losses.grpo_loss(logp, old, rollout, adv, mask, is_correction="none")
  np.testing.assert_allclose(float(loss), -((1.28 + 0.9 + 0.5) / 3 + 0.0) / 2, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# numpy loop oracle on random inputs


def np_grpo(logp, old, rollout, adv, mask, is_correction, tis_cap=2.0, ref=None, kl_coef=0.0):
  """Loop over (i, t) in float64; returns (loss, pg, kl, clip_frac, drop_frac, w_mean, r_mean, mm_kl, grad)."""
  n, t = logp.shape
  adv = np.broadcast_to(adv[:, None], (n, t)) if adv.ndim == 1 else adv
  pg = kl = 0.0
  grad = np.zeros((n, t))
  clipped = dropped = w_sum = r_sum = mm_sum = 0.0
  valid_total = int(mask.sum())
  for i in range(n):
    count = int(mask[i].sum())
    row_pg = row_kl = 0.0
    for j in range(t):
      if not mask[i, j]:
        continue
      r = math.exp(logp[i, j] - old[i, j])
      rho = math.exp(old[i, j] - rollout[i, j])
      a = adv[i, j]
      rc = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
      in_band = 1 / BETA <= rho <= BETA
      w = {"icepop": rho if in_band else 0.0, "truncated": min(rho, tis_cap), "none": 1.0}[is_correction]
      unclipped_active = not (rc * a < r * a)
      row_pg += w * min(r * a, rc * a)
      grad[i, j] = -w * r * a / (n * count) if unclipped_active else 0.0
      if ref is not None:
        d = ref[i, j] - logp[i, j]
        row_kl += math.exp(d) - d - 1
        grad[i, j] += kl_coef * (1 - math.exp(d)) / (n * count)
      clipped += not unclipped_active
      dropped += not in_band
      w_sum += w
      r_sum += r
      mm_sum += rho - 1 - math.log(rho)
    if count:
      pg += row_pg / count
      kl += row_kl / count
  pg, kl = -pg / n, kl / n
  return (
    pg + kl_coef * kl,
    pg,
    kl,
    clipped / valid_total,
    dropped / valid_total,
    w_sum / valid_total,
    r_sum / valid_total,
    mm_sum / valid_total,
    grad,
  )


def random_inputs(seed, n=4, t=7):
  rng = np.random.default_rng(seed)
  old = rng.normal(-2.0, 1.0, (n, t)).astype(np.float32)
  logp = (old + rng.normal(0.0, 0.3, (n, t))).astype(np.float32)
  rollout = (old + rng.normal(0.0, 0.6, (n, t))).astype(np.float32)
  ref = (logp + rng.normal(0.0, 0.5, (n, t))).astype(np.float32)
  adv = rng.normal(0.0, 1.0, (n,)).astype(np.float32)
  mask = rng.random((n, t)) < 0.7
  mask[0, :] = True
  mask[2, :] = False  # an empty row
  return logp, old, rollout, ref, adv, mask


@pytest.mark.parametrize("is_correction", ["icepop", "truncated", "none"])
def test_grpo_matches_numpy_loop_and_analytic_grad(is_correction):
  logp, old, rollout, ref, adv, mask = random_inputs(0)
  want = np_grpo(
    *(x.astype(np.float64) for x in (logp, old, rollout, adv)),
    mask,
    is_correction,
    ref=ref.astype(np.float64),
    kl_coef=0.05,
  )
  fn = lambda lp: losses.grpo_loss(
    lp,
    old,
    rollout,
    adv,
    mask,
    is_correction=is_correction,  # noqa: E731
    ref_logp=ref,
    kl_coef=0.05,
  )
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  np.testing.assert_allclose(float(loss), want[0], rtol=1e-5)
  names = ["pg_loss", "kl_ref", "clip_frac", "icepop_drop_frac", "is_weight_mean", "ratio_mean", "mismatch_kl"]
  for name, value in zip(names, want[1:8]):
    np.testing.assert_allclose(float(m[name]), value, rtol=1e-5, atol=1e-7, err_msg=name)
  assert 0 < want[3] < 1 and 0 < want[4] < 1  # the draw exercises clipping and popping
  np.testing.assert_allclose(np.asarray(grad), want[8], rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(grad)[~mask] == 0.0)


def test_grpo_grad_hand_example():
  """d/dlogp of -w min(rA, clip(r)A)/(N |y_i|): -w r A/(N |y_i|) where the unclipped branch is active, else 0."""
  logp, old, rollout, adv, mask = hand_inputs()
  g_ice = jax.grad(lambda lp: losses.grpo_loss(lp, old, rollout, adv, mask)[0])(logp)
  want = [
    [
      0.0,  # clipped branch active
      0.0,  # popped (w = 0)
      -0.8 * 0.5 * 1.0 / (2 * 3),
    ],  # unclipped: -w r A / (N |y_0|)
    [
      0.0,  # clipped and popped
      -1.0 * 1.5 * -2.0 / (2 * 2),  # unclipped: = +0.75
      0.0,
    ],
  ]  # masked
  np.testing.assert_allclose(np.asarray(g_ice), want, rtol=1e-6, atol=0)
  g = np.asarray(g_ice)
  assert g[0, 0] == 0.0 and g[0, 1] == 0.0 and g[1, 0] == 0.0 and g[1, 2] == 0.0  # exactly zero
  g_none = jax.grad(lambda lp: losses.grpo_loss(lp, old, rollout, adv, mask, is_correction="none")[0])(logp)
  want = [[0.0, -0.9 / 6, -0.5 / 6], [0.0, 0.75, 0.0]]
  np.testing.assert_allclose(np.asarray(g_none), want, rtol=1e-6, atol=0)
  # The constants get no gradient.
  g_old, g_roll, g_adv = jax.grad(
    lambda o, r, a: losses.grpo_loss(logp, o, r, a, mask, is_correction="truncated")[0], argnums=(0, 1, 2)
  )(old, rollout, adv)
  assert not np.any(np.asarray(g_old)) and not np.any(np.asarray(g_roll)) and not np.any(np.asarray(g_adv))


def test_grpo_kl_term_hand():
  logp, old, rollout, adv, mask = hand_inputs()
  d = [[0.5, -0.3, 0.0], [1.0, -1.0, 7.0]]  # ref - logp (the masked 7.0 must not count)
  ref = logp + jnp.asarray(d, jnp.float32)
  fn = lambda lp: losses.grpo_loss(
    lp,
    old,
    rollout,
    adv,
    mask,
    is_correction="none",  # noqa: E731
    ref_logp=ref,
    kl_coef=0.1,
  )
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(logp)
  k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
  kl = ((k3(0.5) + k3(-0.3) + k3(0.0)) / 3 + (k3(1.0) + k3(-1.0)) / 2) / 2
  pg = -((1.28 + 0.9 + 0.5) / 3 + (-1.6 - 3.0) / 2) / 2
  np.testing.assert_allclose(float(m["kl_ref"]), kl, rtol=1e-6)
  np.testing.assert_allclose(float(m["pg_loss"]), pg, rtol=1e-6)
  np.testing.assert_allclose(float(loss), pg + 0.1 * kl, rtol=1e-6)
  # d/dlogp k3 = 1 - exp(ref - logp), scaled by kl_coef / (N |y_i|); plus the policy gradient from above.
  dk = lambda x, n_tok: 0.1 * (1 - math.exp(x)) / (2 * n_tok)  # noqa: E731
  want = [
    [0.0 + dk(0.5, 3), -0.9 / 6 + dk(-0.3, 3), -0.5 / 6 + dk(0.0, 3)],
    [0.0 + dk(1.0, 2), 0.75 + dk(-1.0, 2), 0.0],
  ]
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=1e-9)
  # ref given but kl_coef 0: reported, not added.
  loss0, m0 = losses.grpo_loss(logp, old, rollout, adv, mask, is_correction="none", ref_logp=ref)
  np.testing.assert_allclose(float(loss0), pg, rtol=1e-6)
  np.testing.assert_allclose(float(m0["kl_ref"]), kl, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# asynchronous loss (Eq. 3-5)


def async_inputs():
  # interval (0.8, 1.28).  row 0, A=+1:   r = [1.1 keep, 1.3 out, 0.7 out]
  #                        row 1, A=-0.5: r = [0.9 keep, 1.2 keep, masked]
  roll = np.array([[-1.0, -2.0, -0.5], [-3.0, -0.25, -40.0]])
  logp = roll + np.log(np.array([[1.1, 1.3, 0.7], [0.9, 1.2, 1.0]]))
  logp[1, 2] = 60.0
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return f32(logp), f32(roll), f32([1.0, -0.5]), jnp.asarray(MASK)


def test_async_policy_loss_hand():
  logp, roll, adv, mask = async_inputs()
  (loss, m), grad = jax.value_and_grad(lambda lp: losses.async_policy_loss(lp, roll, adv, mask), has_aux=True)(logp)
  row0 = (1.1 * 1.0) / 1  # one kept token
  row1 = (0.9 * -0.5 + 1.2 * -0.5) / 2  # two kept tokens: -0.525
  np.testing.assert_allclose(float(loss), -(row0 + row1) / 2, rtol=1e-6)  # -0.2875
  np.testing.assert_allclose(float(m["pg_loss"]), -(row0 + row1) / 2, rtol=1e-6)
  np.testing.assert_allclose(float(m["async_masked_frac"]), 2 / 5, rtol=1e-6)
  np.testing.assert_allclose(float(m["ratio_mean"]), (1.1 + 1.3 + 0.7 + 0.9 + 1.2) / 5, rtol=1e-6)
  # gradient -r A / (N |k_i|) on kept tokens, exactly 0 elsewhere
  want = [[-1.1 * 1.0 / (2 * 1), 0.0, 0.0], [-0.9 * -0.5 / (2 * 2), -1.2 * -0.5 / (2 * 2), 0.0]]
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=0)
  g = np.asarray(grad)
  assert g[0, 1] == 0.0 and g[0, 2] == 0.0 and g[1, 2] == 0.0
  # A row whose tokens are all removed contributes 0 and still counts in N.
  mask2 = jnp.asarray([[True, True, True], [False, False, False], [False, True, True]])
  logp3, roll3 = jnp.concatenate([logp, logp[:1]]), jnp.concatenate([roll, roll[:1]])
  loss3, m3 = losses.async_policy_loss(logp3, roll3, jnp.asarray([1.0, -0.5, 3.0]), mask2)
  np.testing.assert_allclose(float(loss3), -(1.1 + 0.0 + 0.0) / 3, rtol=1e-6)
  np.testing.assert_allclose(float(m3["async_masked_frac"]), 4 / 5, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# advantages and aggregation


def test_group_advantages_hand():
  a = losses.group_advantages(jnp.asarray([1, 0, 0, 1, 1, 1, 1, 0], jnp.float32), 4)
  # group 1: mean 0.5, centered +-0.5, sample var (4 * 0.25) / 3 = 1/3, std = sqrt(1/3)
  s1 = math.sqrt(1 / 3) + 1e-6
  # group 2: mean 0.75, centered [0.25, 0.25, 0.25, -0.75], sample var (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5
  s2 = 0.5 + 1e-6
  want = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, 0.25 / s2, 0.25 / s2, 0.25 / s2, -0.75 / s2]
  np.testing.assert_allclose(np.asarray(a), want, rtol=1e-6)
  assert a.shape == (8,) and a.dtype == jnp.float32


def test_group_advantages_degenerate_groups():
  r = jnp.asarray([0.3, 1.0, -2.0], jnp.float32)
  assert np.all(np.asarray(losses.group_advantages(r, 1)) == 0.0)
  a = losses.group_advantages(jnp.asarray([2.0, 2.0, 2.0, 0.0, 1.0, 0.0], jnp.float32), 3)
  assert np.all(np.asarray(a[:3]) == 0.0)  # all-equal group
  np.testing.assert_allclose(np.asarray(a[3:]), np.array([-1, 2, -1]) / 3 / (math.sqrt(1 / 3) + 1e-6), rtol=1e-6)


def test_distill_advantages_value_and_no_grad():
  teacher = jnp.asarray([[-0.5, -1.0], [-2.0, -0.1]], jnp.float32)
  student = jnp.asarray([[-1.5, -0.25], [-2.0, -3.0]], jnp.float32)
  np.testing.assert_allclose(
    np.asarray(losses.distill_advantages(teacher, student)), [[1.0, -0.75], [0.0, 2.9]], rtol=1e-6
  )
  gt, gs = jax.grad(lambda t, s: jnp.sum(losses.distill_advantages(t, s) * s), argnums=(0, 1))(teacher, student)
  assert not np.any(np.asarray(gt))
  # d/ds sum(sg(t - s) * s) = sg(t - s): only the explicit factor carries gradient.
  np.testing.assert_allclose(np.asarray(gs), [[1.0, -0.75], [0.0, 2.9]], rtol=1e-6)


def test_masked_sequence_mean():
  x = jnp.asarray([[1.0, 2.0, jnp.inf], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], jnp.float32)
  mask = jnp.asarray([[1, 1, 0], [0, 0, 0], [0, 0, 1]], jnp.float32)
  out, g = jax.value_and_grad(losses.masked_sequence_mean)(x, mask)
  np.testing.assert_allclose(float(out), ((1 + 2) / 2 + 0.0 + 9 / 1) / 3, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g), [[1 / 6, 1 / 6, 0], [0, 0, 0], [0, 0, 1 / 3]], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# bad input


def _grpo_args():
  logp, old, rollout, adv, mask = hand_inputs()
  return dict(logp=logp, old_logp=old, rollout_logp=rollout, advantages=adv, mask=mask)


@pytest.mark.parametrize(
  "change, names",
  [
    (dict(logp=jnp.zeros((6,))), ["logp", "(6,)"]),
    (dict(old_logp=jnp.zeros((2, 4))), ["old_logp", "(2, 4)"]),
    (dict(rollout_logp=jnp.zeros((3, 3))), ["rollout_logp", "(3, 3)"]),
    (dict(mask=jnp.ones((2, 2), bool)), ["mask", "(2, 2)"]),
    (dict(advantages=jnp.zeros((3,))), ["advantages", "(3,)"]),
    (dict(advantages=jnp.zeros((2, 3, 1))), ["advantages", "(2, 3, 1)"]),
    (dict(eps_low=1.0), ["eps_low", "1.0"]),
    (dict(eps_low=-0.1), ["eps_low", "-0.1"]),
    (dict(eps_high=-0.01), ["eps_high", "-0.01"]),
    (dict(icepop_beta=1.0), ["icepop_beta", "1.0"]),
    (dict(is_correction="tis"), ["is_correction", "'tis'", "icepop", "truncated", "none"]),
    (dict(tis_cap=0.0), ["tis_cap", "0.0"]),
    (dict(kl_coef=-1.0), ["kl_coef", "-1.0"]),
    (dict(kl_coef=0.1), ["kl_coef", "ref_logp"]),
    (dict(ref_logp=jnp.zeros((2, 2))), ["ref_logp", "(2, 2)"]),
  ],
)
def test_grpo_bad_input(change, names):
  kwargs = _grpo_args() | change
  with pytest.raises(ValueError) as err:
    losses.grpo_loss(**kwargs)
  for name in names:
    assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize(
  "change, names",
  [
    (dict(rollout_logp=jnp.zeros((2, 4))), ["rollout_logp", "(2, 4)"]),
    (dict(mask=jnp.ones((3,), bool)), ["mask", "(3,)"]),
    (dict(advantages=jnp.zeros((4,))), ["advantages", "(4,)"]),
    (dict(eps_low=1.5), ["eps_low", "1.5"]),
    (dict(eps_high=-1.0), ["eps_high", "-1.0"]),
    (dict(eps_low=0.0, eps_high=0.0), ["eps_low", "eps_high", "empty"]),
  ],
)
def test_async_bad_input(change, names):
  logp, roll, adv, mask = async_inputs()
  kwargs = dict(logp=logp, rollout_logp=roll, advantages=adv, mask=mask) | change
  with pytest.raises(ValueError) as err:
    losses.async_policy_loss(**kwargs)
  for name in names:
    assert name in str(err.value), (name, str(err.value))


def test_other_bad_input():
  with pytest.raises(ValueError, match=r"rewards.*\(2, 4\)"):
    losses.group_advantages(jnp.zeros((2, 4)), 4)
  with pytest.raises(ValueError, match="group_size.*0"):
    losses.group_advantages(jnp.zeros((4,)), 0)
  with pytest.raises(ValueError, match="N=6.*group_size=4"):
    losses.group_advantages(jnp.zeros((6,)), 4)
  with pytest.raises(ValueError, match=r"student_logp.*\(2, 3\).*\(2, 2\)"):
    losses.distill_advantages(jnp.zeros((2, 3)), jnp.zeros((2, 2)))
  with pytest.raises(ValueError, match=r"teacher_logp.*\(3,\)"):
    losses.distill_advantages(jnp.zeros((3,)), jnp.zeros((3,)))
  with pytest.raises(ValueError, match=r"mask.*\(2, 2\)"):
    losses.masked_sequence_mean(jnp.zeros((2, 3)), jnp.ones((2, 2)))
