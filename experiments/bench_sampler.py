r"""Decoding speed: the KV-cache sampler against re-running the full forward for every new token.

  bash scripts/with_env.sh python experiments/bench_sampler.py                             # glm5_tiny shapes, CPU-sized
  bash scripts/with_env.sh python experiments/bench_sampler.py --hidden_size=1024 --layers=8 --batch=32 \
      --prompt_len=512 \
      --new_tokens=256 --index_topk=256                                 # a GPU / TPU-sized model

Prints the compile time and the steady-state generated tokens per second of each (both jit-compiled once,
greedy, no stop token so every row generates new_tokens), and checks that both produce the same tokens.
The no-cache baseline is what launch/sample.py did before the cache: the whole [B, prompt + new] buffer
through the model each step.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from glm_jax.configs import glm5_tiny
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model.kv_cache import cache_bytes_per_token

_HIDDEN = flags.DEFINE_integer("hidden_size", 64, "Model width (heads scale with it: hidden / 16).")
_LAYERS = flags.DEFINE_integer("layers", 3, "Decoder layers (the first dense, the rest MoE).")
_BATCH = flags.DEFINE_integer("batch", 8, "Prompts decoded together.")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Generated tokens a row.")
_TOPK = flags.DEFINE_integer("index_topk", 32, "DSA keys a query (below prompt + new: DSA selects).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs after the compiling one (the best is reported).")


def model_config() -> ModelConfig:
  m = glm5_tiny.get_config().model.to_dict()
  h = _HIDDEN.value
  m.update(
    hidden_size=h,
    intermediate_size=2 * h,
    moe_intermediate_size=h // 2,
    num_hidden_layers=_LAYERS.value,
    num_attention_heads=max(h // 16, 1),
    num_key_value_heads=max(h // 16, 1),
    q_lora_rank=h // 2,
    kv_lora_rank=h // 2,
    index_topk=_TOPK.value,
    dtype=_DTYPE.value,
    initializer_range=0.2,
    max_position_embeddings=max(4096, _PROMPT.value + _NEW.value),
    vocab_size=max(512, h * 4),
  )
  return ModelConfig.from_dict(m)


def timed(fn, repeats):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return out, first - best, best


def main(argv):
  del argv
  cfg = model_config()
  model = GlmMoeDsa(cfg, nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  b, p, n = _BATCH.value, _PROMPT.value, _NEW.value
  prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (b, p)).tolist()
  sampler = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=n, temperature=0.0))
  cached, compile_c, best_c = timed(lambda: sampler(params, rest, prompts, jax.random.key(0)).tokens, _REPEATS.value)

  @jax.jit
  def no_cache(params, rest, buffer):
    m = nnx.merge(graphdef, params, rest)

    def body(t, buf):
      logits = m(buf, compute_mtp=False).logits[:, t - 1]
      return buf.at[:, t].set(jnp.argmax(logits, -1).astype(jnp.int32))

    return jax.lax.fori_loop(p, p + n, body, buffer)

  buffer = jnp.zeros((b, p + n), jnp.int32).at[:, :p].set(jnp.asarray(prompts, jnp.int32))
  plain, compile_n, best_n = timed(lambda: no_cache(params, rest, buffer), _REPEATS.value)
  same = bool(np.array_equal(np.asarray(cached)[:, : p + n], np.asarray(plain)))
  print(
    f"device {jax.devices()[0].device_kind}; model {cfg.num_hidden_layers} layers x {cfg.hidden_size}, "
    f"{cfg.dtype}; batch {b}, prompt {p}, new {n}, index_topk {cfg.index_topk}; "
    f"cache {cache_bytes_per_token(cfg)} bytes a token"
  )
  print(f"kv cache : {b * n / best_c:10.1f} tokens/s  ({best_c * 1e3:.1f} ms a run, compile {compile_c:.1f} s)")
  print(f"no cache : {b * n / best_n:10.1f} tokens/s  ({best_n * 1e3:.1f} ms a run, compile {compile_n:.1f} s)")
  print(f"speedup {best_n / best_c:.2f}x; same greedy tokens: {same}")


if __name__ == "__main__":
  app.run(main)
