"""The pretraining step: one pure jax.jit over (train state, batch), graphdef closed over.

Stages (train.dsa_stage, docs/glm5_facts.md section 3):
  dense:  dense attention; loss = LM + w_mtp MTP + w_bal balance
  warmup: dense attention; every parameter but the indexer frozen (optimizer mask); loss = indexer KL
  sparse: top-k attention; loss = LM + w_mtp MTP + w_bal balance + w_idx indexer KL, where the KL reaches
          only the indexer (its input is detached) and the LM loss cannot reach it (top-k is discrete)
Gradients are accumulated over `train.microbatches`, clipped to `train.grad_clip_norm`; a step whose loss or
gradient norm is not finite, whose updated parameters are not all finite (an update so large it overflows), or
whose loss exceeds `train.spike_factor` x its running mean, is skipped: parameters, optimizer state and expert
biases stay as they were and `skipped` is 1 in the metrics. So the parameters are always finite; a run whose
steps keep being skipped is stopped by its loop (train.max_consecutive_skips).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glm_jax.model.moe import ExpertBias
from glm_jax.model.quantization import fake_quant_params
from glm_jax.model.transformer import GlmMoeDsa
from glm_jax.train import losses
from glm_jax.tree_paths import Names

STAGES = ("dense", "warmup", "sparse")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array  # int32: batches consumed
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of the other variables (expert biases)
  opt_state: Any
  loss_ema: jax.Array  # running mean of the loss, for the spike guard (0 before the first step)
  skipped: jax.Array  # int32: steps skipped so far


def split_model(model: GlmMoeDsa):
  """(graphdef, params, rest)."""
  return nnx.split(model, nnx.Param, ...)


def new_train_state(params, rest, optimizer: optax.GradientTransformation) -> TrainState:
  """Step 0 for these weights: a fresh optimizer state, no loss history, nothing skipped."""
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    rest=rest,
    opt_state=optimizer.init(params),
    loss_ema=jnp.zeros((), jnp.float32),
    skipped=jnp.zeros((), jnp.int32),
  )


def init_train_state(model: GlmMoeDsa, optimizer: optax.GradientTransformation):
  """(graphdef, step 0 of the model's weights)."""
  graphdef, params, rest = split_model(model)
  return graphdef, new_train_state(params, rest, optimizer)


def is_indexer_param(names: Names) -> bool:
  """Whether a parameter, named by its path (glm_jax.tree_paths.path_names), belongs to a DSA indexer."""
  return "indexer" in names


def model_inputs(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The model's keyword inputs a data batch carries: positions and segment ids, plus GLM's block positions and
  prefix ends under the blank-infilling objective (glm_jax/data/blank_infilling.py)."""
  return {k: batch[k] for k in ("positions", "segment_ids", "block_positions", "prefix_end") if k in batch}


def _forward_losses(graphdef, params, rest, batch, stage: str, train_cfg, plan=None) -> tuple[jax.Array, dict]:
  if plan:  # quantization-aware training: the forward sees the packed weights' values (straight-through grads)
    params = fake_quant_params(params, plan)
  model = nnx.merge(graphdef, params, rest)
  chunk = getattr(train_cfg, "loss_chunk", 0)
  out = model(
    batch["input_ids"],
    **model_inputs(batch),
    indexer_loss=stage in ("warmup", "sparse"),
    embedding_grad_shrink=getattr(train_cfg, "embedding_grad_shrink", 1.0),
    return_hidden=chunk > 0,
  )
  if chunk > 0:  # the head and cross-entropy a chunk of tokens at a time: no [B, T, V] logits
    m = losses.lm_and_mtp_losses(out.hidden, out.mtp_hidden, batch, head=model.head, chunk=chunk)
  else:
    m = losses.lm_and_mtp_losses(out.logits, out.mtp_logits, batch)
  counts = {k: v for k, v in out.aux.items() if k.endswith("expert_counts")}
  if "expert_counts" in out.aux:
    m["balance_loss"] = losses.sequence_balance_loss(
      out.aux["expert_counts"], out.aux["expert_probs"], model.cfg.num_experts_per_tok
    )
  else:
    m["balance_loss"] = jnp.zeros((), jnp.float32)
  m["indexer_kl"] = jnp.mean(out.aux["indexer_kl"]) if "indexer_kl" in out.aux else jnp.zeros((), jnp.float32)
  dropped = [v for k, v in out.aux.items() if k.endswith("expert_dropped")]  # with model.moe_capacity_factor
  if dropped:  # the share of (token, slot) pairs the MoE layers dropped for capacity
    pairs = sum(v.size for v in dropped) * batch["input_ids"].size * model.cfg.num_experts_per_tok
    m["moe_dropped_fraction"] = sum(jnp.sum(v) for v in dropped).astype(jnp.float32) / pairs
  if stage == "warmup":
    loss = m["indexer_kl"]
  else:
    loss = m["lm_loss"] + train_cfg.mtp_loss_weight * m["mtp_loss"] + train_cfg.balance_loss_weight * m["balance_loss"]
    if stage == "sparse":
      loss = loss + train_cfg.indexer_loss_weight * m["indexer_kl"]
  m["loss"] = loss
  return loss, (m, counts)


def _update_expert_biases(rest, counts: dict[str, jax.Array], rate: float):
  """Applies the aux-loss-free rule to every ExpertBias in `rest` from the step's expert counts."""
  out = []
  for path, var in nnx.to_flat_state(rest):
    if isinstance(var, ExpertBias):
      if path[0] == "moe_layers":
        new = losses.expert_bias_update(var[...], counts["expert_counts"], rate)  # counts [L, B, E]
      elif path[0] == "mtp":
        new = losses.expert_bias_update(var[...][None], counts[f"mtp{path[1]}_expert_counts"][None], rate)[0]
      else:
        raise ValueError(f"expert bias at unexpected path {path}")
      var = var.replace(value=new)
    out.append((path, var))
  return nnx.from_flat_state(out)


def apply_gradients(
  state: TrainState,
  grads,
  loss: jax.Array,
  optimizer: optax.GradientTransformation,
  grad_clip_norm: float,
  *,
  new_rest: Any = None,
  also_skip: jax.Array | bool = False,
) -> tuple[TrainState, jax.Array, jax.Array]:
  """One optimizer update from `grads` (clipped to grad_clip_norm when > 0), skipped (parameters, `rest` and
  optimizer state kept as they were) when the loss, the gradient norm or any updated parameter is not finite,
  or `also_skip` holds.
  new_rest: the non-parameter variables after the step (default: unchanged). Returns (the state with step + 1,
  the gradient norm before clipping, skip); loss_ema is carried over unchanged."""
  grad_norm = optax.tree.norm(grads)
  if grad_clip_norm > 0:
    scale = jnp.minimum(1.0, grad_clip_norm / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  params_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(new_params)]))
  skip = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite) | also_skip

  def keep(new, old):
    return jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)

  new_state = TrainState(
    step=state.step + 1,
    params=keep(new_params, state.params),
    rest=state.rest if new_rest is None else keep(new_rest, state.rest),
    opt_state=keep(new_opt_state, state.opt_state),
    loss_ema=state.loss_ema,
    skipped=state.skipped + skip.astype(jnp.int32),
  )
  return new_state, grad_norm, skip


