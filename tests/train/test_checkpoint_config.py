"""Which config differences a checkpoint tolerates (glm_jax/train/checkpoint.py: config_differences), on
hand-written configs: a resume needs the same model, optimizer and DSA stage; a run that starts from another's
weights (train.init_from) may change index_topk, which changes what the model computes, not its parameters."""

from glm_jax.train.checkpoint import COMPARED_SECTIONS, INIT_FROM_FREE_FIELDS, config_differences

SAVED = {
  "model": {"hidden_size": 64, "index_topk": 128, "attention_impl": "reference"},
  "optimizer": {"lr": 3e-3},
  "train": {"dsa_stage": "warmup"},
}


def changed(**sections):
  out = {k: dict(v) for k, v in SAVED.items()}
  for section, fields in sections.items():
    out[section].update(fields)
  return out


def test_a_resume_refuses_another_index_topk_and_names_it():
  assert config_differences(SAVED, changed(model={"index_topk": 64})) == ["model.index_topk: checkpoint 128, config 64"]
  assert config_differences(SAVED, changed(model={"attention_impl": "pallas"})) == []  # a runtime field
  assert config_differences(SAVED, changed(train={"dsa_stage": "sparse"}), sections=COMPARED_SECTIONS) == [
    "train.dsa_stage: checkpoint 'warmup', config 'sparse'"
  ]


def test_init_from_allows_another_index_topk_but_not_another_shape():
  init_from = dict(sections=("model",), train_fields=(), free=INIT_FROM_FREE_FIELDS)
  assert config_differences(SAVED, changed(model={"index_topk": 64}, train={"dsa_stage": "sparse"}), **init_from) == []
  assert config_differences(SAVED, changed(model={"index_topk": 64, "hidden_size": 96}), **init_from) == [
    "model.hidden_size: checkpoint 64, config 96"
  ]


def test_a_field_either_side_lacks_counts_as_its_default(caplog):
  """A checkpoint written before a field existed resumes while the config keeps the field's default
  (checkpoint.SECTION_DEFAULTS: the library's own), and the log says which fields it took so; a run that leaves a
  field out of its config gets the default too."""
  saved = {"model": {"hidden_size": 64}, "optimizer": {"lr": 3e-3}, "train": {}}
  current = {
    "model": {"hidden_size": 64, "norm_style": "prenorm"},
    "optimizer": {"lr": 3e-3, "b2": 0.95},
    "train": {"dsa_stage": "dense"},
  }
  with caplog.at_level("INFO"):
    assert config_differences(saved, current) == []
  said = [r.getMessage() for r in caplog.records if "does not give" in r.getMessage()]
  assert len(said) == 1 and all(f in said[0] for f in ("model.norm_style", "optimizer.b2", "train.dsa_stage"))
  assert config_differences(saved, {**current, "optimizer": {"lr": 3e-3, "b2": 0.99}}) == [
    "optimizer.b2: checkpoint absent (default 0.95), config 0.99"
  ]
  assert config_differences(
    {**saved, "optimizer": {"lr": 3e-3, "b2": 0.99}}, {**current, "optimizer": {"lr": 3e-3}}
  ) == ["optimizer.b2: checkpoint 0.99, config absent (default 0.95)"]
  # a nested section's new field too (data.glm)
  assert (
    config_differences(
      {"data": {"glm": {}}}, {"data": {"glm": {"mask_ratio": 0.15}}}, sections=("data",), train_fields=()
    )
    == []
  )


def test_the_fields_that_change_no_parameter_may_differ():
  """attention_chunk and moe_buffer_factor change how the model runs, not its parameters (ModelConfig declares
  them so; tests/model/test_config.py checks the state under each runtime field)."""
  assert config_differences(SAVED, changed(model={"attention_chunk": 64, "moe_buffer_factor": 2.0})) == []
  assert config_differences(SAVED, changed(model={"param_dtype": "bfloat16"})) == [
    "model.param_dtype: checkpoint absent (default 'float32'), config 'bfloat16'"
  ]
