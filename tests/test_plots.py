"""glm_jax/plots.py and launch/plot.py: the figures' axes and lines carry the data of hand-written metrics and
results files (checked on the Figure objects, not on pixels), and a column or override that does not exist is
refused by name."""

import json
import os

import pytest

from glm_jax import plots
from tests.train.runs import run_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def two_runs(tmp_path):
  a, b = str(tmp_path / "dense"), str(tmp_path / "sparse")
  write_jsonl(
    os.path.join(a, "metrics.jsonl"),
    [
      {"step": 10, "loss": 5.0, "lr": 1e-3, "expert_load_entropy": [1.0, 2.0]},
      {"step": 20, "loss": None, "nonfinite": ["loss"], "lr": 1e-3, "expert_load_entropy": [1.5, 2.5]},
      {"step": 20, "eval_loss": 4.5},
      {"step": 30, "loss": 3.0, "lr": 5e-4, "expert_load_entropy": [1.7, 2.7]},
    ],
  )
  write_jsonl(
    os.path.join(b, "metrics.jsonl"),
    [{"step": 10, "loss": 6.0, "indexer_kl": 0.5}, {"step": 20, "loss": 4.0, "indexer_kl": 0.25}],
  )
  return a, b


def lines_of(ax):
  return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_curves_draw_each_runs_column_over_steps(two_runs, tmp_path):
  a, b = two_runs
  fig = plots.curves({"dense": a, "sparse": b}, ["loss", "eval_loss", "expert_load_entropy[1]"], title="t")
  loss, eval_loss, entropy = fig.axes
  assert [ax.get_xlabel() for ax in fig.axes] == ["step"] * 3
  assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "eval_loss", "expert_load_entropy[1]"]
  # the null (non-finite) loss at step 20 is left out, not drawn as 0
  assert lines_of(loss) == {"dense": ([10, 30], [5.0, 3.0]), "sparse": ([10, 20], [6.0, 4.0])}
  assert lines_of(eval_loss) == {"dense": ([20], [4.5])}
  assert lines_of(entropy) == {"dense": ([10, 20, 30], [2.0, 2.5, 2.7])}
  assert fig.get_suptitle() == "t"
  out = plots.save(fig, str(tmp_path / "figs" / "curves.png"))
  with open(out, "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_runs_given_as_a_list_are_labelled_by_their_directories(two_runs):
  fig = plots.curves(list(two_runs), "loss")
  assert set(lines_of(fig.axes[0])) == {"dense", "sparse"}


def test_a_column_no_run_logged_is_refused_by_name(two_runs):
  with pytest.raises(ValueError) as e:
    plots.curves(list(two_runs), ["loss", "reward_mean"])
  assert "metric 'reward_mean': no run logged it" in str(e.value)
  assert "['eval_loss', 'expert_load_entropy[0]', 'expert_load_entropy[1]', 'indexer_kl', 'loss', 'lr']" in str(e.value)
  with pytest.raises(ValueError, match="no such file"):
    plots.curves([str(two_runs[0]) + "_missing"], "loss")


def sweep_rows():
  rows = []
  for lr, k, loss in [
    ("1e-3", "16", 3.2),
    ("3e-3", "16", 3.0),
    ("1e-2", "16", 3.4),
    ("1e-3", "32", 3.1),
    ("3e-3", "32", 2.9),
    ("1e-2", "32", float("nan")),
  ]:
    rows.append(
      {
        "run": f"optimizer.lr={lr},model.index_topk={k}",
        "overrides": {"optimizer.lr": lr, "model.index_topk": k},
        "result": {"eval_loss": None if loss != loss else loss, "step": 10},
      }
    )
  return rows


def test_sweep_plot_draws_the_final_metric_against_an_override(tmp_path):
  write_jsonl(str(tmp_path / "sweep" / "results.jsonl"), sweep_rows())
  fig = plots.sweep_plot(str(tmp_path / "sweep"), "eval_loss", against="optimizer.lr")
  (ax,) = fig.axes
  assert ax.get_xlabel() == "optimizer.lr" and ax.get_ylabel() == "eval_loss"
  assert ax.get_xscale() == "log"  # positive values spanning 10x
  assert lines_of(ax) == {
    "model.index_topk=16": ([1e-3, 3e-3, 1e-2], [3.2, 3.0, 3.4]),
    "model.index_topk=32": ([1e-3, 3e-3], [3.1, 2.9]),
  }  # the null result is left out


def test_sweep_plot_of_categorical_values_keeps_the_sweep_order():
  rows = [{"overrides": {"optimizer.name": n}, "result": {"eval_loss": v}} for n, v in [("muon", 2.0), ("adamw", 2.5)]]
  (ax,) = plots.sweep_plot(rows, "eval_loss", against="config.optimizer.name").axes
  assert lines_of(ax) == {"eval_loss": ([0, 1], [2.0, 2.5])}
  assert [t.get_text() for t in ax.get_xticklabels()] == ["muon", "adamw"]


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (
      dict(metric="eval_loss", against="optimizer.b1"),
      "against='optimizer.b1' is not an override of the sweep; its overrides: ['optimizer.lr', 'model.index_topk']",
    ),
    (dict(metric="eval_loss", against="optimizer.lr", by=["train.seed"]), "by=['train.seed'] are not overrides"),
    (
      dict(metric="reward", against="optimizer.lr"),
      "metric 'reward': no run of the sweep reported it; the runs' final JSON lines have ['eval_loss', 'step']",
    ),
  ],
)
def test_sweep_plot_refuses_what_the_sweep_does_not_have(kwargs, message):
  with pytest.raises(ValueError) as e:
    plots.sweep_plot(sweep_rows(), **kwargs)
  assert message in str(e.value)


@pytest.mark.slow  # two launch/plot.py processes
def test_the_command_line_writes_a_png_or_one_error_line(two_runs, tmp_path):
  out = str(tmp_path / "c.png")
  done = run_script(
    "launch/plot.py", f"--workdirs={','.join(two_runs)}", "--labels=d,s", "--metrics=loss", f"--out={out}"
  )
  assert done.returncode == 0, done.stderr
  with open(out, "rb") as f:
    assert f.read(8) == PNG_MAGIC
  bad = run_script("launch/plot.py", f"--workdirs={two_runs[0]}", "--metrics=rewardd", f"--out={tmp_path}/x.png")
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines()[-1].startswith("error: metric 'rewardd': no run logged it")
  assert not os.path.exists(f"{tmp_path}/x.png")


def test_summarize_windows_of_a_column_skip_nonfinite_rows(two_runs):
  """experiments/summarize.py's figures for the results table, against the hand-written rows: the loss column of
  the first run is 5.0 (step 10), non-finite (step 20, skipped), 3.0 (step 30)."""
  from experiments import summarize

  rows = plots.read_metrics(two_runs[0])
  assert summarize.summary(rows, "loss", window=1) == {
    "first": 5.0,
    "last": 3.0,
    "mean": 4.0,
    "max": 5.0,
    "final": 3.0,
    "final_step": 30,
    "n": 2,
  }
  assert summarize.summary(rows, "loss", window=5)["first"] == 4.0  # a window longer than the run: all of it
  assert summarize.summary(rows, "indexer_kl", window=1) is None
