"""GLM-130B's options of the model: the bidirectional prefix (dense, DSA reference and kernels, MTP), GLM's 2-D rope,
DeepNorm (the forward as a plain formula, the initial weights' scales), embedding gradient shrink, and the errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.model import deepnorm
from glm_jax.model.layers import apply_rope, rope_angles_2d
from pallas_kernels.visibility import Visibility
from glm_jax.model.mla import AttentionInputs
from glm_jax.model.transformer import DecoderLayer, GlmMoeDsa
from glm_jax.tree_paths import path_names
from glm_jax.train.trainer import INIT_CPU_COMPILER_OPTIONS
from tests.helpers import DEFAULT_COMPILE, TINY_MODEL, fp32_ulps, init_module

B, T = 2, 12
CFG = TINY_MODEL.replace(qk_rope_head_dim=8, index_topk=4, rope_2d=True)  # index_topk < T: DSA selects in every layer


def make_model(cfg, seed=0):
  return init_module(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)), seed)


def ids_and_layout():
  """Two rows: row 0 one document with a 5-token prefix; row 1 two packed documents (7 + 5 tokens) with prefixes
  of 4 and 2 tokens. prefix_end is each token's document's prefix end, as the data pipeline gives it."""
  ids = jnp.asarray(np.random.default_rng(1).integers(6, CFG.vocab_size, (B, T)), jnp.int32)
  seg = jnp.asarray([[1] * 12, [1] * 7 + [2] * 5], jnp.int32)
  pos = jnp.asarray([list(range(12)), list(range(7)) + list(range(5))], jnp.int32)
  block = jnp.asarray([[0] * 5 + [1, 2, 3, 1, 2, 3, 4], [0] * 4 + [1, 2, 3] + [0, 0, 1, 2, 3]], jnp.int32)
  prefix_end = jnp.asarray([[5] * 12, [4] * 7 + [9] * 5], jnp.int32)
  return ids, dict(segment_ids=seg, positions=pos, block_positions=block, prefix_end=prefix_end)


PREFIX = [(0, 0, 5), (1, 0, 4), (1, 7, 9)]  # (row, start, end) of every prefix in ids_and_layout


@pytest.mark.parametrize(
  "changes",
  [
    dict(use_dsa=False),
    dict(use_dsa=True),  # the indexer's scores and top-k look forward within the prefix
    pytest.param(dict(use_dsa=True, attention_impl="pallas"), marks=pytest.mark.slow),  # the kernels (interpret)
  ],
  ids=["dense", "dsa", "dsa-pallas"],
)
def test_prefix_is_bidirectional_and_the_rest_causal(changes):
  """Changing a later prefix token changes the outputs (main head and MTP) at every earlier prefix position of its
  document; changing a token after the prefix changes no prefix output, and no output of another document."""
  model = make_model(CFG.replace(**changes))
  ids, layout = ids_and_layout()
  run = jax.jit(lambda ids: model(ids, **layout))
  base = run(ids)
  for row, start, end in PREFIX:
    last = end - 1
    out = run(ids.at[row, last].set((ids[row, last] + 1) % CFG.vocab_size))
    for got, want in ((out.logits, base.logits), (out.mtp_logits[0], base.mtp_logits[0])):
      # An output the token cannot reach may still move by rounding: exactly 0 on CPU, up to 2 ulps on an H100
      # (another token's experts reorder fp32 sums there). Reached outputs move by 0.7 or more.
      rounding = fp32_ulps(want[row], 16)
      moved = np.abs(np.asarray(got - want)[row]).max(axis=-1)
      assert (moved[start:last] > 1e3 * rounding).all(), (row, start, end, moved)
      others = [t for t in range(T) if layout["segment_ids"][row, t] != layout["segment_ids"][row, start]]
      assert (moved[others] <= rounding).all(), moved[others]
    if CFG.replace(**changes).use_dsa:  # the prefix's queries select keys ahead of them; no other query does
      idx = np.asarray(base.aux["topk_indices"])[:, row]  # [L, T, K]
      ahead = idx > np.arange(T)[None, :, None]
      doc_end = start + int(np.sum(np.asarray(layout["segment_ids"][row]) == int(layout["segment_ids"][row, start])))
      assert ahead[:, start:last].any() and not ahead[:, end:doc_end].any() and not ahead[:, last].any()
    after = end  # the first token after the prefix (a <sop> in the objective's layout)
    out = run(ids.at[row, after].set((ids[row, after] + 1) % CFG.vocab_size))
    moved = np.abs(np.asarray(out.logits - base.logits)[row]).max(axis=-1)
    rounding = fp32_ulps(base.logits[row], 16)
    assert (moved[:after] <= rounding).all() and moved[after] > 1e3 * rounding, moved


@pytest.mark.slow  # four model compiles (the fast tier checks the prefix in test_prefix_is_bidirectional_...)
def test_no_prefix_equals_causal_and_rope_2d_with_zero_blocks_equals_half_rotated():
  """prefix_end all 0 is the causal model exactly; without block positions the 2-D rope uses 0 for them."""
  model = make_model(CFG)
  ids, layout = ids_and_layout()
  run = jax.jit(lambda **blocks: model(ids, segment_ids=layout["segment_ids"], positions=layout["positions"], **blocks))
  causal = run()
  zeros = run(prefix_end=jnp.zeros((B, T), jnp.int32), block_positions=jnp.zeros((B, T), jnp.int32))
  np.testing.assert_array_equal(np.asarray(causal.logits), np.asarray(zeros.logits))


def test_rope_2d_is_two_rotaries_on_the_two_halves():
  """GLM-130B's 2-D rotary on interleaved pairs: dims [0, d/2) rotate by the position, [d/2, d) by the block
  position, each half an ordinary rotary of width d/2 (inv_freq_i = theta^(-2i/(d/2))), written out in numpy."""
  d, theta = 8, 100.0
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, 3, d)).astype(np.float32)
  pos, block = np.array([[0, 5, 9]]), np.array([[0, 1, 3]])
  cos, sin = rope_angles_2d(jnp.asarray(pos), jnp.asarray(block), d, theta)
  got = np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleave=True))
  want = np.empty_like(x)
  for t in range(3):
    for half, p in ((0, pos[0, t]), (1, block[0, t])):
      for i in range(d // 4):
        angle = p * theta ** (-2 * i / (d / 2))
        a, b = x[0, t, half * d // 2 + 2 * i], x[0, t, half * d // 2 + 2 * i + 1]
        want[0, t, half * d // 2 + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
        want[0, t, half * d // 2 + 2 * i + 1] = b * math.cos(angle) + a * math.sin(angle)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_deepnorm_layer_is_the_plain_formula():
  """out = alpha h + FFN(h), h = Norm(alpha x' + Attn(x')), x' = Norm(x), alpha = (2N)^1/2, with the layer's own
  attention and MLP as f: the residual wiring, written out."""
  cfg = CFG.replace(norm_style="deepnorm", use_dsa=False)
  layer = init_module(lambda: DecoderLayer(cfg, False, nnx.Rngs(0)), 3)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, cfg.hidden_size)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  cos, sin = rope_angles_2d(pos, jnp.zeros_like(pos), cfg.qk_rope_head_dim, cfg.rope_theta)
  inp = AttentionInputs(
    cos=cos,
    sin=sin,
    visibility=Visibility(),
    mask=jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T)),
  )

  def norm(v, module):
    return v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + cfg.rms_norm_eps) * module.weight[...]

  alpha = math.sqrt(2 * cfg.num_hidden_layers)
  xn = norm(x, layer.input_layernorm)
  h = norm(alpha * xn + layer.self_attn(xn, inp)[0], layer.post_attention_layernorm)
  want = alpha * h + layer.mlp(h)
  got, _ = layer(x, inp)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert deepnorm.alpha(cfg) == alpha and deepnorm.beta(cfg) == pytest.approx(1 / alpha, rel=1e-15)


@pytest.mark.slow  # builds and compiles a whole model's initialisation
def test_deepnorm_initial_weights_have_the_stated_scales():
  """Xavier normal, std = gain sqrt(2 / (fan_in + fan_out)), gain (2N)^-1/2 on the FFN (dense and experts), W_UV
  (v_proj) and o_proj (out_proj), 1 on the other attention matrices; the rest keeps normal(0, 0.02). Each sample
  std is within 5 standard errors (a normal sample's std has relative standard error ~ 1/sqrt(2n))."""
  cfg = CFG.replace(
    norm_style="deepnorm",
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    q_lora_rank=48,
    kv_lora_rank=40,
    num_attention_heads=4,
    num_key_value_heads=4,
  )
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))))
  # one compile, as the trainer compiles a run's initial state (LLVM O1 on CPU: the same bits as the default, faster)
  init = jax.jit(lambda: nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)))[1], compiler_options=INIT_CPU_COMPILER_OPTIONS)
  model = nnx.merge(graphdef, init())
  beta = (2 * cfg.num_hidden_layers) ** -0.5
  d, h, dn, dv = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
  want = {  # name -> [(columns of the last axis, fan_in, fan_out, gain)]
    "q_a_proj": [(slice(None), d, cfg.q_lora_rank, 1.0)],
    "q_b_proj": [(slice(None), cfg.q_lora_rank, h * cfg.qk_head_dim, 1.0)],
    "kv_a_proj_with_mqa": [(slice(None), d, cfg.kv_latent_dim, 1.0)],
    "kv_b_proj": [(slice(0, dn), cfg.kv_lora_rank, h * dn, 1.0), (slice(dn, None), cfg.kv_lora_rank, h * dv, beta)],
    "o_proj": [(slice(None), h * dv, d, beta)],
  }
  checked = set()
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = path_names(path)
    value = np.asarray(var[...])
    experts = names[-2:-1] == ("mlp",) and names[0] == "moe_layers" or (names[0] == "mtp" and value.ndim == 3)
    if names[-1] in ("gate_proj", "up_proj", "down_proj") and "indexer" not in names:
      fan_in, fan_out = value.shape[-2], value.shape[-1]
      rules = [(slice(None), fan_in, fan_out, beta)]
    elif names[-1] in want and "indexer" not in names:
      rules = want[names[-1]]
    elif value.ndim >= 2 and names[-1] not in ("weight", "bias"):
      rules = [(slice(None), None, None, None)]  # default init
    else:
      continue
    for cols, fan_in, fan_out, gain in rules:
      part = value[..., cols]
      std = 0.02 if gain is None else gain * math.sqrt(2 / (fan_in + fan_out))
      n = part.size
      assert abs(part.std() / std - 1) < 5 / math.sqrt(2 * n), (names, part.std(), std)
      assert abs(part.mean()) < 5 * std / math.sqrt(n), names
    checked.add(names[-1] + ("/experts" if experts else ""))
  assert {"gate_proj", "gate_proj/experts", "o_proj", "kv_b_proj", "embedding", "router", "wq_b"} <= checked


