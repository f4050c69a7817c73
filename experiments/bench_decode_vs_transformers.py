r"""Greedy decoding, ours against transformers' generate, side by side in one process on the CPU.

  bash scripts/with_env.sh python experiments/bench_decode_vs_transformers.py [--batch=1,8] [--prompt_len=64] \
      [--new_tokens=64]

The MoE model of experiments/bench_vs_transformers.py (hidden 256, 4 layers = 1 dense + 3 MoE with 16 experts
top-4, MLA with q_lora 128 / kv_lora 64, vocab 8192; fp32; no MTP layer), built once by transformers
(GlmMoeDsaForCausalLM, weights drawn at initializer_range 0.1 so the logits are unit-scale and argmax ties rare),
saved and read back with glm_jax.convert.hf.load, so that both decode with the same weights. index_topk is
prompt_len + new_tokens: DSA keeps every key in both (transformers runs its indexer in every layer). Each of
--batch's sizes (rows of --prompt_len random tokens) is decoded for exactly --new_tokens tokens by
  jax:    glm_jax.inference.Sampler, greedy (temperature 0, no stop token), one jit-compiled call (the prefill and
          the decode loop; compiled in the warm-up call, which is not timed);
  torch:  transformers' model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N), eager CPU torch
          with as many threads as the machine has cores (jax's CPU client uses them all too).
Each is timed end to end (prefill included) as the median of --repeats calls after one untimed call of each, the
two taking their calls in turn (bench_vs_transformers.interleaved_medians) so that a change in the machine's speed
falls on both alike. One JSON line a batch size: generated tokens/s of each (batch x new_tokens over the call's
seconds), jax / torch, and `same_tokens`: whether both decoded the same tokens (they share the weights; fp32
rounding can still flip a near-tie argmax, after which the sequences differ). Needs the test requirements (torch,
transformers), which `scripts/with_env.sh` installs.
"""

import os
import sys
import tempfile

import jax
import numpy as np
import torch
from absl import app, flags
from flax import nnx
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.bench_vs_transformers import interleaved_medians, model_config, timed  # noqa: E402
from glm_jax import strict_json  # noqa: E402
from glm_jax.convert import hf  # noqa: E402
from glm_jax.inference import Sampler, SamplingParams  # noqa: E402

_BATCH = flags.DEFINE_list("batch", ["1"], "Rows decoded together; one JSON line each (e.g. 1,8).")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens a row.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Generated tokens a row.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls of each, after one untimed call.")


def shared_models(seq_len: int):
  """transformers' model (eval, eager attention) and ours, (cfg, graphdef, params, rest), with the same weights."""
  cfg = model_config("moe", seq_len).replace(initializer_range=0.1)
  torch.manual_seed(0)
  hf_config = GlmMoeDsaConfig(**cfg.to_hf_dict())
  hf_config._attn_implementation = "eager"  # pylint: disable=protected-access
  theirs = GlmMoeDsaForCausalLM(hf_config).eval()
  with tempfile.TemporaryDirectory() as path:
    theirs.save_pretrained(path)
    cfg, ours = hf.load(path)
  return theirs, (cfg, *nnx.split(ours, nnx.Param, ...))


def main(argv):
  del argv
  torch.set_num_threads(os.cpu_count())
  p, n = _PROMPT.value, _NEW.value
  theirs, (cfg, graphdef, params, rest) = shared_models(p + n)
  sampler = Sampler(graphdef, cfg, SamplingParams(max_new_tokens=n, temperature=0.0))
  for b in map(int, _BATCH.value):
    prompts = np.random.default_rng(b).integers(1, cfg.vocab_size, (b, p))
    got = {}

    def ours():
      got["jax"] = np.asarray(sampler(params, rest, prompts.tolist(), jax.random.key(0)).tokens)[:, p : p + n]

    def reference():
      ids = torch.as_tensor(prompts)
      with torch.inference_mode():
        out = theirs.generate(
          ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
      got["torch"] = out[:, p:].numpy()

    jax_s, torch_s = interleaved_medians([timed(ours), timed(reference)], 1, _REPEATS.value)
    print(
      strict_json.dumps(
        {
          "model": f"{cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE, hidden {cfg.hidden_size}, "
          f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, fp32",
          "batch": b,
          "prompt_len": p,
          "new_tokens": n,
          "jax_s": round(jax_s, 4),
          "torch_s": round(torch_s, 4),
          "jax_tokens_per_s": round(b * n / jax_s, 1),
          "torch_tokens_per_s": round(b * n / torch_s, 1),
          "jax_over_torch": round(torch_s / jax_s, 3),
          "same_tokens": bool(np.array_equal(got["jax"], got["torch"])),
          "torch_experts_implementation": theirs.config._experts_implementation,  # pylint: disable=protected-access
          "cpu_count": os.cpu_count(),
          "load_avg_1min": round(os.getloadavg()[0], 2),
        }
      ),
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)
