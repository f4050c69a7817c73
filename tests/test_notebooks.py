"""The notebooks (notebooks/*.ipynb) run top to bottom, headless, with their parameters shrunk to seconds; a cell
that raises fails the test. Each notebook asserts its own numbers at any length (the kernels against their references;
a training run's summaries against its metrics.jsonl, its checkpoints and recomputations), and its learning claims
at full length. Then the test reads the metrics.jsonl files the runs wrote and checks what the notebook printed
against them. Checked in, the notebooks carry no outputs, so none can be stale.

CI runs one notebook, in the checkout's environment; the others are marked `maintainer` (run with --maintainer). The
package a user installs is checked here too: its wheel, built once from a clean copy of the repository, holds the
package and declares its dependencies and extras, and installed in a fresh venv it runs an entry point from anywhere."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile

import nbformat
import pytest

from tests.helpers import ROOT, requirement_name

NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))

# Each notebook's parameters for a run of seconds (papermill's convention: a cell after the one tagged "parameters").
SHRINK = {
  "pretrain_dsa.ipynb": dict(DENSE_STEPS=4, WARMUP_STEPS=2, SPARSE_STEPS=2, MAX_NEW_TOKENS=4),
  # the RL trainer tests' batch shapes (tests/rl/test_trainer.py), so the compilation cache serves both
  "grpo_icepop.ipynb": dict(STEPS=2, SFT_STEPS=2, PROMPTS_PER_STEP=64, EVAL_PROMPTS=256),
  "distillation.ipynb": dict(STEPS=2, TEACHER_SFT_STEPS=2, STUDENT_SFT_STEPS=2, PROMPTS_PER_STEP=32, EVAL_PROMPTS=8),
  "dsa_kernels.ipynb": dict(T=64, TOPK=16, MEMORY_SEQ_LENS=[2048]),
}


def test_every_notebook_has_shrunk_parameters_and_no_outputs():
  assert sorted(SHRINK) == NAMES
  for name in NAMES:
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: one cell tagged 'parameters'"
    for key in SHRINK[name]:
      assert f"\n{key} = " in "\n" + tagged[0].source, f"{name}: its parameters cell has no {key}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{name} carries outputs; clear them"


def test_the_repository_url_is_given_once():
  """pyproject.toml's Homepage is the notebooks' REPO_URL, and each notebook's Open-in-Colab link (its own and the
  README's)."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    url = tomllib.load(f)["project"]["urls"]["Homepage"]
  github = url.removeprefix("https://github.com/")
  readme = open(os.path.join(ROOT, "README.md")).read()
  for name in NAMES:
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    colab = f"https://colab.research.google.com/github/{github}/blob/main/notebooks/{name}"
    assert re.findall(r'REPO_URL = "([^"]+)"', "".join(c.source for c in nb.cells)) == [url], name
    assert colab in nb.cells[0].source and colab in readme, name
  assert sorted(set(re.findall(r"colab\.research\.google\.com/github/[^)]+/notebooks/([\w.]+)", readme))) == NAMES


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory):
  """glm-jax's wheel, built (pip wheel, as a user's pip install does) from a clean copy of the repository: its
  tracked and untracked-but-not-ignored files, as a clone has them."""
  root = tmp_path_factory.mktemp("wheel")
  listed = subprocess.run(
    ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.split("\0")
  copy = root / "glm-jax"
  for rel in filter(None, listed):
    src, dst = os.path.join(ROOT, rel), copy / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(src):
      os.symlink(os.readlink(src), dst)
    elif os.path.isfile(src):
      shutil.copy2(src, dst)
  subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), str(copy)],
    check=True,
    capture_output=True,
    env=_clean_env(),
  )
  (wheel,) = (root / "dist").glob("glm_jax-*.whl")
  return wheel


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory, built_wheel):
  """A fresh venv's python with the wheel installed. The venv reuses this environment's dependencies through a .pth
  line naming its site-packages (a path line: the .pth files there, such as the checkout's editable install, are not
  run), so the source tree is not on its sys.path."""
  root = tmp_path_factory.mktemp("pip_install")
  venv.create(root / "venv", with_pip=False)
  python = str(root / "venv" / "bin" / "python")
  site = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
  ).stdout.strip()
  with open(os.path.join(site, "ci_dependencies.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  subprocess.run(
    [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(built_wheel)],
    check=True,
    capture_output=True,
    env=_clean_env(),
  )
  return python


def test_the_wheel_holds_the_package_and_declares_its_extras(built_wheel):
  """Every module of glm_jax and pallas_kernels (the configs and entry points among them) and nothing else of the
  repository; the dependencies pyproject.toml declares, the test-only and feature ones only in extras."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  with zipfile.ZipFile(built_wheel) as z:
    names = set(z.namelist())
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = z.read(meta).decode()
  tracked = subprocess.run(["git", "ls-files", "glm_jax", "pallas_kernels"], cwd=ROOT, capture_output=True, text=True)
  modules = {p for p in tracked.stdout.split() if p.endswith(".py")}
  assert {n for n in names if n.endswith(".py")} == modules
  assert {"glm_jax/launch/train.py", "glm_jax/configs/glm5_tiny.py", "pallas_kernels/sparse_mla_attention.py"} <= names
  core = {requirement_name(r) for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) if "extra ==" not in r}
  assert core == {requirement_name(r) for r in project["dependencies"]}
  assert not core & {"torch", "transformers", "fastapi", "uvicorn", "matplotlib", "httpx", "libtpu", "pytest"}
  extras = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
  assert extras == set(project["optional-dependencies"]) == {"serve", "plots", "tensorboard", "tpu", "gpu", "test"}
  assert re.search(r"^Requires-Dist: fastapi\S* ?;.*extra == \"serve\"", metadata, re.M)
  assert re.search(r"^Requires-Dist: matplotlib\S* ?;.*extra == \"plots\"", metadata, re.M)


def _clean_env():
  """This environment without PYTHONPATH (the checkout on it would shadow the installed package)."""
  return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def execute(name, workdir, data_cache_dir, python):
  """Runs notebook `name` in a kernel of `python`, in a directory outside the checkout."""
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  values = {**SHRINK[name]}
  for key, value in (("WORKDIR", str(workdir)), ("DATA_CACHE_DIR", data_cache_dir)):
    if f"\n{key} = " in "\n" + nb.cells[at].source:
      values[key] = value
  injected = nbformat.v4.new_code_cell(
    "\n".join(f"{k} = {v!r}" for k, v in values.items()) + "\nimport glm_jax\nprint('glm_jax from', glm_jax.__file__)"
  )
  injected.metadata["tags"] = ["injected-parameters"]
  nb.cells.insert(at + 1, injected)
  run_dir = os.path.dirname(str(workdir))
  path = os.path.join(run_dir, "notebook.ipynb")
  nbformat.write(nb, path)
  # The kernel is the venv's python (jupyter_client runs a "python3" kernel with the launching interpreter).
  code = (
    "import sys, nbformat\nfrom nbclient import NotebookClient\n"
    "nb = nbformat.read(sys.argv[1], as_version=4)\n"
    "NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': sys.argv[2]}}).execute()\n"
    "nbformat.write(nb, sys.argv[1])\n"
  )
  proc = subprocess.run(
    [python, "-c", code, path, run_dir], cwd=run_dir, capture_output=True, text=True, env=_clean_env()
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return nbformat.read(path, as_version=4)


@pytest.mark.slow
def test_the_installed_package_runs_the_launch_scripts_from_anywhere(installed_python, tmp_path):
  """`python -m glm_jax.launch.X --config=configs/NAME.py` in a directory without configs/, after pip install: the
  installed script and config (the venv's, not the checkout's), whose parameter counts are the checkout's."""

  def model_info(python, config, cwd, env=None):
    command = [python, "-m", "glm_jax.launch.model_info", f"--config={config}"]
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

  where = subprocess.run(
    [installed_python, "-c", "import glm_jax.launch.model_info as m; print(m.__file__)"],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    env=_clean_env(),
  ).stdout.strip()
  assert where.startswith(os.path.dirname(os.path.dirname(installed_python))) and not where.startswith(ROOT)
  for config in ("configs/glm5_tiny.py", "configs/grpo_tiny.py:smoke"):
    installed = model_info(installed_python, config, tmp_path, _clean_env())
    assert installed == model_info(sys.executable, config, ROOT), config


def outputs(nb, kind):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == kind]


