r"""Prints text sampled from a training run's latest checkpoint.

  python launch/sample.py --config=configs/glm5_tiny.py --workdir=workdirs/glm5_tiny \
      --prompt="In the beginning" --max_new_tokens=64 --temperature=0.8

--config must be the run's config (with the same overrides), so the model matches; the text is encoded and
decoded with the tokenizer recorded in the checkpoint (the one the model was trained with). --packed samples from
a quantized model written by launch/quantize.py instead of the run's checkpoint. Decoding
uses the KV-cache sampler (glm_jax/inference/sampler.py): one prefill, then one compiled decode step a token;
--speculate=k drafts k tokens a round with the model's MTP layer and verifies them in one forward
(glm_jax/inference/speculative.py: the same text greedy, the same distribution sampling), and prints the acceptance
length.

--infill (a model trained with GLM's blank infilling, configs/glm130b_tiny.py): the literal [MASK], [sMASK] and
[gMASK] in --prompt are blanks, filled left to right, each generated until <eop> (glm_jax/inference/infill.py);
a prompt without one gets [gMASK] appended, which continues the text:

  python launch/sample.py --config=configs/glm130b_tiny.py --workdir=runs/glm130b --infill \
      --prompt="In the beginning God created the [MASK] and the earth."
"""

import re


import dataclasses

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from glm_jax import cli
from glm_jax.data import Tokenizer
from glm_jax.inference import Sampler, SamplingParams, acceptance_length, speculative
from glm_jax.inference.infill import fill_blanks
from glm_jax.train.config import check_seed, check_values, invalid, model_config_for_stage
from glm_jax.train.packed_checkpoint import load_packed
from glm_jax.train.trainer import restore_run

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: workdirs/<config name>).")
_PROMPT = flags.DEFINE_string("prompt", "In the beginning", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer(
  "max_new_tokens", 64, "Tokens to generate (the prompt and these fit model.max_position_embeddings)."
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens with this much probability.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed, in [0, 2**32).")
_SPECULATE = flags.DEFINE_integer("speculate", None, "MTP speculative decoding: tokens drafted a round (>= 1).")
_PACKED = flags.DEFINE_string("packed", None, "A packed (quantized) model's directory (launch/quantize.py).")
_INFILL = flags.DEFINE_bool(
  "infill",
  False,
  "Fill the prompt's [MASK] / [sMASK] / [gMASK] blanks (GLM's blank infilling); without one, [gMASK] is appended.",
)
_BLANKS = {"[MASK]": "mask", "[sMASK]": "smask", "[gMASK]": "gmask"}


def encode_with_blanks(tokenizer: Tokenizer, text: str) -> list[int]:
  """The prompt's tokens with each literal [MASK] / [sMASK] / [gMASK] as its special token ([gMASK] appended when
  there is none: continue the text)."""
  ids = []
  for piece in re.split(r"(\[MASK\]|\[sMASK\]|\[gMASK\])", text):
    ids += [tokenizer.special_ids[_BLANKS[piece]]] if piece in _BLANKS else tokenizer.encode(piece)
  if not any(p in text for p in _BLANKS):
    ids.append(tokenizer.gmask_id)
  return ids


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  # The flags, the config's values and the workdir are checked, in that order, before anything is read, built or
  # created.
  try:
    sampling = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value)
  except ValueError as e:
    raise ValueError(f"--{e}") from e
  check_seed("--seed", _SEED.value)
  config = _CONFIG.value
  check_values(config)  # no NaN or infinity in any field, every seed in range (as the trainers check)
  if _SPECULATE.value:
    if _INFILL.value:
      raise ValueError("--speculate with --infill: blank infilling decodes without speculation; drop one of them")
    try:
      speculative.check(model_config_for_stage(config), _SPECULATE.value)
    except ValueError as e:
      raise ValueError(f"--{e}") from e
  positions = config.model.max_position_embeddings - 1 - (_SPECULATE.value or 0)  # a prompt has at least one token
  if _MAX_NEW.value > positions:
    drafts = f" - --speculate={_SPECULATE.value}" if _SPECULATE.value else ""
    invalid(
      "--max_new_tokens",
      _MAX_NEW.value,
      f"must be in [1, {positions}]: model.max_position_embeddings={config.model.max_position_embeddings} - 1 "
      f"(the prompt's first token){drafts}",
    )
  workdir = _WORKDIR.value or f"workdirs/{config.get('name', 'run')}"
  if _PACKED.value:
    packed = load_packed(_PACKED.value, model_config_for_stage(config), need_tokenizer=True)
    tokenizer = Tokenizer.from_record(packed.tokenizer)
    graphdef, model_cfg, params, rest = packed.graphdef, packed.model_cfg, packed.params, packed.rest
    tag = f"step {packed.meta['source']['step']}, {packed.meta['quant']['scheme']}"
  else:
    run = restore_run(config, workdir)
    tokenizer, tag = run.tokenizer, f"step {run.step}"
    graphdef, model_cfg, params, rest = run.graphdef, run.model_cfg, run.state.params, run.state.rest
  if _INFILL.value:
    if not model_cfg.rope_2d:
      logging.warning("--infill with a model without model.rope_2d: it was not trained with GLM's blank infilling")
    context = encode_with_blanks(tokenizer, _PROMPT.value)
    sampling = dataclasses.replace(sampling, stop_ids=(tokenizer.eop_id, tokenizer.eos_id), pad_id=tokenizer.pad_id)
    filled, spans = fill_blanks(
      Sampler(graphdef, model_cfg, sampling), params, rest, context, tokenizer.special_ids, jax.random.key(_SEED.value)
    )
    print(f"[{tag}] " + tokenizer.decode(filled))
    for i, span in enumerate(spans):
      print(f"  blank {i + 1}: {tokenizer.decode(span)!r}")
    return
  prompt = tokenizer.encode(_PROMPT.value) or [tokenizer.eos_id]
  sampling = dataclasses.replace(sampling, stop_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  out = Sampler(graphdef, model_cfg, sampling, speculate=_SPECULATE.value)(
    params, rest, [prompt], jax.random.key(_SEED.value)
  )
  print(f"[{tag}] " + tokenizer.decode(np.asarray(out.tokens[0, : int(out.lengths[0])]).tolist()))
  if _SPECULATE.value:
    print(f"acceptance length {acceptance_length(out):.2f} tokens a round (k={_SPECULATE.value})")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
