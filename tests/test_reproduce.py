"""experiments/reproduce.py, the script that writes docs/results.md and the committed figures from the runs: every
figure the README and docs/ cite is one it writes, its numbers over seeds are computed as hand computation says, its
page, figures and numbers are rendered from the runs of a shrunk reproduction (checked in as tests/fixtures/
reproduce_runs) with one result run end to end, and (with --maintainer) every result's commands, shrunk to a few
steps a run, write every figure, every result's numbers and the table."""

import json
import os
import platform
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
  assert s.mean == 0.5 and s.fmt() == "0.500 (0.250 to 0.750)" and s.fmt(1) == "0.5 (0.2 to 0.8)"
  assert reproduce.spread([0.1234]).fmt() == "0.123"
  assert reproduce.spread([12705, 12705, 12705]).fmt(0) == "12,705"  # the same in every seed: shown once
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


FIXTURE_RUNS = os.path.join(ROOT, "tests", "fixtures", "reproduce_runs")
# The figures the script draws from the runs themselves (the sweeps'); the others are drawn by the per-seed scripts
# as they run (experiments/dsa_quality.py, agent_tools.py, glm_stability.py), which the maintainer test covers.
RENDERED_FIGURES = [
  "distill_tiny.png",
  "grpo_tiny.png",
  "icepop.png",
  "optimizer_mtp_curves.png",
  "optimizer_mtp_eval_loss.png",
]


def fixture_runs(target, skip=()):
  """tests/fixtures/reproduce_runs copied to `target`/runs (but the results in `skip`), with `target` as the
  temporary folder the runs name."""
  for folder, _, files in os.walk(FIXTURE_RUNS):
    rel = os.path.relpath(folder, FIXTURE_RUNS)
    if rel.split(os.sep)[0] in skip:
      continue
    for name in files:
      dst = target / "runs" / rel / name
      dst.parent.mkdir(parents=True, exist_ok=True)
      with open(os.path.join(folder, name)) as f:
        dst.write_text(f.read().replace("{TMP}", str(target)))


