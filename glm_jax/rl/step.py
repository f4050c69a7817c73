"""The post-training step functions: each one pure jax.jit over (TrainState, batch), the graphdef closed over.

  make_grpo_step:     GRPO with IcePop (GLM-5 Eq. 1), or truncated IS; optional KL to a reference policy.
                      With rl.objective="async", the asynchronous form instead (Eq. 3-5: the ratio to the
                      rollout policy, tokens outside (1-eps_low, 1+eps_high) masked out).
  make_distill_step:  on-policy distillation (Eq. 2): advantage = sg(log p_teacher - log p_student) per token,
                      into Eq. 1.
  make_score_fn:      jit(params, rest, tokens) -> per-token log-probs (teachers, a reference policy).

A batch holds N sampled sequences laid out as the sampler returns them (glm_jax/inference/sampler.py): tokens
[N, S] (prompt, response, padding), response_mask [N, S] (the trained tokens), rollout_logp [N, S] (the
sampler's log-probs), and per objective: advantages [N] (grpo), teacher_logp [N, S] (distill); optional
old_logp [N, S] (default: the current policy's, stop-gradient: one update per batch, so pi_old = pi_theta)
and ref_logp [N, S] (the KL term). Log-probs are of softmax(logits / rl.temperature), the sampler's.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glm_jax.model.quantization import fake_quant_params
from glm_jax.inference.sampling import tempered_log_softmax
from glm_jax.rl import losses
from glm_jax.train.step import TrainState, apply_gradients

OBJECTIVES = ("grpo", "async")


def token_logprobs(model, tokens_BT: jax.Array, temperature: float = 1.0) -> jax.Array:
  """[N, S] fp32: log p(tokens[:, s] | tokens[:, :s]) under softmax(logits / temperature); 0 at s = 0."""
  logits = model(tokens_BT, compute_mtp=False).logits[:, :-1]
  logp = tempered_log_softmax(logits, temperature)  # the sampler's: 0 is greedy, whose log-probs are at 1
  picked = jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, [(0, 0), (1, 0)])


def make_score_fn(graphdef, temperature: float = 1.0) -> Callable:
  """jit(params, rest, tokens [N, S]) -> token_logprobs: a teacher's or a reference policy's scores."""

  def score(params, rest, tokens_BT):
    return token_logprobs(nnx.merge(graphdef, params, rest), tokens_BT, temperature)

  return jax.jit(score)


def _make_step(
  graphdef,
  optimizer: optax.GradientTransformation,
  schedule: Callable,
  rl_cfg,
  objective_fn: Callable,
  quant_plan: dict | None = None,
) -> Callable:
  """The shared update: logp of the batch's tokens, objective_fn(logp, batch) -> (loss, metrics), gradient,
  clip, optimizer; a non-finite loss or gradient skips the update (the state stays, `skipped` is 1). With a
  quant plan (config.quant), quantization-aware: the policy's forward sees its planned weights fake-quantized,
  the values the rollouts' packed weights hold, with the straight-through gradient."""

  def loss_fn(params, rest, batch):
    if quant_plan:
      params = fake_quant_params(params, quant_plan)
    logp = token_logprobs(nnx.merge(graphdef, params, rest), batch["tokens"], rl_cfg.temperature)
    return objective_fn(logp, batch)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state: TrainState, batch: dict[str, jax.Array]):
    (loss, m), grads = grad_fn(state.params, state.rest, batch)
    new_state, grad_norm, skip = apply_gradients(state, grads, loss, optimizer, rl_cfg.grad_clip_norm)
    mask = batch["response_mask"]
    metrics = dict(
      m,
      loss=loss,
      grad_norm=grad_norm,
      lr=schedule(state.step),
      skipped=skip.astype(jnp.int32),
      response_tokens=jnp.sum(mask).astype(jnp.float32),
    )
    return new_state, metrics

  # No donation: an asynchronous rollout worker may still be reading the parameters of the previous version.
  return jax.jit(step)


def _old_logp(logp, batch):
  return batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)


def _grpo_kwargs(rl_cfg) -> dict:
  return dict(
    eps_low=rl_cfg.eps_low,
    eps_high=rl_cfg.eps_high,
    icepop_beta=rl_cfg.icepop_beta,
    is_correction=rl_cfg.is_correction,
    tis_cap=rl_cfg.tis_cap,
    kl_coef=rl_cfg.kl_coef,
  )


def make_grpo_step(
  graphdef, optimizer: optax.GradientTransformation, schedule: Callable, rl_cfg, quant_plan: dict | None = None
) -> Callable:
  """Returns jit step(state, batch) -> (state, metrics); batch: tokens, response_mask, rollout_logp, advantages
  [N] (group-normalized rewards), optionally old_logp and ref_logp. rl_cfg.objective: "grpo" (Eq. 1) or
  "async" (Eq. 3-5)."""
  if rl_cfg.objective not in OBJECTIVES:
    raise ValueError(f"rl.objective={rl_cfg.objective!r} is invalid; one of {OBJECTIVES}")

  def objective(logp, batch):
    if rl_cfg.objective == "async":
      return losses.async_policy_loss(
        logp,
        batch["rollout_logp"],
        batch["advantages"],
        batch["response_mask"],
        eps_low=rl_cfg.eps_low,
        eps_high=rl_cfg.eps_high,
      )
    return losses.grpo_loss(
      logp,
      _old_logp(logp, batch),
      batch["rollout_logp"],
      batch["advantages"],
      batch["response_mask"],
      ref_logp=batch.get("ref_logp"),
      **_grpo_kwargs(rl_cfg),
    )

  return _make_step(graphdef, optimizer, schedule, rl_cfg, objective, quant_plan)


def make_distill_step(
  graphdef, optimizer: optax.GradientTransformation, schedule: Callable, rl_cfg, quant_plan: dict | None = None
) -> Callable:
  """Returns jit step(state, batch) -> (state, metrics); batch: tokens, response_mask, rollout_logp and
  teacher_logp [N, S] (each row scored by its own teacher). Metrics add teacher_kl: the mean over response
  tokens of log p_student - log p_teacher, a per-token estimate of KL(student || teacher) on the student's
  own samples."""

  def objective(logp, batch):
    mask = batch["response_mask"]
    adv = losses.distill_advantages(batch["teacher_logp"], logp)
    loss, m = losses.grpo_loss(logp, _old_logp(logp, batch), batch["rollout_logp"], adv, mask, **_grpo_kwargs(rl_cfg))
    gap = jnp.where(mask, jax.lax.stop_gradient(logp) - batch["teacher_logp"], 0.0)
    n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    return loss, dict(m, teacher_kl=jnp.sum(gap) / n)

  return _make_step(graphdef, optimizer, schedule, rl_cfg, objective, quant_plan)
