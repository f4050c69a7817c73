r"""Prints text sampled from any run's latest checkpoint, or from a packed model.

  bash scripts/with_env.sh python launch/sample.py --workdir=workdirs/glm5_tiny --prompt="In the beginning" \
      --max_new_tokens=64
  bash scripts/with_env.sh python launch/sample.py --workdir=workdirs/grpo_tiny --prompt="3+4=" --max_new_tokens=3 \
      --temperature=0
  bash scripts/with_env.sh python launch/sample.py --workdir=workdirs/sft_tiny --prompts_file=prompts.jsonl \
      --num_samples=4
  bash scripts/with_env.sh python launch/sample.py --workdir=workdirs/glm5_tiny --chat --prompt="Who made the light?"
  bash scripts/with_env.sh python launch/sample.py --packed=workdirs/glm5_tiny_w4a8 --prompt="In the beginning"

--workdir is any run's directory: pretraining or SFT (launch/train.py), GRPO or distillation (config.trainer
"grpo" / "distill"; a distillation's teachers are <workdir>/teachers/<name>, an RL run's warm start <workdir>/init),
or a converted checkpoint (launch/convert.py's --out_dir). The model, the config and the tokenizer come from the
checkpoint (glm_jax/restore.py): the config recorded with its latest step, the tokenizer the model was trained with.
--config (optional) gives the config instead; its model must be the run's (a checkpoint of another model is refused
by name), and without --workdir the run is workdirs/<config.name>. --config.x.y=v overrides without --config apply to
the recorded config (e.g. --config.model.attention_impl=pallas; a change of the model's shapes is refused).
A run trained with QAT (a quant section of a weight-only scheme: configs/sft_tiny.py) is sampled from its weights
packed by that section, the model as it was trained and evaluated (--config.quant.scheme=none: the unquantized
weights). --packed samples from a quantized model written by launch/quantize.py, with the config and tokenizer it
recorded.

Prompts: --prompt, or --prompts_file, a JSON-lines file with one object a line whose "prompt" is a string (other
keys are ignored, so an SFT jsonl of {"prompt", "response"} lines is a prompts file; blank lines are skipped). Each
prompt is sampled --num_samples times; the rows (prompt-major) go through the KV-cache sampler
(glm_jax/inference/sampler.py: one prefill, then one compiled decode step a token) --batch_size rows at a time, every
batch padded to the longest prompt and the last one filled up with copies of its last row, so the generation compiles
once (glm_jax/inference/batches.py). Batch 0 draws with key(--seed), batch b > 0 with fold_in(key(--seed), b).
--chat wraps each prompt as a user turn of GLM-5's chat format (glm_jax/chat.py, then the generation prompt), stops
at the format's stop tokens and prints the reply alone; the run's tokenizer must have the format's tokens (the BPE
trained here has them, the RL tasks' character vocabulary has not).

Output: one prompt and one sample print "[step N] <text>" (the prompt and its continuation; with --chat the reply);
more print "[step N] prompt i, sample j: <text>" (i, j from 1), on stdout. An id the tokenizer does not have (the RL
tasks' 18 characters in a 32-id model) shows as <id N>. Then, on stderr, the tokens generated a second: the response
tokens of every sample (stop tokens included) over the generation's wall time (prefill and decode of every batch),
the compile excluded and shown apart.

--speculate=k drafts k tokens a round with the model's MTP layer and verifies them in one forward
(glm_jax/inference/speculative.py: the same text greedy, the same distribution sampling), and prints the acceptance
length on stderr.

--infill (a model trained with GLM's blank infilling, configs/glm130b_tiny.py): the literal [MASK], [sMASK] and
[gMASK] in --prompt are blanks, filled left to right, each generated until <eop> (glm_jax/inference/infill.py);
a prompt without one gets [gMASK] appended, which continues the text:

  bash scripts/with_env.sh python launch/sample.py --workdir=runs/glm130b --infill \
      --prompt="In the beginning God created the [MASK] and the earth."
"""

import dataclasses
import json
import os
import re
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from glm_jax import chat, cli, restore
from glm_jax.data import Tokenizer
from glm_jax.inference import Sampler, SamplingParams, speculative
from glm_jax.inference.batches import sample_batches
from glm_jax.inference.infill import fill_blanks
from glm_jax.train.config import check_seed, check_values, invalid

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "The run's configs/*.py file (default: the config the checkpoint recorded).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "The run's directory (any run, or a converted checkpoint; with --config: workdirs/<config.name>)."
)
_PROMPT = flags.DEFINE_string("prompt", "In the beginning", "Text to continue (or, with --chat, the user's message).")
_PROMPTS_FILE = flags.DEFINE_string(
  "prompts_file", None, 'A JSON-lines file of prompts, one {"prompt": "..."} a line (instead of --prompt).'
)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples drawn for each prompt (>= 1).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Rows (prompts x samples) generated together (>= 1).")
_CHAT = flags.DEFINE_bool("chat", False, "Each prompt is a user turn of GLM-5's chat format; prints the reply.")
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


