"""The RL step functions: one SGD step's update equals minus lr times the gradient of the objective written out
here independently (per-token REINFORCE terms over the model's log-probabilities), for GRPO + IcePop, on-policy
distillation and the asynchronous form; non-finite losses skip; the frozen indexer stays frozen."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

import glm_jax.configs.grpo_tiny
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import step as rl_step
from glm_jax.rl import config as rl_config, warm_start
from glm_jax.train.step import TrainState

# test_non_finite_loss_skips_the_update compiles the same GRPO step as test_grpo_step_is_icepop_weighted_reinforce:
# with the persistent cache it is compiled once.

N, S = 4, 8


def tiny_cfg() -> ModelConfig:
  m = glm_jax.configs.grpo_tiny.get_config().model.to_dict()
  m.update(num_hidden_layers=2, index_topk=4)  # a dense and a MoE layer; DSA selects 4 of up to 8 keys
  return ModelConfig.from_dict(m)


def rl_cfg(**changes):
  cfg = glm_jax.configs.grpo_tiny.get_config().rl
  cfg.grad_clip_norm = 0.0  # the update is then exactly -lr * gradient
  cfg.update(changes)
  return cfg


@pytest.fixture(scope="module")
def setup():
  cfg = tiny_cfg()
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, 20, (N, S)).astype(np.int32)
  mask = np.zeros((N, S), bool)
  for i, (p, n) in enumerate([(3, 8), (2, 5), (4, 8), (5, 6)]):  # response = tokens p..n-1 of row i
    mask[i, p:n] = True
  return cfg, graphdef, params, rest, jnp.asarray(tokens), jnp.asarray(mask)


@functools.partial(jax.jit, static_argnums=0)
def logp_of(graphdef, params, rest, tokens):
  """log p(tokens[:, s] | tokens[:, :s]) from the model's logits, written out here: [N, S], 0 at s = 0."""
  logits = nnx.merge(graphdef, params, rest)(tokens, compute_mtp=False).logits
  logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  rows, prev = np.arange(N)[:, None], np.arange(S - 1)[None, :]  # the logits at t - 1 score token t
  return jnp.concatenate([jnp.zeros((N, 1)), logp_all[rows, prev, tokens[:, 1:]]], axis=1)


def sgd_update(graphdef, params, rest, step_maker, cfg, batch, lr=0.5):
  opt = optax.sgd(lr)
  state = TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    rest=rest,
    opt_state=opt.init(params),
    loss_ema=jnp.zeros(()),
    skipped=jnp.zeros((), jnp.int32),
  )
  new, metrics = step_maker(graphdef, opt, lambda s: lr, cfg)(state, batch)
  return jax.tree.map(lambda a, b: (b - a) / -lr, params, new.params), metrics, new


def assert_trees_close(a, b, rtol=2e-4, atol=1e-6):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      x, y, rtol=rtol, atol=atol * max(1.0, float(jnp.max(jnp.abs(y)))), err_msg=jax.tree_util.keystr(path)
    )


@functools.partial(jax.jit, static_argnums=0)
def weighted_logp_grad(graphdef, params, rest, tokens, coef):
  """d/dparams of sum_it coef_it * log p(tokens_it), coef given (the chain rule's factor d objective / d logp)."""
  return jax.grad(lambda p: jnp.sum(coef * logp_of(graphdef, p, rest, tokens)))(params)


def reference_grad(setup, dobjective_dlogp, keep=None):
  """d/dparams of -(1/N) sum_i (1/|y_i|) sum_{t in y_i} objective_it, with the per-token derivative
  d objective_it / d logp_it = dobjective_dlogp[i, t] written out by hand (numpy) at the current parameters; y_i
  are the kept tokens (default: the response mask). One compiled program serves every objective."""
  cfg, graphdef, params, rest, tokens, mask = setup
  keep = np.asarray(mask) if keep is None else keep
  coef = -np.where(keep, dobjective_dlogp, 0.0) / keep.sum(1, keepdims=True) / N
  return weighted_logp_grad(graphdef, params, rest, tokens, jnp.asarray(coef, jnp.float32))