def reproduce_py(*args):
  proc = subprocess.run(
    [sys.executable, "experiments/reproduce.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=1200
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def check_page_and_numbers(out, figures):
  """The figures drawn, a table with a measured row for each claim, its detail sections, each result's numbers."""
  assert sorted(os.listdir(out / "figures")) == sorted(figures)
  for name in figures:
    assert (out / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
  page = (out / "results.md").read_text()
  table = [line for line in page.split("\n\n###")[0].splitlines() if line.startswith("| ")][1:]  # the main table
  assert [line.split(" | ")[0].removeprefix("| ") for line in table] == [r.claim for r in reproduce.RESULTS]
  assert not any("not run" in line for line in table)
  titles = re.findall(r"^### (.+)$", page, re.M)
  assert len(titles) == sum(r.details is not reproduce.Result.details for r in reproduce.RESULTS) == 4, titles
  for r in reproduce.RESULTS:
    numbers = json.loads((out / "results" / f"{r.name}.json").read_text())
    assert (
      numbers["claim"] == r.claim
      and numbers["seeds"] == [0]
      and numbers["ran_on"] == [reproduce.this_machine()]
      and numbers["measured"] in page
    )


@pytest.mark.slow
def test_one_result_end_to_end_and_the_rest_rendered_from_runs(tmp_path):
  """grpo_tiny's commands shrunk (a sweep of one seed) run here; every other result's runs are the fixture's. Then a
  render of all of them: the sweeps' figures, the table, the numbers."""
  fixture_runs(tmp_path, skip=("grpo_tiny",))
  out, runs = tmp_path / "out", f"--runs={tmp_path / 'runs'}"
  reproduce_py("--shrink", "--only=grpo_tiny", runs, f"--out={out}")
  assert sorted(os.listdir(out / "figures")) == ["grpo_tiny.png"]
  wall = json.loads((tmp_path / "runs" / "grpo_tiny" / "wall_s.json").read_text())
  assert list(wall) == [
    f"launch/sweep.py --config=configs/grpo_tiny.py:smoke --workdir={tmp_path}/runs/grpo_tiny/sweep --sweep=rl.seed=0"
  ]
  reproduce_py("--shrink", "--render_only", runs, f"--out={out}")
  check_page_and_numbers(out, RENDERED_FIGURES)
  assert json.loads((tmp_path / "runs" / "grpo_tiny" / "wall_s.json").read_text()) == wall  # rendering ran nothing


@pytest.mark.slow
@pytest.mark.maintainer
def test_the_shrunk_reproduction_writes_every_figure_and_row(tmp_path):
  """Every result's commands at a few steps (one seed): the figures the README cites, each result's numbers, and a
  table with a measured row for each claim. (tests/fixtures/make_reproduce_runs.py makes the fixture from such runs.)"""
  out = tmp_path / "out"
  reproduce_py("--shrink", f"--runs={tmp_path / 'runs'}", f"--out={out}")
  check_page_and_numbers(out, reproduce.FIGURES)


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


def _write_seed_results(runs, name, per_seed):
  for seed, rows in enumerate(per_seed):
    d = runs / name / f"seed_{seed}"
    d.mkdir(parents=True)
    (d / "results.json").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _ctx(tmp_path, seeds):
  return reproduce.Ctx(str(tmp_path / "runs"), str(tmp_path / "f"), str(tmp_path / "r"), seeds, shrink=False)


def test_the_stability_table_over_seeds(tmp_path):
  rows = lambda jump, loss: [  # noqa: E731
    {"run": "Pre-LN", "lr": 0.01, "max_jump": jump, "eval_loss": loss, "eval_span_exact": 0.0},
    {"run": "DeepNorm", "lr": 0.01, "max_jump": 0.25, "eval_loss": 3.0, "eval_span_exact": 0.5},
  ]
  _write_seed_results(tmp_path / "runs", "glm_stability", [rows(1.5, 3.5), rows(2.0, 3.75)])
  lines = reproduce.details_stability(_ctx(tmp_path, (0, 1)))
  assert lines[0] == "### Stability at a high learning rate, by run" and "lr 0.01," in lines[2]
  assert lines[4:] == [
    "| run | largest loss jump | held-out loss | held-out span exact |",
    "|---|---|---|---|",
    "| Pre-LN | 1.75 (1.50 to 2.00) | 3.625 (3.500 to 3.750) | 0.000 |",  # means of the two seeds; a tie shown once
    "| DeepNorm | 0.25 | 3.000 | 0.500 |",
  ]
  assert reproduce.details_stability(_ctx(tmp_path, (0, 1, 2))) is None  # a seed without results: not run yet


def test_the_quantization_claim_and_table_over_seeds(tmp_path):
  def seed(ptq_experts, qat_experts):
    fp32 = {"model": "sft fp32", "served": "fp32", "eval_loss": 2.0, "weight_bytes": 1000, "minus_fp32": 0.0}
    out = [fp32]
    for scheme, ptq, qat in (
      ("int4_g32_experts", ptq_experts, qat_experts),
      ("int4_g32_all", 0.01, 0.007),
      ("int4_row_all", 0.012, 0.009),
    ):
      out.append({"model": "sft fp32", "served": f"PTQ {scheme}", "eval_loss": 2 + ptq, "weight_bytes": 500})
      out.append(
        {"model": f"sft QAT {scheme}", "served": f"packed {scheme}", "eval_loss": 2 + qat, "weight_bytes": 500}
      )
    for row in out:
      row["minus_fp32"] = row["eval_loss"] - 2.0
    return out

  runs = tmp_path / "runs"
  _write_seed_results(runs, "quant", [seed(0.001, -0.0005), seed(0.002, 0.003)])  # QAT worse in seed 1
  m = reproduce.measure_quant(_ctx(tmp_path, (0, 1)))
  assert m["verdict"] == (
    "routed experts: mixed across seeds; every linear layer: reproduces; every linear layer per row (GLM-130B): "
    "reproduces"
  )
  assert m["measured"].startswith("held-out loss of the INT4 model as served minus fp32's; routed experts: PTQ ")
  assert "routed experts: PTQ 0.0015 (0.0010 to 0.0020), QAT 0.0013 (-0.0005 to 0.0030)" in m["measured"]
  lines = reproduce.details_quant(_ctx(tmp_path, (0, 1)))
  assert lines[4:7] == [
    "| model | served as | held-out loss | minus fp32 | weight bytes |",
    "|---|---|---|---|---|",
    "| sft fp32 | fp32 | 2.0000 | 0.0000 | 1,000 |",
  ]
  assert lines[7] == "| sft fp32 | PTQ int4_g32_experts | 2.0015 (2.0010 to 2.0020) | 0.0015 (0.0010 to 0.0020) | 500 |"
  (runs / "quant" / "seed_1" / "results.json").unlink()
  _write_seed_results(tmp_path / "runs2", "quant", [seed(0.001, -0.0005), seed(0.002, 0.001)])
  ctx = reproduce.Ctx(str(tmp_path / "runs2"), "", "", (0, 1), shrink=False)
  assert reproduce.measure_quant(ctx)["verdict"].startswith("routed experts: reproduces;")


def test_the_table_says_where_each_result_ran(tmp_path, monkeypatch):
  runs = tmp_path / "runs"
  ctx = _ctx(tmp_path, (0,))
  monkeypatch.setattr(reproduce, "this_machine", lambda: "2 x86_64 CPUs")
  # a run records the machine it ran on and its wall time (a subprocess: python -c pass)
  ctx.run("dsa_quality", ["-c", "pass"])
  assert json.loads((runs / "dsa_quality" / "machine.json").read_text()) == ["2 x86_64 CPUs"]
  assert list(json.loads((runs / "dsa_quality" / "wall_s.json").read_text())) == ["-c pass"]
  monkeypatch.setattr(reproduce, "this_machine", lambda: "elsewhere")
  ctx.run("dsa_quality", ["-c", "pass"])  # the same invocation again finds its runs done: neither is recorded
  assert json.loads((runs / "dsa_quality" / "machine.json").read_text()) == ["2 x86_64 CPUs"]
  monkeypatch.setattr(reproduce, "this_machine", lambda: "2 x86_64 CPUs")
  (runs / "dsa_quality" / "machine.json").write_text('["1 NVIDIA H200 (16 x86_64 CPUs)"]')  # as a GPU run writes it
  # mtp reads the sweep's runs: their machines (two here) and wall time (60 s + 30 s)
  (runs / "optimizer_mtp").mkdir(parents=True)
  (runs / "optimizer_mtp" / "machine.json").write_text('["A", "B"]')
  (runs / "optimizer_mtp" / "wall_s.json").write_text('{"x": 60, "y": 30}')
  (runs / "grpo_tiny").mkdir()  # runs from before machine.json existed ran here
  measured = {n: {"measured": f"m_{n}", "verdict": "v"} for n in ("dsa_quality", "mtp", "grpo_tiny")}
  rows = {
    line.split(" | ")[0].removeprefix("| "): line.split(" | ")
    for line in reproduce.render(ctx, measured).splitlines()
    if line.startswith("| ")
  }
  claim = {r.name: r.claim for r in reproduce.RESULTS}
  assert rows["claim"][3:5] == ["wall time", "ran on"]
  assert rows[claim["dsa_quality"]][4:6] == ["1 NVIDIA H200 (16 x86_64 CPUs)", "m_dsa_quality"]
  assert rows[claim["mtp"]][3:6] == ["1.5 min", "A, B", "m_mtp"]
  assert rows[claim["grpo_tiny"]][4] == "2 x86_64 CPUs"
  assert rows[claim["icepop"]][4:6] == ["-", "not run"]


@pytest.mark.skipif(os.environ.get("JAX_PLATFORMS") != "cpu", reason="the runs' jax here is not the CPU's")
def test_this_machine_names_the_cpus_when_jax_runs_on_them():
  # the probe is a subprocess with this environment: it sees the devices the runs would
  reproduce.this_machine.cache_clear()
  assert reproduce.this_machine() == f"{os.cpu_count()} {platform.machine()} CPUs"


def test_a_seed_whose_results_exist_is_not_run_again(tmp_path, monkeypatch):
  # e.g. a result run on another machine, its results copied here without its checkpoints
  calls = []
  monkeypatch.setattr(reproduce.Ctx, "run", lambda self, name, argv: calls.append(argv))
  ctx = _ctx(tmp_path, (0, 1))
  (tmp_path / "runs" / "dsa_quality" / "seed_0").mkdir(parents=True)
  (tmp_path / "runs" / "dsa_quality" / "seed_0" / "results.json").write_text("{}")
  reproduce.run_dsa(ctx)
  assert [a[:3] for a in calls] == [
    ["experiments/dsa_quality.py", f"--workdir={tmp_path / 'runs' / 'dsa_quality' / 'seed_1'}", "--seed=1"]
  ]


def test_the_agentic_claim_over_seeds(tmp_path):
  def seed(calc, verse):  # success with the tool of base, SFT, GRPO
    rates = {"calculator": calc, "verse_lookup": verse}
    return {
      "eval": {
        f"{env}/{policy}/tools": {"success_rate": rate}
        for env, three in rates.items()
        for policy, rate in zip(("base", "sft", "grpo"), three)
      }
    }

  d = tmp_path / "runs" / "agent_tools"
  for k, s in enumerate([seed((0, 1, 1), (0, 0.25, 0.125)), seed((0, 0.5, 0.75), (0, 0.125, 0.0625))]):
    (d / f"seed_{k}").mkdir(parents=True)
    (d / f"seed_{k}" / "results.json").write_text(json.dumps(s))
  m = reproduce.measure_agent_tools(_ctx(tmp_path, (0, 1)))
  # GRPO above the base everywhere; above SFT only on the calculator in seed 1 (0.75 > 0.5): mixed
  assert m["verdict"] == "SFT then GRPO over the base: reproduces; GRPO over SFT: mixed across seeds"
  assert m["measured"] == (
    "calculator: success with its tool base 0.000, SFT 0.750 (0.500 to 1.000), GRPO 0.875 (0.750 to 1.000); "
    "verse_lookup: success with its tool base 0.000, SFT 0.188 (0.125 to 0.250), GRPO 0.094 (0.062 to 0.125)"
  )
