"""Exact-match scoring of generated answers.

Normalisation rules, applied to prediction and answer alike:
  1. only the first line counts (decoding stops at the end of the line; anything after is not the answer);
  2. surrounding whitespace is dropped and inner runs of whitespace become one space;
  3. one trailing period is dropped (the corpus ends answers as sentences: "A: 41.").
Case and every other character count, so `K3#q` is not `k3#q`. A completion must also have ended its
line (or the sequence) within the decoding budget: an answer followed by more text on the same line
that was cut off is not a match.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Sequence


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


def summarize(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """Accuracy, and two readings of it: `majority_share`, what always giving the most common answer
  would score, and `distinct_predictions` (a model that always writes " 1" scores the share of 1s)."""
  correct = sum(r["correct"] for r in records)
  total = len(records)
  answers = Counter(normalize(r["answer"]) for r in records)
  return {"accuracy": correct / total if total else 0.0, "correct": correct, "total": total,
          "majority_share": max(answers.values()) / total if total else 0.0,
          "distinct_predictions": len({normalize(r["prediction"]) for r in records})}
