"""Rows in the one format every objective shares (docs/architecture.md#one-example-format).

An example is a token sequence with a bidirectional prefix of `prefix_len` tokens (0 for causal
LM) and an objective id. A row packs several examples; per token it carries

  inputs         the example shifted right by one, BOS first (0, seqio's decoder start, unless the
                 vocabulary has a token of its own for it: data/vocab/vocabulary.py start_id)
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
  targets = np.zeros((1, seq_len), FIELD_DTYPES["targets"])
  start = 0
  for ex in examples:
    n = len(ex.tokens)
    if not 0 <= ex.prefix_len <= n:
      raise ValueError(f"prefix_len {ex.prefix_len} is outside [0, {n}] for an example of {n} tokens")
    if start + n > seq_len:
      raise ValueError(f"examples need {start + n} tokens, more than the row length {seq_len}")
    targets[0, start:start + n] = ex.tokens
    start += n

  def per_example(f):
    return np.asarray([[f(ex) for ex in examples]], np.int64).reshape(1, len(examples))

  rows = pack_rows(targets, per_example(lambda ex: len(ex.tokens)), per_example(lambda ex: ex.prefix_len),
                   per_example(lambda ex: ex.objective_id))
  return {k: v[0] for k, v in rows.items()}


def pack_rows(targets: np.ndarray, lengths: np.ndarray, prefix_lens: np.ndarray,
              objective_ids: np.ndarray, bos_id: int = 0) -> Dict[str, np.ndarray]:
  """All fields of many rows at once, from their tokens; each example's inputs start with bos_id.

  targets (rows, seq_len): each row's examples one after another from slot 0, zeros after them.
  lengths, prefix_lens, objective_ids (rows, T): each row's examples in order; example t of a row
  is segment t + 1 (a length-0 entry holds no token, so put them after the row's last example).
  """
  targets = np.asarray(targets, FIELD_DTYPES["targets"])
  num_rows, seq_len = targets.shape
  lengths, prefix_lens = np.asarray(lengths, np.int64), np.asarray(prefix_lens, np.int64)
  used = lengths.sum(axis=1)
  if (used > seq_len).any():
    raise ValueError(f"examples need {int(used.max())} tokens, more than the row length {seq_len}")
  if ((prefix_lens < 0) | (prefix_lens > lengths)).any():
    raise ValueError("a prefix_len is outside [0, length] for its example")

  # Pieces tile the flattened batch: each row's examples, then its padding. Per piece: its size,
  # first slot, segment id (padding 0), last bidirectional position (BOS and the prefix; -1: none),
  # first position with loss (padding: none) and objective id, each then repeated over its slots.
  t = lengths.shape[1]
  piece = np.zeros((6, num_rows, t + 1), np.int32)
  piece[0, :, :t], piece[0, :, t] = lengths, seq_len - used
  piece[2, :, :t] = np.arange(1, t + 1)
  piece[3, :, :t], piece[3, :, t] = np.where(prefix_lens > 0, prefix_lens, -1), -1
  piece[4, :, :t], piece[4, :, t] = prefix_lens, seq_len
  piece[5, :, :t] = objective_ids
  sizes = piece[0].ravel()
  piece[1] = (sizes.cumsum(dtype=np.int32) - sizes).reshape(num_rows, t + 1)
  first, segment_ids, bidir_last, loss_first, objective = piece[1:].reshape(5, -1).repeat(sizes, axis=1)
  positions = np.arange(num_rows * seq_len, dtype=np.int32) - first
  positions *= segment_ids > 0  # padding: 0
  flat = targets.reshape(-1)
  inputs = np.empty_like(flat)
  inputs[1:] = flat[:-1]
  inputs[(positions == 0) & (segment_ids > 0)] = bos_id  # BOS at each example's start
  inputs[segment_ids == 0] = 0  # padding
  rows = {"inputs": inputs, "targets": flat, "positions": positions, "segment_ids": segment_ids,
          "prefix_mask": positions <= bidir_last,
          "loss_weights": (positions >= loss_first).astype(np.float32), "objective_ids": objective}
  return {f: rows[f].reshape(num_rows, seq_len) for f in FIELDS}


def stack_rows(rows: Iterable[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
  rows = list(rows)
  return {f: np.stack([r[f] for r in rows]) for f in FIELDS}


def packing_efficiency(batch: Dict[str, np.ndarray]) -> float:
  """Fraction of token slots that hold real (non-padding) tokens."""
  return float(np.mean(batch["segment_ids"] > 0))
