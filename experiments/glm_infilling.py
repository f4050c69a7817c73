r"""Blank infilling against a causal LM of the same size: GLM-130B's objective on the embedded corpus.

  bash scripts/with_env.sh python experiments/glm_infilling.py \
      --workdir=runs/glm_infilling  # two 600-step runs, ~10 min on 2 CPU cores

Trains configs/glm130b_tiny.py (blank infilling: 30% [MASK] / 70% [gMASK]) and its `causal` variant (the same
model on the same documents, next-token prediction), then scores both on the same held-out blanks (the glm data
pipeline's held-out batches, whose corruption is fixed): for every blank, the NLL of its tokens and whether all of
them are the model's argmax (teacher-forced argmax everywhere == greedy decoding reproduces the span).
  glm     the blank given the context on both sides (its layout: part A bidirectional, the span after <sop>)
  causal  the blank given the text before it only (the original document, read left to right)
The <eop> that ends a GLM span is not scored (the causal model has no such token), nor a blank at a document's
start (nothing precedes it for the causal model), so the two losses count the same tokens. Rows go to --results
(JSON lines); the table is printed, overall and by mask kind and span length.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from glm_jax.configs import glm130b_tiny
from glm_jax import cli
from glm_jax import data as data_lib
from glm_jax.train import step as step_lib
from glm_jax.train.trainer import restore_run, train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "runs/glm_infilling", "Where the runs go.")
_STEPS = flags.DEFINE_integer("steps", 600, "Training steps of each model.")
_RESULTS = flags.DEFINE_string("results", "", "JSON lines of the table (default: <workdir>/results.jsonl).")
_SEED = flags.DEFINE_integer("seed", 0, "train.seed of both models (the initialization, the data order).")


def blanks_of(batch: dict[str, np.ndarray]) -> list[dict]:
  """Every blank of a glm batch: {"row", "doc": the original text's tokens (part A with each mask replaced by its
  span), "start": where the blank starts in doc, "span": its tokens, "b": the indices of its <sop> s_1 .. s_L in the
  row, "mask": the id of the mask token it replaces}. Read from the layout alone (positions of part B = the mask's
  position in A)."""
  out = []
  for r in range(batch["input_ids"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      idx = np.flatnonzero(seg == s)
      start, prefix_end = idx[0], batch["prefix_end"][r, idx[0]]
      a = batch["input_ids"][r, start:prefix_end]
      sops = [t for t in idx if t >= prefix_end and batch["block_positions"][r, t] == 1]
      groups = []
      for i, t in enumerate(sops):
        end = sops[i + 1] if i + 1 < len(sops) else idx[-1] + 1
        groups.append((int(batch["positions"][r, t]), list(range(t, end))))
      groups.sort()
      doc, last, starts = [], 0, []
      for mask_pos, b in groups:
        span = batch["input_ids"][r, b[1:]].tolist()
        doc += a[last:mask_pos].tolist()
        starts.append(len(doc))
        doc += span
        last = mask_pos + 1
      doc += a[last:].tolist()
      for (mask_pos, b), st in zip(groups, starts):
        out.append(
          {
            "row": r,
            "doc": doc,
            "start": st,
            "span": batch["input_ids"][r, b[1:]].tolist(),
            "b": b,
            "mask": int(a[mask_pos]),
          }
        )
  return out


def _blank_row(blank: dict, lp: np.ndarray, names: dict[int, str]) -> dict:
  """One scored blank: lp [L, V] the log-probs that predict its L tokens."""
  span = np.asarray(blank["span"])
  return {
    "kind": names[blank["mask"]],
    "len": len(span),
    "nll": -float(lp[np.arange(len(span)), span].sum()),
    "exact": bool((lp.argmax(-1) == span).all()),
  }


def score_glm(run, batches) -> list[dict]:
  forward = jax.jit(lambda params, rest, batch: jax.nn.log_softmax(_logits(run, params, rest, batch)))
  names = _mask_names(run.tokenizer)
  rows = []
  for batch in batches:
    logp = np.asarray(forward(run.state.params, run.state.rest, {k: jnp.asarray(v) for k, v in batch.items()}))
    for blank in blanks_of(batch):
      if blank["span"] and blank["start"] > 0:  # the causal model's blanks; <sop> .. s_{L-1} predict s_1 .. s_L
        rows.append(_blank_row(blank, logp[blank["row"], blank["b"][:-1]], names))
  return rows


def _logits(run, params, rest, batch):
  model = nnx.merge(run.graphdef, params, rest)
  return model(batch["input_ids"], **step_lib.model_inputs(batch), compute_mtp=False).logits


def _mask_names(tokenizer) -> dict[int, str]:
  return {tokenizer.mask_id: "[MASK]", tokenizer.smask_id: "[sMASK]", tokenizer.gmask_id: "[gMASK]"}


def score_causal(run, batches, seq_len: int, names: dict[int, str]) -> list[dict]:
  """The same blanks (those not at a document's start: nothing before them to condition on) read left to right."""
  forward = jax.jit(lambda params, rest, ids: jax.nn.log_softmax(_logits(run, params, rest, {"input_ids": ids})))
  rows = []
  for batch in batches:
    items = [b for b in blanks_of(batch) if b["span"]]
    ids = np.zeros((len(items), seq_len), np.int32)
    for i, blank in enumerate(items):
      ids[i, : len(blank["doc"])] = blank["doc"]
    logp = np.asarray(forward(run.state.params, run.state.rest, jnp.asarray(ids)))
    for i, blank in enumerate(items):
      st = blank["start"]
      if st > 0:
        rows.append(_blank_row(blank, logp[i, st - 1 : st - 1 + len(blank["span"])], names))
  return rows


def summarize(rows: list[dict]) -> dict:
  """span NLL per token, exact-match rate, counts: over all blanks and by mask kind and length."""

  def stats(sel):
    tokens = sum(r["len"] for r in sel)
    return {
      "span_nll": sum(r["nll"] for r in sel) / tokens,
      "exact": sum(r["exact"] for r in sel) / len(sel),
      "blanks": len(sel),
      "span_tokens": tokens,
    }

  groups = {}
  for r in rows:
    bucket = "1" if r["len"] == 1 else "2-3" if r["len"] <= 3 else "4+"
    groups.setdefault(f"{r['kind']} len {bucket}", []).append(r)
  return {**stats(rows), "by_kind": {k: stats(v) for k, v in sorted(groups.items())}}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  rows = []
  configs = {"glm": glm130b_tiny.get_config(), "causal": glm130b_tiny.get_config("causal")}
  for name, config in configs.items():
    config.train.steps = _STEPS.value
    config.train.seed = _SEED.value
    config.train.eval_every = config.train.checkpoint_every = _STEPS.value
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, max(_STEPS.value // 10, 1))  # 50 at 600
    config.optimizer.decay_steps = _STEPS.value - config.optimizer.warmup_steps
    workdir = os.path.join(_WORKDIR.value, name)
    t0 = time.perf_counter()
    summary = train_and_evaluate(config, workdir)
    rows.append({"model": name, "train_s": round(time.perf_counter() - t0, 1), "summary": summary})
  glm_cfg = configs["glm"]
  glm_run = restore_run(glm_cfg, os.path.join(_WORKDIR.value, "glm"))
  batches = data_lib.make_eval_batches(glm_cfg.data, glm_run.tokenizer)
  glm_rows = score_glm(glm_run, batches)
  causal_run = restore_run(configs["causal"], os.path.join(_WORKDIR.value, "causal"))
  causal_rows = score_causal(causal_run, batches, glm_cfg.data.seq_len, _mask_names(glm_run.tokenizer))
  rows[0].update(summarize(glm_rows))
  rows[1].update(summarize(causal_rows))
  results_path = _RESULTS.value or os.path.join(_WORKDIR.value, "results.jsonl")
  os.makedirs(os.path.dirname(results_path) or ".", exist_ok=True)
  with open(results_path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  print(f"{'model':8s} {'span NLL':>9s} {'exact':>7s} {'blanks':>7s} {'tokens':>7s} {'eval_loss':>9s}")
  for row in rows:
    print(
      f"{row['model']:8s} {row['span_nll']:9.4f} {row['exact']:7.3f} {row['blanks']:7d} {row['span_tokens']:7d} "
      f"{row['summary']['eval_loss']:9.4f}"
    )
  print(f"\n{'blanks':18s} {'count':>6s} " + " ".join(f"{m + ' NLL':>11s} {m + ' exact':>12s}" for m in configs))
  for kind in rows[0]["by_kind"]:
    cells = [row["by_kind"].get(kind) for row in rows]
    print(
      f"{kind:18s} {cells[0]['blanks']:6d} "
      + " ".join(f"{c['span_nll']:11.3f} {c['exact']:12.3f}" if c else f"{'-':>11s} {'-':>12s}" for c in cells)
    )


if __name__ == "__main__":
  cli.run(main)
