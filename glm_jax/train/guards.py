"""Host-side guards that stop a run going wrong silently: consecutive skipped steps, non-finite weights.

The step (glm_jax/train/step.py) never applies an update whose loss, gradient norm or new parameters are not
finite, so the parameters stay finite; but a run whose every step is skipped (after one finite but enormous
update, say) trains nothing. ConsecutiveSkips counts the skipped steps and raises Diverged after a number of
them in a row. It reads each step's flag one step late, after the next step has been dispatched, so the
device never waits on the host for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm_jax.tree_paths import path_names, path_str


class Diverged(RuntimeError):
  """The run stopped because it is not training (its steps keep being skipped)."""


class ConsecutiveSkips:
  """update(step, skipped) after dispatching each step; raises Diverged once `limit` steps in a row were
  skipped (limit 0: never). `field` names the config field in the message."""

  def __init__(self, limit: int, field: str):
    self.limit, self.field = limit, field
    self.run, self.first = 0, None
    self.pending = None

  def update(self, step: int, skipped: jax.Array) -> None:
    previous, self.pending = self.pending, (step, skipped)
    if previous is not None:
      self.count(*previous)

  def finish(self) -> None:
    """Counts the last step (call after the loop)."""
    if self.pending is not None:
      self.count(*self.pending)
      self.pending = None

  def count(self, step: int, skipped) -> None:
    """Counts `step` now (for a loop that has its metrics on the host already)."""
    if not int(skipped):
      self.run, self.first = 0, None
      return
    self.run += 1
    self.first = self.first or step
    if self.limit and self.run >= self.limit:
      raise Diverged(
        f"the run is diverging: {self.run} steps in a row were skipped (steps {self.first}-{step}: "
        "a non-finite loss, gradient or update, or a loss spike); no update of them was applied, so "
        "every checkpoint holds finite weights. Lower optimizer.lr or set train.grad_clip_norm, or "
        f"raise {self.field}={self.limit} (0 = never stop)"
      )


@jax.jit
def _all_finite(leaves):
  return [jnp.all(jnp.isfinite(x)) for x in leaves]


def first_nonfinite(tree) -> str | None:
  """The path of the first array of `tree` (an nnx.State or any pytree) with a NaN or infinite entry, or None.
  One jitted program for all leaves (so every process of a multi-process run runs the same collectives)."""
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(tree)
  flags = jax.device_get(_all_finite([x for _, x in paths_and_leaves]))
  for (path, _), ok in zip(paths_and_leaves, flags):
    if not ok:
      return path_str(path_names(path))
  return None
