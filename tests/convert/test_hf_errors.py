"""A damaged Hugging Face directory is refused with a message that names the file (and the tensor), and the
directory is left byte for byte as it was: truncated safetensors (single file and one shard of several), a truncated
config.json or index, a config.json that is not GLM-5's, a tensor of a non-float dtype."""

import json
import os
import re
import shutil

import pytest
import torch

from glm_jax.convert import hf
from tests.convert.test_hf import _rewrite, make_hf_model
from tests.helpers import edit_json


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """{"single": a transformers-saved directory, "sharded": the same model in several shards with an index}. Both
  written by transformers: hf.save writes the same layout but needs a loaded model, whose first load compiles."""
  root = tmp_path_factory.mktemp("hf_errors")
  model = make_hf_model()
  model.save_pretrained(root / "single")
  model.save_pretrained(root / "sharded", max_shard_size="100KB")
  return {"single": str(root / "single"), "sharded": str(root / "sharded")}


def _snapshot(path):
  return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def _copy(dirs, kind, tmp_path):
  dst = str(tmp_path / kind)
  shutil.copytree(dirs[kind], dst)
  return dst


def _truncate(file):
  data = open(file, "rb").read()
  with open(file, "wb") as f:
    f.write(data[: len(data) // 2])


def _edit_config(path, edit):
  edit_json(os.path.join(path, "config.json"), edit)


def _load_fails(path, message):
  """hf.load(path) raises ValueError whose message starts with `message` (taken literally); returns it. The
  directory's bytes are unchanged."""
  before = _snapshot(path)
  with pytest.raises(ValueError, match="^" + re.escape(message)) as err:
    hf.load(path)
  assert _snapshot(path) == before
  return str(err.value)


def test_fixtures_load_and_are_sharded(dirs):
  shards = set(json.load(open(os.path.join(dirs["sharded"], hf.INDEX_FILE)))["weight_map"].values())
  assert len(shards) >= 3
  for path in dirs.values():
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == hf.MODEL_TYPE
  assert hf.load_config(dirs["single"]) == hf.load_config(dirs["sharded"])


def test_truncated_single_file_is_named(dirs, tmp_path):
  path = _copy(dirs, "single", tmp_path)
  file = os.path.join(path, hf.SINGLE_FILE)
  _truncate(file)
  _load_fails(path, f"{file}: cannot be read as safetensors (truncated or corrupt: ")


def test_truncated_shard_is_named(dirs, tmp_path):
  path = _copy(dirs, "sharded", tmp_path)
  file = os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1])
  _truncate(file)
  _load_fails(path, f"{file}: cannot be read as safetensors (truncated or corrupt: ")


def test_truncated_index_is_named(dirs, tmp_path):
  path = _copy(dirs, "sharded", tmp_path)
  _truncate(os.path.join(path, hf.INDEX_FILE))
  _load_fails(path, f"{os.path.join(path, hf.INDEX_FILE)}: not valid JSON (line ")


def test_truncated_config_is_named(dirs, tmp_path):
  path = _copy(dirs, "single", tmp_path)
  _truncate(os.path.join(path, "config.json"))
  _load_fails(path, f"{os.path.join(path, 'config.json')}: not valid JSON (line ")


def test_config_without_model_type_is_refused(dirs, tmp_path):
  path = _copy(dirs, "single", tmp_path)
  _edit_config(path, lambda c: c.pop("model_type"))
  _load_fails(
    path, f"{os.path.join(path, 'config.json')}: model_type is missing; expected 'glm_moe_dsa' (a GLM-5 checkpoint)"
  )


def test_config_of_another_model_is_refused(dirs, tmp_path):
  path = _copy(dirs, "single", tmp_path)
  _edit_config(path, lambda c: c.update(model_type="llama"))
  _load_fails(
    path, f"{os.path.join(path, 'config.json')}: model_type='llama'; expected 'glm_moe_dsa' (a GLM-5 checkpoint)"
  )


def test_unsupported_setting_names_the_config_file(dirs, tmp_path):
  path = _copy(dirs, "single", tmp_path)
  _edit_config(path, lambda c: c.update(hidden_act="gelu"))
  _load_fails(path, f"{os.path.join(path, 'config.json')}: hidden_act='gelu'; only 'silu' is implemented")


def test_non_float_tensor_is_named(dirs, tmp_path):
  name = "model.layers.1.mlp.gate.weight"
  path = _rewrite(dirs["single"], tmp_path / "bad", lambda t: t.update({name: t[name].to(torch.uint8)}))
  _load_fails(
    path, f"{os.path.join(path, hf.SINGLE_FILE)}: tensor {name} has dtype U8; expected one of BF16, F16, F32, F64"
  )
