"""Untrusted files and destructive flags (launch/convert.py, glm_jax/convert/*): a bad input is refused in one line
that names the file, the field and the value, costs memory bounded by the files (not by what config.json claims),
and destroys nothing; an output that is, contains or is inside its input is refused before anything is written.

Each command-line case runs launch/convert.py as a user does (in a process forked for it from one that has made
the script's imports: tests/forked.py) and asserts the exit code, the one line on stderr (glm_jax/cli.py's
`error: ...`), the process's peak resident memory (os.wait4's rusage) and that the input's files, byte for byte, and
the output's absence are as before. The library's checks (safetensors headers, the index, path relations, `.partial`
markers) are tested beside them, in process.
"""

import collections
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from flax import nnx

from glm_jax import paths
from glm_jax.convert import hf, safetensors_io, stream
from glm_jax.model import GlmMoeDsa
from tests import forked
from tests.helpers import ROOT, TINY_MODEL, edit_json, fifo_errors, read_header, write_header

# A refusal costs the interpreter and its imports (jax, flax, tensorstore: about 130 MiB resident in a child forked
# as run_cli forks one); before the checks, launch/convert.py passed 3 GiB within 30 s on a 1 KB config.json claiming
# 10^6 layers or 10^7 experts (on its way to 15-17 GB). The watchdog stops a process past WATCHDOG_MIB, so a
# regression fails the test, not the machine.
PEAK_BOUND_MIB = 512
WATCHDOG_MIB = 1536

Result = collections.namedtuple("Result", "rc stderr stdout peak_mib killed")


