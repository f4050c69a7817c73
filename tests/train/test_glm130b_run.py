"""configs/glm130b_tiny.py end to end: a short blank-infilling run whose final JSON line's held-out infilling loss
and span exact-match equal a numpy recomputation from the restored model's logits on the held-out batches."""

import numpy as np
import pytest

from glm_jax.configs import glm130b_tiny
from glm_jax import data as data_lib
from glm_jax.train import step as step_lib
from glm_jax.train.trainer import check_config, restore_run, train_and_evaluate


@pytest.mark.slow  # a 20-step run and a restore
def test_glm130b_tiny_reports_infilling_loss_and_exact_match(tmp_path, data_cache_dir):
  config = glm130b_tiny.get_config("smoke")
  config.data.cache_dir = data_cache_dir
  config.data.seq_len, config.data.batch_size = 128, 8
  config.train.steps = config.train.eval_every = config.train.checkpoint_every = 12
  summary = train_and_evaluate(config, str(tmp_path / "run"))
  run = restore_run(config, str(tmp_path / "run"))
  batches = data_lib.make_eval_batches(config.data, run.tokenizer)
  from flax import nnx

  model = nnx.merge(run.graphdef, run.state.params, run.state.rest)
  nll, count, spans, exact = 0.0, 0, 0, 0
  for batch in batches:
    logits = np.asarray(model(batch["input_ids"], **step_lib.model_inputs(batch), compute_mtp=False).logits, np.float64)
    logp = (
      logits
      - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
      - logits.max(-1, keepdims=True)
    )
    for r in range(batch["input_ids"].shape[0]):
      for t in np.flatnonzero(batch["loss_mask"][r]):
        nll -= logp[r, t, batch["targets"][r, t]]
        count += 1
      # a span: a <sop> (block position 1) and the positions after it while the block position counts up
      t, n = 0, batch["input_ids"].shape[1]
      while t < n:
        if batch["loss_mask"][r, t] and batch["block_positions"][r, t] == 1:
          u = t + 1
          while (
            u < n
            and batch["loss_mask"][r, u]
            and batch["block_positions"][r, u] == batch["block_positions"][r, u - 1] + 1
          ):
            u += 1
          spans += 1
          exact += all(logits[r, v].argmax() == batch["targets"][r, v] for v in range(t, u))
          t = u
        else:
          t += 1
  assert summary["eval_spans"] == spans > 0
  np.testing.assert_allclose(summary["eval_loss"], nll / count, rtol=2e-5)
  assert summary["eval_span_exact"] == pytest.approx(exact / spans, abs=1e-12)


def test_glm_objective_needs_the_2d_rope():
  config = glm130b_tiny.get_config()
  config.model.rope_2d = False
  with pytest.raises(ValueError, match=r"model.rope_2d=False is invalid; data.objective='glm' gives GLM's 2-D"):
    check_config(config)
  config = glm130b_tiny.get_config()
  config.train.embedding_grad_shrink = 0.0
  with pytest.raises(ValueError, match=r"train.embedding_grad_shrink=0.0 is invalid; a number in \(0, 1\]"):
    check_config(config)
