"""glm_jax/cli.py's handling of what libraries print from their background threads when a run fails."""

import logging
import sys

from glm_jax import cli


def test_a_background_failure_is_logged_in_one_line():
  try:
    raise ValueError("RESOURCE_EXHAUSTED: Failed to write 10 bytes: No space left on device\nsecond line")
  except ValueError:
    exc_info = sys.exc_info()
  orbax = logging.LogRecord("absl", logging.ERROR, "/x/orbax/checkpoint/a.py", 1, "save %d failed", (6,), exc_info)
  assert cli._OneLineBackgroundErrors().filter(orbax)
  assert orbax.exc_info is None
  assert orbax.getMessage() == (
    "save 6 failed (ValueError: RESOURCE_EXHAUSTED: Failed to write 10 bytes: No space left on device second line)"
  )
  ours = logging.LogRecord("absl", logging.ERROR, "/x/glm_jax/train/a.py", 1, "ours", None, exc_info)
  assert cli._OneLineBackgroundErrors().filter(ours) and ours.exc_info is exc_info  # our own keep their traceback