@pytest.mark.slow  # compiles a GRPO step and its reference gradient
def test_grpo_step_is_icepop_weighted_reinforce(setup):
  """On-policy (old = current), r = 1 so the clip is inactive and d[w r A]/dtheta = w A dlogp/dtheta; IcePop's
  w = rho = exp(old - rollout) inside [1/2, 2], 0 outside."""
  cfg, graphdef, params, rest, tokens, mask = setup
  logp0 = logp_of(graphdef, params, rest, tokens)
  shift = np.zeros((N, S), np.float32)
  shift[0, 3], shift[1, 2], shift[2, 5], shift[3, 5] = 0.9, -1.2, 0.3, -0.4  # rho = e^-0.9 (dropped), e^1.2 (dropped),
  rollout_logp = logp0 + shift  # e^-0.3, e^0.4 (kept)
  adv = jnp.asarray([1.5, -0.5, 0.7, -1.2])
  rho = np.exp(-shift)
  w = np.where((rho >= 0.5) & (rho <= 2.0), rho, 0.0)
  want = reference_grad(setup, w * np.asarray(adv)[:, None])  # d[w r A]/dlogp = w r A, r = 1
  got, m, _ = sgd_update(
    graphdef,
    params,
    rest,
    rl_step.make_grpo_step,
    rl_cfg(),
    dict(tokens=tokens, response_mask=mask, rollout_logp=rollout_logp, advantages=adv),
  )
  assert_trees_close(got, want)
  assert float(m["icepop_drop_frac"]) == pytest.approx(2 / int(mask.sum()))
  assert int(m["skipped"]) == 0


@pytest.mark.slow  # a third step function compiled
def test_distill_step_uses_teacher_gap_as_advantage(setup):
  """Eq. 2: A_it = sg(log p_teacher - log p_student); with rollout = old = current, w = 1."""
  cfg, graphdef, params, rest, tokens, mask = setup
  logp0 = logp_of(graphdef, params, rest, tokens)
  teacher = logp0 + jnp.asarray(np.random.default_rng(1).normal(0, 0.5, (N, S)), jnp.float32)
  gap = np.asarray(teacher - logp0)
  want = reference_grad(setup, gap)  # the advantage is stop-gradient: d[w r A]/dlogp = A
  got, m, _ = sgd_update(
    graphdef,
    params,
    rest,
    rl_step.make_distill_step,
    rl_cfg(group_size=1),
    dict(tokens=tokens, response_mask=mask, rollout_logp=logp0, teacher_logp=teacher),
  )
  assert_trees_close(got, want)
  np.testing.assert_allclose(float(m["teacher_kl"]), float(np.sum(-gap * np.asarray(mask)) / mask.sum()), rtol=1e-5)


@pytest.mark.slow  # compiles the async-objective step and its reference gradient
def test_async_step_masks_tokens_outside_the_ratio_band(setup):
  """Eq. 3-5: r = exp(logp - rollout_logp); tokens with r outside (0.8, 1.28) removed; d[r A] = r A dlogp."""
  cfg, graphdef, params, rest, tokens, mask = setup
  logp0 = logp_of(graphdef, params, rest, tokens)
  shift = np.zeros((N, S), np.float32)
  shift[0, 4], shift[2, 6], shift[1, 3] = 0.5, -0.3, 0.1  # r = e^-0.5 (out), e^0.3 = 1.35 (out), e^-0.1 (in)
  adv = np.asarray([1.0, -2.0, 0.5, 0.8], np.float32)
  r = np.exp(-shift)
  keep = np.asarray(mask) & (r > 0.8) & (r < 1.28)

  # d[r A]/dlogp = r A with r = exp(logp - rollout_logp) = exp(-shift) at the current parameters
  want = reference_grad(setup, r * adv[:, None], keep)
  got, m, _ = sgd_update(
    graphdef,
    params,
    rest,
    rl_step.make_grpo_step,
    rl_cfg(objective="async"),
    dict(tokens=tokens, response_mask=mask, rollout_logp=logp0 + shift, advantages=adv),
  )
  assert_trees_close(got, want)
  assert float(m["async_masked_frac"]) == pytest.approx(2 / int(mask.sum()))