@pytest.mark.slow  # two gradient compiles
def test_embedding_gradient_shrink():
  """EGS: the same forward bit for bit; the embedding table's gradient is alpha times the plain one (exactly for
  alpha = 0.5, a power of two, to fp32 rounding for GLM-130B's 0.1), every other gradient unchanged."""
  model = make_model(CFG.replace(use_dsa=False))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids, layout = ids_and_layout()

  def loss(p, a):
    out = nnx.merge(graphdef, p, rest)(ids, **layout, embedding_grad_shrink=a)
    return jnp.sum(out.logits * jnp.cos(jnp.arange(CFG.vocab_size))) + jnp.sum(out.mtp_logits**2), out.logits

  # Two programs compared bit for bit: XLA:CPU's default compilation, whose sums of the table's rows these two share.
  plain = jax.jit(lambda p: jax.grad(loss, has_aux=True)(p, 1.0), compiler_options=DEFAULT_COMPILE)  # no stop_gradient
  shrunk = jax.jit(jax.grad(loss, has_aux=True), compiler_options=DEFAULT_COMPILE)  # alpha traced: one compile for both
  (g1, l1), (g5, l5), (g01, _) = plain(params), shrunk(params, 0.5), shrunk(params, 0.1)
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l5))
  emb = lambda g: np.asarray(g["embed_tokens"]["embedding"][...])  # noqa: E731
  np.testing.assert_array_equal(emb(g5), 0.5 * emb(g1))
  np.testing.assert_allclose(emb(g01), 0.1 * emb(g1), rtol=1e-5, atol=1e-7 * np.abs(emb(g1)).max())
  for (path, a), (_, b) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(g5)):
    if path_names(path)[0] != "embed_tokens":
      np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_errors_name_the_option(tmp_path):
  with pytest.raises(ValueError, match="norm_style='postnorm'.*prenorm"):
    CFG.replace(norm_style="postnorm")
  with pytest.raises(ValueError, match="qk_rope_head_dim=6.*multiple of 4 with rope_2d"):
    CFG.replace(qk_rope_head_dim=6, index_head_dim=8)
  with pytest.raises(ValueError, match="norm_style='deepnorm' has no counterpart in transformers"):
    CFG.replace(rope_2d=False, norm_style="deepnorm").to_hf_dict()
  with pytest.raises(ValueError, match="rope_2d=True has no counterpart"):
    CFG.to_hf_dict()
  from glm_jax.convert import hf

  cfg = CFG.replace(norm_style="deepnorm")
  with pytest.raises(ValueError, match="norm_style='deepnorm'"):
    hf.save(cfg, nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
  model = make_model(CFG.replace(rope_2d=False, qk_rope_head_dim=6, index_head_dim=8))
  ids, layout = ids_and_layout()
  with pytest.raises(ValueError, match="block_positions given, but model.rope_2d is False"):
    model(ids, **layout)
  with pytest.raises(ValueError, match=r"prefix_end: shape \(2, 11\)"):
    model(ids, prefix_end=layout["prefix_end"][:, :11])
