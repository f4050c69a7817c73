"""A packed model's packed.json read defensively (glm_jax/quant/packed.py read_meta) and launch/quantize.py's
`.partial` directory: every field of the format checked, each error naming the file, the field, the value and what
is valid; a FIFO is refused without blocking; a `<out>.partial` that launch/quantize.py did not make is left alone
and refused in one line before any work."""

import copy
import json
import os

import ml_collections
import pytest
from flax import nnx

from glm_jax import paths
from glm_jax.model import GlmMoeDsa
from glm_jax.model.quantization import default_quant_config
from glm_jax.quant import packed
from tests.convert.test_untrusted import assert_refused, run_cli, snapshot
from tests.helpers import TINY_MODEL, fifo_errors, init_module


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(directory, packed.json's value) of a model packed by save_packed (w4a8, no tokenizer), as tests change it."""
  from glm_jax.train.packed_checkpoint import save_packed

  out = str(tmp_path_factory.mktemp("packed") / "w4a8")
  _, params, rest = nnx.split(init_module(lambda: GlmMoeDsa(TINY_MODEL, nnx.Rngs(0)), 0), nnx.Param, ...)
  quant = default_quant_config()
  quant.scheme, quant.group_size = "w4a8", 4
  config = ml_collections.ConfigDict({"model": TINY_MODEL.to_dict()})
  save_packed(
    out, params, rest, quant=quant, config=config.to_dict(), tokenizer=None, source={"workdir": "w", "step": 3}
  )
  with open(os.path.join(out, packed.META_FILE)) as f:
    return out, json.load(f)


def _write(tmp_path, meta=None, text=None):
  directory = tmp_path / "model"
  directory.mkdir(exist_ok=True)
  with open(directory / packed.META_FILE, "w") as f:
    f.write(text if text is not None else json.dumps(meta))
  return str(directory), str(directory / packed.META_FILE)


def test_what_save_packed_writes_reads_back(saved):
  out, meta = saved
  assert packed.read_meta(out) == meta and meta["tokenizer"] is None and len(meta["plan"]) > 10
  with pytest.raises(ValueError) as err:
    packed.read_meta(out, need_tokenizer=True)
  assert str(err.value) == (
    f"{os.path.join(out, packed.META_FILE)}: field 'tokenizer' is null; decoding text needs the tokenizer the run "
    "recorded (pack a run that records one)"
  )


def _drop(key):
  return lambda m: m.pop(key)


def _set(*keys, value):
  def edit(m):
    for k in keys[:-1]:
      m = m[k]
    m[keys[-1]] = value

  return edit


PLAN_KEY = "dense_layers/mlp/down_proj"
CASES = {
  "missing_plan": (_drop("plan"), "field 'plan' is missing; expected an object {parameter path: how it is packed}"),
  "missing_quant": (_drop("quant"), "field 'quant' is missing; expected an object"),
  "missing_tokenizer": (_drop("tokenizer"), "field 'tokenizer' is missing; expected an object (the run's "),
  "missing_model": (_drop("model"), "field 'model' is missing; expected an object of the model config's fields"),
  "missing_scheme": (lambda m: m["quant"].pop("scheme"), "field 'quant.scheme' is missing; expected a string"),
  "format_2": (_set("format", value=2), "field 'format'=2 is invalid; expected 1 (the format this code reads)"),
  "format_string": (_set("format", value="1"), "field 'format'='1' is invalid; expected 1"),
  "null_plan": (_set("plan", value=None), "field 'plan'=null is invalid; expected an object {parameter path: "),
  "weight_bytes": (_set("weight_bytes", value=-1), "field 'weight_bytes'=-1 is invalid; expected a non-negative"),
  "group_size": (_set("quant", "group_size", value=1.5), "field 'quant.group_size'=1.5 is invalid; expected a non-neg"),
  "rule_bits": (_set("plan", PLAN_KEY, "bits", value=3), f"field 'plan.{PLAN_KEY}.bits'=3 is invalid; expected 4 or 8"),
  "rule_act_bits": (_set("plan", PLAN_KEY, "act_bits", value=4), f"field 'plan.{PLAN_KEY}.act_bits'=4 is invalid; "),
  "rule_missing": (lambda m: m["plan"][PLAN_KEY].pop("free_axes"), f"field 'plan.{PLAN_KEY}.free_axes' is missing"),
  "rule_not_object": (_set("plan", PLAN_KEY, value=[8]), f"field 'plan.{PLAN_KEY}'=[8] is invalid; expected an obj"),
  "tokenizer_list": (_set("tokenizer", value=[]), "field 'tokenizer'=[] is invalid; expected an object (the run's"),
  "tokenizer_fields": (_set("tokenizer", value={"name": "bpe"}), "field 'tokenizer.sha256' is missing; expected a str"),
  "source_step": (_set("source", "step", value="3"), "field 'source.step'='3' is invalid; expected a non-negative"),
  "not_an_object": (None, "expected a JSON object, found list"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_field_is_named(saved, tmp_path, case):
  edit, why = CASES[case]
  meta = copy.deepcopy(saved[1])
  if edit is None:
    meta = [meta]
  else:
    edit(meta)
  directory, path = _write(tmp_path, meta)
  with pytest.raises(ValueError) as err:
    packed.read_meta(directory)
  assert str(err.value).startswith(f"{path}: {why}"), str(err.value)


@pytest.mark.parametrize(
  "text, why",
  [
    ("", "empty (0 bytes); expected a JSON object"),
    ("  \n", "empty (3 bytes); expected a JSON object"),
    ('{"format": 1,', "not valid JSON (line 1 column 14: Expecting property name enclosed in double quotes)"),
    ('{"format": NaN}', "not strict JSON (NaN is not a JSON number)"),
    ('{"format": 1, "format": 2}', "not strict JSON (key 'format' appears twice in one object)"),
    ("[" * 100_000 + "]" * 100_000, "not strict JSON (nested too deeply to parse)"),
  ],
)
def test_unreadable_files_are_named(tmp_path, text, why):
  directory, path = _write(tmp_path, text=text)
  with pytest.raises(ValueError) as err:
    packed.read_meta(directory)
  assert str(err.value) == f"{path}: {why}"


def test_special_files_are_refused_without_blocking(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a packed model \\(no packed.json\\); launch/quantize.py writes one"):
    packed.read_meta(str(tmp_path))
  (tmp_path / "dir" / packed.META_FILE).mkdir(parents=True)
  with pytest.raises(ValueError, match="packed.json: a directory, not a regular file$"):
    packed.read_meta(str(tmp_path / "dir"))
  fifo = tmp_path / "fifo"
  fifo.mkdir()
  os.mkfifo(fifo / packed.META_FILE)
  got = fifo_errors(fifo / packed.META_FILE, [lambda: packed.read_meta(str(fifo))])
  assert got == [f"{fifo / packed.META_FILE}: a named pipe (FIFO), not a regular file"]


# --------------------------------------------------------------------------------- launch/quantize.py's .partial


@pytest.mark.parametrize("kind", ["directory", "file", "symlink_to_ours"])
def test_quantize_leaves_a_foreign_partial_alone(tmp_path, kind):
  out, partial = tmp_path / "X", tmp_path / "X.partial"
  if kind == "directory":
    partial.mkdir()
    (partial / "keep.txt").write_text("not launch/quantize.py's")
  elif kind == "file":
    partial.write_text("not launch/quantize.py's")
  else:
    paths.make_partial(str(tmp_path / "elsewhere"))
    os.symlink(tmp_path / "elsewhere", partial)
  before = snapshot(str(tmp_path))
  result = run_cli(
    "quantize.py", "--config=configs/glm5_tiny.py", f"--workdir={tmp_path / 'run'}", "--scheme=w8a8", f"--out={out}"
  )
  assert_refused(
    result,
    f"error: --out={out} is written through {partial}, which exists and was not made by this code (no "
    f"{paths.PARTIAL_MARKER} in it), so it is left alone; move it away or choose another output",
  )
  assert snapshot(str(tmp_path)) == before


@pytest.mark.slow  # a conversion and a quantize.py run (about 25 s)
def test_quantize_replaces_its_own_stale_partial(tmp_path):
  """A `.partial` launch/quantize.py left behind (it carries the marker) is removed; the packed model is written
  through a new one, renamed to --out complete, and nothing else is left."""
  from glm_jax.configs import glm5_tiny
  from glm_jax.convert import stream
  from glm_jax.model import ModelConfig
  from tests.convert.test_untrusted import make_stale_partial, write_hf

  config = glm5_tiny.get_config()
  hf_dir = write_hf(str(tmp_path / "hf"), ModelConfig.from_dict(config.model))
  stream.hf_to_orbax(hf_dir, str(tmp_path / "run"), config)
  out, partial = tmp_path / "X", tmp_path / "X.partial"
  make_stale_partial(str(partial))  # what a run that died mid-save leaves
  result = run_cli(
    "quantize.py", "--config=configs/glm5_tiny.py", f"--workdir={tmp_path / 'run'}", "--scheme=w8a8", f"--out={out}"
  )
  assert result.rc == 0, result.stderr[-20:]
  assert json.loads(result.stdout.splitlines()[-1])["out"] == str(out)
  assert sorted(os.listdir(tmp_path)) == ["X", "hf", "run"]
  assert sorted(os.listdir(out)) == [packed.META_FILE, "weights"]
  meta = packed.read_meta(str(out), need_tokenizer=True)
  assert meta["quant"]["scheme"] == "w8a8" and meta["source"]["step"] == 0