# The notebook CI runs (the quickest: the kernels against their references and a TPU compile, no training); the
# others run with --maintainer (tests/conftest.py).
IN_CI = "dsa_kernels.ipynb"


@pytest.mark.slow
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=() if n == IN_CI else pytest.mark.maintainer) for n in NAMES], ids=NAMES
)
def test_a_notebook_runs_top_to_bottom(name, tmp_path, data_cache_dir):
  nb = execute(name, tmp_path / "work", data_cache_dir, sys.executable)
  assert not outputs(nb, "error")
  (where,) = re.findall(r"glm_jax from (\S+)", stdout(nb))
  assert where == os.path.join(ROOT, "glm_jax", "__init__.py")  # the checkout's: its install cell was skipped
  images = [o for kind in ("display_data", "execute_result") for o in outputs(nb, kind) if "image/png" in o["data"]]
  assert images, f"{name} showed no figure"
  if name != "dsa_kernels.ipynb":
    assert any(os.path.exists(os.path.join(d, "metrics.jsonl")) for d, _, _ in os.walk(tmp_path / "work"))
  text = json.dumps([o.get("text", "") for o in outputs(nb, "stream")])
  if name == "dsa_kernels.ipynb":
    assert "100.00% of the indices equal the reference's" in text
  else:
    CHECK_PRINTED[name](stdout(nb), tmp_path / "work", SHRINK[name])
    # the runs' progress lines (glm_jax/train/progress.py) reach the notebook's output
    assert re.search(r"^\[[\w ]+\] step \d+/\d+  \|", stdout(nb), re.M), "no progress line in the notebook's output"


