"""Optimizers: Muon's Newton-Schulz update against a plain-jnp quintic, the Muon split per head, the update RMS,
the other leaves equal to the optax optimizer named (AdamW, Lion) by optax's own, frozen leaves bitwise still,
schedules and weight-decay masks by hand."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from glm_jax.configs import glm5_tiny
from glm_jax.model import ModelConfig
from glm_jax.model.params import abstract_model
from glm_jax.train import optimizers as opt
from glm_jax.train.optimizer_config import default_optimizer_config
from glm_jax.train.param_plan import leaf_plan
from glm_jax.tree_paths import path_names
from tests.helpers import DEFAULT_COMPILE, newton_schulz

# The 5-step quintic leaves singular values in about [0.68, 1.14], not at 1 (measured on Gaussian matrices).
NS_SV_RANGE = (0.675, 1.14)


def muon_update(g, lr, rms=0.2):
  """The first-step Muon update of one [fan_in, fan_out] matrix (Nesterov momentum is a multiple of g)."""
  return -lr * rms * math.sqrt(max(g.shape)) * newton_schulz(g)


def cfg(**kw):
  c = default_optimizer_config()
  c.update(dict(warmup_steps=0, schedule="constant", lr=0.5, weight_decay=0.0))
  c.update(kw)
  return c


# A tree named like the model's: L=2 stacked layers, D=16, R=8 latents, H=2 heads, qk_nope 4, qk_rope 2, v 6.
L, D, R, H, DN, DR, DV, E, I = 2, 16, 8, 2, 4, 2, 6, 3, 8
SHAPES = {
  "embed_tokens": {"embedding": (32, D)},
  "lm_head": (D, 32),
  "norm": {"weight": (D,)},
  "moe_layers": {
    "input_layernorm": {"weight": (L, D)},
    "self_attn": {
      "q_a_proj": (L, D, R),
      "q_b_proj": (L, R, H, DN + DR),
      "kv_a_proj_with_mqa": (L, D, R + DR),
      "kv_a_layernorm": {"weight": (L, R)},
      "kv_b_proj": (L, R, H, DN + DV),
      "o_proj": (L, H, DV, D),
      "indexer": {"wk": (L, D, 4), "k_norm": {"weight": (L, 4), "bias": (L, 4)}},
    },
    "mlp": {"router": (L, D, E), "gate_proj": (L, E, D, I), "down_proj": (L, E, I, D)},
  },
}


def tree_of(seed, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
  )


def first_update(c, grads, params=None, compiler_options=None, **kw):
  params = tree_of(0) if params is None else params
  tx = opt.make_optimizer(c, params, **kw)
  updates, _ = jax.jit(tx.update, compiler_options=compiler_options)(grads, tx.init(params), params)
  return updates


def test_newton_schulz_update_equals_plain_quintic():
  params = {"moe_layers": {"self_attn": {"q_a_proj": jnp.zeros((1, 24, 40))}}}
  g = tree_of(1, (1, 24, 40))
  # atol 2e-6 holds for XLA:CPU's default compilation; the suite's faster one is 7e-6 off (tests/helpers.py)
  u = first_update(cfg(), {"moe_layers": {"self_attn": {"q_a_proj": g}}}, params, compiler_options=DEFAULT_COMPILE)
  u = u["moe_layers"]["self_attn"]["q_a_proj"][0]
  np.testing.assert_allclose(u, muon_update(g[0], 0.5), atol=2e-6)
  sv = np.linalg.svd(np.asarray(u / (-0.5 * 0.2 * math.sqrt(40))), compute_uv=False)
  assert NS_SV_RANGE[0] <= sv.min() and sv.max() <= NS_SV_RANGE[1], sv
  # The polar factor U V^T has every singular value 1; the quintic stays within 0.33 of it in spectral norm.
  uu, _, vt = np.linalg.svd(np.asarray(g[0]), full_matrices=False)
  assert np.linalg.norm(np.asarray(u) / (-0.5 * 0.2 * math.sqrt(40)) - uu @ vt, 2) < 0.33


@pytest.fixture(scope="module")
def default_update():
  """(grads, updates) of the first step of cfg() on tree_of(0), shared by the tests that only read it."""
  grads = tree_of(1)
  return grads, first_update(cfg(), grads)


def test_muon_split_orthogonalizes_each_head_and_part(default_update):
  grads, u = default_update
  u = u["moe_layers"]["self_attn"]
  g = grads["moe_layers"]["self_attn"]
  for l in range(L):
    for h in range(H):
      # W_UK_h = kv_b_proj[:, h, :qk_nope], W_UV_h = kv_b_proj[:, h, qk_nope:], each on its own
      np.testing.assert_allclose(
        u["kv_b_proj"][l, :, h, :DN], muon_update(g["kv_b_proj"][l, :, h, :DN], 0.5), atol=2e-6
      )
      np.testing.assert_allclose(
        u["kv_b_proj"][l, :, h, DN:], muon_update(g["kv_b_proj"][l, :, h, DN:], 0.5), atol=2e-6
      )
      np.testing.assert_allclose(u["q_b_proj"][l, :, h], muon_update(g["q_b_proj"][l, :, h], 0.5), atol=2e-6)
    # o_proj [H, v, D] is one [H*v, D] matrix
    np.testing.assert_allclose(
      u["o_proj"][l].reshape(H * DV, D), muon_update(g["o_proj"][l].reshape(H * DV, D), 0.5), atol=2e-6
    )
  # without the split, kv_b_proj is one [R, H*(qk_nope+v)] matrix per layer, and that is a different update
  whole = first_update(cfg(muon_split=False), grads)["moe_layers"]["self_attn"]["kv_b_proj"]
  for l in range(L):
    ref = muon_update(g["kv_b_proj"][l].reshape(R, -1), 0.5).reshape(R, H, DN + DV)
    np.testing.assert_allclose(whole[l], ref, atol=2e-6)
    assert np.abs(whole[l] - u["kv_b_proj"][l]).max() > 0.05


def test_expert_matrices_are_orthogonalized_one_by_one(default_update):
  grads, u = default_update
  u = u["moe_layers"]["mlp"]
  g = grads["moe_layers"]["mlp"]
  for l in range(L):
    for e in range(E):
      np.testing.assert_allclose(u["gate_proj"][l, e], muon_update(g["gate_proj"][l, e], 0.5), atol=2e-6)
      np.testing.assert_allclose(u["down_proj"][l, e], muon_update(g["down_proj"][l, e], 0.5), atol=2e-6)


def test_update_rms_matches_config():
  shapes = {"mtp": [{"eh_proj": (96, 32)}]}
  g = tree_of(3, shapes)
  for rms in (0.2, 0.05):
    u = first_update(cfg(muon_update_rms=rms), g, params=g)["mtp"][0]["eh_proj"]
    o = u / (-0.5 * rms * math.sqrt(96))  # the orthogonalized factor
    sv = np.linalg.svd(np.asarray(o), compute_uv=False)
    got = float(jnp.sqrt(jnp.mean(u**2))) / 0.5
    # RMS = rms * sqrt(max(in, out)) * ||O||_F / sqrt(in*out) = rms * (quadratic mean of O's singular values)
    np.testing.assert_allclose(got, rms * np.sqrt(np.mean(sv**2)), rtol=1e-5)
    assert 0.8 * rms <= got <= rms  # an exactly orthogonal O would give rms itself


PARTNER_LEAVES = [
  ("embed_tokens", "embedding"),
  ("lm_head",),
  ("norm", "weight"),
  ("moe_layers", "input_layernorm", "weight"),
  ("moe_layers", "mlp", "router"),
  ("moe_layers", "self_attn", "kv_a_layernorm", "weight"),
  ("moe_layers", "self_attn", "indexer", "k_norm", "weight"),
  ("moe_layers", "self_attn", "indexer", "k_norm", "bias"),
]
MATRICES = [
  ("lm_head",),
  ("moe_layers", "mlp", "router"),
  ("moe_layers", "mlp", "gate_proj"),
  ("moe_layers", "mlp", "down_proj"),
  ("moe_layers", "self_attn", "indexer", "wk"),
] + [("moe_layers", "self_attn", k) for k in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
ALL_LEAVES = [path_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree_of(0))]


@pytest.mark.parametrize(
  "setting, reference, compared, decayed",
  [
    # GLM-5's: Muon with AdamW for the rest; only lm_head and the router among those leaves decay
    (
      {},
      lambda c, lr, mask: optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=0.1, mask=mask),
      PARTNER_LEAVES,
      MATRICES[:2],
    ),
    # Muon's partner by config, with a hyperparameter of its own
    (
      {"partner": "lion", "hparams": {"b2": 0.99}},
      lambda c, lr, mask: optax.lion(lr, b1=c.b1, b2=0.99, weight_decay=0.1, mask=mask),
      PARTNER_LEAVES,
      MATRICES[:2],
    ),
    # any optax optimizer by name takes every leaf; every matrix but the embedding decays
    (
      {"name": "lion"},
      lambda c, lr, mask: optax.lion(lr, b1=c.b1, b2=c.b2, weight_decay=0.1, mask=mask),
      ALL_LEAVES,
      MATRICES,
    ),
    (
      {"name": "adamw"},
      lambda c, lr, mask: optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=0.1, mask=mask),
      ALL_LEAVES,
      MATRICES,
    ),
  ],
  ids=["muon+adamw", "muon+lion", "lion", "adamw"],
)
def test_elementwise_leaves_get_the_named_optax_optimizers_updates(setting, reference, compared, decayed):
  """Four steps of updates of the leaves the optax optimizer takes equal optax's own optimizer's, with the
  schedule, the betas and weight decay on the matrices listed here by hand."""
  c = cfg(
    lr=1e-2, warmup_steps=3, lr_init=1e-3, weight_decay=0.1, schedule="linear", decay_steps=10, lr_end=1e-3, **setting
  )
  params = tree_of(0)
  tx = opt.make_optimizer(c, params)
  mask = jax.tree_util.tree_map_with_path(lambda p, _: path_names(p) in decayed, params)
  ref = reference(c, opt.learning_rate_schedule(c), mask)
  state, ref_state, p, ref_p = tx.init(params), ref.init(params), params, params
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  for step in range(4):
    grads = tree_of(10 + step)
    u, state = update(grads, state, p)
    ru, ref_state = ref_update(grads, ref_state, ref_p)
    p, ref_p = optax.apply_updates(p, u), optax.apply_updates(ref_p, ru)
    flat, ref_flat = ({path_names(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)} for t in (u, ru))
    for name in compared:
      np.testing.assert_array_equal(flat[name], ref_flat[name], err_msg=str((step, name)))


def test_the_partners_matrices_are_a_pattern():
  """optimizer.partner_matrices picks by path which matrices Muon leaves to its partner."""
  params = tree_of(0)
  plan = leaf_plan(cfg(partner_matrices=r"(^|/)embedding$"), params)
  assert plan[("embed_tokens", "embedding")].label == "elementwise"
  assert plan[("lm_head",)].label == plan[("moe_layers", "mlp", "router")].label == "muon"
  plan = leaf_plan(cfg(partner_matrices=r"^moe_layers/self_attn/"), params)
  assert {n for n, p in plan.items() if p.label == "muon"} == (
    {
      ("embed_tokens", "embedding"),
      ("lm_head",),
      ("moe_layers", "mlp", "router"),
      ("moe_layers", "mlp", "gate_proj"),
      ("moe_layers", "mlp", "down_proj"),
    }
  )


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"name": "adamx"}, "name='adamx'; expected 'muon' or the name of an optax optimizer"),
    ({"partner": "muon"}, "partner='muon'; expected the name of an optax optimizer"),
    ({"name": "lion", "hparams": {"beta": 0.9}}, "hparams ['beta'] are not arguments of optax.lion; it takes "),
    ({"name": "sgd", "weight_decay": 0.1}, "weight_decay=0.1; optax.sgd (name) takes no weight decay"),
    ({"partner_matrices": "(embedding"}, "partner_matrices='(embedding'; expected a regular expression"),
  ],
)
def test_optimizer_names_and_hyperparameters_are_checked(changes, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    opt.make_optimizer(cfg(**changes), tree_of(0))


def test_frozen_leaves_stay_bitwise_and_keep_no_state():
  params = tree_of(0)
  attn = params["moe_layers"]["self_attn"]
  attn["q_a_proj"] = attn["q_a_proj"].at[0, 0, 0].set(-0.0)  # p + 0.0 would flip this to +0.0
  attn["indexer"]["k_norm"]["bias"] = jnp.zeros((L, 4))
  c = cfg(weight_decay=0.1)
  tx = opt.make_optimizer(c, params, trainable=lambda names: "indexer" in names)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s, u))(*tx.update(g, s, p)))
  p, state = params, tx.init(params)
  for i in range(3):
    p, state, u = step(p, state, tree_of(20 + i))
  for path, x in jax.tree_util.tree_leaves_with_path(p):
    names = path_names(path)
    before = dict((path_names(k), v) for k, v in jax.tree_util.tree_leaves_with_path(params))[names]
    if "indexer" in names:
      assert np.abs(np.asarray(x) - np.asarray(before)).max() > 1e-3, names
    else:
      assert np.asarray(x).tobytes() == np.asarray(before).tobytes(), names
      assert not np.any(np.asarray(_leaf(u, names))), names
  # the optimizer keeps moments only for the trainable leaves: 3 indexer leaves (wk by Muon: mu; the k_norm
  # weight and bias by AdamW: mu and nu)
  state_sizes = sum(x.size for x in jax.tree.leaves(state) if x.ndim > 0)
  assert state_sizes == L * D * 4 + 2 * 2 * (L * 4) + 3  # + Muon's ns_coeffs (3,)
  # a bool tree gives the same plan as the predicate
  flags = jax.tree_util.tree_map_with_path(lambda p, _: "indexer" in path_names(p), params)
  assert leaf_plan(c, params, trainable=flags) == leaf_plan(c, params, trainable=lambda n: "indexer" in n)


def _leaf(tree, names):
  return dict((path_names(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree))[names]


@pytest.mark.parametrize(
  "kind,mid,quarter",
  [
    ("cosine", 5.5e-4, 1e-4 + 9e-4 * (1 + math.cos(math.pi / 4)) / 2),
    ("linear", 5.5e-4, 1e-3 - 9e-4 * 0.25),
    ("constant", 1e-3, 1e-3),
  ],
)
def test_schedule_values(kind, mid, quarter):
  s = opt.learning_rate_schedule(
    cfg(lr=1e-3, lr_init=0.0, lr_end=1e-4, warmup_steps=10, decay_steps=100, schedule=kind)
  )
  end = 1e-3 if kind == "constant" else 1e-4
  expected = {0: 0.0, 5: 5e-4, 9: 9e-4, 10: 1e-3, 35: quarter, 60: mid, 110: end, 1000: end}
  for step, value in expected.items():
    np.testing.assert_allclose(float(s(step)), value, rtol=1e-6, atol=1e-12, err_msg=f"step {step}")


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_weight_decay_mask(name):
  params = tree_of(0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  u = first_update(cfg(name=name, lr=0.1, weight_decay=0.5), zeros, params)
  new = optax.apply_updates(params, u)
  for names in [
    ("norm", "weight"),
    ("moe_layers", "input_layernorm", "weight"),
    ("embed_tokens", "embedding"),
    ("moe_layers", "self_attn", "indexer", "k_norm", "bias"),
  ]:
    np.testing.assert_array_equal(_leaf(new, names), _leaf(params, names), err_msg=str(names))
  for names in [
    ("lm_head",),
    ("moe_layers", "mlp", "router"),
    ("moe_layers", "self_attn", "kv_b_proj"),
    ("moe_layers", "mlp", "gate_proj"),
  ]:
    np.testing.assert_allclose(_leaf(new, names), _leaf(params, names) * (1 - 0.1 * 0.5), rtol=1e-6, err_msg=str(names))


def test_nnx_state_and_pure_dict_give_the_same_updates(default_update):
  grads, u_dict = default_update
  state_params = nnx.State(jax.tree.map(nnx.Param, tree_of(0)))
  state_grads = nnx.State(jax.tree.map(nnx.Param, grads))
  u_state = first_update(cfg(), state_grads, state_params)
  assert jax.tree.structure(u_state) == jax.tree.structure(state_params)
  for path, x in jax.tree_util.tree_leaves_with_path(u_state):
    np.testing.assert_array_equal(x, _leaf(u_dict, path_names(path)))


def test_plan_of_the_tiny_model():
  mc = ModelConfig.from_dict(glm5_tiny.get_config().model)
  plan = leaf_plan(None, nnx.state(abstract_model(mc), nnx.Param))
  labels = {}
  for names, p in plan.items():
    labels.setdefault(p.label, set()).add(names[-1] if isinstance(names[-1], str) else names)
  assert labels["elementwise"] == {"weight", "bias", "embedding", "lm_head", "router"}
  assert labels["muon"] == {
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "eh_proj",
  }
  for prefix in [("dense_layers",), ("moe_layers",), ("mtp", 0, "layer")]:
    assert plan[prefix + ("self_attn", "kv_b_proj")].split_sizes == (mc.qk_nope_head_dim, mc.v_head_dim)
  assert not plan[("embed_tokens", "embedding")].weight_decay and plan[("lm_head",)].weight_decay
  assert not plan[("moe_layers", "input_layernorm", "weight")].weight_decay  # [L, D]: a stacked 1-D leaf


def test_config_errors_name_the_field():
  params = tree_of(0)
  with pytest.raises(ValueError, match="schedule='cosin'"):
    opt.make_optimizer(cfg(schedule="cosin"), params)
  with pytest.raises(ValueError, match="unknown field.*'lr_ed'"):
    opt.make_optimizer({"lr_ed": 1e-5}, params)
  with pytest.raises(ValueError, match="no Muon layout"):
    opt.make_optimizer(cfg(), {"blocks": {"conv": jnp.zeros((3, 3, 4, 4))}})
  with pytest.raises(ValueError, match="cannot read qk_nope_head_dim"):
    opt.make_optimizer(cfg(), {"self_attn": {"kv_b_proj": jnp.zeros((8, 2, 10))}})
