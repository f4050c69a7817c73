"""Streaming conversion (glm_jax/convert/stream.py, launch/convert.py) and slice-by-slice loading
(glm_jax/sharding/checkpoint_arrays.py), against the public reference and plain formulas.

- A random GLM-5-shaped model written by transformers in BF16, sharded, converts to an Orbax checkpoint; the
  weights launch/sample.py loads from it (trainer.restore_run) give transformers' logits; it converts back to HF
  safetensors bit for bit.
- An FP8 checkpoint made here from the BF16 one (e4m3 in 16 x 16 blocks, partial blocks included, in the release's
  layout: `weight_scale_inv` beside each quantized linear, router and indexer weights_proj unquantized) reads as
  the plain dequantization formula, within e4m3's rounding of the BF16 weights.
- On 8 simulated devices, loading onto an fsdp x expert mesh gives every device exactly its slices, and no read
  returns a whole expert stack (the reads are recorded).
- Bad input is named and leaves nothing behind.
"""

import json
import os
import re
import shutil

import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tokenizers
import torch
from flax import nnx
from transformers import GlmMoeDsaForCausalLM

from glm_jax.configs import glm5_tiny
from glm_jax.convert import fp8, hf, safetensors_io, stream
from glm_jax.model import GlmMoeDsa
from glm_jax.sharding import checkpoint_arrays
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.trainer import restore_run
from tests.convert.test_hf import TOL, hf_logits, make_hf_model, max_diff, token_ids
from tests import helpers

VOCAB = 512  # the embedded tokenizer's size: restore_run checks the model covers it
BLOCK = (16, 16)  # FP8 blocks small enough that the tiny model's weights span several, partial ones included


def run_config(cfg, **mesh):
  """glm5_tiny's run config with `cfg` as its model (float32), in the sparse stage."""
  config = glm5_tiny.get_config()
  config.model = ml_collections.ConfigDict(cfg.replace(param_dtype="float32", dtype="float32").to_dict())
  config.train.dsa_stage = "sparse"
  for axis, size in mesh.items():
    config.mesh[axis] = size
  return config


def all_tensors(path):
  """{name: float32 array} of every tensor of a HF directory, read with the plain reader (FP8 as stored)."""
  out = {}
  for name in sorted(os.listdir(path)):
    if name.endswith(".safetensors"):
      f = safetensors_io.SafetensorsFile(os.path.join(path, name))
      out.update({n: np.asarray(f.read(n), np.float32) for n in f.names()})
  return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
  """(transformers model in float32 with the BF16-rounded weights, its BF16 sharded directory)."""
  path = str(tmp_path_factory.mktemp("stream") / "bf16")
  make_hf_model(vocab_size=VOCAB).to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB")
  reference = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
  return reference, path


@pytest.fixture(scope="module")
def converted(bf16, tmp_path_factory):
  _, path = bf16
  config = run_config(hf.load_config(path))
  out = str(tmp_path_factory.mktemp("stream") / "orbax")
  report = stream.hf_to_orbax(path, out, config)
  return config, out, report


@pytest.mark.slow  # converts and samples a model
def test_bf16_sharded_checkpoint_converts_and_samples_as_transformers(bf16, converted):
  reference, path = bf16
  config, out, report = converted
  assert len(set(json.load(open(os.path.join(path, hf.INDEX_FILE)))["weight_map"].values())) >= 3
  assert report["tensors"] == len([n for n in all_tensors(path)])
  run = restore_run(config, out)  # launch/sample.py's loading path
  assert run.step == stream.STEP
  # It is Orbax's format: Orbax's own restore reads the same arrays.
  state_dir = os.path.join(out, "checkpoints", "0", "state")
  restored = ocp.StandardCheckpointer().restore(state_dir)
  for p, var in nnx.to_flat_state(run.state.params):
    node = restored["params"]
    for key in [*map(str, p), "value"]:
      node = node[key]
    np.testing.assert_array_equal(np.asarray(node), np.asarray(var.get_value()), err_msg=str(p))
  model = nnx.merge(run.graphdef, run.state.params, run.state.rest)
  ids = token_ids(11, 2, 24, VOCAB)  # 24 > index_topk = 8: the indexer selects
  diff = max_diff(model(jnp.asarray(ids)).logits, hf_logits(reference, ids))
  print(f"converted BF16 checkpoint vs transformers: max |dlogit| = {diff:.2e}")
  assert diff <= TOL


