"""Rows in the one format every objective shares (DESIGN.md, decision 4).

An example is a token sequence with a bidirectional prefix of `prefix_len` tokens (0 for causal
LM) and an objective id. A row packs several examples; per token it carries

  inputs         the example shifted right by one, 0 (BOS) first
  targets        the example's tokens: targets[i] is predicted from inputs[: i + 1]
  positions      0, 1, ... within each example
  segment_ids    1, 2, ... per example; 0 marks padding
  prefix_mask    True where the input token attends bidirectionally: BOS and the prefix tokens
  loss_weights   1.0 on target tokens past the prefix; 0.0 on the prefix and padding
  objective_ids  the example's objective (0 causal, 1 prefix, 2 span) for per-objective metrics
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Sequence

import numpy as np

FIELDS = ("inputs", "targets", "positions", "segment_ids", "prefix_mask", "loss_weights", "objective_ids")
FIELD_DTYPES = {"inputs": np.int32, "targets": np.int32, "positions": np.int32, "segment_ids": np.int32,
                "prefix_mask": np.bool_, "loss_weights": np.float32, "objective_ids": np.int32}


@dataclasses.dataclass(frozen=True)
class Example:
  tokens: np.ndarray
  prefix_len: int = 0
  objective_id: int = 0


def empty_rows(num_rows: int, seq_len: int) -> Dict[str, np.ndarray]:
  return {f: np.zeros((num_rows, seq_len), FIELD_DTYPES[f]) for f in FIELDS}


def pack_row(examples: Sequence[Example], seq_len: int) -> Dict[str, np.ndarray]:
  """Writes examples one after another into a single row; they must fit."""
  row = {k: v[0] for k, v in empty_rows(1, seq_len).items()}
  start = 0
  for segment, ex in enumerate(examples, start=1):
    n = len(ex.tokens)
    if not 0 <= ex.prefix_len <= n:
      raise ValueError(f"prefix_len {ex.prefix_len} is outside [0, {n}] for an example of {n} tokens")
    end = start + n
    if end > seq_len:
      raise ValueError(f"examples need {end} tokens, more than the row length {seq_len}")
    span = slice(start, end)
    row["targets"][span] = ex.tokens
    row["inputs"][start + 1:end] = ex.tokens[:-1]
    row["positions"][span] = np.arange(n)
    row["segment_ids"][span] = segment
    if ex.prefix_len > 0:
      row["prefix_mask"][start:min(start + ex.prefix_len + 1, end)] = True  # never past the segment
    row["loss_weights"][start + ex.prefix_len:end] = 1.0
    row["objective_ids"][span] = ex.objective_id
    start = end
  return row


def stack_rows(rows: Iterable[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
  rows = list(rows)
  return {f: np.stack([r[f] for r in rows]) for f in FIELDS}


def packing_efficiency(batch: Dict[str, np.ndarray]) -> float:
  """Fraction of token slots that hold real (non-padding) tokens."""
  return float(np.mean(batch["segment_ids"] > 0))
