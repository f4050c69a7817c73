"""Which config differences a checkpoint tolerates (glm_jax/train/checkpoint.py: config_differences), on
hand-written configs: a resume needs the same model, optimizer and DSA stage; a run that starts from another's
weights (train.init_from) may change index_topk, which changes what the model computes, not its parameters."""

from glm_jax.train.checkpoint import COMPARED_SECTIONS, INIT_FROM_FREE_FIELDS, config_differences

SAVED = {"model": {"hidden_size": 64, "index_topk": 128, "attention_impl": "reference"},
         "optimizer": {"lr": 3e-3}, "train": {"dsa_stage": "warmup"}}


def changed(**sections):
  out = {k: dict(v) for k, v in SAVED.items()}
  for section, fields in sections.items():
    out[section].update(fields)
  return out


def test_a_resume_refuses_another_index_topk_and_names_it():
  assert config_differences(SAVED, changed(model={"index_topk": 64})) == [
      "model.index_topk: checkpoint 128, config 64"]
  assert config_differences(SAVED, changed(model={"attention_impl": "pallas"})) == []  # a runtime field
  assert config_differences(SAVED, changed(train={"dsa_stage": "sparse"}), sections=COMPARED_SECTIONS) == [
      "train.dsa_stage: checkpoint 'warmup', config 'sparse'"]


def test_init_from_allows_another_index_topk_but_not_another_shape():
  init_from = dict(sections=("model",), train_fields=(), free=INIT_FROM_FREE_FIELDS)
  assert config_differences(SAVED, changed(model={"index_topk": 64}, train={"dsa_stage": "sparse"}), **init_from) == []
  assert config_differences(SAVED, changed(model={"index_topk": 64, "hidden_size": 96}), **init_from) == [
      "model.hidden_size: checkpoint 64, config 96"]
