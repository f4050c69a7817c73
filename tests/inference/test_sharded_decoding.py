"""The KV-cache sampler under a mesh (Sampler(..., mesh=...)) against the same sampler on one device.

On 8 simulated CPU devices, greedy decoding of ragged prompts with DSA selecting (index_topk 6 < the 8-token prompt)
gives the one-device tokens, and logits within fp32 rounding of each row's scale, on a data x tensor x expert mesh
(heads over tensor, experts by all-to-all), on an fsdp x expert mesh with the DSA kernels (interpret mode) and
IndexShare, and with MTP speculative decoding on the first mesh. The multi-device tests run in
tests/test_multi_device.py's 8-device session; the bad-input tests run anywhere.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import glm_jax.configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.mesh_axes import MESH_AXES
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.sharding.mesh import make_mesh
from tests import helpers

multi_device = helpers.multi_device(8)  # runs in tests/test_multi_device.py's session
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [12], [7, 7, 7], [1, 2, 3, 4, 5, 6], [9, 8], [4]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def tiny(**changes) -> ModelConfig:
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict())
  return cfg.replace(initializer_range=0.2, index_topk=6, **changes)  # far from uniform logits: no argmax near-ties


@pytest.fixture(scope="module")
def one_device_decoding():
  """{model changes: (graphdef, params, rest, cfg, the one-device greedy SampleOutput)}, filled as the cases ask: the
  plain and the speculative case on the first mesh share one model and one compile of its one-device decoding."""
  return {}


@multi_device
@pytest.mark.parametrize(
  "mesh_cfg, changes, speculate",
  [
    ({"data": 2, "tensor": 2, "expert": 2}, {}, None),
    ({"fsdp": 2, "expert": 4}, {"attention_impl": "pallas", "indexer_types": "FSF"}, None),
    ({"data": 2, "tensor": 2, "expert": 2}, {}, 2),
  ],
  ids=["data2-tensor2-expert2", "fsdp2-expert4-pallas-indexshare", "data2-tensor2-expert2-speculative"],
)
def test_sharded_greedy_decoding_equals_one_device(one_device_decoding, mesh_cfg, changes, speculate):
  """speculate: MTP speculative decoding (k = 2) on the mesh against plain decoding on one device, the MTP cache
  laid out with the main one."""
  key = tuple(sorted(changes.items()))
  if key not in one_device_decoding:
    cfg = tiny(**changes)
    graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
    one = Sampler(graphdef, cfg, GREEDY, return_logits=True)(params, rest, PROMPTS, jax.random.key(0))
    one_device_decoding[key] = graphdef, params, rest, cfg, one
  graphdef, params, rest, cfg, one = one_device_decoding[key]
  mesh = make_mesh(mesh_cfg)
  out = Sampler(graphdef, cfg, GREEDY, return_logits=True, mesh=mesh, speculate=speculate)(
    params, rest, PROMPTS, jax.random.key(0)
  )
  assert len(out.tokens.sharding.device_set) == 8  # the generation ran on the mesh
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), [len(p) + 6 for p in PROMPTS])
  mask = np.asarray(one.response_mask)
  got, want = np.asarray(out.logits)[mask], np.asarray(one.logits)[mask]
  eps = np.finfo(np.float32).eps
  scale_R = np.abs(want).max(-1)  # each row's largest |logit|: the size of the sums behind every logit of the row
  tol = logit_ulps(cfg)
  ulps = np.abs(got - want) / (eps * scale_R)[:, None]
  assert ulps.max() <= tol, f"a logit {ulps.max():.1f} fp32 ulps of its row's largest off the one-device one"
  # The token's log-probability: 2 tol (1 - p) ulps of the row's scale and sqrt(V) ulps of 1 (logit_ulps).
  logp_one = np.asarray(one.logp)[mask]
  logp_err = np.abs(np.asarray(out.logp)[mask] - logp_one)
  logp_bound = eps * (2 * tol * (1 - np.exp(logp_one)) * scale_R + np.sqrt(cfg.vocab_size))
  assert np.all(logp_err <= logp_bound), f"a token's logp {(logp_err / logp_bound).max():.2f} of its bound off"


def logit_ulps(cfg: ModelConfig) -> float:
  """How far, in fp32 ulps of the row's largest |logit|, a sharded decode's logits may sit from the one-device ones
  (66 for tiny()), and what that allows a token's log-probability.

  The mesh runs the same computation with its fp32 sums in another order (a contraction over the model dimension
  split over fsdp and psummed, the heads' over tensor, the experts' rows exchanged and added back), nothing else;
  the tokens are equal, so the logits differ by rounding only. A sum of n terms rounds n - 1 times, each time by at
  most half an ulp of the running sum (at most the sum's scale s), and the roundings have independent signs: one
  order's error is a random walk of standard deviation sqrt((n - 1) / 3) / 2 ulps of s, two orders differ by
  sqrt(2 (n - 1) / 3) / 2 (3.2 ulps at n = 64), and sqrt(n) ulps of s is 2.5 of those standard deviations.
  Along the path to a logit the mesh reorders, in each of the L layers, the attention sublayer's contractions
  (at most max(D, H x v_head_dim) = 64 terms: the projections out of the model dimension, o_proj over the heads) and
  the MLP's (at most intermediate_size = 128 terms: the dense down projection; the MoE's 2 routed + 1 shared
  experts of moe_intermediate_size = 32 add 96), each adding its rounding to the residual stream, which the RMSNorms
  keep relative to its scale and the layers pass on at gain about 1; then the head contracts D = 64 terms. Budget:
  L (sqrt(64) + sqrt(128)) + sqrt(64) = 3 x 19.3 + 8 = 66 ulps of the row's scale. (Measured: 14 ulps on one CPU, 24
  on another; a sharding bug - a missing psum, an expert row sent to the wrong device, a cache row out of place -
  moves a logit by a fraction of the row's scale, 1e5 ulps and more.)
  A token's log-probability, l_t - logsumexp(l), moves by d l_t - sum_v p_v d l_v = sum_{v != t} p_v (d l_t - d l_v):
  at most 2 budgets times 1 - p_t (p_t its probability), plus the rounding of logsumexp's own V-term sum of
  exp(l - max) >= 1, sqrt(V) ulps of it, which the log turns into sqrt(V) ulps of 1 (absolute). (Measured: 5% of
  that bound; the logits' errors are correlated, which the bound does not count on.)"""
  attention = max(cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim)
  mlp = max(cfg.intermediate_size, (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size)
  return float(cfg.num_hidden_layers * (np.sqrt(attention) + np.sqrt(mlp)) + np.sqrt(cfg.hidden_size))


def abstract_mesh(**sizes) -> AbstractMesh:
  return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


def test_a_batch_or_head_count_the_mesh_does_not_divide_is_named():
  cfg = tiny()
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
  with pytest.raises(ValueError, match=r"mesh.tensor=8 does not divide model.num_attention_heads=4"):
    Sampler(graphdef, cfg, GREEDY, mesh=abstract_mesh(tensor=8))
  sampler = Sampler(graphdef, cfg, GREEDY, mesh=abstract_mesh(data=2, expert=2, tensor=2))
  with pytest.raises(
    ValueError,
    match=r"a batch of 3 rows; the mesh's batch axes \{'data': 2, 'expert': 2\} split the "
    r"rows 4 ways: give a multiple of 4 rows",
  ):
    sampler(params, rest, PROMPTS[:3], jax.random.key(0))
