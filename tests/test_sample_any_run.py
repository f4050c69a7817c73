"""launch/sample.py and launch/quantize.py on any run without --config (glm_jax/restore.py): a GRPO, a distillation and
an SFT run (with INT4 QAT) and a packed model each print the text an in-process Sampler gives on weights restored
the trainers' own way (the RL policy's whole TrainState, restore_run, load_packed), greedy or seeded; --prompts_file,
--num_samples, --batch_size, --chat and --config.* overrides of the recorded config; each bad input is one line naming
the flag, and nothing is written.

The runs are the shipped configs at one step, on a model of two layers without the MTP layer (a shorter compile)."""

import json
import os

import jax
import numpy as np
import pytest

import glm_jax.configs.distill_tiny
import glm_jax.configs.grpo_tiny
import glm_jax.configs.sft_tiny
from glm_jax import chat
from glm_jax.data import Tokenizer
from glm_jax.inference import Sampler, SamplingParams
from glm_jax.model import ModelConfig
from glm_jax.model.quantization import pack_params, quant_plan
from glm_jax.rl import trainer as rl_trainer
from glm_jax.rl import warm_start
from glm_jax.rl.tasks import CharVocab
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.config import model_config_for_stage
from glm_jax.train.packed_checkpoint import load_packed
from glm_jax.train.trainer import restore_run, train_and_evaluate
from tests.train import runs

SMALL = {"num_hidden_layers": 2, "num_nextn_predict_layers": 0}
VERSES = [
  ("Genesis 1:1\n", "In the beginning God created the heaven and the earth."),
  ("Genesis 1:3\n", "And God said, Let there be light: and there was light."),
  ("John 11:35\n", "Jesus wept."),
  ("Genesis 1:5\n", "And God called the light Day, and the darkness he called Night."),
]


def run_scripts(*commands):
  """Runs each [script, args...] from the repository root as a user runs it, one after another (tests/train/runs.py:
  run_script); their CompletedProcesses."""
  return [runs.run_script(*command) for command in commands]


def ok(proc) -> list[str]:
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.splitlines()


def samples(proc) -> tuple[str, str]:
  """(the samples launch/sample.py printed on stdout, the last line of stderr: the tokens a second); a sample's text
  may hold newlines."""
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, proc.stderr.strip().splitlines()[-1]


def error_line(proc) -> str:
  assert proc.returncode != 0, proc.stdout[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc.stderr.strip().splitlines()[-1]


def shown(tokenizer, ids) -> str:
  """The text launch/sample.py documents: the tokenizer's text, an id outside the tokenizer as <id N>."""
  out, run = "", []
  for i in ids:
    if i < tokenizer.vocab_size:
      run.append(i)
    else:
      out += tokenizer.decode(run) + f"<id {i}>"
      run = []
  return out + tokenizer.decode(run)


def greedy(graphdef, cfg, params, rest, prompts, stops, pad_id, max_new, *, temperature=0.0, key=None, width=None):
  """The in-process reference: one Sampler call on these rows; each row's tokens (prompt, then response)."""
  sampling = SamplingParams(max_new_tokens=max_new, temperature=temperature, stop_ids=stops, pad_id=pad_id)
  sampler = Sampler(graphdef, cfg, sampling, width=width or max(map(len, prompts)))
  out = jax.device_get(sampler(params, rest, prompts, jax.random.key(0) if key is None else key))
  return [np.asarray(out.tokens[r, : int(out.lengths[r])]).tolist() for r in range(len(prompts))], out


def rl_policy(workdir, config):
  """(graphdef, cfg, params, rest) of an RL run's latest checkpoint: its whole TrainState, as the trainer resumes."""
  cfg = ModelConfig.from_dict(config.model)
  graphdef, state, _, _ = warm_start.make_policy(cfg, config.optimizer, 0, config.rl.freeze_indexer)
  with Checkpointer(workdir, read_only=True) as ckpt:
    state = ckpt.restore(ckpt.latest_step(), state)
  return graphdef, cfg, state.params, state.rest


def quiet_rl(config, **rl):
  config.model.update(SMALL)
  config.sft.steps = 0
  config.rl.update(dict(tensorboard=False, steps=1, eval_prompts=2, eval_every=1000, checkpoint_every=1, **rl))
  return config


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("grpo"))
  config = quiet_rl(glm_jax.configs.grpo_tiny.get_config(), prompts_per_step=2, group_size=2)
  rl_trainer.run(config, workdir)
  return workdir, config


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, grpo_run):
  """Both teachers are the GRPO run's policy (teachers.<name>.init_from): no teacher is fine-tuned here."""
  workdir = str(tmp_path_factory.mktemp("distill"))
  config = quiet_rl(glm_jax.configs.distill_tiny.get_config(), prompts_per_step=4, max_new_tokens=3)
  for teacher in config.teachers.values():
    teacher.init_from = grpo_run[0]
  rl_trainer.run(config, workdir)
  return workdir, config


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, data_cache_dir):
  """configs/sft_tiny.py (INT4 QAT in groups of 32; here of every matmul weight of the layers, not the routed experts
  only) for one step on four verses (a jsonl: its BPE is trained on them, and has the chat format's tokens)."""
  root = tmp_path_factory.mktemp("sft")
  data = root / "verses.jsonl"
  data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in VERSES))
  config = glm_jax.configs.sft_tiny.get_config()
  config.model.update(SMALL)
  config.quant.scope = "routed_experts,shared_experts,dense_mlp,attention"  # QAT that moves the greedy text
  config.data.update(
    dict(source="jsonl", path=str(data), eval_fraction=0.0, seq_len=32, batch_size=2, cache_dir=data_cache_dir)
  )
  config.train.update(dict(steps=1, checkpoint_every=1, eval_every=1000, tensorboard=False))
  workdir = str(root / "run")
  train_and_evaluate(config, workdir)
  return workdir, config


