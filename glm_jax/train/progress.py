"""What a training loop shows while it runs: a line on stdout every log_every steps, whether or not stdout is a
terminal, and a progress bar where one can render (a terminal or a notebook, through tqdm.auto).

  [glm5_tiny] compiling the train step (the first step waits for it)
  [glm5_tiny] step 1 took 24.6 s (compilation included)
  [glm5_tiny] step 10/30  |  loss 8.06  lm_loss 6.188  |  16.4k tok/s  0.125 s/step  |  ETA 9s

The rates are of the training steps alone. The first step of a process compiles, so it is timed apart; held-out
evaluations, checkpoint saves and hooks run inside `aside()`, which waits for the steps dispatched before it and
leaves its own time out. ETA counts everything: the steps left at the wall-clock rate since the first step.
MFU (useful FLOPs a second over the devices' peak, glm_jax/train/flops.py's `useful_flops` for the numerator) is
shown where the devices' bf16 peak is known: the TPU generations of glm_jax/sharding/hlo_cost.py and NVIDIA's
A100 / H100 / H200 (dense bf16, from NVIDIA's data sheets); on a CPU it is left out.
`summary()` gives the run's totals for its final JSON line.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax

# The logged values that measure time (they differ between two runs of the same steps): tokens_per_s, step_s and mfu
# of the rates, the RL loops' own per-step timings.
TIMING_KEYS = frozenset({"tokens_per_s", "step_s", "mfu", "train_s", "rollout_s"})

# Dense bf16 FLOP/s a GPU (NVIDIA's data sheets: A100 SXM 312 TFLOPS, H100 SXM 989 TFLOPS, H200 the H100's).
_GPU_PEAKS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def device_peak_flops(device: Any = None) -> float | None:
  """The dense bf16 FLOP/s of one `device` (default: the first local device), or None where it is not known."""
  from glm_jax.sharding import hlo_cost
  from glm_jax.sharding.topology import generation_of

  device = device or jax.local_devices()[0]
  try:
    return hlo_cost.PEAKS[generation_of(device)].bf16_flops
  except KeyError:
    pass
  kind = getattr(device, "device_kind", "")
  return next((peak for name, peak in _GPU_PEAKS.items() if name in kind), None)


def format_duration(seconds: float) -> str:
  """4.2 -> "4s", 125 -> "2m05s", 7300 -> "2h01m"."""
  s = int(round(seconds))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(value: float) -> str:
  """8312.4 -> "8.31k", 1.2e6 -> "1.2M", 12.5 -> "12.5"."""
  for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= scale:
      return f"{value / scale:.3g}{suffix}"
  return f"{value:.3g}"


def _format_value(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}" if math.isfinite(value) else str(value)
  return str(value)


def _in_notebook() -> bool:
  shell = sys.modules.get("IPython")
  get = getattr(shell, "get_ipython", None)
  return get is not None and get() is not None and "IPKernelApp" in getattr(get(), "config", {})


def _bar(total: int, initial: int, desc: str):
  """A tqdm.auto bar where one renders (a terminal on stderr, a notebook), else None."""
  if not (_in_notebook() or (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())):
    return None
  from tqdm.auto import tqdm

  try:
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)
  except ImportError:  # a notebook without ipywidgets: tqdm's text bar
    from tqdm import tqdm as text_tqdm

    return text_tqdm(total=total, initial=initial, desc=desc, file=sys.stdout, disable=False)


class Progress:
  """The progress of one training loop from step `start` to `total` (see the module docstring).

  tokens_per_step / flops_per_step: what one step processes and its useful FLOPs (None: the line leaves tok/s or
  MFU out; a loop whose steps differ gives each step's tokens to step_done). enabled=False (every process of a
  multi-process run but the first) shows nothing but still counts."""

  def __init__(
    self,
    name: str,
    *,
    total: int,
    start: int,
    tokens_per_step: float = 0,
    flops_per_step: float | None = None,
    enabled: bool = True,
    devices: int | None = None,
  ):
    self.name, self.total, self.start = name, total, start
    self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
    self.enabled = enabled
    peak = device_peak_flops() if flops_per_step else None
    self.peak_flops = None if peak is None else peak * (devices or jax.device_count())
    self.bar = _bar(total, start, name) if enabled and total > start else None
    self.t_begin = time.perf_counter()
    self.t_first = None  # when the first step (and its compilation) had finished
    self.first_step_s = None
    self.steps_done = 0  # steps this process ran, the first included
    self.steps_s = 0.0  # the time of the steps after the first, asides left out
    self._window_start = self._window_aside = None
    self._window_steps = self._window_tokens = self._steps_tokens = 0

  def print(self, text: str) -> None:
    if not self.enabled:
      return
    line = f"[{self.name}] {text}"
    if self.bar is not None:
      self.bar.write(line, file=sys.stdout)
    else:
      print(line, flush=True)

  def compiling(self, what: str) -> None:
    """Announces the first step's compilation; the run's clock (wall_s, first_step_s) starts here."""
    self.t_begin = time.perf_counter()
    self.print(f"compiling {what} (the first step waits for it)")

  def step_done(self, step: int, outputs: Any = None, *, tokens: float | None = None) -> None:
    """After each step. The first one of the process waits for `outputs` (the step's results) and reports its time,
    compilation included; the clocks of the rates start after it. tokens: the step's own count, where steps differ
    (else tokens_per_step)."""
    self.steps_done += 1
    if self.bar is not None:
      self.bar.update(1)
    if self.t_first is None:
      jax.block_until_ready(outputs)
      now = time.perf_counter()
      self.first_step_s = now - self.t_begin
      self.t_first = self._window_start = now
      self._window_aside = 0.0
      self.print(f"step {step} took {self.first_step_s:.1f} s (compilation included)")
    else:
      self._window_steps += 1
      self._window_tokens += self.tokens_per_step if tokens is None else tokens

  @contextlib.contextmanager
  def aside(self, wait_for: Any = None) -> Iterator[None]:
    """Work that is not a training step (an evaluation, a checkpoint save): its time is left out of the rates. It
    first waits for `wait_for` (the state the steps before it produce), whose time stays the steps'."""
    if wait_for is not None:
      jax.block_until_ready(wait_for)
    t0 = time.perf_counter()
    try:
      yield
    finally:
      if self._window_aside is not None:
        self._window_aside += time.perf_counter() - t0

  def rates(self) -> dict[str, float]:
    """The rates of the steps since the last call (tokens_per_s, step_s, mfu where known), and restarts the window;
    {} when no step ran in it. The caller waits for the window's last step first (reads its metrics)."""
    if self._window_start is None or self._window_steps == 0:
      return {}
    now = time.perf_counter()
    seconds = max(now - self._window_start - self._window_aside, 1e-9)
    steps, tokens = self._window_steps, self._window_tokens
    self.steps_s += seconds
    self._steps_tokens += tokens
    self._window_start, self._window_aside, self._window_steps, self._window_tokens = now, 0.0, 0, 0
    return self._rates(steps, tokens, seconds)

  def _rates(self, steps: int, tokens: float, seconds: float) -> dict[str, float]:
    out = {"step_s": seconds / steps}
    if tokens:
      out["tokens_per_s"] = tokens / seconds
    if self.flops_per_step and self.peak_flops:
      out["mfu"] = steps * self.flops_per_step / (seconds * self.peak_flops)
    return out

  def eta_s(self, step: int) -> float | None:
    """Seconds to step `total` at the wall-clock rate since the first step (None before a second step)."""
    after_first = self.steps_done - 1
    if self.t_first is None or after_first <= 0:
      return None
    return (self.total - step) * (time.perf_counter() - self.t_first) / after_first

  def log(self, step: int, values: Mapping[str, Any], rates: Mapping[str, float]) -> None:
    """The line of a logged step: `values` (e.g. losses) as they are, then the rates, then ETA."""
    parts = [f"step {step}/{self.total}", "  ".join(f"{k} {_format_value(v)}" for k, v in values.items())]
    speed = []
    if "tokens_per_s" in rates:
      speed.append(f"{format_rate(rates['tokens_per_s'])} tok/s")
    if "step_s" in rates:
      speed.append(f"{rates['step_s']:.3g} s/step")
    if "mfu" in rates:
      speed.append(f"MFU {100 * rates['mfu']:.1f}%")
    if speed:
      parts.append("  ".join(speed))
    eta = self.eta_s(step)
    if eta is not None and step < self.total:
      parts.append(f"ETA {format_duration(eta)}")
    self.print("  |  ".join(p for p in parts if p))
    if self.bar is not None and values:
      self.bar.set_postfix({k: _format_value(v) for k, v in list(values.items())[:2]}, refresh=False)

  def summary(self) -> dict[str, float | None]:
    """The run's totals: wall_s (this process's loop, compilation included), first_step_s, and over the steps after
    the first, asides left out: steps_s, tokens_per_s and mfu (None where not known)."""
    self.rates()  # closes the last window
    steps = max(self.steps_done - 1, 0)
    rates = self._rates(steps, self._steps_tokens, self.steps_s) if steps and self.steps_s > 0 else {}
    return {
      "wall_s": time.perf_counter() - self.t_begin,
      "first_step_s": self.first_step_s,
      "steps_s": self.steps_s,
      "tokens_per_s": rates.get("tokens_per_s"),
      "mfu": rates.get("mfu"),
    }

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None
