"""Per-step measurements around each growth: loss, gradient norm and the update norm of the copied block.

`window` steps before and after every stage boundary (TrainingRun's growth_window; 0 turns it off),
each step of a stacked run writes one record of split "growth":

  growth_step, offset        the boundary it is nearest, and step - boundary (negative before it)
  loss, grad_norm, learning_rate   of that step
  update_norm/copied         the norm of this step's parameter change of the layers the growth adds
                             (after it) or of the layers it will copy them from (before it)
  update_norm/source         after a growth: the same of the layers the copies came from
  update_norm/all            of every layer's parameters (embeddings, final norm and head excluded)

Norms are over every parameter with a `layers` axis, float32. The rows are gathered by a small jitted
function before the step (the step donates the state) and compared after it, only on the window's
steps, so the rest of the run is untouched.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from midas_jax.stacking.grow import layers_axis
from midas_jax.stacking.operators import new_layer_mask
from midas_jax.stacking.schedule import StageSchedule


def _rows(params, logical, index: np.ndarray):
  leaves = [jnp.take(x, index, axis=layers_axis(spec)).astype(jnp.float32)
            for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(logical, is_leaf=lambda s: isinstance(s, P)))
            if layers_axis(spec) is not None]
  return leaves


class GrowthProbe:
  """Which steps are watched, which layers are whose, and the norms (see the module docstring)."""

  def __init__(self, schedule: StageSchedule, window: int):
    self.schedule, self.window = schedule, int(window)
    self._fns: Dict[Tuple[int, int], Any] = {}

  def near(self, step: int) -> Optional[Tuple[int, int]]:
    """(boundary, stage grown into) of the boundary `step` is within the window of, else None."""
    if self.window <= 0 or not self.schedule.provenances:
      return None
    for i, b in enumerate(self.schedule.boundaries):
      if b - self.window <= step < b + self.window:
        return b, i + 2
    return None

  def groups(self, step: int) -> Optional[Dict[str, np.ndarray]]:
    """The layer indices of each measured group at `step` (in the model that trains it)."""
    found = self.near(step)
    if found is None:
      return None
    boundary, stage = found
    prov = self.schedule.provenance_into(stage)
    new = new_layer_mask(prov)
    sources = np.asarray(prov[new], np.int64)
    depth = self.schedule.depth_at(step)
    if step < boundary:  # the model before the growth: the layers the copies will come from
      return {"copied": sources, "all": np.arange(depth)}
    first = {int(p): j for j, p in reversed(list(enumerate(prov))) if not new[j]}
    return {"copied": np.flatnonzero(new), "source": np.asarray([first[int(p)] for p in sources], np.int64),
            "all": np.arange(depth)}

  def before(self, params, logical, step: int):
    """What the step's update is measured against (None off the window)."""
    groups = self.groups(step)
    if groups is None:
      return None
    key = (step < self.near(step)[0], self.near(step)[1])
    if key not in self._fns:
      self._fns[key] = jax.jit(lambda p: {g: _rows(p, logical, idx) for g, idx in groups.items()})
    return key, self._fns[key](params)

  def after(self, snapshot, params, metrics: Dict[str, Any], step: int) -> Dict[str, float]:
    """The growth record of `step` (the scalars of the module docstring)."""
    key, old = snapshot
    new = self._fns[key](params)
    boundary, _ = self.near(step)
    out = {"growth_step": boundary, "offset": step - boundary, "loss": float(metrics["loss"]),
           "grad_norm": float(metrics["grad_norm"]), "learning_rate": float(metrics["learning_rate"])}
    for group in old:
      total = sum(float(jnp.sum(jnp.square(b - a))) for a, b in zip(old[group], new[group]))
      out[f"update_norm/{group}"] = total ** 0.5
    return out