def sft_reference(workdir, config, texts, chat_stops, max_new, *, qat=True):
  """(restore_run's run, each text's greedy tokens): the run restored as before glm_jax/restore.py (restore_run, with
  the run's config), its weights packed by config.quant (the QAT model) unless qat=False. chat_stops: the texts are
  rendered chats, stopped at these tokens (else plain text, stopped at eos)."""
  run = restore_run(config, workdir)
  tok, params = run.tokenizer, run.state.params
  if qat:
    params = pack_params(params, quant_plan(params, config.quant))
  if chat_stops:
    prompts, stops = [tok.encode_chat(t) for t in texts], tuple(tok.chat_ids[s] for s in chat_stops)
  else:
    prompts, stops = [tok.encode(t) for t in texts], (tok.eos_id,)
  rows, _ = greedy(run.graphdef, run.model_cfg, params, run.state.rest, prompts, stops, tok.pad_id, max_new)
  return run, rows


# ------------------------------------------------------------------------------------------------ runs of each kind
# Each test computes its reference first: the script's identical sampling program then comes from the suite's
# persistent compilation cache (tests/conftest.py).


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "distill"])
def test_sample_py_on_an_rl_run_without_config(kind, request):
  """A GRPO and a distillation run (config.trainer "grpo" / "distill": no train section, a CharVocab) sampled from
  the command line with nothing but --workdir."""
  workdir, config = request.getfixturevalue(f"{kind}_run")
  vocab = CharVocab()
  graphdef, cfg, params, rest = rl_policy(workdir, config)
  rows, _ = greedy(graphdef, cfg, params, rest, [vocab.encode("3+4=")], (vocab.eos_id,), vocab.pad_id, 3)
  (proc,) = run_scripts(
    ["launch/sample.py", f"--workdir={workdir}", "--prompt=3+4=", "--max_new_tokens=3", "--temperature=0"]
  )
  text, last = samples(proc)
  assert text == "[step 1] " + shown(vocab, rows[0]) + "\n"
  assert last.startswith(f"{len(rows[0]) - 4} tokens generated in ")