@pytest.mark.slow  # an export and a second transformers model
def test_orbax_checkpoint_converts_back_bit_for_bit(bf16, converted, tmp_path):
  reference, path = bf16
  _, out, _ = converted
  report = stream.orbax_to_hf(out, str(tmp_path / "back"), dtype="bfloat16", max_shard_bytes=150_000)
  assert report["files"] > 1
  original, back = all_tensors(path), all_tensors(str(tmp_path / "back"))
  mtp = {n for n in back if n.startswith(f"model.layers.{reference.config.num_hidden_layers}.")}
  assert mtp and set(back) - mtp == set(original)  # the MTP layer initialized on conversion is written too
  for name, value in original.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  again = GlmMoeDsaForCausalLM.from_pretrained(
    str(tmp_path / "back"), dtype=torch.float32, attn_implementation="eager"
  ).eval()
  ids = token_ids(12, 1, 16, VOCAB)
  np.testing.assert_array_equal(hf_logits(again, ids), hf_logits(reference, ids))


# ------------------------------------------------------------------------------------------------------ FP8


def _quantize(w):
  """The release's block scheme, written here from its definition: scale_inv = amax(block) / 448, q = w / scale."""
  rows, cols = fp8.scale_shape(w.shape, BLOCK)
  scale = np.zeros((rows, cols), np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for i in range(rows):
    for j in range(cols):
      blk = w[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
      scale[i, j] = max(float(np.abs(blk).max()), 1e-12) / 448.0
      q[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (blk / scale[i, j]).astype(q.dtype)
  return q, scale


def _is_quantized(name, w):
  """The release's quantized tensors: the layers' linear weights but the router's and weights_proj."""
  return (
    w.ndim == 2
    and (".self_attn." in name or ".mlp." in name)
    and "norm" not in name
    and not name.endswith(("mlp.gate.weight", "weights_proj.weight"))
  )


@pytest.fixture(scope="module")
def fp8_dir(bf16, tmp_path_factory):
  _, path = bf16
  out = str(tmp_path_factory.mktemp("stream") / "fp8")
  os.makedirs(out)
  cfg = json.load(open(os.path.join(path, "config.json")))
  cfg["quantization_config"] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
  }
  json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
  tensors = {}
  for name, w in all_tensors(path).items():
    if _is_quantized(name, w):
      tensors[name], tensors[name + "_scale_inv"] = _quantize(w)
    else:
      tensors[name] = w.astype(ml_dtypes.bfloat16)
  names = sorted(tensors)  # two files and an index, as the release is laid out
  halves = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
  for fname, part in halves.items():
    safetensors_io.write(
      os.path.join(out, fname), [(n, tensors[n].dtype, tensors[n].shape) for n in part], tensors.__getitem__
    )
  json.dump(
    {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}},
    open(os.path.join(out, hf.INDEX_FILE), "w"),
  )
  return out, tensors


def test_fp8_checkpoint_reads_as_the_dequantization_formula(bf16, fp8_dir):
  _, path = bf16
  out, stored = fp8_dir
  original = all_tensors(path)
  cfg, block = hf.read_config(out)
  assert block == BLOCK
  reader = hf.Reader(out, block)
  quantized = [n for n in original if n + "_scale_inv" in stored]
  assert len(quantized) > 20 and any(n.endswith("mlp.gate.weight") for n in original)
  assert any(fp8.scale_shape(original[n].shape, BLOCK)[0] * BLOCK[0] > original[n].shape[0] for n in quantized)
  for name in quantized:
    q, s = stored[name].astype(np.float32), stored[name + "_scale_inv"]
    plain = q * np.kron(s, np.ones(BLOCK, np.float32))[: q.shape[0], : q.shape[1]]
    got = reader.get(name, np.float32)
    np.testing.assert_array_equal(got, plain, err_msg=name)
    # e4m3 keeps 3 mantissa bits: |w - deq| <= 2^-4 |w| for normal values, plus the subnormal step 2^-9 * scale
    bound = np.abs(original[name]) * 2.0**-4 + np.kron(s, np.ones(BLOCK))[: q.shape[0], : q.shape[1]] * 2.0**-9
    assert np.all(np.abs(got - original[name]) <= bound), name
  for name in set(original) - set(quantized):  # unquantized tensors pass through
    np.testing.assert_array_equal(reader.get(name, np.float32), original[name], err_msg=name)


def test_fp8_checkpoint_converts_to_its_dequantized_weights(fp8_dir, tmp_path):
  out, _ = fp8_dir
  cfg, model = hf.load(out)
  config = run_config(cfg)
  stream.hf_to_orbax(out, str(tmp_path / "orbax"), config)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  with Checkpointer(str(tmp_path / "orbax"), read_only=True) as ckpt:
    got_params, got_rest = ckpt.restore_weights(0, *nnx.split(GlmMoeDsa(cfg, nnx.Rngs(5)), nnx.Param, ...)[1:])
  for want, got in ((params, got_params), (rest, got_rest)):
    for (p, a), (_, b) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got)):
      if p[0] != "mtp":  # hf.load and the converter initialize the missing MTP layer alike; compared elsewhere
        np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), err_msg=str(p))


