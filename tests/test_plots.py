"""glm_jax/plots.py and launch/plot.py: the figures' axes and lines carry the data of hand-written metrics and
results files (checked on the Figure objects, not on pixels): titles and units, the unigram-entropy line, smoothing
against a hand-computed trailing mean, train and held-out on one panel, stages on one step axis, log-x for rates and
categories drawn as points or bars; a column or override that does not exist is refused by name."""

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
  """{label: (x, y)} of the labelled lines (the unlabelled ones, such as smoothing's raw lines, left out)."""
  return {
    line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
    for line in ax.get_lines()
    if not line.get_label().startswith("_")
  }


def test_curves_draw_each_runs_column_over_steps(two_runs, tmp_path):
  a, b = two_runs
  fig = plots.curves({"dense": a, "sparse": b}, ["loss", "eval_loss", "expert_load_entropy[1]"], title="t")
  loss, entropy = fig.axes  # eval_loss shares the panel of loss
  assert [ax.get_xlabel() for ax in fig.axes] == ["step"] * 2
  assert [ax.get_ylabel() for ax in fig.axes] == ["loss / eval_loss (nats/token)", "expert_load_entropy[1]"]
  # the null (non-finite) loss at step 20 is left out, not drawn as 0
  assert lines_of(loss) == {
    "dense: loss": ([10, 30], [5.0, 3.0]),
    "dense: eval_loss": ([20], [4.5]),
    "sparse: loss": ([10, 20], [6.0, 4.0]),
  }
  assert lines_of(entropy) == {"dense": ([10, 20, 30], [2.0, 2.5, 2.7])}
  assert fig.get_suptitle() == "t"
  out = plots.save(fig, str(tmp_path / "figs" / "curves.png"))
  with open(out, "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_train_and_held_out_share_a_panel_one_colour_a_run(two_runs):
  fig = plots.curves({"dense": two_runs[0], "sparse": two_runs[1]}, ["loss", "eval_loss"])
  (ax,) = fig.axes
  style = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in ax.get_lines()}
  assert style == {"dense: loss": ("C0", "-"), "dense: eval_loss": ("C0", "--"), "sparse: loss": ("C1", "-")}
  assert fig.get_suptitle() == "loss, eval_loss over training steps"  # a title by default
  # one legend, the figure's, outside the axes: none drawn over the curves
  assert ax.get_legend() is None and len(fig.legends) == 1
  # runs by colour, metrics by style
  assert [t.get_text() for t in fig.legends[0].get_texts()] == ["dense", "sparse", "loss", "eval_loss"]
  assert [(h.get_color(), h.get_linestyle()) for h in fig.legends[0].legend_handles] == [
    ("C0", "-"),
    ("C1", "-"),
    ("0.3", "-"),
    ("0.3", "--"),
  ]
  fig.draw_without_rendering()  # runs the constrained layout
  legend_box, axes_box = fig.legends[0].get_window_extent(), ax.get_window_extent()
  assert legend_box.x0 >= axes_box.x1


def test_eval_loss_joins_lm_loss_before_loss():
  assert plots.panels(["loss", "lm_loss", "eval_loss", "grad_norm"]) == [
    ["loss"],
    ["lm_loss", "eval_loss"],
    ["grad_norm"],
  ]
  assert plots.panels(["eval_loss", "lm_loss"]) == [["eval_loss"], ["lm_loss"]]  # asked first: a panel of its own
  assert plots.panels(["reward_mean", "eval_reward_mean"]) == [["reward_mean", "eval_reward_mean"]]


def test_units_on_the_axes():
  assert plots.axis_label(["tokens_per_s"]) == "tokens_per_s (tokens/s)"
  assert plots.axis_label(["lm_loss", "eval_loss"]) == "lm_loss / eval_loss (nats/token)"
  assert plots.axis_label(["indexer_kl"]) == "indexer_kl (nats/token)"
  assert plots.axis_label(["loss"], pretraining=False) == "loss"  # an RL run's policy loss has no unit
  assert plots.axis_label(["step_s"]) == "step_s (s)"
  assert plots.axis_label(["lm_loss", "grad_norm"]) == "lm_loss / grad_norm"  # no shared unit: none