@pytest.mark.slow
def test_sample_py_on_an_sft_run_samples_the_qat_model(sft_run):
  """An SFT run with INT4 QAT: sampled from its weights packed by its quant section (the model it trained); with
  --config.quant.scheme=none (an override of the recorded config, without --config) from the unquantized ones.
  An override that changes the model's shapes is refused by name."""
  workdir, config = sft_run
  run, want_qat = sft_reference(workdir, config, ["Genesis 1:3\n"], None, 6)
  _, want_plain = sft_reference(workdir, config, ["Genesis 1:3\n"], None, 6, qat=False)
  args = ["launch/sample.py", f"--workdir={workdir}", "--prompt=Genesis 1:3\n", "--max_new_tokens=6", "--temperature=0"]
  qat, plain, deeper = run_scripts(
    args, [*args, "--config.quant.scheme=none"], [*args, "--config.model.num_hidden_layers=3"]
  )
  assert samples(qat)[0] == "[step 1, int4 (QAT)] " + shown(run.tokenizer, want_qat[0]) + "\n"
  assert samples(plain)[0] == "[step 1] " + shown(run.tokenizer, want_plain[0]) + "\n"
  assert want_plain != want_qat  # the QAT model is not the unquantized one
  assert "incompatible config: model.num_hidden_layers: checkpoint 2, config 3." in error_line(deeper)


@pytest.mark.slow
def test_quantize_py_without_config_then_sample_py_on_the_packed_model(sft_run, tmp_path):
  """launch/quantize.py on the SFT run with only --workdir (the quant section's group size from the recorded config),
  then launch/sample.py --packed: the packed model's text is load_packed's in-process, and the QAT run's own text
  (the same quantizer, the same plan)."""
  workdir, config = sft_run
  out = str(tmp_path / "int4")
  (proc,) = run_scripts(["launch/quantize.py", f"--workdir={workdir}", "--scheme=int4", f"--out={out}"])
  meta = json.loads(ok(proc)[-1])
  assert (meta["scheme"], meta["group_size"], meta["source_step"]) == ("int4", 32, 1)
  packed = load_packed(out, model_config_for_stage(config), need_tokenizer=True)
  tok = Tokenizer.from_record(packed.tokenizer)
  prompt = [tok.encode("Genesis 1:3\n")]
  rows, _ = greedy(packed.graphdef, packed.model_cfg, packed.params, packed.rest, prompt, (tok.eos_id,), tok.pad_id, 6)
  _, qat = sft_reference(workdir, config, ["Genesis 1:3\n"], None, 6)
  assert rows == qat
  (proc,) = run_scripts(
    ["launch/sample.py", f"--packed={out}", "--prompt=Genesis 1:3\n", "--max_new_tokens=6", "--temperature=0"]
  )
  assert samples(proc)[0] == "[step 1, int4] " + shown(tok, rows[0]) + "\n"


@pytest.mark.slow
def test_sample_py_on_a_converted_checkpoint(tmp_path):
  """launch/convert.py's weights-only checkpoint of a HF directory converted without a run config (its config item is
  the model section alone) and with the release's tokenizer.json, sampled with nothing but --workdir; the reference
  reads the arrays with Orbax's own restore onto the model of config.json (DSA on: no DSA stage without a train
  section)."""
  import orbax.checkpoint as ocp
  import tokenizers
  from flax import nnx

  from glm_jax.convert import hf, stream
  from glm_jax.data import SPECIAL_TOKENS
  from glm_jax.model import GlmMoeDsa
  from tests.convert.test_untrusted import write_hf
  from tests.helpers import TINY_MODEL

  hf_dir = write_hf(str(tmp_path / "hf"), TINY_MODEL)
  words = "in the beginning god created heaven and earth".split()
  vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *words])}  # 30 ids of the model's 40
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.save(os.path.join(hf_dir, "tokenizer.json"))
  out = str(tmp_path / "converted")
  stream.hf_to_orbax(hf_dir, out)
  tok = Tokenizer(backend, "words")
  cfg = hf.load_config(hf_dir)
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param, ...)
  with ocp.StandardCheckpointer() as ckptr:
    stored = ckptr.restore(os.path.join(out, "checkpoints", "0", "state"))

  def filled(state, kind):
    flat = []
    for path, var in nnx.to_flat_state(state):
      node = stored[kind]
      for key in [*map(str, path), "value"]:
        node = node[key]
      # committed to the device, as the script reads its weights: its sampling program is then this one
      flat.append((path, var.replace(value=jax.device_put(node, jax.local_devices()[0]))))
    return nnx.from_flat_state(flat)

  prompt = tok.encode("in the beginning")
  rows, _ = greedy(
    graphdef, cfg, filled(params, "params"), filled(rest, "rest"), [prompt], (tok.eos_id,), tok.pad_id, 5
  )
  (proc,) = run_scripts(
    ["launch/sample.py", f"--workdir={out}", "--prompt=in the beginning", "--max_new_tokens=5", "--temperature=0"]
  )
  assert samples(proc)[0] == "[step 0] " + shown(tok, rows[0]) + "\n"
  assert len(rows[0]) == len(prompt) + 5 and tok.eos_id not in rows[0]  # five tokens of text, not a bare stop