# -------------------------------------------------------------------------------------------- 8 devices


@helpers.multi_device(8)
def test_under_a_mesh_every_device_reads_exactly_its_slices(tmp_path, monkeypatch):
  from glm_jax.sharding.mesh import make_mesh
  from glm_jax.train.config import model_config_for_stage
  from glm_jax.train.trainer import abstract_train_state

  config = run_config(hf.ModelConfig.from_dict(glm5_tiny.get_config().model), fsdp=4, expert=2)
  cfg = model_config_for_stage(config)
  model = GlmMoeDsa(cfg, nnx.Rngs(3))
  hf.save(cfg, model, str(tmp_path / "hf"), max_shard_bytes=100_000)
  stream.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "orbax"), config)
  mesh = make_mesh(config.mesh)
  state = abstract_train_state(config, cfg, mesh).state  # train.init_from's target: shapes, shardings, no arrays
  reads = []
  real = checkpoint_arrays.read_slice

  def recorded(array, index, dtype):
    out = real(array, index, dtype)
    reads.append((tuple(array.shape), out.size))
    return out

  monkeypatch.setattr(checkpoint_arrays, "read_slice", recorded)
  with Checkpointer(str(tmp_path / "orbax"), read_only=True) as ckpt:
    params, rest = ckpt.restore_weights(0, state.params, state.rest)
  _, want_params, want_rest = nnx.split(model, nnx.Param, ...)
  stacks = 0
  for want, got, target in ((want_params, params, state.params), (want_rest, rest, state.rest)):
    for (p, a), (_, b), (_, c) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got), nnx.to_flat_state(target)):
      full, arr = np.asarray(a.get_value()), b.get_value()
      assert arr.sharding == c.get_value().sharding, p
      for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=f"{p} {shard.device}")
      if "moe_layers" in p and p[-1] in ("gate_proj", "up_proj", "down_proj") and "shared_experts" not in p:
        stacks += 1
        sizes = [n for shape, n in reads if shape == full.shape]
        assert sizes and max(sizes) <= full.size // 8, (p, sizes)  # fsdp x expert: an eighth each, never more
  assert stacks == 3


# ---------------------------------------------------------------------------------------------- bad input


def _listing(path):
  return sorted(os.listdir(path))


