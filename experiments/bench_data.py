"""Prints the data pipeline's start-up and per-step costs on the embedded corpus, cold (empty cache) and warm.

bash scripts/with_env.sh python experiments/bench_data.py [--seq_len=256 --batch_size=16]
"""

import argparse
import tempfile
import time

import numpy as np

from glm_jax import data
from glm_jax.data import sources, tokenized
from glm_jax.data import tokenizer as tokenizer_lib


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  cfg = data.default_data_config()
  cfg.seq_len, cfg.batch_size = args.seq_len, args.batch_size
  cfg.cache_dir = tempfile.mkdtemp()

  def clock(label, fn):
    start = time.perf_counter()
    out = fn()
    print(f"{label:<44s} {time.perf_counter() - start:7.3f} s")
    return out

  corpus = clock("read the corpus (SQLite) + hash + split", lambda: sources.load_corpus(cfg))
  train = [corpus.docs[i] for i in corpus.train_idx]
  clock(f"train the {cfg.bpe_vocab_size}-token BPE", lambda: tokenizer_lib.train_bpe(train, cfg.bpe_vocab_size))
  sources._CORPUS_MEMO.clear()  # pylint: disable=protected-access
  tok = clock("cold load_tokenizer (read + train + save)", lambda: data.load_tokenizer(cfg))
  tc = clock("cold tokenize the corpus (+ save)", lambda: tokenized.tokenize_corpus(cfg, tok))
  print(
    f"corpus: {len(corpus.docs)} documents ({len(corpus.train_idx)} train, {len(corpus.eval_idx)} held out), "
    f"{sum(map(len, corpus.docs)):,} characters, {len(tc.tokens):,} tokens (eos included)"
  )
  sources._CORPUS_MEMO.clear()  # pylint: disable=protected-access
  tokenized._MEMO.clear()  # pylint: disable=protected-access
  tok = clock("warm load_tokenizer (cached)", lambda: data.load_tokenizer(cfg))
  it = clock(
    "warm make_train_iterator + first batch", lambda: (lambda i: (i, next(i)))(data.make_train_iterator(cfg, tok))[0]
  )
  clock(f"{args.steps} batches [{cfg.batch_size}, {cfg.seq_len}]", lambda: [next(it) for _ in range(args.steps)])
  evals = clock("make_eval_batches", lambda: data.make_eval_batches(cfg, tok))
  h = clock("unigram_entropy", lambda: data.unigram_entropy(cfg, tok))
  print(
    f"unigram entropy of the training split: {h:.4f} nats/token; {len(evals)} eval batches, "
    f"{int(np.sum([(b['segment_ids'] > 0).sum() for b in evals])):,} held-out tokens in them"
  )


if __name__ == "__main__":
  main()
