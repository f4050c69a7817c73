r"""MTP speculative decoding against plain decoding, on a trained model: acceptance length and tokens a second.

  bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py        # the README's main job
  bash scripts/with_env.sh python experiments/bench_speculative.py --config=configs/glm5_tiny.py

Restores the run's latest checkpoint (launch/sample.py's restore_run), takes --batch prompts of --prompt_len tokens
from the run's held-out documents, and generates --new_tokens a row (no stop token) with plain decoding and with
speculative decoding for each k in --ks, greedy and at --temperature. Each generation is compiled once and timed over
--repeats runs (the best is kept). Prints one line a (mode, k): the acceptance length (tokens a verification round,
1 to k + 1), generated tokens a second and the speedup over plain decoding, and, greedy, whether the tokens equal
plain decoding's; then one JSON line with every figure. The MTP layer is the run's own, trained with the MTP loss
(train.mtp_loss_weight).
"""

import json
import time

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli
from glm_jax.data import pipeline
from glm_jax.inference import Sampler, SamplingParams, acceptance_length
from glm_jax.train.trainer import restore_run

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: workdirs/<config name>).")
_KS = flags.DEFINE_list("ks", ["1", "2", "4"], "Drafted tokens a round to measure.")
_BATCH = flags.DEFINE_integer("batch", 8, "Prompts decoded together.")
_PROMPT = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens (the start of held-out documents).")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Generated tokens a row.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "The sampling mode's temperature (greedy is also measured).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs after the compiling one (the best is reported).")


def held_out_prompts(config, tokenizer, n: int, length: int) -> list[list[int]]:
  """The first `length` tokens of n held-out documents (the run's eval split; a packed row's first document, when
  it is that long)."""
  rows = []
  for batch in pipeline.make_eval_batches(config.data, tokenizer):
    for ids, seg in zip(np.asarray(batch["input_ids"]), np.asarray(batch["segment_ids"])):
      first = ids[(seg == seg[0]) & (seg > 0)]
      if len(first) >= length:
        rows.append(first[:length].tolist())
      if len(rows) == n:
        return rows
  raise ValueError(
    f"--batch={n} --prompt_len={length}: the eval split has only {len(rows)} documents of "
    f"{length} tokens or more (data.eval_batches={config.data.eval_batches})"
  )


def timed(run, repeats: int):
  out = jax.block_until_ready(run())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    best = min(best, time.perf_counter() - t0)
  return out, best


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  ks = [int(k) for k in _KS.value]
  config = _CONFIG.value
  run = restore_run(config, _WORKDIR.value or f"workdirs/{config.get('name', 'run')}")
  prompts = held_out_prompts(config, run.tokenizer, _BATCH.value, _PROMPT.value)
  args = (run.state.params, run.state.rest, prompts)
  made = _BATCH.value * _NEW.value
  print(
    f"device {jax.devices()[0].device_kind}; step {run.step}; batch {_BATCH.value}, prompt {_PROMPT.value}, "
    f"new {_NEW.value}"
  )
  report = {"step": run.step, "batch": _BATCH.value, "prompt_len": _PROMPT.value, "new_tokens": _NEW.value}
  for mode, temperature in (("greedy", 0.0), (f"T={_TEMPERATURE.value:g}", _TEMPERATURE.value)):
    sampling = SamplingParams(max_new_tokens=_NEW.value, temperature=temperature)
    sampler = Sampler(run.graphdef, run.model_cfg, sampling)
    plain, base = timed(lambda: sampler(*args, jax.random.key(0)), _REPEATS.value)
    print(f"{mode:>8} plain     : {made / base:9.1f} tokens/s")
    report[mode] = {"plain_tokens_per_s": made / base}
    for k in ks:
      sampler = Sampler(run.graphdef, run.model_cfg, sampling, speculate=k)
      out, best = timed(lambda: sampler(*args, jax.random.key(0)), _REPEATS.value)
      same = "" if temperature else f"; same tokens as plain: {np.array_equal(out.tokens, plain.tokens)}"
      length = acceptance_length(out)
      print(
        f"{mode:>8} k={k}       : {made / best:9.1f} tokens/s ({base / best:.2f}x), acceptance length "
        f"{length:.2f} of {k + 1}{same}"
      )
      report[mode][f"k{k}"] = {"acceptance_length": length, "tokens_per_s": made / best, "speedup": base / best}
  print(json.dumps(report))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