@pytest.mark.slow  # compiles the GRPO step (test_grpo_step_is_icepop_weighted_reinforce's, cached in a full run)
def test_non_finite_loss_skips_the_update(setup):
  cfg, graphdef, params, rest, tokens, mask = setup
  logp0 = logp_of(graphdef, params, rest, tokens)
  _, m, new = sgd_update(
    graphdef,
    params,
    rest,
    rl_step.make_grpo_step,
    rl_cfg(),
    dict(tokens=tokens, response_mask=mask, rollout_logp=logp0, advantages=jnp.asarray([1.0, jnp.nan, 0.0, 0.0])),
  )
  assert int(m["skipped"]) == 1 and int(new.skipped) == 1
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # compiles a second GRPO step
def test_frozen_indexer_stays_fixed():
  """rl.freeze_indexer (GLM-5's RL): the optimizer leaves every indexer parameter as it was."""
  cfg = tiny_cfg()
  opt_cfg = glm_jax.configs.grpo_tiny.get_config().optimizer
  opt_cfg.lr = opt_cfg.lr_init = 1e-2
  graphdef, state, optimizer, schedule = warm_start.make_policy(cfg, opt_cfg, 0, freeze_indexer=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, 20, (2, S)), jnp.int32)
  mask = jnp.zeros((2, S), bool).at[:, 3:].set(True)
  logp0 = rl_step.token_logprobs(nnx.merge(graphdef, state.params, state.rest), tokens)
  step = rl_step.make_grpo_step(graphdef, optimizer, schedule, rl_cfg())
  new, _ = step(state, dict(tokens=tokens, response_mask=mask, rollout_logp=logp0, advantages=jnp.asarray([1.0, -1.0])))
  changed = {}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(new.params)):
    changed[jax.tree_util.keystr(path)] = bool(jnp.any(a != b))
  indexer = [k for k in changed if "indexer" in k]
  assert indexer and not any(changed[k] for k in indexer)
  assert changed["['lm_head'].value"] and changed["['moe_layers']['self_attn']['q_b_proj'].value"]


def test_rl_config_errors():
  config = glm_jax.configs.grpo_tiny.get_config()
  for field, value, message in (
    ("group_size", 1, "rl.group_size=1 is invalid; GRPO needs >= 2"),
    ("objective", "ppo", "rl.objective='ppo' is invalid; one of"),
    ("objective", "async", "rl.objective='async' is invalid; 'async' .* needs rl.async"),
    ("is_correction", "x", "rl.is_correction='x' is invalid"),
    ("icepop_beta", 0.5, "rl.icepop_beta=0.5 is invalid; must be > 1"),
    ("tau", -1, "rl.tau=-1 is invalid"),
    ("temperature", 0.0, "rl.temperature=0.0 is invalid"),
    ("speculate", -2, r"rl.speculate=-2 is invalid; must be an integer >= 0"),
  ):
    bad = ml_collections.ConfigDict(config.to_dict())
    bad.rl[field] = value
    with pytest.raises(ValueError, match=message):
      rl_config.validate_rl_config(bad)
  bad = ml_collections.ConfigDict(config.to_dict())
  bad.rl.speculate, bad.model.num_nextn_predict_layers = 2, 0
  with pytest.raises(
    ValueError,
    match=r"rl.speculate=2 is invalid; speculative rollouts draft with the MTP layer, "
    r"but model.num_nextn_predict_layers=0",
  ):
    rl_config.validate_rl_config(bad)