def stdout(nb) -> str:
  return "".join(o.get("text", "") for o in outputs(nb, "stream") if o.get("name") == "stdout")


def printed_dicts(text: str, first_key: str) -> list[dict]:
  """The dicts the notebook printed whose first key is first_key (print(summary)), parsed."""
  return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{" + repr(first_key) + ":")]


def printed(pattern: str, text: str) -> tuple[str, ...]:
  m = re.search(pattern, text)
  assert m, f"the notebook printed no line matching {pattern!r}"
  return m.groups()


def metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def last(rows: list[dict], key: str) -> dict:
  return [r for r in rows if key in r][-1]


def check_pretrain(text, work, sizes):
  rows = {stage: metrics(work / stage) for stage in ("dense", "warmup", "sparse")}
  dense, sparse = printed_dicts(text, "step")
  for stage, summary in (("dense", dense), ("sparse", sparse)):
    steps = sizes[f"{stage.upper()}_STEPS"]
    assert summary["step"] == steps == rows[stage][-1]["step"] == last(rows[stage], "eval_loss")["step"], stage
    assert summary["eval_loss"] == last(rows[stage], "eval_loss")["eval_loss"], stage
    assert summary["train_loss"] == last(rows[stage], "loss")["loss"], stage
  assert rows["warmup"][-1]["step"] == sizes["WARMUP_STEPS"]
  held = printed(r"held-out loss: dense (\S+), after sparse training (\S+); unigram entropy (\S+)\n", text)
  assert held == tuple(f"{v:.3f}" for v in (dense["eval_loss"], sparse["eval_loss"], dense["unigram_entropy"]))
  # The sparse stage's first step (logged: at these sizes every step is) against the notebook's recomputation of it
  # from the warm-up's weights.
  step1 = next(r for r in rows["sparse"] if r["step"] == 1 and "lm_loss" in r)["lm_loss"]
  logged, recomputed = printed(r"sparse stage, step 1: lm_loss (\S+) logged, (\S+) from the warm-up's weights", text)
  assert logged == f"{step1:.6f}"
  assert abs(float(recomputed) - step1) <= 1e-5 * step1 + 5e-7, (recomputed, step1)  # the notebook's rtol, rounding
  printed(r"(\d+) layers x (\d+) queries: each attended to the top min\(visible keys, (\d+)\)", text)


def check_rl_summary(text, rows, steps) -> dict:
  """The run's summary as printed: its step, its accuracies before and after, against the run's rows."""
  (summary,) = printed_dicts(text, "trainer")
  evals = [r for r in rows if "eval_accuracy" in r]
  assert rows[0]["step"] == 0 and summary["start_eval_accuracy"] == rows[0]["eval_accuracy"]
  assert summary["step"] == steps == rows[-1]["step"] == evals[-1]["step"]
  assert summary["eval_accuracy"] == evals[-1]["eval_accuracy"]
  assert summary["reward_mean"] == rows[-1]["reward_mean"]
  return summary


def check_grpo(text, work, sizes):
  rows = metrics(work)
  check_rl_summary(text, rows, sizes["STEPS"])
  start, end = printed(r"greedy accuracy: (\S+) after the warm start -> (\S+)\n", text)
  assert (start, end) == (f"{rows[0]['eval_accuracy']:.3f}", f"{last(rows, 'eval_accuracy')['eval_accuracy']:.3f}")
  updates, trained, dropped = printed(
    r"(\d+) logged updates of \d+ answers: (\d+) answer tokens trained, (\d+) dropped", text
  )
  assert int(updates) == len(rows) - 1 == sizes["STEPS"]
  assert int(trained) == sum(r["response_tokens"] for r in rows[1:])
  assert int(dropped) == round(sum(r["icepop_drop_frac"] * r["response_tokens"] for r in rows[1:]))


def check_distill(text, work, sizes):
  rows = metrics(work)
  summary = check_rl_summary(text, rows, sizes["STEPS"])
  kl = [r["teacher_kl"] for r in rows if "teacher_kl" in r]
  assert len(kl) == sizes["STEPS"] and summary["teacher_kl"] == kl[-1]
  assert printed(r"teacher_kl: (\S+) at the first step -> (\S+) at the last", text) == (f"{kl[0]:.3f}", f"{kl[-1]:.3f}")


CHECK_PRINTED = {
  "pretrain_dsa.ipynb": check_pretrain,
  "grpo_icepop.ipynb": check_grpo,
  "distillation.ipynb": check_distill,
}