# ------------------------------------------------------------------------------------- prompts, samples and chat


@pytest.mark.slow
def test_prompts_file_num_samples_and_batches(grpo_run, tmp_path):
  """Two prompts from a jsonl, three samples each at temperature 1, two rows a batch: the rows prompt-major, batch b
  drawn with fold_in(key(seed), b) (batch 0 with key(seed)), the last batch filled with its last row; the tokens
  counted are the samples' responses."""
  workdir, config = grpo_run
  vocab = CharVocab()
  graphdef, cfg, params, rest = rl_policy(workdir, config)
  p1, p2 = vocab.encode("3+4="), vocab.encode("9+9=")
  batches = [[p1, p1, p1, p2], [p2, p2, p2, p2]]  # the last one filled with its last row: two samples kept
  key = jax.random.key(5)
  want, generated = [], 0
  for b, (batch, kept) in enumerate(zip(batches, (4, 2))):
    batch_key = key if b == 0 else jax.random.fold_in(key, b)
    got, out = greedy(graphdef, cfg, params, rest, batch, (1,), 0, 3, temperature=1.0, key=batch_key)
    want += got[:kept]
    generated += int(np.sum((out.lengths - out.prompt_lens)[:kept]))
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "3+4="}\n\n{"prompt": "9+9=", "answer": "18"}\n')
  flags = ["--max_new_tokens=3", "--temperature=1", "--seed=5", "--num_samples=3", "--batch_size=4"]
  (proc,) = run_scripts(["launch/sample.py", f"--workdir={workdir}", f"--prompts_file={path}", *flags])
  text, last = samples(proc)
  assert text == "".join(
    f"[step 1] prompt {i // 3 + 1}, sample {i % 3 + 1}: " + shown(vocab, w) + "\n" for i, w in enumerate(want)
  )
  assert last.startswith(f"{generated} tokens generated in ") and "6 sample(s) in 2 batch(es) of 4 rows" in last


@pytest.mark.slow
def test_chat_wraps_each_prompt_as_a_user_turn(sft_run, grpo_run):
  """--chat: the prompt rendered as GLM-5's chat template with the generation prompt, generation stopped at the
  format's stop tokens, the reply printed alone. A run whose tokenizer has no chat tokens is refused by name."""
  workdir, config = sft_run
  text = "[gMASK]<sop><|user|>Who wept?<|assistant|><think>"
  assert chat.render([{"role": "user", "content": "Who wept?"}], add_generation_prompt=True) == text
  run, rows = sft_reference(workdir, config, [text], ("<|endoftext|>", "<|user|>", "<|observation|>"), 5)
  stops = [run.tokenizer.chat_ids[s] for s in ("<|endoftext|>", "<|user|>", "<|observation|>")]
  reply = rows[0][len(run.tokenizer.encode_chat(text)) :]
  reply = reply[:-1] if reply and reply[-1] in stops else reply
  args = ["--chat", "--prompt=Who wept?", "--max_new_tokens=5", "--temperature=0"]
  proc, refused = run_scripts(
    ["launch/sample.py", f"--workdir={workdir}", *args], ["launch/sample.py", f"--workdir={grpo_run[0]}", *args]
  )
  assert samples(proc)[0] == "[step 1, int4 (QAT)] " + shown(run.tokenizer, reply) + "\n"
  assert error_line(refused).startswith("error: --chat: the run cannot chat: tokenizer CharVocab(")


# ------------------------------------------------------------------------------------------------------ bad input


