"""useful_flops, the MFU numerator, against hand counts: a small model's matmul parameters written out weight by
weight, the attention and indexer pairs counted by loops over query positions, each stage's rules applied by hand;
its relation to analytic_flops; and, printed for the record, the 744B config's useful / analytic ratios."""

import pytest

from glm_jax.configs import glm5_744b, glm5_744b_128k, glm5_744b_200k
from glm_jax.model import ModelConfig
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.flops import analytic_flops, useful_flops

# A small model with a different size in every field, so a swapped dimension changes the count.
D, V, I, I_E = 24, 50, 40, 12  # hidden, vocab, dense MLP width, expert width
L, L_DENSE, M = 3, 1, 1  # decoder layers (the first dense, then MoE), MTP layers
H, R_Q, R_KV, D_N, D_R, D_V = 2, 10, 6, 4, 2, 5  # heads, q / kv latent ranks, nope / rope / value head dims
E, S, KE = 4, 1, 2  # routed experts, shared experts, experts a token
H_I, D_I, K = 3, 4, 8  # indexer heads, indexer head dim, index_topk
B = 2


def small_config(**changes) -> ModelConfig:
  return ModelConfig(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=I,
    moe_intermediate_size=I_E,
    num_hidden_layers=L,
    first_k_dense_replace=L_DENSE,
    num_nextn_predict_layers=M,
    num_attention_heads=H,
    num_key_value_heads=H,
    q_lora_rank=R_Q,
    kv_lora_rank=R_KV,
    qk_nope_head_dim=D_N,
    qk_rope_head_dim=D_R,
    v_head_dim=D_V,
    n_routed_experts=E,
    n_shared_experts=S,
    num_experts_per_tok=KE,
    index_n_heads=H_I,
    index_head_dim=D_I,
    index_topk=K,
    max_position_embeddings=64,
    **changes,
  )


# Matmul parameters one token passes through, weight by weight.
ATTN = (
  D * R_Q  # q_a_proj
  + R_Q * H * (D_N + D_R)  # q_b_proj
  + D * (R_KV + D_R)  # kv_a_proj_with_mqa
  + R_KV * H * (D_N + D_V)  # kv_b_proj
  + H * D_V * D
)  # o_proj
MLP = D * I + D * I + I * D  # gate, up, down
EXPERT = D * I_E + D * I_E + I_E * D
MOE = D * E + S * EXPERT + KE * EXPERT  # router, shared experts, the routed experts a token uses
HEAD = D * V
MAIN = L * ATTN + L_DENSE * MLP + (L - L_DENSE) * MOE + HEAD
MTP = 2 * D * D + ATTN + MOE + HEAD  # eh_proj, the MTP decoder layer (index 3 >= first_k_dense_replace: MoE), head
INDEXER = R_Q * H_I * D_I + D * D_I + D * H_I  # wq_b, wk, weights_proj

# Forward FLOPs of one (query, key) pair in one layer.
DENSE_PAIR = H * (2 * (D_N + D_R) + 2 * D_V)  # per head: q . k over nope + rope, then p . v
SPARSE_PAIR = H * (2 * (R_KV + D_R) + 2 * R_KV)  # absorbed: q~ . [c_kv ; k_rope], then p . c_kv
INDEXER_PAIR = H_I * (2 * D_I + 2)  # per indexer head: q_I . k_I, then the weighted sum


def causal(t):
  return sum(i + 1 for i in range(t))  # query i sees keys 0..i


def selected(t):
  return sum(min(i + 1, K) for i in range(t))  # query i sees its top-K of keys 0..i


def hand_count(stage: str, t: int, indexer_layers: int = L + M) -> int:
  n = B * t
  if stage == "dense":
    return 6 * n * (MAIN + MTP) + 3 * B * causal(t) * DENSE_PAIR * (L + M)
  indexer_proj = (2 + 2) * n * INDEXER * indexer_layers  # forward + weight gradients, no input gradients
  if stage == "warmup":  # the model forward only; the indexer trained on every visible key
    return (
      2 * n * (MAIN + MTP)
      + B * causal(t) * DENSE_PAIR * (L + M)
      + indexer_proj
      + 3 * B * causal(t) * INDEXER_PAIR * indexer_layers
    )
  if t <= K:  # the sparse stage where top-K selects every key: dense attention, KL over every visible key
    return (
      6 * n * (MAIN + MTP)
      + 3 * B * causal(t) * DENSE_PAIR * (L + M)
      + indexer_proj
      + 3 * B * causal(t) * INDEXER_PAIR * indexer_layers
    )
  return (
    6 * n * (MAIN + MTP)
    + 3 * B * selected(t) * SPARSE_PAIR * (L + M)
    + indexer_proj
    + B * causal(t) * INDEXER_PAIR * indexer_layers  # the selection: forward, no gradient
    + 3 * B * selected(t) * INDEXER_PAIR * indexer_layers
  )  # the KL over the selected keys


