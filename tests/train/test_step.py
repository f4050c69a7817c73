"""The jit train step on the tiny GLM-5 (configs/glm5_tiny.py at seq_len 16): gradient accumulation equals the
full-batch gradient, clipping by hand, the non-finite and spike guards leave everything bitwise as it was, the
aux-loss-free bias rule against numpy on a separate forward's expert counts, the DSA warm-up (only the indexer moves,
its KL falls), the sparse stage's gradient separation, and the MTP weight.

Each train config is its own XLA program, so one module-scoped run per config serves several tests, and the
programs are compiled at XLA's lowest backend optimization level (about half the ~9 s a step takes at the
default on CPU; the same computation)."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from glm_jax.configs import glm5_tiny
from glm_jax.model import ModelConfig
from glm_jax.model.transformer import GlmMoeDsa
from glm_jax.train import losses, optimizers
from glm_jax.train import step as step_lib
from glm_jax.tree_paths import path_names
from tests.helpers import FAST_COMPILE

pytestmark = pytest.mark.slow  # every test here compiles whole train steps of the tiny model (about 35 s in all)

B, T = 4, 16
LR = 0.5
BIAS_RATE = 1e-3
MTP_W = 0.3
BAL_W = 1e-4
INDEX_TOPK = 6  # < the 10-token documents below, so the sparse stage really selects


def compile_fast(jitted, *args):
  return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)


def model_config(**overrides) -> ModelConfig:
  return ModelConfig.from_dict(glm5_tiny.get_config().model).replace(**overrides)


def train_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(
    dict(
      dsa_stage="dense",
      microbatches=1,
      grad_clip_norm=0.0,
      mtp_loss_weight=MTP_W,
      balance_loss_weight=BAL_W,
      indexer_loss_weight=1.0,
      expert_bias_rate=BIAS_RATE,
      spike_factor=0.0,
      spike_min_steps=0,
      spike_ema=0.99,
    )
  )
  c.update(overrides)
  return c


def build(cfg: ModelConfig, seed=0):
  """(graphdef, params, rest) filled from numpy without per-shape compiles: weights N(0, 0.3^2) (large enough
  that attention is far from uniform and the indexer KL is ~1, not ~1e-6 as at the 0.02 init), norm scales
  1 + N(0, 0.1^2), norm biases N(0, 0.1^2), expert biases N(0, 0.01^2) (so the update rule starts off zero)."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param, ...)
  rng = np.random.default_rng(seed)

  def fill(path, a):
    names = [str(n) for n in path_names(path)]
    z = rng.standard_normal(a.shape)
    if "e_score_correction_bias" in names:
      v = 0.01 * z
    elif any("norm" in n for n in names):
      v = 1 + 0.1 * z if names[-1] == "weight" else 0.1 * z
    else:
      v = 0.3 * z
    return np.asarray(v, a.dtype)

  fill_tree = lambda s: jax.tree_util.tree_map_with_path(fill, s)
  return graphdef, fill_tree(params), fill_tree(rest)


def make_batch(seed=0, vocab=512):
  """Rows 0 and 2: documents of 10 and 6 tokens; rows 1 and 3: 5 and 8 tokens, then 3 padding. Microbatches
  of 2 rows therefore hold the same number of LM and MTP targets."""
  rng = np.random.default_rng(seed)
  layouts = [(10, 6, 0), (5, 8, 3), (10, 6, 0), (5, 8, 3)]
  seg = np.array([[1] * a + [2] * b + [0] * c for a, b, c in layouts], np.int32)
  pos = np.array([list(range(a)) + list(range(b)) + list(range(c)) for a, b, c in layouts], np.int32)
  ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
  return {"input_ids": ids, "segment_ids": seg, "positions": pos}


