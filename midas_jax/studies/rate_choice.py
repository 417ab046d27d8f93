"""Choosing each arm's peak learning rate fairly: on a validation set, bracketed, re-checked.

An arm's rate is the one of lowest mean final loss on the validation shard over the grid's seeds (a
rate at which any seed diverged ranks after every rate at which none did). A best rate on the grid's
edge says only that the optimum may lie beyond it, so the grid grows one step past that edge (the
step is the ratio between the edge and its neighbour) and is trained again, up to a cap; after the
cap the page says "not bracketed". Pure functions of {rate: losses}: the study trains the cells.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

Losses = Dict[float, Sequence[Optional[float]]]  # rate -> each grid seed's final loss (None: diverged)


def _rank(losses: Sequence[Optional[float]]):
  kept = [x for x in losses if x is not None and math.isfinite(x)]
  diverged = len(kept) < len(losses) or not kept
  return (diverged, sum(kept) / len(kept) if kept else float("inf"))


def best_rate(grid: Losses) -> float:
  """The rate of lowest mean loss, diverged rates last."""
  return min(sorted(grid), key=lambda r: _rank(grid[r]))


def bracketed(grid: Losses) -> bool:
  """Whether the best rate has a trained rate on each side."""
  rates = sorted(grid)
  return 0 < rates.index(best_rate(grid)) < len(rates) - 1


def extension(grid: Losses) -> Optional[float]:
  """The next rate to train: one grid step past the edge the best rate lies on; None when the best is
  bracketed (or the grid has a single rate, which gives no step)."""
  rates = sorted(grid)
  if len(rates) < 2 or bracketed(grid):
    return None
  edge, inner = (rates[0], rates[1]) if best_rate(grid) == rates[0] else (rates[-1], rates[-2])
  return float(f"{edge * edge / inner:.3g}")  # three figures: a rate a person can type


def neighbours(rates: Sequence[float], best: float) -> Sequence[float]:
  """The grid's rates either side of `best` (the re-check at the longest length trains these)."""
  rates = sorted(rates)
  i = rates.index(best)
  return [r for r in (rates[i - 1] if i > 0 else None, rates[i + 1] if i + 1 < len(rates) else None) if r]
