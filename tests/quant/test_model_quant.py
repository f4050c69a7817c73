"""Quantization of GLM-5's weights (glm_jax/model/quantization.py, glm_jax/train/packed_checkpoint.py): which weights
a scheme packs, QAT steps whose fake-quantized weights and logits equal the packed model's bit for bit, the
straight-through gradient through the whole model, a W8A8 matmul of two contracted axes against a numpy formula,
the packed checkpoint's round trip and its refusals, and the packed 744B-shaped decode compiled for TPU with
integer dots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model import quantization as Q
from glm_jax.model.layers import dense
from glm_jax.quant.packed import PackedWeight, dequantize_weight, pack_weight
from glm_jax.tree_paths import path_names, path_str
from tests.helpers import init_module, needs_libtpu

ROUTED = [
  "moe_layers/mlp/down_proj",
  "moe_layers/mlp/gate_proj",
  "moe_layers/mlp/up_proj",
  "mtp/0/layer/mlp/down_proj",
  "mtp/0/layer/mlp/gate_proj",
  "mtp/0/layer/mlp/up_proj",
]


def tiny_cfg(**changes) -> ModelConfig:
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  return cfg.replace(initializer_range=0.2, **changes)


def quant(scheme, group_size=32, scope=""):
  q = Q.default_quant_config()
  q.scheme, q.group_size, q.scope = scheme, group_size, scope
  return q


@pytest.fixture(scope="module")
def tiny_model():
  cfg = tiny_cfg(use_dsa=False)  # the dense stage's model, as a packed checkpoint of a dense-stage run loads
  graphdef, params, rest = nnx.split(init_module(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)), 0, 0.2), nnx.Param, ...)
  return cfg, graphdef, params, rest


def planned(plan):
  return {path_str(k): v for k, v in plan.items()}


def test_default_scopes_pack_what_each_scheme_names(tiny_model):
  """int4 (GLM-5's QAT): the routed experts only, groups along the input. w4a8 (the Ascend mix): 4-bit MoE experts
  (routed and shared), 8-bit attention and dense MLPs, integer activations except kv_b_proj; never the router, the
  indexer, norms, embeddings or the head."""
  _, _, params, _ = tiny_model
  p = planned(Q.quant_plan(params, quant("int4")))
  assert sorted(p) == ROUTED
  assert {(r.bits, r.group_size, r.act_bits) for r in p.values()} == {(4, 32, None)}
  p = planned(Q.quant_plan(params, quant("w4a8")))
  shared = {k for k in p if "shared_experts" in k}
  assert len(shared) == 6 and {k for k, r in p.items() if r.bits == 4} == set(ROUTED) | shared
  assert p["moe_layers/self_attn/o_proj"] == Q.Rule(8, None, 8, 2, 1)
  assert p["dense_layers/self_attn/q_b_proj"] == Q.Rule(8, None, 8, 1, 2)
  assert p["moe_layers/self_attn/kv_b_proj"].act_bits is None
  assert p["dense_layers/mlp/gate_proj"] == Q.Rule(8, None, 8, 1, 1)
  for name in p:
    assert not any(s in name for s in ("router", "indexer", "norm", "embed", "lm_head", "eh_proj")), name
  assert sorted(planned(Q.quant_plan(params, quant("int4", scope="re:lm_head$")))) == ["lm_head"]


@pytest.mark.parametrize(
  "q, message",
  [
    (quant("int3"), r"quant.scheme='int3' is invalid; one of \['none', 'int4'"),
    (quant("int4", scope="experts"), r"unknown group\(s\) \['experts'\]; groups are \['routed_experts'"),
    (quant("int4", scope="re:nothing_like_this"), r"matches no parameter of this model.*its matmul weights are"),
    (quant("int4", scope="re:input_layernorm"), r"matches \['dense_layers/input_layernorm/weight'.*not matmul"),
    (quant("int4", group_size=48), r"quant.group_size=48 does not divide moe_layers/mlp/down_proj's input of 32"),
    (quant("int4", group_size=-1), r"quant.group_size=-1 is invalid"),
    (quant("int4", scope="re:("), r"not a regular expression"),
  ],
)
def test_bad_quant_sections_are_refused_by_name(tiny_model, q, message):
  with pytest.raises(ValueError, match=message):
    Q.quant_plan(tiny_model[2], q)


@pytest.mark.slow  # two gradient compiles of the whole model (tests/quant/test_quantizer.py has the fast one)
def test_straight_through_gradient_of_the_whole_model(tiny_model):
  """d loss(fake_quant(p)) / dp is the gradient of the loss at the fake-quantized weights, for the quantized
  weights (the straight-through estimator) and the others alike, bit for bit."""
  _, graphdef, params, rest = tiny_model
  plan = Q.quant_plan(params, quant("int4_row", scope="routed_experts,attention"))
  ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 512)

  def loss(p):
    return jnp.mean(nnx.merge(graphdef, p, rest)(ids, compute_mtp=False).logits ** 2)

  through = jax.jit(jax.grad(lambda p: loss(Q.fake_quant_params(p, plan))))(params)
  at_fake = jax.jit(lambda p: jax.grad(loss)(Q.fake_quant_params(p, plan)))(params)
  for a, b in zip(jax.tree.leaves(through), jax.tree.leaves(at_fake)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(jnp.abs(through["moe_layers"]["mlp"]["gate_proj"][...]).max()) > 0


def test_w8a8_dense_of_two_contracted_axes_equals_the_formula():
  """o_proj's 'bthv,hvd->btd' with a W8A8 weight: per-token int8 activations over (h, v), per-channel int8 weights
  over the flattened (h, v) input, integer products summed exactly; a plain numpy formula in float64."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
  w = rng.standard_normal((4, 8, 6)).astype(np.float32)
  p = pack_weight(jnp.asarray(w), bits=8, group_size=None, contracted_axes=2, free_axes=1, act_bits=8)
  y = np.asarray(dense(jnp.asarray(x), nnx.Param(p), jnp.float32, "bthv,hvd->btd"))
  x2, w2 = x.reshape(6, 32).astype(np.float64), w.reshape(32, 6)
  sx = np.abs(x.reshape(6, 32)).max(axis=1, keepdims=True) / np.float32(127)
  xq = np.clip(np.round(x.reshape(6, 32) / sx.astype(np.float32)), -127, 127)
  sw = np.abs(w2).max(axis=0, keepdims=True) / np.float32(127)
  wq = np.clip(np.round(w2 / sw.astype(np.float32)), -127, 127)
  want = (xq @ wq) * sx.astype(np.float64) * sw.astype(np.float64)
  np.testing.assert_allclose(y.reshape(6, 6), want, rtol=0, atol=1e-6 * np.abs(want).max())
  assert np.abs(want - x2 @ w2).max() < 0.05 * np.abs(x2 @ w2).max()  # and it is a good approximation


@pytest.mark.slow  # three QAT steps and two sampler compiles
def test_qat_steps_then_packed_model_is_bitwise_the_qat_model():
  """After INT4 QAT steps (groups of 32 on the routed experts and the attention), each fake-quantized weight equals
  its packed form dequantized bit for bit, and the sampler's greedy tokens and logits from the packed model equal
  those from the QAT model (the fake-quantized weights) bit for bit."""
  from glm_jax.configs import sft_tiny
  from glm_jax.train import step as step_lib
  from glm_jax.train.trainer import abstract_train_state, training_quant_plan

  config = sft_tiny.get_config()
  config.quant.scope = "routed_experts,attention"
  config.quant.group_size = 16
  config.data.batch_size = 2
  config.optimizer.name = "adamw"  # a shorter compile than Muon's; the optimizer is not what is tested
  model_cfg = ModelConfig.from_dict(config.model).replace(use_dsa=False)
  # The trainer's state of given weights (train.init_from's path), the weights filled from numpy: no compile of the
  # random initialization
  target = abstract_train_state(config, model_cfg)
  _, params, rest = nnx.split(init_module(lambda: GlmMoeDsa(model_cfg, nnx.Rngs(0)), 0, 0.2), nnx.Param, ...)
  graphdef, state = target.graphdef, target.from_weights(params, rest)
  plan = training_quant_plan(config, state.params)
  assert len(plan) == 6 + 5 * 3
  train_step = step_lib.make_train_step(graphdef, target.optimizer, target.schedule, config.train, quant_plan=plan)
  rng = np.random.default_rng(0)
  before = jax.tree.map(np.asarray, state.params)
  for _ in range(3):
    ids = rng.integers(3, 512, (2, 16)).astype(np.int32)
    batch = {
      "input_ids": ids,
      "segment_ids": np.ones_like(ids),
      "positions": np.tile(np.arange(16), (2, 1)),
      "loss_mask": (np.arange(16) >= 4).astype(np.int32)[None].repeat(2, 0),
    }
    state, metrics = train_step(state, jax.tree.map(jnp.asarray, batch))
  assert not np.array_equal(
    before["moe_layers"]["mlp"]["gate_proj"], np.asarray(state.params["moe_layers"]["mlp"]["gate_proj"][...])
  )

  # The QAT model's weights as its train step computes them (fake_quant_params inside a jit), the packed ones as
  # launch/quantize.py packs them (pack_params op by op)
  fake = jax.jit(lambda p: Q.fake_quant_params(p, plan))(state.params)
  packed = Q.pack_params(state.params, plan)
  flat_packed = {
    path_names(p): x
    for p, x in jax.tree_util.tree_flatten_with_path(packed, is_leaf=lambda v: isinstance(v, PackedWeight))[0]
  }
  for path, f in jax.tree_util.tree_flatten_with_path(fake)[0]:
    names = path_names(path)
    p = flat_packed[names]
    if names in plan:
      assert isinstance(p, PackedWeight)
      np.testing.assert_array_equal(np.asarray(dequantize_weight(p)), np.asarray(f), err_msg=path_str(names))
    else:
      np.testing.assert_array_equal(np.asarray(p), np.asarray(f))

  sampler = Sampler(graphdef, model_cfg, SamplingParams(max_new_tokens=4, temperature=0.0), return_logits=True)
  prompts = [[5, 6, 7, 8, 9], [10, 11]]
  a = sampler(fake, state.rest, prompts, jax.random.key(0))
  b = sampler(packed, state.rest, prompts, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))


