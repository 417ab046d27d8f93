"""The effective speedup of a grown run: the compute the baseline needs to reach its loss, over its own.

The MIDAS paper's claim is about compute to a loss, not about loss at a step: on a flattening curve a
constant compute penalty looks like a closing loss gap. The baseline's compute-to-loss curve is read
from a ladder of complete baseline runs (each with its own full learning-rate schedule, so each rung
is a finished run, not a mid-schedule checkpoint): rung i spent C_i FLOPs and ended at held-out loss
L_i. A loss L between two consecutive rungs (in compute order) is reached at

  log C(L) = (1 - w) log C_a + w log C_b,   w = (L_a - L) / (L_a - L_b),

linear in log-compute, as loss curves nearly are over a short span. Outside the ladder nothing is
extrapolated: a loss below every rung needs more than the top rung's compute (a lower bound on the
speedup), one above every rung less than the bottom rung's (an upper bound). Pure functions of
(compute, loss) pairs: nothing here trains or loads a model.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

Rung = Tuple[float, float]  # (training FLOPs, final held-out loss)


def _ordered(ladder: Sequence[Rung]) -> Sequence[Rung]:
  rungs = sorted((float(c), float(l)) for c, l in ladder)
  if len(rungs) < 2 or any(c <= 0 for c, _ in rungs):
    raise ValueError(f"a ladder needs two or more rungs of positive compute, got {list(ladder)}")
  return rungs


def compute_to_reach(ladder: Sequence[Rung], loss: float) -> Dict[str, Optional[float]]:
  """The baseline's compute to reach `loss`: {"flops": C, "bound": None} between rungs (the first
  consecutive pair, in compute order, whose losses bracket it); {"flops": C_top, "bound": ">"} below
  every rung (more than the top rung's C); {"flops": C_bottom, "bound": "<"} above every rung."""
  rungs = _ordered(ladder)
  for (ca, la), (cb, lb) in zip(rungs, rungs[1:]):
    if min(la, lb) <= loss <= max(la, lb):
      w = 0.0 if la == lb else (la - loss) / (la - lb)
      return {"flops": math.exp((1 - w) * math.log(ca) + w * math.log(cb)), "bound": None}
  if loss < min(l for _, l in rungs):
    return {"flops": rungs[-1][0], "bound": ">"}
  return {"flops": rungs[0][0], "bound": "<"}


def effective_speedup(ladder: Sequence[Rung], loss: float, flops: float) -> Dict[str, Optional[float]]:
  """The baseline's compute to reach the arm's `loss` over the arm's `flops`: {"value", "bound",
  "baseline_flops"}; bound ">" or "<" says value is a lower or upper bound (the loss lies outside the
  ladder), None that it is a number."""
  reach = compute_to_reach(ladder, loss)
  return {"value": reach["flops"] / float(flops), "bound": reach["bound"], "baseline_flops": reach["flops"]}


def loss_at_compute(ladder: Sequence[Rung], flops: float) -> Optional[float]:
  """The ladder's loss at `flops`, linear in log-compute between the two rungs around it; None outside
  the ladder (the equal-FLOPs gap is then not read)."""
  rungs = _ordered(ladder)
  for (ca, la), (cb, lb) in zip(rungs, rungs[1:]):
    if ca <= flops <= cb:
      w = 0.0 if ca == cb else (math.log(flops) - math.log(ca)) / (math.log(cb) - math.log(ca))
      return (1 - w) * la + w * lb
  return None


def text(speedup: Dict[str, Optional[float]], digits: int = 2) -> str:
  """'1.25x', '> 1.61x' or '< 0.80x'."""
  value = f"{speedup['value']:.{digits}f}x"
  return f"{speedup['bound']} {value}" if speedup["bound"] else value
