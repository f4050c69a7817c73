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

import configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.mesh_axes import MESH_AXES
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.sharding.mesh import make_mesh
from tests import helpers

multi_device = helpers.multi_device(8)  # runs in tests/test_multi_device.py's session
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [12], [7, 7, 7], [1, 2, 3, 4, 5, 6], [9, 8], [4]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def tiny(**changes) -> ModelConfig:
  cfg = ModelConfig.from_dict(configs.glm5_tiny.get_config().model.to_dict())
  return cfg.replace(initializer_range=0.2, index_topk=6, **changes)  # far from uniform logits: no argmax near-ties


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
def test_sharded_greedy_decoding_equals_one_device(mesh_cfg, changes, speculate):
  """speculate: MTP speculative decoding (k = 2) on the mesh against plain decoding on one device, the MTP cache
  laid out with the main one."""
  cfg = tiny(**changes)
  graphdef, params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)
  one = Sampler(graphdef, cfg, GREEDY, return_logits=True)(params, rest, PROMPTS, jax.random.key(0))
  mesh = make_mesh(mesh_cfg)
  out = Sampler(graphdef, cfg, GREEDY, return_logits=True, mesh=mesh, speculate=speculate)(
    params, rest, PROMPTS, jax.random.key(0)
  )
  assert len(out.tokens.sharding.device_set) == 8  # the generation ran on the mesh
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), [len(p) + 6 for p in PROMPTS])
  mask = np.asarray(one.response_mask)
  # The mesh sums in another order (psums over the tensor / fsdp axes, the exchanged expert rows), so a logit's
  # fp32 error is set by the size of its row, not by its own value (a logit near 0 is a sum of large terms): each
  # logit within 64 fp32 ulps of its row's largest |logit| (measured: 14 on one CPU, 24 on another).
  # The token's log-probability (its logit less the row's logsumexp) is held to the same bound.
  got, want = np.asarray(out.logits)[mask], np.asarray(one.logits)[mask]
  ulp_BT = np.abs(want).max(-1) * np.finfo(np.float32).eps
  ulps = np.abs(got - want) / ulp_BT[:, None]
  assert ulps.max() <= 64, f"a logit {ulps.max():.1f} fp32 ulps of its row's largest off the one-device one"
  logp_ulps = np.abs(np.asarray(out.logp)[mask] - np.asarray(one.logp)[mask]) / ulp_BT
  assert logp_ulps.max() <= 64, f"a token's logp {logp_ulps.max():.1f} ulps off the one-device one"


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
