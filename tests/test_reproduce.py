"""experiments/reproduce.py, the script that writes docs/results.md and the committed figures from the runs: every
figure the README and docs/ cite is one it writes, its numbers over seeds are computed as hand computation says, and
(slow) its whole code path, shrunk to a few steps a run, writes every figure, every result's numbers and the table."""

import json
import os
import re
import subprocess
import sys

import pytest

from experiments import reproduce
from tests.helpers import ROOT


def cited_figures() -> set[str]:
  """The PNG files of experiments/figures/ that README.md and docs/*.md name."""
  texts = [open(os.path.join(ROOT, "README.md")).read()]
  docs = os.path.join(ROOT, "docs")
  texts += [open(os.path.join(docs, n)).read() for n in os.listdir(docs) if n.endswith(".md")]
  names = set()
  for text in texts:
    names |= set(re.findall(r"experiments/figures/([\w.-]+\.png)", text))
  return names


def test_every_cited_and_committed_figure_is_written_by_the_script():
  committed = {n for n in os.listdir(os.path.join(ROOT, "experiments", "figures")) if n.endswith(".png")}
  assert cited_figures() <= set(reproduce.FIGURES), cited_figures() - set(reproduce.FIGURES)
  assert committed <= set(reproduce.FIGURES), committed - set(reproduce.FIGURES)


def test_spread_over_seeds():
  s = reproduce.spread([0.5, 0.25, 0.75])
  assert s.mean == 0.5 and s.fmt() == "0.500 (0.250-0.750)" and s.fmt(1) == "0.5 (0.2-0.8)"
  assert reproduce.spread([0.1234]).fmt() == "0.123"
  assert reproduce.spread([1, 2]).below(reproduce.spread([2.5, 3]))
  assert not reproduce.spread([1, 2.6]).below(reproduce.spread([2.5, 3]))  # overlapping ranges: not in every seed
  assert reproduce.verdict(True, False) == "reproduces"
  assert reproduce.verdict(False, True) == "does not reproduce"
  assert reproduce.verdict(False, False) == "mixed across seeds"


def test_window_means(tmp_path):
  rows = [{"step": i, "reward_mean": float(i)} for i in range(1, 11)] + [{"step": 10, "eval_accuracy": 0.5}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert reproduce.window_means(str(tmp_path), "reward_mean", 3) == (2.0, 9.0)  # (1+2+3)/3, (8+9+10)/3
  assert reproduce.window_means(str(tmp_path), "reward_mean", 20) == (3.0, 8.0)  # at most half the points each
  assert reproduce.window_means(str(tmp_path), "teacher_kl", 3) is None


@pytest.mark.slow
def test_the_shrunk_reproduction_writes_every_figure_and_row(tmp_path):
  """Every result's commands at a few steps (one seed): the figures the README cites, each result's numbers, and a
  table with a measured row for each claim."""
  out = tmp_path / "out"
  proc = subprocess.run(
    [sys.executable, "experiments/reproduce.py", "--shrink", f"--runs={tmp_path / 'runs'}", f"--out={out}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=3000,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(os.listdir(out / "figures")) == sorted(reproduce.FIGURES)
  table = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")][1:]
  assert [line.split(" | ")[0].removeprefix("| ") for line in table] == [r.claim for r in reproduce.RESULTS]
  assert not any("not run" in line for line in table)
  for r in reproduce.RESULTS:
    numbers = json.loads((out / "results" / f"{r.name}.json").read_text())
    assert (
      numbers["claim"] == r.claim
      and numbers["seeds"] == [0]
      and numbers["measured"] in (out / "results.md").read_text()
    )


def test_the_script_replaces_only_its_section(tmp_path):
  page = tmp_path / "results.md"
  page.write_text(f"# Results\nintro\n{reproduce.BEGIN}\nold table\n{reproduce.END}\n\n## Quantization\nkept\n")
  reproduce.write_page(str(page), f"{reproduce.BEGIN}\nnew table\n{reproduce.END}")
  assert (
    page.read_text() == f"# Results\nintro\n{reproduce.BEGIN}\nnew table\n{reproduce.END}\n\n## Quantization\nkept\n"
  )
  fresh = tmp_path / "fresh.md"
  reproduce.write_page(str(fresh), "section")
  assert fresh.read_text() == "section\n"
  # the committed page has the markers once each, so a run of the script replaces only the reproductions' table
  committed = open(os.path.join(ROOT, "docs", "results.md")).read()
  assert committed.count(reproduce.BEGIN) == 1 and committed.count(reproduce.END) == 1
