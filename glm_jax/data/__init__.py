"""Pretraining and SFT data on Grain: sources, tokenizer, packing, per-process sharding, checkpointable iterators.

  tok = load_tokenizer(cfg.data); check_vocab(tok, cfg.model.vocab_size)
  it = make_train_iterator(cfg.data, tok, process_index=jax.process_index(), process_count=jax.process_count())
  batch = next(it)   # {"input_ids", "segment_ids", "positions", "loss_mask"}: [batch_size // process_count,
                     #  seq_len] int32
  eval_batches = make_eval_batches(cfg.data, tok)   # the same keys and shapes
  baseline = unigram_entropy(cfg.data, tok)   # nats/token; the held-out loss must beat it

data.format picks what a batch holds: "lm" (the default) documents packed end to end, "sft" prompt/response
examples, "chat" conversations in GLM-5's chat format (glm_jax/data/conversations.py); data.objective "glm" is GLM's
blank infilling (glm_jax/data/blank_infilling.py), whose batch adds "targets", "block_positions" and "prefix_end". The
batch's layout and which predictions count: glm_jax/data/pipeline.py. The iterator is saved in the same Orbax step as
the model, with grain's handler (one JSON file per process, process_{i}-of-{n}.json; `it` is restored in place):
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          data=grain.checkpoint.CheckpointSave(it)))
  mngr.restore(step, args=ocp.args.Composite(state=..., data=grain.checkpoint.CheckpointRestore(it)))
"""

from glm_jax.data.config import default_data_config, validate_data_config
from glm_jax.data.pipeline import make_eval_batches, make_train_iterator, unigram_entropy
from glm_jax.data.special_tokens import SPECIAL_TOKENS
from glm_jax.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

__all__ = [
  "SPECIAL_TOKENS",
  "Tokenizer",
  "check_vocab",
  "default_data_config",
  "load_tokenizer",
  "make_eval_batches",
  "make_train_iterator",
  "unigram_entropy",
  "validate_data_config",
]
