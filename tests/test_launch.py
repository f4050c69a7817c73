"""launch/model_info.py, run as a user would: its counts are the public reference's figures."""

import json

import pytest

from tests import forked


def run_info(*args):
  done = forked.run("launch/model_info.py", *args, timeout=300)
  assert done.returncode == 0 and not done.killed, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_glm5_744b_counts_match_the_reference():
  info = run_info("--config=configs/glm5_744b.py")
  # transformers' GlmMoeDsaForCausalLM for the released config: 743.91e9 parameters (no MTP), 41.78e9
  # active with 8 of 256 experts; the MTP layer adds 9.95e9.
  assert round(info["total"] / 1e9, 2) == 743.91
  assert round(info["active"] / 1e9, 2) == 41.78
  assert round(info["mtp"] / 1e9, 2) == 9.95


@pytest.mark.slow  # a launch/model_info.py process with a forward pass
def test_flag_overrides_reach_the_model():
  info = run_info("--config=configs/glm5_tiny.py", "--config.model.vocab_size=300", "--forward_tokens=48")
  assert info["logits_shape"] == [1, 48, 300]
  # A freshly initialized model predicts close to uniformly: loss near ln(V).
  assert abs(info["init_loss"] - info["ln_vocab"]) < 0.1