def test_bad_directories_are_named(bf16, tmp_path):
  _, path = bf16
  with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path}: no config.json")):
    stream.hf_to_orbax(str(tmp_path), str(tmp_path / "out"))
  bad = tmp_path / "other"
  shutil.copytree(path, bad)
  cfg = json.load(open(bad / "config.json"))
  json.dump({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}}, open(bad / "config.json", "w"))
  with pytest.raises(ValueError, match=r"quantization_config.quant_method='awq'; only 'fp8'"):
    stream.hf_to_orbax(str(bad), str(tmp_path / "out"))
  json.dump({**cfg, "model_type": "llama"}, open(bad / "config.json", "w"))
  with pytest.raises(ValueError, match=r"model_type='llama'; expected 'glm_moe_dsa'"):
    stream.hf_to_orbax(str(bad), str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def test_truncated_missing_and_misshapen_tensors_are_named(bf16, tmp_path):
  _, path = bf16
  shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
  cases = {}
  trunc = tmp_path / "trunc"
  shutil.copytree(path, trunc)
  data = open(trunc / shard, "rb").read()
  open(trunc / shard, "wb").write(data[: len(data) // 2])
  cases[trunc] = re.escape(f"{trunc / shard}: cannot be read as safetensors (truncated or corrupt: ")
  tensors = all_tensors(path)
  name = "model.layers.1.self_attn.kv_b_proj.weight"
  for kind, edit in (
    ("missing", lambda t: t.pop(name)),
    ("shape", lambda t: t.update({name: np.zeros((3, 5), np.float32)})),
  ):
    d = tmp_path / kind
    os.makedirs(d)
    shutil.copy(os.path.join(path, "config.json"), d)
    t = dict(tensors)
    edit(t)
    safetensors_io.write(
      str(d / hf.SINGLE_FILE), [(n, np.dtype(np.float32), v.shape) for n, v in t.items()], t.__getitem__
    )
    cases[d] = re.escape(f"{d}: {'missing tensor' if kind == 'missing' else 'tensor'} {name}")
  for d, message in cases.items():
    before = _listing(d)
    with pytest.raises(ValueError, match="^" + message):
      stream.hf_to_orbax(str(d), str(tmp_path / "out"))
    assert _listing(d) == before and not os.path.exists(tmp_path / "out")


def test_config_mesh_and_out_dir_errors(bf16, tmp_path):
  _, path = bf16
  cfg = hf.load_config(path)
  with pytest.raises(ValueError, match=r"--config's model is not the one in .*hidden_size: config 32, checkpoint 64"):
    stream.hf_to_orbax(path, str(tmp_path / "out"), run_config(cfg.replace(hidden_size=32)))
  with pytest.raises(ValueError, match=r"mesh.*multiplies to 3, but there are 8 devices"):
    stream.hf_to_orbax(path, str(tmp_path / "out"), run_config(cfg, fsdp=3), devices=8)
  with pytest.raises(
    ValueError,
    match=r"--config's mesh .*: parameter dense_layers/mlp/down_proj: dimension of size "
    r"64 is sharded over mesh axis 'fsdp' of size 3, which does not divide it",
  ):
    stream.hf_to_orbax(path, str(tmp_path / "out"), run_config(cfg, fsdp=3), devices=3)
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "keep.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="exists and is not empty"):
    stream.hf_to_orbax(path, str(tmp_path / "full"))
  assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_a_failure_mid_write_leaves_no_checkpoint(bf16, tmp_path, monkeypatch):
  _, path = bf16
  real, calls = hf.Reader.get, []

  def failing(self, name, dtype):
    calls.append(name)
    if len(calls) == 10:
      raise OSError(28, "No space left on device")
    return real(self, name, dtype)

  monkeypatch.setattr(hf.Reader, "get", failing)
  with pytest.raises(OSError, match="No space left"):
    stream.hf_to_orbax(path, str(tmp_path / "out"))
  assert _listing(tmp_path) == []  # neither the checkpoint nor its temporary directory


@pytest.mark.slow  # two launch/convert.py processes
def test_launch_convert_both_ways_without_a_config(bf16, tmp_path):
  """launch/convert.py as a user runs it: without --config the checkpoint keeps config.json's model and dtype
  (bfloat16), and --to_hf writes the same tensors back."""
  import subprocess
  import sys

  from tests.helpers import ROOT

  _, path = bf16
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)

  def convert(*args):
    proc = subprocess.run(
      [sys.executable, "launch/convert.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    return proc.returncode, proc.stdout, proc.stderr

  rc, out, err = convert(f"--hf_dir={path}", f"--out_dir={tmp_path / 'orbax'}")
  assert rc == 0, err[-3000:]
  report = json.loads(out.strip().splitlines()[-1])
  assert report["bytes_written"] < 2 * report["bytes_read"] and report["peak_rss_bytes"] > 0
  saved = json.load(open(tmp_path / "orbax" / "checkpoints" / "0" / "config" / "metadata"))
  assert saved["model"]["param_dtype"] == "bfloat16"
  rc, out, err = convert("--to_hf", f"--workdir={tmp_path / 'orbax'}", f"--out_dir={tmp_path / 'back'}")
  assert rc == 0, err[-3000:]
  back = all_tensors(str(tmp_path / "back"))
  for name, value in all_tensors(path).items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  rc, _, err = convert(f"--hf_dir={path}", f"--out_dir={tmp_path / 'orbax'}")  # not empty: refused, kept
  assert rc == 1 and "exists and is not empty" in err.strip().splitlines()[-1]
  assert os.listdir(tmp_path / "orbax" / "checkpoints") == ["0"]


def _release_tokenizer(path):
  """A tokenizer.json shaped like a GLM release's: a byte-level BPE, then GLM's special tokens added after it (the
  role tokens, the chat format's tags; no <|pad|>)."""
  from glm_jax import chat

  backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=300, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
  )
  backend.train_from_iterator(["What is 37*91? Use the calculator.", "In the beginning God created"] * 5, trainer)
  specials = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", *chat.FORMAT_TOKENS]
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
  backend.save(path)


def test_the_release_tokenizer_is_carried_both_ways(bf16, tmp_path):
  """A release's tokenizer.json is recorded with the converted step: restore_run (launch/sample.py) chats with it as
  transformers reads the file, and --to_hf writes it back; a malformed or oversized one is named, nothing written."""
  from transformers import PreTrainedTokenizerFast

  from glm_jax import chat

  _, path = bf16
  release = str(tmp_path / "release")
  shutil.copytree(path, release)
  _release_tokenizer(os.path.join(release, "tokenizer.json"))
  config = run_config(hf.load_config(release))
  report = stream.hf_to_orbax(release, str(tmp_path / "orbax"), config)
  assert report["tokenizer"] == os.path.join(release, "tokenizer.json")
  tok = restore_run(config, str(tmp_path / "orbax")).tokenizer
  added = {t["content"]: t["id"] for t in json.load(open(os.path.join(release, "tokenizer.json")))["added_tokens"]}
  assert tok.chat_ids == {t: added[t] for t in tok.chat_ids}  # the release's own ids
  assert tok.pad_id == max(added.values()) + 1  # the one role it lacks, added after its last id
  text = chat.render(
    [
      {"role": "user", "content": "What is 37*91?"},
      {"role": "assistant", "content": "3367"},
      {"role": "user", "content": "ok"},
    ],
    add_generation_prompt=True,
  )
  expected = PreTrainedTokenizerFast(tokenizer_file=os.path.join(release, "tokenizer.json"))
  assert tok.encode_chat(text) == expected(text, add_special_tokens=False)["input_ids"]
  stream.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
  back = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "back" / "tokenizer.json"))
  assert back(text, add_special_tokens=False)["input_ids"] == tok.encode_chat(text)

  for content, match in [
    ("{not json", r"tokenizer\.json: not a valid tokenizer\.json"),
    (None, r"needs 607 ids, with the 7 special tokens added that it lacks, but config\.json's vocab_size=512"),
  ]:
    if content is None:
      backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0"))
      content = backend.to_str()
    with open(os.path.join(release, "tokenizer.json"), "w") as f:
      f.write(content)
    with pytest.raises(ValueError, match=match):
      stream.hf_to_orbax(release, str(tmp_path / "refused"), config)
    assert not os.path.exists(tmp_path / "refused")
