"""Exact-match scoring of generated answers, and the 95% intervals every score is reported with.

Normalisation rules, applied to prediction and answer alike:
  1. only the first line counts (decoding stops at the end of the line; anything after is not the answer);
  2. surrounding whitespace is dropped and inner runs of whitespace become one space;
  3. one trailing period is dropped (the corpus ends answers as sentences: "A: 41.").
Case and every other character count, so `K3#q` is not `k3#q`. A completion must also have ended its
line (or the sequence) within the decoding budget: an answer followed by more text on the same line
that was cut off is not a match.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, List, Sequence, Tuple

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def normalize(text: str) -> str:
  line = " ".join(text.split("\n", 1)[0].split())
  if line.endswith("."):
    line = line[:-1].rstrip()
  return line


def exact_match(prediction: str, answer: str) -> bool:
  return normalize(prediction) == normalize(answer)


def score(examples: Sequence[Any], completions: Sequence[Any]) -> List[Dict[str, Any]]:
  """One record per example: prompt, answer, prediction, whether the line ended, and `correct`."""
  if len(examples) != len(completions):
    raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
  records = []
  for ex, c in zip(examples, completions):
    records.append({"prompt": ex.prompt, "answer": ex.answer, "prediction": c.text, "ended": c.ended,
                    "correct": bool(c.ended and exact_match(c.text, ex.answer)), "meta": dict(ex.meta)})
  return records


def wilson_interval(successes: int, total: int, z: float = Z95) -> Tuple[float, float]:
  """The Wilson score interval of a proportion: sensible at 0 and 1 and for small totals, unlike
  p +- z * sqrt(p(1-p)/n), which collapses to a point there."""
  if total <= 0:
    return (0.0, 1.0)
  p = successes / total
  centre = (p + z * z / (2 * total)) / (1 + z * z / total)
  half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
  return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values: Sequence[float], z: float = Z95) -> Tuple[float, float, float]:
  """(mean, low, high): the normal-approximation interval of a mean over independent questions."""
  n = len(values)
  if n == 0:
    return (float("nan"),) * 3
  mean = sum(values) / n
  if n == 1:
    return (mean, mean, mean)
  sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
  half = z * sd / math.sqrt(n)
  return (mean, mean - half, mean + half)


def majority_share(answers: Sequence[str]) -> float:
  """What always giving the most common (normalized) answer scores: exact match's chance level."""
  counts = Counter(normalize(a) for a in answers)
  return max(counts.values()) / len(answers) if answers else 0.0


def summarize(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """Accuracy with its 95% (Wilson) interval, and two readings of it: `majority_share`, what always
  giving the most common answer would score, and `distinct_predictions` (a model that always writes
  " 1" scores the share of 1s)."""
  correct = sum(r["correct"] for r in records)
  total = len(records)
  return {"accuracy": correct / total if total else 0.0, "accuracy_ci95": list(wilson_interval(correct, total)),
          "correct": correct, "total": total, "majority_share": majority_share([r["answer"] for r in records]),
          "distinct_predictions": len({normalize(r["prediction"]) for r in records})}