@pytest.mark.slow  # a save, a load and two forwards
def test_packed_checkpoint_round_trip_and_refusals(tiny_model, tmp_path):
  """launch/quantize.py's format: the loaded packed model computes what the packed params in memory compute;
  another scheme, another model and an existing directory are refused by name, and nothing is left half-written."""
  from glm_jax.train.packed_checkpoint import load_packed, save_packed

  cfg, graphdef, params, rest = tiny_model
  config = glm_jax.configs.glm5_tiny.get_config()
  config.model.initializer_range = 0.2
  out = str(tmp_path / "w4a8")
  meta = save_packed(
    out,
    params,
    rest,
    quant=quant("w4a8"),
    config=config.to_dict(),
    tokenizer=None,
    source={"workdir": "test", "step": 0},
  )
  assert meta["weight_bytes"] < 0.5 * meta["unpacked_weight_bytes"]
  loaded = load_packed(out, cfg)
  ids = jax.random.randint(jax.random.key(2), (2, 10), 0, 512)
  model_cfg = loaded.model_cfg
  # One program for both (compiled once when the loaded graphdef equals the one in memory, as it should)
  forward = jax.jit(lambda g, p, r: nnx.merge(g, p, r)(ids, compute_mtp=False).logits, static_argnums=0)
  want = forward(graphdef, Q.pack_params(params, Q.quant_plan(params, quant("w4a8"))), rest)
  got = forward(loaded.graphdef, loaded.params, loaded.rest)
  assert model_cfg.use_dsa is False
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match=r"packed with scheme 'w4a8', not 'int4'"):
    load_packed(out, cfg, scheme="int4")
  with pytest.raises(ValueError, match=r"packed from another model: model.hidden_size: checkpoint 64, config 32"):
    load_packed(out, cfg.replace(hidden_size=32))
  with pytest.raises(FileExistsError, match=r"exists; a packed model is written to a new directory"):
    save_packed(out, params, rest, quant=quant("int4"), config=config.to_dict(), tokenizer=None, source={})
  with pytest.raises(FileNotFoundError, match=r"not a packed model"):
    load_packed(str(tmp_path), cfg)
  with pytest.raises(ValueError, match=r"does not divide"):
    save_packed(
      str(tmp_path / "bad"),
      params,
      rest,
      quant=quant("int4", group_size=48),
      config=config.to_dict(),
      tokenizer=None,
      source={},
    )
  assert sorted(p.name for p in tmp_path.iterdir()) == ["w4a8"]