def read_prompts(path: str) -> list[str]:
  """The prompts of a JSON-lines file: each non-blank line an object whose "prompt" is a string."""
  field = f"--prompts_file={path}"
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{field}: no such file; give a JSON-lines file, one {{\"prompt\": \"...\"}} a line")
  prompts = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        item = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{field}: line {n} is not JSON ({e.msg}); each line is one {{\"prompt\": \"...\"}}") from e
      if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        raise ValueError(
          f'{field}: line {n} is not an object with a string "prompt"; each line is one {{"prompt": "..."}}'
        )
      prompts.append(item["prompt"])
  if not prompts:
    raise ValueError(f'{field}: the file holds no prompt; give one {{"prompt": "..."}} a line')
  return prompts


def checked_flags() -> tuple[SamplingParams, list[str]]:
  """The sampling flags and the prompts' texts, checked before anything of the run is read."""
  try:
    sampling = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value)
  except ValueError as e:
    raise ValueError(f"--{e}") from e
  check_seed("--seed", _SEED.value)
  if _NUM_SAMPLES.value < 1:
    invalid("--num_samples", _NUM_SAMPLES.value, "must be an integer >= 1 (the samples drawn for each prompt)")
  if _BATCH.value < 1:
    invalid("--batch_size", _BATCH.value, "must be an integer >= 1 (the rows generated together)")
  if _PROMPTS_FILE.value is not None and flags.FLAGS["prompt"].present:
    raise ValueError(f"--prompt with --prompts_file={_PROMPTS_FILE.value}: give one of them")
  if _INFILL.value:
    for name, used in (
      ("--speculate", _SPECULATE.value),
      ("--chat", _CHAT.value),
      ("--prompts_file", _PROMPTS_FILE.value is not None),
      ("--num_samples", _NUM_SAMPLES.value > 1),
    ):
      if used:
        raise ValueError(f"{name} with --infill: blank infilling fills the blanks of one --prompt; drop one of them")
  texts = read_prompts(_PROMPTS_FILE.value) if _PROMPTS_FILE.value is not None else [_PROMPT.value]
  return sampling, texts


def run_source() -> tuple[str, str]:
  """(the flag naming what is sampled, its directory): --packed, else --workdir (with --config: its default)."""
  if _PACKED.value:
    return "--packed", _PACKED.value
  if _WORKDIR.value:
    return "--workdir", _WORKDIR.value
  if _CONFIG.value is not None:
    return "--workdir", f"workdirs/{_CONFIG.value.get('name', 'run')}"
  raise ValueError("--workdir is required: give a run's directory (or --packed, a packed model's)")


def check_lengths(cfg, speculate: int | None) -> None:
  if speculate:
    try:
      speculative.check(cfg, speculate)
    except ValueError as e:
      raise ValueError(f"--{e}") from e
  positions = cfg.max_position_embeddings - 1 - (speculate or 0)  # a prompt has at least one token
  if _MAX_NEW.value > positions:
    drafts = f" - --speculate={speculate}" if speculate else ""
    invalid(
      "--max_new_tokens",
      _MAX_NEW.value,
      f"must be in [1, {positions}]: model.max_position_embeddings={cfg.max_position_embeddings} - 1 "
      f"(the prompt's first token){drafts}",
    )


def chat_stops(tokenizer) -> tuple[int, ...]:
  """--chat: the ids of the chat format's stop strings; a tokenizer without the format's tokens is refused."""
  try:
    return tuple(tokenizer.chat_ids[s] for s in chat.STOP_STRINGS)
  except (AttributeError, ValueError) as e:
    why = str(e) if isinstance(e, ValueError) else f"tokenizer {tokenizer!r} has no special tokens"
    raise ValueError(f"--chat: the run cannot chat: {why}; sample without --chat") from e


def encode(tokenizer, texts: list[str], cfg) -> list[list[int]]:
  """The prompts' token ids (with --chat each text a user turn, then the generation prompt), each checked to fit."""
  room = cfg.max_position_embeddings - _MAX_NEW.value - (_SPECULATE.value or 0)
  prompts = []
  for i, text in enumerate(texts):
    where = f"--prompts_file={_PROMPTS_FILE.value}: prompt {i + 1}" if _PROMPTS_FILE.value else "--prompt"
    try:
      if _CHAT.value:
        ids = tokenizer.encode_chat(chat.render([{"role": "user", "content": text}], add_generation_prompt=True))
      else:
        ids = tokenizer.encode(text) or [tokenizer.eos_id]
    except ValueError as e:  # a character the vocabulary lacks
      raise ValueError(f"{where}: {e}") from e
    if len(ids) > room:
      raise ValueError(
        f"{where} is {len(ids)} tokens; with --max_new_tokens={_MAX_NEW.value} at most {room} fit "
        f"model.max_position_embeddings={cfg.max_position_embeddings}"
      )
    prompts.append(ids)
  return prompts


def decode(tokenizer, ids: list[int]) -> str:
  """The text of `ids`; an id the tokenizer does not have (a model's vocabulary may be larger: the RL tasks' 18
  characters in a 32-id model) is shown as <id N>."""
  pieces, run = [], []
  for i in ids:
    if 0 <= i < tokenizer.vocab_size:
      run.append(i)
    else:
      pieces += [tokenizer.decode(run), f"<id {i}>"]
      run = []
  return "".join([*pieces, tokenizer.decode(run)])


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  # The flags, the config's values and the run are checked, in that order, before any weight is read or anything
  # built; nothing is written.
  sampling, texts = checked_flags()
  flag, source = run_source()

  def check(config):  # the config's values and the lengths, before any weight is read
    check_values(config)  # no NaN or infinity in any field, every seed in range (as the trainers check)
    check_lengths(restore.model_config(config), _SPECULATE.value)

  if _CONFIG.value is not None:
    check(_CONFIG.value)  # before the run is looked at
  if flag == "--packed":
    model = restore.load_packed_model(source, _CONFIG.value, check=check)
    tag = f"step {model.step}, {model.scheme}"
    params = model.params
  else:
    model = restore.load_run(source, _CONFIG.value, check=check)
    q = restore.qat_section(model.config)
    tag = f"step {model.step}" + (f", {q.scheme} (QAT)" if q else "")
    params = restore.served_params(model.config, model.params)
  tokenizer = model.tokenizer
  if _INFILL.value:
    infill(model, params, tokenizer, sampling, tag)
    return
  stops = chat_stops(tokenizer) if _CHAT.value else (tokenizer.eos_id,)
  prompts = encode(tokenizer, texts, model.model_cfg)
  sampling = dataclasses.replace(sampling, stop_ids=stops, pad_id=tokenizer.pad_id)
  sampler = Sampler(model.graphdef, model.model_cfg, sampling, width=max(map(len, prompts)), speculate=_SPECULATE.value)
  out = sample_batches(
    sampler,
    params,
    model.rest,
    prompts,
    jax.random.key(_SEED.value),
    num_samples=_NUM_SAMPLES.value,
    batch_size=_BATCH.value,
  )
  for i, row in enumerate(out.rows):
    if _CHAT.value:  # the reply alone, without its stop token
      text = decode(tokenizer, row.response[:-1] if row.finished else row.response)
    else:
      text = decode(tokenizer, row.tokens)
    which = "" if len(out.rows) == 1 else f" prompt {i // _NUM_SAMPLES.value + 1}, sample {i % _NUM_SAMPLES.value + 1}:"
    print(f"[{tag}]{which} {text}", flush=True)
  print(  # on stderr, after the samples: stdout holds the text alone
    f"{out.generated} tokens generated in {out.seconds:.3f} s: {out.generated / max(out.seconds, 1e-9):.1f} tokens/s "
    f"({len(out.rows)} sample(s) in {out.batches} batch(es) of {out.batch_rows} rows; prefill and decode, the "
    f"{out.compile_seconds:.1f} s compile excluded)",
    file=sys.stderr,
  )
  if _SPECULATE.value:
    rate = out.made / out.rounds if out.rounds else float("nan")
    print(f"acceptance length {rate:.2f} tokens a round (k={_SPECULATE.value})", file=sys.stderr)


def infill(model, params, tokenizer, sampling: SamplingParams, tag: str) -> None:
  """--infill: the prompt's blanks filled left to right; prints the text and each blank's span."""
  if not isinstance(tokenizer, Tokenizer):
    raise ValueError(f"--infill: the run's tokenizer {tokenizer!r} has no [MASK] / [sMASK] / [gMASK] tokens")
  if not model.model_cfg.rope_2d:
    logging.warning("--infill with a model without model.rope_2d: it was not trained with GLM's blank infilling")
  context = encode_with_blanks(tokenizer, _PROMPT.value)
  sampling = dataclasses.replace(sampling, stop_ids=(tokenizer.eop_id, tokenizer.eos_id), pad_id=tokenizer.pad_id)
  filled, spans = fill_blanks(
    Sampler(model.graphdef, model.model_cfg, sampling),
    params,
    model.rest,
    context,
    tokenizer.special_ids,
    jax.random.key(_SEED.value),
  )
  print(f"[{tag}] " + tokenizer.decode(filled))
  for i, span in enumerate(spans):
    print(f"  blank {i + 1}: {tokenizer.decode(span)!r}")


if __name__ == "__main__":
  sys.argv = restore.config_file_argv(
    sys.argv, os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded_config.py")
  )
  cli.run(main)
