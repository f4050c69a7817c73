"""glm_jax/train/progress.py (the progress lines and the rates of the steps alone) on a clock the test moves by hand,
glm_jax/train/metrics.py's TensorBoard groups, and glm_jax's CPU default on a host with libtpu but no TPU."""

import os
import subprocess
import sys

import pytest

from glm_jax.train import progress as progress_lib
from glm_jax.train.metrics import tensorboard_tag
from tests.helpers import ROOT


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


@pytest.fixture
def clock(monkeypatch):
  c = Clock()
  monkeypatch.setattr(progress_lib.time, "perf_counter", c)
  return c


def test_rates_leave_out_the_first_step_and_the_asides(clock, capsys):
  p = progress_lib.Progress("run", total=10, start=0, tokens_per_step=512, flops_per_step=1e9)
  p.compiling("the train step")
  clock.now += 30.0  # the first step: compilation
  p.step_done(1)
  for step in (2, 3, 4):
    clock.now += 0.5
    p.step_done(step)
  with p.aside():  # an evaluation
    clock.now += 7.0
  clock.now += 0.5
  p.step_done(5)
  rates = p.rates()
  # 4 steps after the first in 2.0 s of steps (9.0 s of wall time less the 7.0 s evaluation)
  assert rates["step_s"] == pytest.approx(0.5)
  assert rates["tokens_per_s"] == pytest.approx(4 * 512 / 2.0)
  assert "mfu" not in rates  # a CPU: no known peak
  # ETA: 5 steps left at the wall-clock rate since the first step, the evaluation included: 9.0 s / 4 steps
  assert p.eta_s(5) == pytest.approx(5 * 9.0 / 4)
  p.log(5, {"loss": 2.5, "lm_loss": 2.25}, rates)
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "[run] compiling the train step (the first step waits for it)"
  assert out[1] == "[run] step 1 took 30.0 s (compilation included)"
  assert out[2] == "[run] step 5/10  |  loss 2.5  lm_loss 2.25  |  1.02k tok/s  0.5 s/step  |  ETA 11s"
  clock.now += 1.0
  p.step_done(6, tokens=100)  # a step with its own count
  summary = p.summary()
  assert summary["first_step_s"] == pytest.approx(30.0)
  assert summary["wall_s"] == pytest.approx(30.0 + 9.0 + 1.0)
  assert summary["steps_s"] == pytest.approx(3.0)
  assert summary["tokens_per_s"] == pytest.approx((4 * 512 + 100) / 3.0)
  assert summary["mfu"] is None


def test_mfu_against_the_devices_peak(clock, monkeypatch):
  monkeypatch.setattr(progress_lib, "device_peak_flops", lambda device=None: 459e12)
  p = progress_lib.Progress("run", total=4, start=0, flops_per_step=2e14, devices=8)
  p.step_done(1)
  clock.now += 0.25
  p.step_done(2)
  clock.now += 0.25
  p.step_done(3)
  assert p.rates()["mfu"] == pytest.approx(2 * 2e14 / (0.5 * 8 * 459e12))


def test_device_peaks():
  class Device:
    def __init__(self, kind):
      self.device_kind = kind

  assert progress_lib.device_peak_flops(Device("TPU v5")) == 459e12  # v5p (glm_jax/sharding/hlo_cost.py)
  assert progress_lib.device_peak_flops(Device("TPU v5 lite")) == 197e12
  assert progress_lib.device_peak_flops(Device("NVIDIA H100 80GB HBM3")) == 989e12
  assert progress_lib.device_peak_flops(Device("cpu")) is None


def test_a_disabled_progress_prints_nothing(clock, capsys):
  p = progress_lib.Progress("run", total=3, start=0, enabled=False)
  p.compiling("x")
  p.step_done(1)
  p.log(1, {"loss": 1.0}, {})
  assert capsys.readouterr().out == ""


@pytest.mark.parametrize("seconds, text", [(4.2, "4s"), (59.6, "1m00s"), (125, "2m05s"), (7300, "2h01m")])
def test_durations(seconds, text):
  assert progress_lib.format_duration(seconds) == text


def test_tensorboard_groups():
  assert tensorboard_tag("eval_loss") == "eval/loss"
  assert tensorboard_tag("eval_accuracy") == "eval/accuracy"
  assert tensorboard_tag("lm_loss") == "train/lm_loss"
  assert tensorboard_tag("grad_norm") == "train/grad_norm"
  assert tensorboard_tag("expert_load_entropy") == "moe/expert_load_entropy"
  assert tensorboard_tag("balance_loss") == "moe/balance_loss"
  assert tensorboard_tag("indexer_kl") == "dsa/indexer_kl"
  assert tensorboard_tag("reward_mean") == "rl/reward_mean"
  assert tensorboard_tag("mismatch_kl") == "rl/mismatch_kl"
  assert tensorboard_tag("teacher_kl/sort") == "distill/teacher_kl/sort"
  assert tensorboard_tag("tokens_per_s") == "speed/tokens_per_s"
  assert tensorboard_tag("rollout_s") == "speed/rollout_s"


@pytest.mark.skipif(
  bool(os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")), reason="a TPU host: jax should find the chips"
)
def test_importing_glm_jax_keeps_jax_on_the_cpu_without_a_tpu():
  """libtpu is installed (the test extra) and this host has no TPU chips: without JAX_PLATFORMS, importing glm_jax
  keeps jax from probing for one (no libtpu INVALID_ARGUMENT block on stderr)."""
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = "import jax, glm_jax, os; print(jax.devices()[0].platform, os.environ['JAX_PLATFORMS'])"
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ["cpu", "cpu"]
  assert "INVALID_ARGUMENT" not in proc.stderr and "TPU_WORKER_HOSTNAMES" not in proc.stderr