def run_cli(script, *args, timeout=120):
  """launch/<script> as a user runs it (in a process forked for it: tests/forked.py): (exit code, stderr lines,
  stdout, peak resident MiB, whether the watchdog stopped it past WATCHDOG_MIB or `timeout` seconds)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("GLM_JAX_TRACEBACK", None)
  done = forked.run(f"launch/{script}", *args, timeout=timeout, env=env, limit_kib=WATCHDOG_MIB * 1024)
  return Result(done.returncode, done.stderr.splitlines(), done.stdout, done.peak_kib / 1024, done.killed)


def snapshot(*roots):
  """{path: bytes, or what it is for a directory, symlink or special file} of everything under `roots` (FIFOs are
  not opened)."""
  out = {}
  for root in roots:
    for folder, dirs, files in os.walk(root):
      out[folder] = "dir"
      for name in dirs + files:
        path = os.path.join(folder, name)
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
          out[path] = "-> " + os.readlink(path)
        elif stat.S_ISREG(mode):
          with open(path, "rb") as f:
            out[path] = f.read()
        elif not stat.S_ISDIR(mode):
          out[path] = paths.kind_of(mode)
  return out


def assert_refused(result, line):
  """Exit code 1, exactly `line` on stderr (no traceback), within the memory bound."""
  assert not result.killed, f"stopped by the watchdog: {result.peak_mib:.0f} MiB"
  assert (result.rc, result.stderr) == (1, [line]), result.stderr[-20:]
  print(f"refused in one line, peak resident memory {result.peak_mib:.0f} MiB")
  assert result.peak_mib < PEAK_BOUND_MIB, result.peak_mib


# ------------------------------------------------------------------------------------------------------ fixtures


def write_hf(path, cfg=TINY_MODEL, **kw):
  """A HF directory of `cfg` (random weights) as hf.write writes one; no model is built."""
  leaves = {p: v for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0)))))}
  rng = np.random.default_rng(0)
  hf.write(cfg, path, leaves, lambda s: rng.standard_normal(hf.slice_shape(s, leaves)).astype(np.float32), **kw)
  return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """{"single": a one-file HF directory, "sharded": the same model in 4 shards with an index, "workdir": single
  converted to a weights-only Orbax checkpoint}, each copied by the tests that change it."""
  root = tmp_path_factory.mktemp("untrusted")
  single = write_hf(str(root / "single"))
  sharded = write_hf(str(root / "sharded"), max_shard_bytes=20_000)
  stream.hf_to_orbax(single, str(root / "workdir"))
  return {"single": single, "sharded": sharded, "workdir": str(root / "workdir")}


def copy(sources, kind, dst):
  shutil.copytree(sources[kind], dst)
  return str(dst)


A = "model.layers.1.mlp.experts.0.gate_proj.weight"
B = "model.layers.1.mlp.experts.1.gate_proj.weight"


# ----------------------------------------------------------------------------------- untrusted HF directories


def _claim(**fields):
  """config.json claiming `fields` (its per-layer lists dropped, so that nothing else refuses it first)."""

  def make(sources, d):
    path = copy(sources, "single", d)

    def edit(cfg):
      cfg.pop("mlp_layer_types")
      cfg.pop("indexer_types")
      cfg.update(fields)

    edit_json(os.path.join(path, "config.json"), edit)
    return path, [path]

  return make


def _header(edit):
  """model.safetensors with its header changed by edit(header, data) -> (header, header text or None)."""

  def make(sources, d):
    path = copy(sources, "single", d)
    file = os.path.join(path, hf.SINGLE_FILE)
    header, data = read_header(file)
    header, text = edit(header, data)
    write_header(file, header, data, text)
    return path, [path]

  return make


def _overlap(header, data):
  header[B]["data_offsets"] = header[A]["data_offsets"]
  return header, None


def _fractional(header, data):
  begin, end = header[A]["data_offsets"]
  header[A]["data_offsets"] = [begin + 0.5, end + 0.5]
  return header, None


def _nested(header, data):
  return header, json.dumps(header)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"


def _index_entry(value, fifo=False, outside=False):
  """The index of a sharded directory with lm_head.weight's shard replaced by `value`; fifo: a FIFO of that name
  beside it; outside: a real shard at ../outside/model.safetensors."""

  def make(sources, d):
    path = copy(sources, "sharded", d)
    edit_json(os.path.join(path, hf.INDEX_FILE), lambda idx: idx["weight_map"].update({"lm_head.weight": value}))
    if fifo:
      os.mkfifo(os.path.join(path, value))
    roots = [path]
    if outside:
      roots.append(copy(sources, "single", os.path.join(os.path.dirname(path), "outside")))
    return path, roots

  return make


def _fifo_config(sources, d):
  path = copy(sources, "single", d)
  os.remove(os.path.join(path, "config.json"))
  os.mkfifo(os.path.join(path, "config.json"))
  return path, [path]


SHARD_NAME = "the name of a shard file in {d} (a string, with no directory part)"
UNTRUSTED = {
  "huge_layer_count": (
    _claim(num_hidden_layers=10**6),
    "{d}/config.json: num_hidden_layers=1000000, but the safetensors files hold 4 layers (model.layers.<i>.*); "
    "every decoder layer must be there",
  ),
  "huge_expert_count": (
    _claim(n_routed_experts=10**7),
    "{d}/config.json: n_routed_experts=10000000, but the safetensors files hold 4 routed experts "
    "(model.layers.<i>.mlp.experts.<e>.*)",
  ),
  "huge_mtp_count": (
    _claim(num_nextn_predict_layers=10**6),
    "{d}/config.json: num_nextn_predict_layers=1000000, but the safetensors files hold 1 MTP layers "
    "(model.layers.3.* on); the 999999 missing would be initialized, and at most num_hidden_layers=3 are",
  ),
  "overlapping_offsets": (
    _header(_overlap),
    "{d}/model.safetensors: cannot be read as safetensors (truncated or corrupt: tensors " + A + " (bytes "
    "23264..23776) and " + B + " (bytes 23264..23776) overlap)",
  ),
  "fractional_offsets": (
    _header(_fractional),
    "{d}/model.safetensors: cannot be read as safetensors (truncated or corrupt: tensor " + A + ": "
    "data_offsets=[23264.5, 23776.5] is not two integers [begin, end])",
  ),
  "nested_header": (
    _header(_nested),
    "{d}/model.safetensors: cannot be read as safetensors (truncated or corrupt: header nests deeper than the "
    "format's 3 levels)",
  ),
  "index_traversal": (
    _index_entry("../outside/model.safetensors", outside=True),
    "{d}/model.safetensors.index.json: weight_map['lm_head.weight']='../outside/model.safetensors' is invalid; "
    + SHARD_NAME,
  ),
  "index_absolute_path": (
    _index_entry("/etc/hostname"),
    "{d}/model.safetensors.index.json: weight_map['lm_head.weight']='/etc/hostname' is invalid; " + SHARD_NAME,
  ),
  "index_not_a_string": (
    _index_entry(7),
    "{d}/model.safetensors.index.json: weight_map['lm_head.weight']=7 is invalid; " + SHARD_NAME,
  ),
  "index_names_a_fifo": (
    _index_entry("fifo.safetensors", fifo=True),
    "{d}/model.safetensors.index.json: weight_map['lm_head.weight']='fifo.safetensors' is a named pipe (FIFO), "
    "not a regular file",
  ),
  "config_is_a_fifo": (_fifo_config, "{d}/config.json: a named pipe (FIFO), not a regular file"),
}


@pytest.mark.parametrize("case", list(UNTRUSTED))
def test_untrusted_hf_directory_is_refused_in_one_line(sources, tmp_path, case):
  make, line = UNTRUSTED[case]
  path, roots = make(sources, tmp_path / "hf")
  before = snapshot(*roots)
  result = run_cli("convert.py", f"--hf_dir={path}", f"--out_dir={tmp_path / 'out'}", timeout=60)
  assert_refused(result, "error: " + line.format(d=path))
  assert snapshot(*roots) == before
  assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == sorted(os.path.basename(r) for r in roots)


@pytest.mark.parametrize("case", ["huge_layer_count", "huge_expert_count", "huge_mtp_count"])
def test_huge_claims_cost_memory_bounded_by_the_files(sources, tmp_path, case):
  """hf.open_checkpoint's Python allocations (tracemalloc) on a claim of 10^6 layers, 10^7 experts or 10^6 MTP
  layers stay within a few times what it allocates for the valid directory."""

  def peak(path):
    tracemalloc.start()
    try:
      try:
        hf.open_checkpoint(path)
      except ValueError as e:
        error = str(e)
      else:
        error = None
      return tracemalloc.get_traced_memory()[1], error
    finally:
      tracemalloc.stop()

  valid, error = peak(sources["single"])
  assert error is None
  path, _ = UNTRUSTED[case][0](sources, tmp_path / "hf")
  claimed, error = peak(path)
  assert error == UNTRUSTED[case][1].format(d=path)
  print(f"{case}: peak {claimed / 2**10:.0f} KiB traced, valid directory {valid / 2**10:.0f} KiB")
  assert claimed < 2 * valid + 2**20


def test_config_fields_of_the_wrong_type_are_named(sources, tmp_path):
  path = copy(sources, "single", tmp_path / "hf")
  cfg_path = os.path.join(path, "config.json")
  for field, value, valid in (
    ("num_hidden_layers", "3", "an integer"),
    ("n_routed_experts", 4.0, "an integer"),
    ("rope_parameters", [1], "an object or null"),
    ("eos_token_id", [], "an integer, a non-empty list of integers, or null"),
    ("norm_topk_prob", 1, "true or false"),
  ):
    shutil.copy(os.path.join(sources["single"], "config.json"), cfg_path)
    edit_json(cfg_path, lambda c: c.update({field: value}))
    with pytest.raises(ValueError) as err:
      hf.load_config(path)
    assert str(err.value) == f"{cfg_path}: {field}={value!r} is invalid; {valid}"
  shutil.copy(os.path.join(sources["single"], "config.json"), cfg_path)
  edit_json(cfg_path, lambda c: c["rope_parameters"].update(rope_theta="1e4"))
  with pytest.raises(ValueError, match=r"config.json: rope_parameters.rope_theta='1e4' is invalid; a number$"):
    hf.load_config(path)
  with open(cfg_path, "w") as f:
    f.write('{"model_type": "glm_moe_dsa", "hidden_size": NaN}')
  with pytest.raises(ValueError, match=r"config.json: not strict JSON \(NaN is not a JSON number\)$"):
    hf.load_config(path)
  with open(cfg_path, "w") as f:
    f.write('{"model_type": "glm_moe_dsa", "hidden_size": 16, "hidden_size": 17}')
  with pytest.raises(ValueError, match=r"config.json: not strict JSON \(key 'hidden_size' appears twice"):
    hf.load_config(path)


# --------------------------------------------------------------------------------------- safetensors headers


def _file(tmp_path, tensors):
  path = str(tmp_path / "t.safetensors")
  safetensors_io.write(path, [(n, v.dtype, v.shape) for n, v in tensors.items()], tensors.__getitem__)
  return path


@pytest.mark.parametrize(
  "edit, why",
  [
    (lambda h: h["a"].update(data_offsets=[0, 24.0]), "tensor a: data_offsets=[0, 24.0] is not two integers"),
    (lambda h: h["a"].update(data_offsets=["0", "24"]), "tensor a: data_offsets=['0', '24'] is not two integers"),
    (lambda h: h["a"].update(data_offsets=[True, 24]), "tensor a: data_offsets=[True, 24] is not two integers"),
    (lambda h: h["a"].update(data_offsets=[-8, 16]), "tensor a: data_offsets=[-8, 16] is not [begin, end] with 0"),
    (lambda h: h["a"].update(data_offsets=[24, 0]), "tensor a: data_offsets=[24, 0] is not [begin, end] with 0"),
    (lambda h: h["b"].update(data_offsets=[16, 40]), "tensors a (bytes 0..24) and b (bytes 16..40) overlap"),
    (lambda h: h["b"].update(data_offsets=[0, 24]), "tensors a (bytes 0..24) and b (bytes 0..24) overlap"),
    (lambda h: h["a"].update(shape=[2.0, 3]), "tensor a: shape=[2.0, 3] is not a list of non-negative integers"),
    (lambda h: h["a"].update(shape="[2, 3]"), "tensor a: shape='[2, 3]' is not a list of non-negative integers"),
    (lambda h: h["a"].update(dtype=["F32"]), "tensor a has unknown dtype ['F32']; one of F64, F32"),
    (lambda h: h["a"].update(extra=[[[[1]]]]), "tensor a's header entry {'dtype': 'F32'"),
    (lambda h: h.update(__metadata__={"format": {"pt": 1}}), "__metadata__={'format': {'pt': 1}} is not an object"),
    (lambda h: h["b"].update(data_offsets=[24, 10**30]), "tensor b ends at byte "),
  ],
)
def test_bad_safetensors_headers_are_named(tmp_path, edit, why):
  path = _file(tmp_path, {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)})
  header, data = read_header(path)
  edit(header)
  write_header(path, header, data)
  with pytest.raises(ValueError) as err:
    safetensors_io.SafetensorsFile(path)
  assert str(err.value).startswith(f"{path}: cannot be read as safetensors (truncated or corrupt: {why}")


def test_valid_headers_still_read(tmp_path):
  """Empty tensors (sharing an offset with each other and with a neighbour's end), adjacent tensors, metadata."""
  tensors = {"e1": np.zeros((0, 4), np.float32), "a": np.arange(6, dtype=np.float32).reshape(2, 3)}
  tensors |= {"e2": np.zeros((3, 0), np.int8), "b": np.full((4,), 7, np.int32)}
  path = _file(tmp_path, tensors)
  header, data = read_header(path)
  header["__metadata__"] = {"format": "pt"}
  write_header(path, header, data)
  f = safetensors_io.SafetensorsFile(path)
  assert f.metadata == {"format": "pt"} and "a" in f and "z" not in f
  for name, value in tensors.items():
    np.testing.assert_array_equal(f.read(name), value)


def test_duplicate_tensor_in_a_header_is_named(tmp_path):
  path = _file(tmp_path, {"a": np.ones((2,), np.float32)})
  header, data = read_header(path)
  text = json.dumps(header)[:-1] + ', "a": ' + json.dumps(header["a"]) + "}"
  write_header(path, None, data, text)
  with pytest.raises(ValueError, match=r"header is not strict JSON: key 'a' appears twice in one object\)$"):
    safetensors_io.SafetensorsFile(path)


def test_opening_a_fifo_does_not_block(tmp_path):
  fifo = str(tmp_path / "pipe")
  os.mkfifo(fifo)
  readers = (paths.open_regular, safetensors_io.SafetensorsFile, paths.read_json)
  got = fifo_errors(fifo, [lambda fn=fn: fn(fifo) for fn in readers])
  assert got == [f"{fifo}: a named pipe (FIFO), not a regular file"] * 3


def test_index_entries_must_be_regular_files_in_the_directory(sources, tmp_path):
  path = copy(sources, "sharded", tmp_path / "hf")
  index = os.path.join(path, hf.INDEX_FILE)
  os.mkdir(os.path.join(path, "subdir"))
  cases = {
    "subdir": f"{index}: weight_map['lm_head.weight']='subdir' is a directory, not a regular file",
    "..": f"{index}: weight_map['lm_head.weight']='..' is invalid; the name of a shard file in {path}",
    "": f"{index}: weight_map['lm_head.weight']='' is invalid; the name of a shard file in {path}",
    None: f"{index}: weight_map['lm_head.weight']=None is invalid; the name of a shard file in {path}",
  }
  for value, message in cases.items():
    edit_json(index, lambda idx: idx["weight_map"].update({"lm_head.weight": value}))
    with pytest.raises(ValueError) as err:
      hf.Reader(path)
    assert str(err.value).startswith(message)
  edit_json(index, lambda idx: idx.update(weight_map=["lm_head.weight"]))
  with pytest.raises(ValueError, match=r"weight_map=\['lm_head.weight'\] is invalid; expected an object \{tensor"):
    hf.Reader(path)
  # The Hugging Face cache's layout: a snapshot of symlinks to blobs elsewhere reads as the files themselves.
  shutil.copy(os.path.join(sources["sharded"], hf.INDEX_FILE), index)
  blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
  os.makedirs(blobs)
  os.makedirs(snap)
  for name in os.listdir(path):
    if name != "subdir":
      shutil.move(os.path.join(path, name), blobs / name)
      os.symlink(blobs / name, snap / name)
  cfg, model = hf.load(str(snap))
  assert cfg == TINY_MODEL


# ------------------------------------------------------------------------------------------ outputs and inputs


def test_relation_of_paths(tmp_path):
  a, inner, other = tmp_path / "a", tmp_path / "a" / "b", tmp_path / "c"
  os.makedirs(inner)
  os.makedirs(other)
  os.symlink(a, tmp_path / "link")
  rel = paths.relation
  assert rel(str(a), str(a)) == "is" and rel(str(tmp_path / "link"), str(a)) == "is"
  assert rel(str(tmp_path / "link" / ".." / "a"), str(a)) == "is"
  assert rel(str(tmp_path), str(a)) == "contains" and rel(str(a), str(inner)) == "contains"
  assert rel(str(inner), str(a)) == "is inside" and rel(str(a / "new" / "deeper"), str(a)) == "is inside"
  assert rel(str(tmp_path / "link" / "new"), str(a)) == "is inside"
  assert rel(str(other), str(a)) is None and rel(str(tmp_path / "new"), str(a)) is None
  assert rel(str(a), str(tmp_path / "missing")) is None


def _workdir(sources, tmp_path):
  return copy(sources, "workdir", tmp_path / "parent" / "W")


def _hf_dir(sources, tmp_path):
  return copy(sources, "single", tmp_path / "parent" / "X")


APART = (
  "an output must be apart from its input (not it, not above it, not inside it), or writing it could destroy the input"
)
DESTRUCTIVE = {  # (make the input, its flags, the output relative to it, the relation named)
  "to_hf_onto_the_workdir": (_workdir, "--to_hf --workdir={i}", "{i}", "is", "--workdir"),
  "to_hf_onto_the_workdirs_parent": (_workdir, "--to_hf --workdir={i}", "{p}", "contains", "--workdir"),
  "to_hf_inside_the_workdir": (_workdir, "--to_hf --workdir={i}", "{i}/export", "is inside", "--workdir"),
  "hf_onto_the_hf_dir": (_hf_dir, "--hf_dir={i}", "{i}", "is", "--hf_dir"),
  "hf_onto_the_hf_dirs_parent": (_hf_dir, "--hf_dir={i}", "{p}", "contains", "--hf_dir"),
  "hf_inside_the_hf_dir": (_hf_dir, "--hf_dir={i}", "{i}/orbax", "is inside", "--hf_dir"),
}


@pytest.mark.parametrize("case", list(DESTRUCTIVE))
def test_overwrite_onto_an_input_is_refused(sources, tmp_path, case):
  make, flags, out, how, flag = DESTRUCTIVE[case]
  source = make(sources, tmp_path)
  parent = os.path.dirname(source)
  out = out.format(i=source, p=parent)
  before = snapshot(str(tmp_path))
  result = run_cli("convert.py", *flags.format(i=source).split(), f"--out_dir={out}", "--overwrite")
  assert_refused(result, f"error: --out_dir={out} {how} {flag}={source}; {APART}")
  assert snapshot(str(tmp_path)) == before


def test_an_output_holding_a_symlinked_input_file_is_refused(sources, tmp_path):
  """The Hugging Face cache's layout: the snapshot links to blobs elsewhere; an --out_dir of the blobs' directory
  would delete them with --overwrite."""
  blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
  shutil.copytree(sources["single"], blobs)
  os.makedirs(snap)
  for name in os.listdir(blobs):
    os.symlink(blobs / name, snap / name)
  before = snapshot(str(tmp_path))
  with pytest.raises(ValueError) as err:
    stream.hf_to_orbax(str(snap), str(blobs), overwrite=True)
  assert str(err.value) == (
    f"--out_dir={blobs} contains {snap / 'config.json'} (-> {blobs / 'config.json'}), which --hf_dir reads; {APART}"
  )
  assert snapshot(str(tmp_path)) == before


def test_untrusted_workdir_config_is_named(sources, tmp_path):
  """--to_hf reads the checkpoint's recorded model: counts it does not hold, or a FIFO, are refused by name before
  anything is built from them."""
  work = copy(sources, "workdir", tmp_path / "W")
  meta = os.path.join(work, "checkpoints", "0", "config", "metadata")
  state = os.path.join(work, "checkpoints", "0", "state")
  original = open(meta).read()
  cases = (
    ({"num_nextn_predict_layers": 10**6}, f"{meta}: model.num_nextn_predict_layers=1000000, but {state} holds 1 MTP"),
    ({"num_hidden_layers": 10**6}, f"{work}/checkpoints/0: moe_layers/input_layernorm/weight has shape [2, 16], the"),
    ({"n_routed_experts": 10**7}, f"{work}/checkpoints/0: moe_layers/mlp/down_proj has shape [2, 4, 8, 16], the"),
  )
  for change, message in cases:
    edit_json(meta, lambda item: item["model"].update(change))
    tracemalloc.start()
    try:
      with pytest.raises(ValueError) as err:
        stream.orbax_to_hf(work, str(tmp_path / "out"))
      peak = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
    assert str(err.value).startswith(message) and peak < 32 * 2**20, (str(err.value), peak)
    with open(meta, "w") as f:
      f.write(original)
  os.remove(meta)
  os.mkfifo(meta)
  with pytest.raises(ValueError, match="^" + re.escape(f"{meta}: a named pipe (FIFO), not a regular file") + "$"):
    stream.orbax_to_hf(work, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- .partial markers


def make_stale_partial(path: str) -> None:
  """A `.partial` made by a process that has ended (a write that died before its rename)."""
  code = f"from glm_jax import paths; paths.make_partial({path!r})"
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_partial_directories_are_removed_only_when_ours(tmp_path):
  ours = str(tmp_path / "ours.partial")
  make_stale_partial(ours)
  open(os.path.join(ours, "half-written"), "w").close()
  paths.clear_partial(ours, "--out=x")
  assert not os.path.lexists(ours)
  busy = str(tmp_path / "busy.partial")  # ours, and its writer (this process) is alive: it may be writing it
  paths.make_partial(busy)
  with pytest.raises(FileExistsError) as err:
    paths.clear_partial(busy, "--out=/x")
  assert str(err.value) == (
    f"--out=/x is being written through {busy} by pid {os.getpid()} on host {socket.gethostname()!r}; wait for it "
    "to end or choose another output"
  )
  assert os.path.isdir(busy)
  foreign = tmp_path / "foreign.partial"
  foreign.mkdir()
  (foreign / "keep.txt").write_text("mine")
  as_file = tmp_path / "file.partial"
  as_file.write_text("mine")
  target = str(tmp_path / "target")
  paths.make_partial(target)  # ours, but reached through a symlink of another name: not ours to follow
  link = tmp_path / "link.partial"
  os.symlink(target, link)
  for partial in (foreign, as_file, link):
    before = snapshot(str(tmp_path))
    with pytest.raises(FileExistsError) as err:
      paths.clear_partial(str(partial), "--out=/x")
    assert str(err.value) == (
      f"--out=/x is written through {partial}, which exists and was not made by this code (no "
      f"{paths.PARTIAL_MARKER} in it), so it is left alone; move it away or choose another output"
    )
    assert snapshot(str(tmp_path)) == before