@needs_libtpu
@pytest.mark.slow  # XLA:TPU compiles a 744B-shaped decode step (two layers)
def test_packed_744b_decode_step_compiles_to_integer_dots_for_tpu():
  """glm5_744b's shapes (one dense and one MoE layer: the step of every layer of the stacks) packed as w4a8, its
  KV-cache decode step compiled for a v5p chip: the compiled HLO multiplies int8 activations with int8 weights
  (attention, dense MLP), with int4 weights (the shared expert) into int32, and the routed experts' grouped dot
  takes int8 operands (their int4 codes widened: XLA:TPU's ragged dot has no 4-bit operands)."""
  import re

  from glm_jax.configs import glm5_744b
  from glm_jax.model.platform import target_platform
  from glm_jax.sharding.topology import tpu_topology_devices

  cfg = ModelConfig.from_dict(glm5_744b.get_config().model).replace(
    num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0
  )
  device = tpu_topology_devices("v5p:2x2x1")[0]
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param, ...)
  plan = Q.quant_plan(params, quant("w4a8"))
  packed = jax.eval_shape(lambda p: Q.pack_params(p, plan), params)
  on_chip = jax.sharding.SingleDeviceSharding(device)
  place = lambda t: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on_chip), t)
  batch, cache_len = 8, 4096
  with target_platform("tpu"):
    cache = jax.eval_shape(
      lambda p, r: nnx.merge(graphdef, p, r).prefill(jnp.zeros((batch, 16), jnp.int32), cache_len)[1], packed, rest
    )
    token = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=on_chip)
    step = jax.jit(lambda p, r, t, pos, c: nnx.merge(graphdef, p, r).decode(t, pos, c))
    compiled = step.lower(place(packed), place(rest), token, token, place(cache)).compile()
  hlo = compiled.as_text()
  dtype_of = dict(re.findall(r"%([\w.\-]+) = ([a-z]+\d*)\[", hlo))  # every value's element type
  int_dots = {
    tuple(sorted(dtype_of.get(a, "?") for a in (x, y)))
    for x, y in re.findall(r"= s32\[[^\]]*\]\S* (?:convolution|dot)\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
  }
  assert ("s8", "s8") in int_dots and ("s4", "s8") in int_dots, int_dots
  # XLA:TPU's ragged dot (a Mosaic custom call) for the routed experts: int8 rows x int8 [E, K, N] weights -> int32
  ragged = re.findall(r"%ragged-dot\S* = s32\[[^\]]*\]\S* custom-call\(.*?operand_layout_constraints=\{(.*?\})\}", hlo)
  assert len(ragged) == 3 and all(re.search(r"s8\[64,\d+\]\{1,0\}, s8\[256,\d+,\d+\]", c) for c in ragged), ragged
  float_dots = re.findall(r"= f32\[[^\]]*\]\S* (?:convolution|dot)\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
  assert float_dots  # the absorbed attention, the indexer and the head stay floating point


@pytest.mark.slow  # a save, a load and a scorer compile
def test_a_packed_model_serves_as_a_distillation_teacher(tmp_path):
  """teachers.<name>.init_from naming launch/quantize.py's output: load_teacher returns the packed weights, and the
  teacher's scores of a batch of tokens are the packed model's own log-probabilities; a packed model of another
  tokenizer is refused by name."""
  import types

  from glm_jax.configs import distill_tiny
  from glm_jax.rl import step as rl_step, tasks as tasks_lib
  from glm_jax.rl.warm_start import load_teacher
  from glm_jax.train.packed_checkpoint import save_packed

  config = distill_tiny.get_config()
  cfg = ModelConfig.from_dict(config.model)
  graphdef, params, rest = nnx.split(init_module(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)), 1, 0.2), nnx.Param, ...)
  vocab = tasks_lib.CharVocab()
  out = str(tmp_path / "teacher_w8a8")
  save_packed(out, params, rest, quant=quant("w8a8"), config=config.to_dict(), tokenizer=vocab.record(), source={})
  config.teachers.addition.init_from = out
  setup = types.SimpleNamespace(config=config, vocab=vocab, workdir=str(tmp_path))
  t_graphdef, t_params, t_rest = load_teacher(setup, "addition")
  assert isinstance(t_params["moe_layers"]["mlp"]["gate_proj"][...], PackedWeight)
  tokens = jax.random.randint(jax.random.key(3), (4, 9), 0, cfg.vocab_size)
  got = rl_step.make_score_fn(t_graphdef)(t_params, t_rest, tokens)
  logits = nnx.merge(graphdef, Q.pack_params(params, Q.quant_plan(params, quant("w8a8"))), rest)(
    tokens, compute_mtp=False
  ).logits
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
  want = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(got)[:, 1:], np.asarray(want), rtol=0, atol=1e-5)
  other = str(tmp_path / "other_tokenizer")
  save_packed(
    other,
    params,
    rest,
    quant=quant("w8a8"),
    config=config.to_dict(),
    source={},
    tokenizer={"name": "bpe", "sha256": "0" * 64, "vocab_size": cfg.vocab_size},
  )
  config.teachers.addition.init_from = other
  with pytest.raises(ValueError, match=r"teachers\.addition\.init_from=.*trained with the tokenizer 'bpe'"):
    load_teacher(setup, "addition")
