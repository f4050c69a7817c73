"""Pretraining and SFT data on Grain: sources, tokenizer, packing, per-process sharding, checkpointable iterators.

  tok = load_tokenizer(cfg.data); check_vocab(tok, cfg.model.vocab_size)
  it = make_train_iterator(cfg.data, tok, process_index=jax.process_index(), process_count=jax.process_count())
  batch = next(it)   # {"input_ids", "segment_ids", "positions", "loss_mask"}: [batch_size // process_count,
                     #  seq_len] int32
  eval_batches = make_eval_batches(cfg.data, tok)   # the same keys and shapes
  baseline = unigram_entropy(cfg.data, tok)   # nats/token; the held-out loss must beat it

data.format picks what a batch holds. "lm" (the default): documents packed end to end (concat-then-split),
loss_mask = (segment_ids > 0). "sft": prompt/response examples (data.source "jsonl" or "embedded"), each
encode(prompt) + encode(response) + [eos], packed whole (grain's first-fit packer, padding at row ends),
loss_mask 1 on the response tokens and the eos, 0 on the prompt and the padding. "chat": conversations in GLM-5's
chat format (jsonl {"messages", "tools"} lines), packed as "sft", loss_mask 1 on what the model writes in its
assistant turns (glm_jax/data/conversations.py). In all three, the prediction at
position t of token t + 1 counts when segment_ids[t + 1] == segment_ids[t] != 0 and loss_mask[t + 1] == 1
(glm_jax/data/pipeline.py has the layout). data.objective "glm" (format "lm") is GLM's blank infilling
(glm_jax/data/blank_infilling.py): the batch adds "targets", "block_positions" and "prefix_end", and the prediction
at t of targets[t] counts where loss_mask[t] == 1.

The iterator is saved in the same Orbax step as the model, with grain's handler:
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          data=grain.checkpoint.CheckpointSave(it)))
  mngr.restore(step, args=ocp.args.Composite(state=..., data=grain.checkpoint.CheckpointRestore(it)))
(one JSON file per process, process_{i}-of-{n}.json; `it` is restored in place).
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
