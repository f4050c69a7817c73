"""ConsecutiveSkips (glm_jax/train/guards.py), the divergence stop both training loops use, on hand-made flags."""

import pytest

from glm_jax.train.guards import ConsecutiveSkips, Diverged


def feed(guard, flags, start=1):
  """update() for steps start, start + 1, ... with these skipped flags; returns the step whose update raised."""
  for step, flag in enumerate(flags, start):
    try:
      guard.update(step, flag)
    except Diverged as e:
      return step, str(e)
  return None, None


def test_three_skips_in_a_row_stop_the_run_one_step_late():
  guard = ConsecutiveSkips(3, "train.max_consecutive_skips")
  # Steps 2, 4, 5 and 6 are skipped: the run of three ends at step 6, and its flag is read after step 7's update.
  step, message = feed(guard, [0, 1, 0, 1, 1, 1, 0, 0])
  assert step == 7
  assert message.startswith("the run is diverging: 3 steps in a row were skipped (steps 4-6: ")
  assert message.endswith("or raise train.max_consecutive_skips=3 (0 = never stop)")


def test_a_finite_step_resets_the_count_and_finish_reads_the_last_flag():
  guard = ConsecutiveSkips(3, "rl.max_consecutive_skips")
  assert feed(guard, [1, 1, 0, 1, 1]) == (None, None)  # 2, then 2 again: never 3
  with pytest.raises(Diverged, match=r"3 steps in a row were skipped \(steps 4-6"):
    guard.update(6, 1)
    guard.finish()  # the last step's flag is read when the loop ends


def test_limit_zero_never_stops():
  guard = ConsecutiveSkips(0, "train.max_consecutive_skips")
  assert feed(guard, [1] * 50) == (None, None)
  guard.finish()


def test_count_reads_at_once():
  guard = ConsecutiveSkips(2, "rl.max_consecutive_skips")
  guard.count(1, 1)
  with pytest.raises(Diverged, match=r"2 steps in a row were skipped \(steps 1-2"):
    guard.count(2, 1)
