"""Statistics over a handful of seeds: spreads, paired differences with t-intervals, and exact tests.

A study has three to five seeds, so every interval says its degrees of freedom, and beside the
t-interval (which assumes normal differences) stands a test that assumes nothing but symmetry: the
exact sign-flip permutation test of the mean paired difference, whose smallest two-sided p with n
seeds is 2 / 2^n (0.25 at 3 seeds, 0.0625 at 5): with fewer than 6 seeds no result reaches 0.05,
and the page says so rather than pretending otherwise.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, Optional, Sequence

import numpy as np


def spread(values: Sequence[Optional[float]]) -> Dict[str, Any]:
  """mean, sd (n-1), min, max and n of the values that are not None."""
  v = [float(x) for x in values if x is not None]
  if not v:
    return {"n": 0, "mean": None, "sd": None, "min": None, "max": None, "values": []}
  return {"n": len(v), "mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)) if len(v) > 1 else None,
          "min": min(v), "max": max(v), "values": v}


def t_interval(mean: float, sd: Optional[float], n: int, level: float = 0.95) -> Optional[list]:
  """The t-interval of a mean of n values (n - 1 degrees of freedom); None below two values."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  if n < 2 or sd is None:
    return None
  half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
  return [mean - half, mean + half]


def sign_flip_p(differences: Sequence[float]) -> Optional[float]:
  """Exact two-sided p of the sign-flip permutation test that the mean difference is 0: the share of
  the 2^n sign patterns whose |mean| is at least the observed one. None without values."""
  d = np.asarray([float(x) for x in differences])
  if d.size == 0:
    return None
  observed = abs(d.mean())
  flips = np.asarray(list(itertools.product((1.0, -1.0), repeat=d.size)))
  return float(np.mean(np.abs((flips * d).mean(axis=1)) >= observed - 1e-12))


def paired(differences: Sequence[Optional[float]]) -> Dict[str, Any]:
  """The spread of per-seed differences, the 95% t-interval of their mean, whether it excludes 0
  ("resolved"), and the sign-flip test's p."""
  out = spread(differences)
  out["ci95"] = t_interval(out["mean"], out["sd"], out["n"]) if out["n"] else None
  out["resolved"] = bool(out["ci95"] and (out["ci95"][0] > 0 or out["ci95"][1] < 0))
  out["p_sign_flip"] = sign_flip_p(out["values"])
  return out


def ratios(values: Sequence[float]) -> Dict[str, Any]:
  """Ratios (speedups) over seeds, summarized on the log scale: the geometric mean, its 95% t-interval
  (exponentiated), and the sign-flip p of log ratio = 0 (a ratio of 1)."""
  logs = [math.log(v) for v in values]
  p = paired(logs)
  if not p["n"]:
    return {"n": 0, "geomean": None, "ci95": None, "p_sign_flip": None, "values": []}
  return {"n": p["n"], "geomean": math.exp(p["mean"]), "values": [float(v) for v in values],
          "ci95": None if p["ci95"] is None else [math.exp(p["ci95"][0]), math.exp(p["ci95"][1])],
          "excludes_1": p["resolved"], "p_sign_flip": p["p_sign_flip"]}