_XLA_FLAG = re.compile(r"--(xla_[a-z0-9_]+)=(\S+)")


def xla_compiler_options(flags: str) -> dict[str, str]:
  """train.xla_flags ("--xla_name=value ...", as LIBTPU_INIT_ARGS spells them) as jax's compiler_options; a token
  of another form is a ValueError naming it."""
  if not isinstance(flags, str):
    raise ValueError(f"train.xla_flags={flags!r}; valid: a string of --xla_name=value flags, or ''")
  options = {}
  for token in flags.split():
    m = _XLA_FLAG.fullmatch(token)
    if not m:
      raise ValueError(
        f"train.xla_flags: {token!r} is not an XLA flag; valid: --xla_name=value tokens separated "
        "by spaces (as in LIBTPU_INIT_ARGS)"
      )
    options[m.group(1)] = m.group(2)
  return options


def make_train_step(
  graphdef,
  optimizer: optax.GradientTransformation,
  schedule: Callable,
  train_cfg,
  *,
  state_shardings: Any = None,
  batch_sharding: Any = None,
  unroll_microbatches: bool = False,
  quant_plan: dict | None = None,
) -> Callable:
  """Returns jitted step(state, batch) -> (state, metrics). batch: input_ids, segment_ids, positions (and, for
  SFT, loss_mask) [global_batch, seq_len] int32; the batch is split into train_cfg.microbatches equal parts. With
  shardings (glm_jax.sharding), the state keeps its layout across steps and the batch is split over the mesh.
  unroll_microbatches unrolls the accumulation loop (for XLA's cost analysis, which counts a loop body once).
  train_cfg.xla_flags (optional): XLA:TPU flags the step is compiled with when its batch sharding is on TPU.
  quant_plan (glm_jax.model.quantization.quant_plan): quantization-aware training of the planned weights."""
  stage = train_cfg.dsa_stage
  if stage not in STAGES:
    raise ValueError(f"train.dsa_stage={stage!r}; one of {STAGES}")
  n_micro = train_cfg.microbatches
  bias_rate = 0.0 if stage == "warmup" else train_cfg.expert_bias_rate
  grad_fn = jax.value_and_grad(_forward_losses, argnums=1, has_aux=True)

  def step(state: TrainState, batch: dict[str, jax.Array]):
    b = batch["input_ids"].shape[0]
    if b % n_micro:
      raise ValueError(f"train.microbatches={n_micro} does not divide the batch of {b} sequences")
    micro = jax.tree.map(lambda x: x.reshape((n_micro, b // n_micro) + x.shape[1:]), batch)

    def micro_grads(mb):
      (_, (m, counts)), g = grad_fn(graphdef, state.params, state.rest, mb, stage, train_cfg, quant_plan)
      return g, m, counts

    def accumulate(carry, mb):
      return jax.tree.map(jnp.add, carry, micro_grads(mb)), None

    if n_micro == 1:  # no accumulation loop: 0 + g and g / 1 are g exactly, so this is the same step
      grads, m, counts = micro_grads(batch)
    else:
      shapes = jax.eval_shape(micro_grads, jax.tree.map(lambda x: x[0], micro))
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      (grads, m, counts), _ = jax.lax.scan(accumulate, zeros, micro, unroll=unroll_microbatches)
      grads = jax.tree.map(lambda g: g / n_micro, grads)
      m = {k: (v if k == "tokens" else v / n_micro) for k, v in m.items()}

    new_rest = _update_expert_biases(state.rest, counts, bias_rate) if bias_rate else state.rest
    loss = m["loss"]
    spike = (
      (train_cfg.spike_factor > 0)
      & (state.step >= train_cfg.spike_min_steps)
      & (state.loss_ema > 0)
      & (loss > train_cfg.spike_factor * state.loss_ema)
    )
    new_state, grad_norm, skip = apply_gradients(
      state, grads, loss, optimizer, train_cfg.grad_clip_norm, new_rest=new_rest, also_skip=spike
    )
    ema = jnp.where(state.loss_ema == 0, loss, train_cfg.spike_ema * state.loss_ema + (1 - train_cfg.spike_ema) * loss)
    new_state.loss_ema = jnp.where(skip, state.loss_ema, ema)
    metrics = dict(m, grad_norm=grad_norm, lr=schedule(state.step), skipped=skip.astype(jnp.int32))
    if "expert_counts" in counts:
      metrics["expert_load_entropy"] = losses.expert_load_entropy(counts["expert_counts"])
    return new_state, metrics

  # train.xla_flags tune XLA:TPU (async collectives, scheduling); other compilers do not know them
  options = xla_compiler_options(train_cfg.get("xla_flags", ""))
  on_tpu = batch_sharding is not None and next(iter(batch_sharding.device_set)).platform == "tpu"
  jit_kw = {"compiler_options": options} if options and on_tpu else {}
  if state_shardings is None:
    return jax.jit(step, donate_argnums=(0,), **jit_kw)
  return jax.jit(
    step,
    donate_argnums=(0,),
    in_shardings=(state_shardings, batch_sharding),
    out_shardings=(state_shardings, None),
    **jit_kw,
  )


def make_eval_step(graphdef, quant_plan: dict | None = None, loss_chunk: int = 0) -> Callable:
  """Returns jitted eval(params, rest, batch) -> {"nll": sum of the targets' NLL, "tokens": number of targets,
  and, for a blank-infilling batch (with "targets"), "spans": its spans, "spans_exact": those whose every target
  (the span's tokens and its <eop>) is the model's argmax}: of the fake-quantized model under a quant plan (which
  computes what its packed form computes), over the targets the batch's loss_mask keeps when it has one. A span is
  exact under teacher forcing exactly when greedy decoding of it reproduces it, so spans_exact / spans is the
  exact-match rate of greedily filled blanks. loss_chunk > 0: the head a chunk of tokens at a time
  (losses.chunked_cross_entropy)."""

  def evaluate(params, rest, batch):
    if quant_plan:
      params = fake_quant_params(params, quant_plan)
    model = nnx.merge(graphdef, params, rest)
    out = model(batch["input_ids"], **model_inputs(batch), compute_mtp=False, return_hidden=True)
    targets, valid = losses.prediction_targets(batch, 0)
    nll, count, predicted = losses.chunked_cross_entropy(
      model.head, out.hidden, targets, valid, loss_chunk, with_argmax=True
    )
    result = {"nll": nll, "tokens": count}
    if "targets" in batch:
      result.update(losses.exact_spans(predicted, targets, valid, batch["block_positions"]))
    return result

  return jax.jit(evaluate)
