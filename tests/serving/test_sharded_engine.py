"""The serving engine under a mesh (Engine(..., mesh=...)) against the Sampler on one device, on 8 simulated CPU
devices (tests/test_multi_device.py's session): a data x tensor x expert mesh splits the rows and the pages 4 ways
(each shard its own pool), the heads over tensor, the experts by all-to-all; DSA selects (index_topk 8)."""

import jax
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.serving import Engine, EngineConfig
from glm_jax.sharding.mesh import make_mesh
from tests import helpers

multi_device = helpers.multi_device(8)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
  cfg = ModelConfig.from_dict(glm_jax.configs.glm5_tiny.get_config().model.to_dict()).replace(
    initializer_range=0.2, index_topk=8
  )
  return cfg, *nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)


@multi_device
def test_sharded_engine_equals_the_sampler_alone(tiny):
  """10 requests (more than the 8 rows) with a shared 17-token prefix on half of them: every response is the
  one-device Sampler's for its prompt; a shard's prefix cache serves the copies admitted to it."""
  cfg, graphdef, params, rest = tiny
  rng = np.random.default_rng(0)
  prefix = rng.integers(1, 512, size=17).tolist()
  prompts = [rng.integers(1, 512, size=int(n)).tolist() for n in rng.integers(3, 30, size=5)]
  prompts += [prefix + [int(t)] for t in rng.integers(1, 512, size=5)]
  mesh = make_mesh({"data": 2, "tensor": 2, "expert": 2})
  config = EngineConfig(num_pages=64, page_size=8, max_running=8, prefill_rows=4, prefill_chunk=16, max_seq_len=48)
  eng = Engine(graphdef, params, rest, cfg, config, mesh=mesh)
  assert eng.shards == 4 and len(eng.pools) == 4
  ids = {eng.add(p, GREEDY): i for i, p in enumerate(prompts)}
  out = {}
  while eng.has_work():
    for ev in eng.step():
      out.setdefault(ids[ev.rid], []).append(ev.token)
  sampler = Sampler(graphdef, cfg, GREEDY, width=32, cache_len=48)
  for i, p in enumerate(prompts):
    want = sampler(params, rest, [p], jax.random.key(0))
    assert out[i] == np.asarray(want.tokens[0, len(p) : len(p) + 8]).tolist(), i
  assert eng.stats["prefix_cached_tokens"] > 0 and eng.used_pages == 0


@multi_device
def test_sizes_the_mesh_does_not_divide_are_refused_by_name(tiny):
  cfg, graphdef, params, rest = tiny
  mesh = make_mesh({"data": 2, "tensor": 2, "expert": 2})
  with pytest.raises(ValueError, match=r"engine.max_running=6: .* split rows and pages 4 ways"):
    Engine(graphdef, params, rest, cfg, EngineConfig(max_running=6, prefill_rows=4), mesh=mesh)