def test_smoothing_draws_the_trailing_mean_over_the_faint_raw_curve(tmp_path):
  run = str(tmp_path / "run")
  losses = [4.0, 2.0, 6.0, 0.0, 3.0]
  write_jsonl(
    os.path.join(run, "metrics.jsonl"),
    [{"step": 10 * (i + 1), "lm_loss": v} for i, v in enumerate(losses)] + [{"step": 50, "eval_loss": 3.5}],
  )
  fig = plots.curves([run], ["lm_loss", "eval_loss"], smooth=3, reference=None)
  (ax,) = fig.axes
  # the mean of the last 3 logged values at each step, by hand: 4, (4+2)/2, (4+2+6)/3, (2+6+0)/3, (6+0+3)/3
  assert lines_of(ax) == {
    "lm_loss": ([10, 20, 30, 40, 50], [4.0, 3.0, 4.0, 8 / 3, 3.0]),
    "eval_loss": ([50], [3.5]),  # held-out points are not smoothed
  }
  (raw,) = [line for line in ax.get_lines() if line.get_label().startswith("_")]
  assert list(raw.get_ydata()) == losses and raw.get_alpha() == 0.25
  bold = [line for line in ax.get_lines() if line.get_label() == "lm_loss"][0]
  assert bold.get_linewidth() > raw.get_linewidth() and bold.get_color() == raw.get_color()
  assert fig.get_suptitle() == "lm_loss, eval_loss over training steps (3-point trailing mean)"
  assert plots.trailing_mean([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
  with pytest.raises(ValueError, match="smooth=0 is invalid"):
    plots.curves([run], "lm_loss", smooth=0)


def reference_lines(ax):
  return [(line.get_label(), list(line.get_ydata())) for line in ax.get_lines() if line.get_label().startswith("unig")]


def test_the_unigram_entropy_line_on_lm_losses(tmp_path):
  """auto: from a sweep run's result.json; a number: that; None: no line. Only on the cross-entropy panels."""
  run = str(tmp_path / "sweep" / "train.seed=1")
  write_jsonl(os.path.join(run, "metrics.jsonl"), [{"step": 10, "lm_loss": 5.5, "loss": 5.9, "grad_norm": 1.0}])
  with open(os.path.join(run, "result.json"), "w") as f:
    json.dump({"run": "train.seed=1", "result": {"eval_loss": 5.4, "unigram_entropy": 5.179}}, f)
  lm, total, norm = plots.curves([run], ["lm_loss", "loss", "grad_norm"]).axes
  assert reference_lines(lm) == [("unigram entropy 5.179", [5.179, 5.179])]
  assert reference_lines(total) == reference_lines(norm) == []  # the total loss adds MTP and balance terms
  (ax,) = plots.curves([run], "lm_loss", reference=4.25).axes
  assert reference_lines(ax) == [("unigram entropy 4.250", [4.25, 4.25])]
  (ax,) = plots.curves([run], "lm_loss", reference=None).axes
  assert reference_lines(ax) == []
  with pytest.raises(ValueError, match="reference='high' is invalid"):
    plots.curves([run], "lm_loss", reference="high")


def stage_dirs(tmp_path):
  """dense logs steps 10-30, warmup 5-10, sparse 10-20 (each counting from 0, as a run started by init_from does)."""
  dirs = {}
  for name, rows in {
    "dense": [{"step": 10, "lm_loss": 6.0}, {"step": 30, "lm_loss": 5.0}],
    "warmup": [{"step": 5, "lm_loss": 5.0}, {"step": 10, "lm_loss": 5.0}],
    "sparse": [{"step": 10, "lm_loss": 4.8}, {"step": 20, "lm_loss": 4.6}],
    "dense_branch": [{"step": 10, "lm_loss": 4.7}, {"step": 20, "lm_loss": 4.5}],
  }.items():
    dirs[name] = str(tmp_path / name)
    write_jsonl(os.path.join(dirs[name], "metrics.jsonl"), rows)
  return dirs


def test_dsa_stages_on_one_timeline(tmp_path):
  d = stage_dirs(tmp_path)
  fig = plots.timeline([d["dense"], d["warmup"], d["sparse"]], "lm_loss", reference=None)
  (ax,) = fig.axes
  assert lines_of(ax) == {
    "dense": ([10, 30], [6.0, 5.0]),
    "warmup": ([35, 40], [5.0, 5.0]),  # offset by dense's last step, 30
    "sparse": ([50, 60], [4.8, 4.6]),  # by 30 + 10
  }
  boundaries = [line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("_")]
  assert boundaries == [30, 40]
  assert [(t.get_position()[0], t.get_text().strip()) for t in ax.texts] == [
    (0, "dense"),
    (30, "warmup"),
    (40, "sparse"),
  ]
  assert fig.get_suptitle() == "lm_loss over the stages dense -> warmup -> sparse"
  assert ax.get_xlabel() == "step (the stages' steps end to end)"


def test_branches_continue_from_the_last_stage(tmp_path):
  d = stage_dirs(tmp_path)
  runs, offsets, boundaries = plots.chain(
    {"dense": d["dense"], "warmup": d["warmup"]}, {"sparse": d["sparse"], "dense_branch": d["dense_branch"]}
  )
  assert offsets == {"dense": 0, "warmup": 30, "sparse": 40, "dense_branch": 40}
  assert boundaries == [(0, "dense"), (30, "warmup"), (40, "branches")]
  assert list(runs) == ["dense", "warmup", "sparse", "dense_branch"]
  (ax,) = plots.timeline([d["dense"], d["warmup"]], "lm_loss", branches=[d["sparse"], d["dense_branch"]]).axes
  assert lines_of(ax)["dense_branch"] == ([50, 60], [4.7, 4.5])


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
  assert ax.get_xlabel() == "optimizer.lr (log scale)" and ax.get_ylabel() == "eval_loss (nats/token)"
  assert ax.get_xscale() == "log"
  assert lines_of(ax) == {
    "model.index_topk=16": ([1e-3, 3e-3, 1e-2], [3.2, 3.0, 3.4]),
    "model.index_topk=32": ([1e-3, 3e-3], [3.1, 2.9]),
  }  # the null result is left out
  # ticked at the swept values, as written, and nowhere else
  assert list(ax.get_xticks()) == [1e-3, 3e-3, 1e-2]
  assert [t.get_text() for t in ax.get_xticklabels()] == ["1e-3", "3e-3", "1e-2"]
  assert fig.get_suptitle() == "eval_loss at step 10, against optimizer.lr"


@pytest.mark.parametrize(
  "field, values, log",
  [
    ("optimizer.lr", ["1e-3", "2e-3"], True),  # a learning rate, even over 2x
    ("sft.optimizer.lr_end", ["1e-4", "2e-4"], True),
    ("model.index_topk", ["16", "32", "64", "128"], False),  # 8x
    ("train.balance_loss_weight", ["1e-4", "1e-2"], True),  # 100x
    ("train.mtp_loss_weight", ["0", "0.3"], False),  # not all positive
  ],
)
def test_log_x_for_rates_and_wide_spans(field, values, log):
  rows = [{"overrides": {field: v}, "result": {"eval_loss": 3.0 + i}} for i, v in enumerate(values)]
  (ax,) = plots.sweep_plot(rows, "eval_loss", against=field).axes
  assert ax.get_xscale() == ("log" if log else "linear")


def categorical_rows():
  rows = []
  for name, mtp, loss in [("muon", "1", 3.02), ("muon", "0", 3.05), ("adamw", "1", 2.84), ("adamw", "0", 2.89)]:
    overrides = {"optimizer.name": name, "model.num_nextn_predict_layers": mtp}
    rows.append({"overrides": overrides, "result": {"eval_loss": loss, "train_loss": loss - 0.1, "step": 600}})
  return rows


def test_sweep_plot_of_categorical_values_draws_points_never_a_line():
  rows = [{"overrides": {"optimizer.name": n}, "result": {"eval_loss": v}} for n, v in [("muon", 2.0), ("adamw", 2.5)]]
  (ax,) = plots.sweep_plot(rows, "eval_loss", against="config.optimizer.name").axes
  assert lines_of(ax) == {"eval_loss": ([0, 1], [2.0, 2.5])}
  assert [line.get_linestyle() for line in ax.get_lines()] == ["None"]
  assert [t.get_text() for t in ax.get_xticklabels()] == ["muon", "adamw"]
  # two series: side by side at each category (0.8 / 2 apart), each a set of points
  (ax,) = plots.sweep_plot(categorical_rows(), "eval_loss", against="optimizer.name").axes
  got = lines_of(ax)
  assert got == {
    "model.num_nextn_predict_layers=1": ([-0.2, 0.8], [3.02, 2.84]),
    "model.num_nextn_predict_layers=0": ([0.2, 1.2], [3.05, 2.89]),
  }
  assert {line.get_linestyle() for line in ax.get_lines()} == {"None"}


def test_sweep_plot_of_categorical_values_as_bars():
  (ax,) = plots.sweep_plot(categorical_rows(), "eval_loss", against="optimizer.name", bars=True).axes
  assert ax.get_lines() == []
  bars = sorted((round(p.get_x() + p.get_width() / 2, 6), p.get_height()) for p in ax.patches)
  assert bars == [(-0.2, 3.02), (0.2, 3.05), (0.8, 2.84), (1.2, 2.89)]
  assert {round(p.get_width(), 6) for p in ax.patches} == {0.4}


def test_train_and_eval_loss_of_a_sweep_on_one_axis():
  rows = [
    {"overrides": {"optimizer.lr": lr}, "result": {"train_loss": t, "eval_loss": e}}
    for lr, t, e in [("1e-3", 3.1, 3.2), ("3e-3", 2.9, 3.0)]
  ]
  (ax,) = plots.sweep_plot(rows, ["train_loss", "eval_loss"], against="optimizer.lr").axes
  style = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
  assert lines_of(ax) == {"train_loss": ([1e-3, 3e-3], [3.1, 2.9]), "eval_loss": ([1e-3, 3e-3], [3.2, 3.0])}
  assert style == {"train_loss": "-", "eval_loss": "--"}
  assert ax.get_ylabel() == "train_loss / eval_loss (nats/token)"


def test_sweep_plot_draws_the_unigram_entropy_its_runs_reported():
  """A line when it is near the data; far above it (it would squash the data into a strip), a note at the edge."""
  rows = categorical_rows()
  for row in rows:
    row["result"]["unigram_entropy"] = 3.2  # within the data's span (2.84 - 3.05) of it
  fig = plots.sweep_plot(rows, "eval_loss", against="optimizer.name")
  (ax,) = fig.axes
  assert reference_lines(ax) == [("unigram entropy 3.200", [3.2, 3.2])]
  assert fig.get_suptitle() == "eval_loss at step 600, against optimizer.name"
  assert reference_lines(plots.sweep_plot(rows, "eval_loss", against="optimizer.name", reference=None).axes[0]) == []
  for row in rows:
    row["result"]["unigram_entropy"] = 5.179
  (ax,) = plots.sweep_plot(rows, "eval_loss", against="optimizer.name").axes
  assert reference_lines(ax) == [] and [t.get_text() for t in ax.texts] == ["unigram entropy 5.179 (above the axis)"]
  assert ax.get_ylim()[1] < 3.2


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
    "launch/plot.py",
    f"--workdirs={','.join(two_runs)}",
    "--labels=d,s",
    "--stages",
    "--metrics=loss",
    "--smooth=2",
    "--reference=4.0",
    f"--out={out}",
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