@pytest.mark.slow  # starts the launch scripts
def test_bad_input_is_one_line_naming_the_flag(tmp_path):
  """Each refused before any run is read or anything written."""
  nothing = tmp_path / "nothing"  # a directory without checkpoints
  nothing.mkdir()
  unsaved = tmp_path / "unsaved"  # a checkpoints directory without a complete step (Orbax's temporary one only)
  (unsaved / "checkpoints" / "1.orbax-checkpoint-tmp-0").mkdir(parents=True)
  no_run = (
    f"--workdir={nothing}: no checkpoints directory ({nothing}/checkpoints does not exist); give a run's directory: "
    "launch/train.py's --workdir or launch/convert.py's --out_dir"
  )
  cases = [
    (
      ["launch/sample.py", f"--workdir={nothing}", "--num_samples=0"],
      "error: --num_samples=0 is invalid; must be an integer >= 1 (the samples drawn for each prompt)",
    ),
    (
      ["launch/sample.py", f"--workdir={nothing}", f"--prompts_file={tmp_path}/missing.jsonl", "--batch_size=2"],
      f'error: --prompts_file={tmp_path}/missing.jsonl: no such file; give a JSON-lines file, one {{"prompt": "..."}} '
      "a line",
    ),
    (["launch/sample.py", f"--workdir={nothing}"], f"error: {no_run}"),
    (
      ["launch/sample.py", f"--workdir={unsaved}"],
      f"error: --workdir={unsaved}: no complete checkpoint in {unsaved}/checkpoints (a run stopped before its first "
      "save has none); give a run's directory: launch/train.py's --workdir or launch/convert.py's --out_dir",
    ),
    (
      ["launch/sample.py", f"--workdir={nothing}", "--config.model.attention_impl=pallas"],
      f"error: Configuration is not available because of an earlier failure to load: {no_run} (--helpfull lists the "
      "flags)",
    ),
    (
      ["launch/sample.py", "--prompt=x"],
      "error: --workdir is required: give a run's directory (or --packed, a packed model's)",
    ),
    (["launch/quantize.py", f"--workdir={nothing}", "--scheme=int4", f"--out={tmp_path}/out"], f"error: {no_run}"),
  ]
  for proc, (_, want) in zip(run_scripts(*[args for args, _ in cases]), cases):
    assert proc.returncode in (1, 2) and error_line(proc) == want, proc.args
  assert sorted(os.listdir(nothing)) == [] and not os.path.exists(tmp_path / "out")
  assert os.listdir(unsaved / "checkpoints") == ["1.orbax-checkpoint-tmp-0"]


def test_a_prompts_file_is_json_lines_of_prompts(tmp_path):
  """One {"prompt": ...} a line, other keys ignored, blank lines skipped; an empty file or another line is refused
  by line number."""
  from glm_jax.launch.sample import read_prompts

  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "Genesis 1:1\\n", "response": "In the beginning"}\n\n{"prompt": ""}\n')
  assert read_prompts(str(path)) == ["Genesis 1:1\n", ""]
  path.write_text("\n \n")
  with pytest.raises(
    ValueError, match=r'^--prompts_file=.*: the file holds no prompt; give one \{"prompt": "..."\} a line$'
  ):
    read_prompts(str(path))
  path.write_text('{"prompt": "a"}\n["not", "an", "object"]\n')
  with pytest.raises(ValueError, match=r'--prompts_file=.*: line 2 is not an object with a string "prompt"'):
    read_prompts(str(path))
  path.write_text('{"prompt": "a"}\n{"prompt": 3\n')
  with pytest.raises(ValueError, match=r"--prompts_file=.*: line 2 is not JSON \(Expecting"):
    read_prompts(str(path))


def test_a_packed_flag_without_a_packed_model_names_it(tmp_path):
  from glm_jax import restore

  with pytest.raises(FileNotFoundError, match=f"^--packed={tmp_path}: {tmp_path}: not a packed model"):
    restore.load_packed_model(str(tmp_path))


def test_a_char_vocab_record_rebuilds_the_vocabulary():
  """An RL run records its CharVocab by name and hash (no JSON); from_record rebuilds it and refuses a record whose
  alphabet does not hash to the recorded sha256, or that is not a CharVocab's."""
  vocab = CharVocab("ab,'\"")
  assert CharVocab.from_record(vocab.record()) == vocab
  assert CharVocab.from_record(CharVocab().record()).encode("3+4=") == [5, 12, 6, 13]
  with pytest.raises(ValueError, match="its alphabet hashes to"):
    CharVocab.from_record(dict(vocab.record(), sha256="0" * 64))
  with pytest.raises(ValueError, match="not a CharVocab's"):
    CharVocab.from_record({"name": "CharVocab(__import__('os'))", "sha256": "0", "vocab_size": 3})
