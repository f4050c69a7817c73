"""The notebooks (notebooks/*.ipynb) run top to bottom, headless, with their parameters shrunk to seconds; a cell
that raises fails the test (each notebook asserts its own numbers: the kernels against their references, the
metrics its runs log). Checked in, they carry no outputs, so none can be stale."""

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ROOT

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


def execute(name, workdir, data_cache_dir):
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  values = {**SHRINK[name]}
  for key, value in (("WORKDIR", str(workdir)), ("DATA_CACHE_DIR", data_cache_dir)):
    if f"\n{key} = " in "\n" + nb.cells[at].source:
      values[key] = value
  injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items()))
  injected.metadata["tags"] = ["injected-parameters"]
  nb.cells.insert(at + 1, injected)
  # The kernel runs in the repository root (as in a checkout) with this environment (JAX_PLATFORMS=cpu, the venv).
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  return nb


def outputs(nb, kind):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == kind]


@pytest.mark.slow
@pytest.mark.usefixtures("shared_compilation_cache")  # the kernel inherits it through the environment
@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_runs_top_to_bottom(name, tmp_path, data_cache_dir):
  nb = execute(name, tmp_path / "work", data_cache_dir)
  assert not outputs(nb, "error")
  images = [o for kind in ("display_data", "execute_result") for o in outputs(nb, kind) if "image/png" in o["data"]]
  assert images, f"{name} showed no figure"
  if name != "dsa_kernels.ipynb":
    assert any(os.path.exists(os.path.join(d, "metrics.jsonl")) for d, _, _ in os.walk(tmp_path / "work"))
  text = json.dumps([o.get("text", "") for o in outputs(nb, "stream")])
  if name == "dsa_kernels.ipynb":
    assert "100.00% of the indices equal the reference's" in text