@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
@pytest.mark.parametrize("t", [5, K, K + 1, 13, 40])
def test_total_equals_hand_count(stage, t):
  got = useful_flops(small_config(), B, t, stage)
  assert got["total"] == hand_count(stage, t)
  assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_parts_by_hand():
  t = 13
  sparse = useful_flops(small_config(), B, t, "sparse")
  assert sparse["attention_sparse"] == 3 * B * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 * 6) * SPARSE_PAIR * (L + M)
  assert sparse["indexer_selection"] == B * (13 * 14 // 2) * INDEXER_PAIR * (L + M)
  assert sparse["indexer_scores"] == 3 * B * (28 + 8 * 6) * INDEXER_PAIR * (L + M)
  warmup = useful_flops(small_config(), B, t, "warmup")
  assert warmup["params_main_forward_only"] == 2 * B * t * MAIN
  assert warmup["attention_forward_only"] == B * 91 * DENSE_PAIR * (L + M)
  assert "indexer_selection" not in warmup and "indexer_projections" not in useful_flops(small_config(), B, t, "dense")


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_shared_indexer_layers_do_no_indexer_work(stage):
  # IndexShare: layer 1 reuses layer 0's top-k; its indexer neither scores nor learns. The MTP layer's is its own.
  t = 13
  got = useful_flops(small_config(indexer_types="FSF"), B, t, stage)
  assert got["total"] == hand_count(stage, t, indexer_layers=2 + M)


@pytest.mark.parametrize("cfg", [small_config(), ModelConfig()], ids=["small", "744b"])
@pytest.mark.parametrize("t", [5, 13, 4096])
def test_dense_attention_is_analytic_times_causal_fraction(cfg, t):
  useful = useful_flops(cfg, B, t, "dense")["attention"]
  analytic = analytic_flops(cfg, B, t, "dense")["attention"]
  assert useful * (2 * t * t) == analytic * t * (t + 1)  # useful = analytic t (t + 1) / (2 t^2), exactly


@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
def test_parameters_count_as_analytic(stage):
  u, a = useful_flops(small_config(), B, 40, stage), analytic_flops(small_config(), B, 40, stage)
  for key in ("params_main", "params_mtp"):
    key += "_forward_only" if stage == "warmup" else ""
    assert u[key] == a[key]


@pytest.mark.parametrize(
  "cfg,t",
  [(small_config(), 40), (small_config(), 200), (ModelConfig(), 8192), (ModelConfig(), 131072)],
  ids=["small-40", "small-200", "744b-8K", "744b-128K"],
)
def test_sparse_numerator_below_analytic_for_long_sequences(cfg, t):
  u, a = useful_flops(cfg, 1, t, "sparse"), analytic_flops(cfg, 1, t, "sparse")
  assert u["total"] < a["total"]
  assert u["attention_sparse"] < a["attention_sparse"]
  assert u["indexer_selection"] + u["indexer_scores"] < a["indexer_scores"]


def test_unknown_stage_is_refused():
  with pytest.raises(ValueError, match="dsa_stage='pretrain'"):
    useful_flops(small_config(), B, 8, "pretrain")


def _stage(config, stage=None):
  if stage:
    config.train.dsa_stage = stage
  return config


GLM5_STEPS = {
  "4K dense": _stage(glm5_744b.get_config(), "dense"),
  "4K sparse": _stage(glm5_744b.get_config(), "sparse"),
  "128K sparse": glm5_744b_128k.get_config(),
  "200K sparse": glm5_744b_200k.get_config(),
  "128K warmup": glm5_744b_128k.get_config("warmup"),
  "200K warmup": glm5_744b_200k.get_config("warmup"),
}


def test_glm5_744b_ratios():
  """On analytic's numerator, the indexer's scores are 44% of the 128K sparse step's count and 55% of the 200K
  one's. The useful / analytic ratios are printed (pytest -s), not asserted: they are the record."""
  print(
    f"\n{'step':12s} {'batch':>5s} {'seq':>7s} {'analytic':>10s} {'useful':>10s} {'ratio':>6s} "
    f"{'index scores / analytic':>23s} {'indexer / useful':>16s}"
  )
  shares = {}
  for name, config in GLM5_STEPS.items():
    stage, b, t = config.train.dsa_stage, config.data.batch_size, config.data.seq_len
    cfg = model_config_for_stage(config)
    a, u = analytic_flops(cfg, b, t, stage), useful_flops(cfg, b, t, stage)
    shares[name] = a.get("indexer_scores", 0.0) / a["total"]
    indexer = sum(v for k, v in u.items() if k.startswith("indexer")) / u["total"]
    print(
      f"{name:12s} {b:5d} {t:7d} {a['total']:10.4g} {u['total']:10.4g} {u['total'] / a['total']:6.3f} "
      f"{shares[name]:23.3f} {indexer:16.3f}"
    )
    assert u["total"] < a["total"]
  assert shares["128K sparse"] == pytest.approx(0.44, abs=0.01)
  assert shares["200K sparse"] == pytest.approx(0.55, abs=0.01)