def to_host(tree):
  """Private numpy copies (the step donates its input state)."""
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def to_device(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def new_state(params, rest, optimizer):
  p = to_device(params)
  return step_lib.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=p,
    rest=to_device(rest),
    opt_state=optimizer.init(p),
    loss_ema=jnp.zeros((), jnp.float32),
    skipped=jnp.zeros((), jnp.int32),
  )


def run_steps(graphdef, optimizer, train_cfg, state, batches, lr=LR):
  """Runs the jit step over `batches`; returns host snapshots [before, after 1, ...] and host metrics."""
  step = compile_fast(
    step_lib.make_train_step(graphdef, optimizer, lambda s: lr, train_cfg), state, to_device(batches[0])
  )
  snaps, metrics = [to_host(state)], []
  for batch in batches:
    state, m = step(state, to_device(batch))
    snaps.append(to_host(state))
    metrics.append(to_host(m))
  return snaps, metrics


def leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def global_norm(tree):
  return float(np.sqrt(sum(np.sum(x * x) for x in leaves(tree))))


def flat(tree):
  return {path_names(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_bitwise_equal(a, b, name=""):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


def assert_trees_equal(a, b):
  """Bitwise, leaf by leaf (so -0.0 != 0.0 and NaN payloads count)."""
  fa, fb = flat(a), flat(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    assert_bitwise_equal(fa[k], fb[k], k)


def grads_fn(graphdef, rest, stage, params, batch):
  """Compiled (params, batch, w_mtp, w_balance, w_indexer) -> ((loss, metrics, expert counts), grads) of the
  step's own loss function, the weights traced (np.float32) so one program serves every weight."""

  def fn(params, batch, mtp_w, bal_w, idx_w):
    cfg = types.SimpleNamespace(mtp_loss_weight=mtp_w, balance_loss_weight=bal_w, indexer_loss_weight=idx_w)
    (loss, (m, counts)), g = jax.value_and_grad(step_lib._forward_losses, argnums=1, has_aux=True)(
      graphdef, params, rest, batch, stage, cfg
    )
    return (loss, m, counts), g

  w = np.float32(0)
  return compile_fast(jax.jit(fn), params, batch, w, w, w)


# ---- the dense stage: one run per train config ----------------------------------------------------------------


@pytest.fixture(scope="module")
def dense():
  graphdef, params, rest = build(model_config(use_dsa=False))
  batch = make_batch()
  fn = grads_fn(graphdef, rest, "dense", to_device(params), to_device(batch))
  w = np.float32
  (_, _, counts), g_mtp = fn(to_device(params), to_device(batch), w(MTP_W), w(BAL_W), w(0))
  _, g_0 = fn(to_device(params), to_device(batch), w(0), w(BAL_W), w(0))
  return types.SimpleNamespace(
    graphdef=graphdef,
    params=params,
    rest=rest,
    batch=batch,
    grads=to_host(g_mtp),
    grads_no_mtp=to_host(g_0),
    expert_counts=to_host(counts),
  )


@pytest.fixture(scope="module")
def run_main(dense):
  """microbatches=1, no clipping, spike guard on from step 1 at factor 0.5: a good step, a step with an id
  outside the vocabulary (NaN embedding, so a NaN loss), then the good batch again (a spike: its loss is far
  above 0.5 x the running mean)."""
  opt = optax.sgd(LR, momentum=0.9)
  cfg = train_config(spike_factor=0.5, spike_min_steps=1)
  bad = dict(dense.batch, input_ids=dense.batch["input_ids"].copy())
  bad["input_ids"][1, 3] = 512  # == vocab_size
  snaps, metrics = run_steps(
    dense.graphdef, opt, cfg, new_state(dense.params, dense.rest, opt), [dense.batch, bad, dense.batch]
  )
  return snaps, metrics


@pytest.fixture(scope="module")
def run_accumulated(dense):
  opt = optax.sgd(LR, momentum=0.9)
  cfg = train_config(microbatches=2, spike_factor=0.5, spike_min_steps=1)
  return run_steps(dense.graphdef, opt, cfg, new_state(dense.params, dense.rest, opt), [dense.batch])


@pytest.fixture(scope="module")
def run_clipped_no_mtp(dense):
  """grad_clip_norm at a quarter of the raw gradient norm, MTP weight 0; the spike guard on from step 0."""
  clip = global_norm(dense.grads_no_mtp) / 4
  opt = optax.sgd(LR)
  cfg = train_config(grad_clip_norm=clip, mtp_loss_weight=0.0, spike_factor=3.0, spike_min_steps=0)
  snaps, metrics = run_steps(dense.graphdef, opt, cfg, new_state(dense.params, dense.rest, opt), [dense.batch])
  return clip, snaps, metrics


def test_sgd_step_is_minus_lr_grad(dense, run_main):
  (s0, s1, _, _), (m1, _, _) = run_main
  assert m1["skipped"] == 0
  np.testing.assert_allclose(m1["grad_norm"], global_norm(dense.grads), rtol=1e-5)
  for k, g in flat(dense.grads).items():
    new, old = flat(s1.params)[k], flat(s0.params)[k]
    np.testing.assert_allclose(new, old - LR * g, rtol=0, atol=1e-6, err_msg=str(k))


def test_gradient_accumulation_equals_one_microbatch(dense, run_main, run_accumulated):
  (s0, s1, _, _), (m1, _, _) = run_main
  (_, a1), (ma,) = run_accumulated
  assert ma["skipped"] == 0
  moved = max(np.max(np.abs(x - y)) for x, y in zip(leaves(s1.params), leaves(s0.params)))
  assert moved > 1e-3
  # Equal up to float32 summation order (the batch sum split in two): 1e-5 of the leaf's largest update,
  # plus 2 ulps of the parameters for the rounding of p - lr g. Summing instead of averaging the microbatches,
  # or keeping one of them, would be off by the size of the update itself.
  for k, old in flat(s0.params).items():
    ref = flat(s1.params)[k].astype(np.float64) - old
    acc = flat(a1.params)[k].astype(np.float64) - old
    tol = 1e-5 * np.max(np.abs(ref)) + 2 * np.spacing(np.max(np.abs(old)))
    np.testing.assert_allclose(acc, ref, rtol=0, atol=tol, err_msg=str(k))
  np.testing.assert_allclose(ma["grad_norm"], m1["grad_norm"], rtol=1e-5)
  for k in ("loss", "lm_loss", "mtp_loss", "balance_loss"):
    np.testing.assert_allclose(ma[k], m1[k], rtol=1e-6, err_msg=k)
  assert ma["tokens"] == m1["tokens"] == 50  # 2 x (9 + 5) + 2 x (4 + 7) targets
  # Expert counts are summed over the microbatches: the same bias update and load entropy.
  np.testing.assert_allclose(ma["expert_load_entropy"], m1["expert_load_entropy"], rtol=1e-6)
  assert_trees_equal(a1.rest, s1.rest)


def test_clipping(dense, run_clipped_no_mtp):
  clip, (s0, s1), (m1,) = run_clipped_no_mtp
  raw = global_norm(dense.grads_no_mtp)
  assert raw > clip
  np.testing.assert_allclose(m1["grad_norm"], raw, rtol=1e-5)  # the metric is the norm before clipping
  update = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), s1.params, s0.params)
  np.testing.assert_allclose(global_norm(update), LR * clip, rtol=1e-5)
  scale = clip / (raw + 1e-6)
  for k, g in flat(dense.grads_no_mtp).items():
    np.testing.assert_allclose(
      flat(s1.params)[k], flat(s0.params)[k] - LR * scale * g, rtol=0, atol=1e-6, err_msg=str(k)
    )


def test_mtp_weight_scales_only_the_mtp_term(run_main, run_clipped_no_mtp):
  _, (m_w, _, _) = run_main
  _, _, (m_0,) = run_clipped_no_mtp
  assert m_w["mtp_loss"] > 1.0
  np.testing.assert_allclose(m_0["mtp_loss"], m_w["mtp_loss"], rtol=1e-6)
  np.testing.assert_allclose(m_0["loss"], m_0["lm_loss"] + BAL_W * m_0["balance_loss"], rtol=1e-6)
  np.testing.assert_allclose(m_w["loss"] - m_0["loss"], MTP_W * m_w["mtp_loss"], rtol=1e-5)


def test_skip_non_finite(run_main):
  (_, s1, s2, _), (m1, m2, _) = run_main
  assert not np.isfinite(m2["loss"])
  assert m2["skipped"] == 1 and s2.skipped == 1 and s2.step == 2
  assert_trees_equal(s2.params, s1.params)
  assert_trees_equal(s2.opt_state, s1.opt_state)
  assert_trees_equal(s2.rest, s1.rest)
  assert s2.loss_ema == s1.loss_ema == m1["loss"]  # the first step sets the running mean to its loss


def test_skip_spike(run_main):
  (_, _, s2, s3), (m1, _, m3) = run_main
  assert m1["skipped"] == 0  # step 0 < spike_min_steps
  assert np.isfinite(m3["loss"]) and m3["loss"] > 0.5 * s2.loss_ema
  assert m3["skipped"] == 1 and s3.skipped == 2 and s3.step == 3
  assert_trees_equal(s3.params, s2.params)
  assert_trees_equal(s3.opt_state, s2.opt_state)
  assert_trees_equal(s3.rest, s2.rest)
  assert s3.loss_ema == s2.loss_ema


def test_spike_guard_needs_a_running_mean(run_clipped_no_mtp):
  """With spike_min_steps=0 the first step has no running mean (0): it must not count as a spike (it used to:
  loss > 3 x 0, so every step was skipped and the mean never left 0)."""
  _, (_, s1), (m1,) = run_clipped_no_mtp
  assert m1["skipped"] == 0 and s1.skipped == 0
  assert s1.loss_ema == m1["loss"]


def test_expert_bias_update(dense, run_main):
  (s0, s1, _, _), (m1, _, _) = run_main
  # Expert counts [L, B, E] from a separate forward of the initial model on the same batch.
  counts = {"moe": dense.expert_counts["expert_counts"], "mtp": dense.expert_counts["mtp0_expert_counts"][None]}
  # These are the step's counts: the same per-layer load entropy as its metric.
  load = counts["moe"].sum(1).astype(np.float64)  # [L, E]
  share = load / load.sum(-1, keepdims=True)
  entropy = -np.sum(np.where(share > 0, share * np.log(np.where(share > 0, share, 1.0)), 0.0), axis=-1)
  np.testing.assert_allclose(m1["expert_load_entropy"], entropy, rtol=1e-6)

  old, new = flat(s0.rest), flat(s1.rest)
  biases = {
    "moe": ("moe_layers", "mlp", "e_score_correction_bias"),
    "mtp": ("mtp", 0, "layer", "mlp", "e_score_correction_bias"),
  }
  assert set(old) == set(biases.values())
  for name, key in biases.items():
    load = counts[name].sum(1)  # [L, E] selections per expert over the batch
    sign = np.sign(load - load.mean(-1, keepdims=True)).astype(np.float32)
    assert (sign > 0).any() and (sign < 0).any()
    want = old[key].reshape(sign.shape) - np.float32(BIAS_RATE) * sign
    np.testing.assert_array_equal(new[key].reshape(sign.shape), want, err_msg=name)


# ---- the DSA warm-up stage ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_warmup(dense):
  """25 warm-up steps on one batch, AdamW on the indexer only (every other parameter frozen)."""
  opt_cfg = dict(name="adamw", lr=3e-2, warmup_steps=0, schedule="constant", weight_decay=0.0)
  opt = optimizers.make_optimizer(opt_cfg, dense.params, trainable=step_lib.is_indexer_param)
  return run_steps(
    dense.graphdef, opt, train_config(dsa_stage="warmup"), new_state(dense.params, dense.rest, opt), [dense.batch] * 25
  )


def test_warmup_trains_only_the_indexer(run_warmup):
  snaps, metrics = run_warmup
  kl = [float(m["indexer_kl"]) for m in metrics]
  for m in metrics:
    assert m["skipped"] == 0 and m["loss"] == m["indexer_kl"]
  assert kl[0] > 0.5 and kl[-1] < 0.1 * kl[0], kl
  before, after = flat(snaps[0].params), flat(snaps[-1].params)
  main_indexer = [k for k in before if "indexer" in k and k[0] != "mtp"]
  assert len(main_indexer) == 2 * 5  # wq_b, wk, k_norm weight and bias, weights_proj; dense and MoE stacks
  for k in main_indexer:
    assert not np.array_equal(after[k], before[k]), k
  for k in before:
    if "indexer" not in k:
      assert_bitwise_equal(after[k], before[k], k)
  assert_trees_equal(snaps[-1].rest, snaps[0].rest)  # no bias updates in the warm-up


def test_warmup_trains_the_mtp_indexer(run_warmup):
  snaps, _ = run_warmup
  before, after = flat(snaps[0].params), flat(snaps[-1].params)
  mtp_indexer = [k for k in before if "indexer" in k and k[0] == "mtp"]
  assert len(mtp_indexer) == 5
  for k in mtp_indexer:
    assert not np.array_equal(after[k], before[k]), k


# ---- the sparse stage -----------------------------------------------------------------------------------------


def test_sparse_stage_gradients():
  cfg = model_config(use_dsa=True, index_topk=INDEX_TOPK)
  graphdef, params, rest = build(cfg)
  batch = to_device(make_batch())

  def lm_grads(params):
    def lm_loss(p):
      out = nnx.merge(graphdef, p, rest)(
        batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"], compute_mtp=False
      )
      lm = losses.lm_and_mtp_losses(out.logits, None, {k: batch[k] for k in ("input_ids", "segment_ids")})["lm_loss"]
      return lm, out.aux["topk_indices"]

    return jax.grad(lm_loss, has_aux=True)(params)

  g_lm, topk = compile_fast(jax.jit(lm_grads), to_device(params))(to_device(params))
  # The top-k really selects: a query 9 tokens into a 10-token document sees 10 keys and attends to 6.
  np.testing.assert_array_equal(np.sum(np.asarray(topk)[:, 0, 9] >= 0, axis=-1), INDEX_TOPK)

  total = grads_fn(graphdef, rest, "sparse", to_device(params), batch)
  w = np.float32
  (_, m0, _), g0 = total(to_device(params), batch, w(MTP_W), w(BAL_W), w(0))
  (_, m1, _), g1 = total(to_device(params), batch, w(MTP_W), w(BAL_W), w(1))
  assert float(m1["indexer_kl"]) > 0.1
  np.testing.assert_allclose(float(m1["loss"]) - float(m0["loss"]), float(m1["indexer_kl"]), rtol=1e-5)
  f_lm, f0, f1 = flat(g_lm), flat(g0), flat(g1)
  n_indexer = 0
  for k in f_lm:
    if "indexer" in k:
      n_indexer += 1
      np.testing.assert_array_equal(f_lm[k], np.zeros_like(f_lm[k]), err_msg=f"LM grad reaches {k}")
      np.testing.assert_array_equal(f0[k], np.zeros_like(f0[k]), err_msg=str(k))
      assert np.any(f1[k] != 0), k
    else:
      np.testing.assert_array_equal(f1[k], f0[k], err_msg=f"indexer loss reaches {k}")
  assert n_indexer == 3 * 5  # dense stack, MoE stack, MTP layer
  assert global_norm(g_lm) > 0
