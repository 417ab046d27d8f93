"""Reading a run at another run's held-out loss: the bracketing evals and the interpolation between them.

The paper compares arms at equal perplexity. The study's baseline keeps a checkpoint at every eval;
a stacked arm's final held-out loss is then found on the baseline's eval curve, between the first two
consecutive evals whose losses bracket it, and each primitive score is read there by linear
interpolation in the loss between the scores of the two checkpoints. Pure functions of the curve
and the scores: nothing here loads a model.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple


def bracket(curve: Sequence[Mapping[str, float]], loss: float) -> Optional[Tuple[int, int, float]]:
  """(step_a, step_b, w): the first consecutive evals a, b of `curve` (rows with step and loss, in step
  order) whose losses bracket `loss`, and w in [0, 1] with loss = (1 - w) * loss_a + w * loss_b.
  None when no pair does (the run never reached `loss`, or started below it): no extrapolation."""
  rows = sorted(curve, key=lambda r: r["step"])
  for a, b in zip(rows, rows[1:]):
    la, lb = float(a["loss"]), float(b["loss"])
    if min(la, lb) <= loss <= max(la, lb):
      w = 0.0 if la == lb else (la - loss) / (la - lb)
      return int(a["step"]), int(b["step"]), float(w)
  return None


def interpolate(scores_a: Mapping[str, Mapping[str, float]], scores_b: Mapping[str, Mapping[str, float]],
                w: float) -> Dict[str, Dict[str, float]]:
  """Per task and score, (1 - w) * a + w * b: the scores at the matched loss."""
  return {task: {score: (1 - w) * float(value) + w * float(scores_b[task][score])
                 for score, value in by_score.items()}
          for task, by_score in scores_a.items()}


def step_at_loss(curve: Sequence[Mapping[str, float]], loss: float) -> Optional[float]:
  """The (fractional) step at which the run's eval curve reaches `loss`, on the same bracket; None if never."""
  found = bracket(curve, loss)
  if found is None:
    return None
  a, b, w = found
  return a + w * (b - a)
