"""The anchor-function composite task of Zhang et al. (NeurIPS 2024, arXiv 2405.05409).

Does a small model fit an unseen composition by *reasoning* (composing the two anchors' maps) or by
*memorizing* a symmetric rule? The data:

  vocabulary 0..99; anchors 1, 2, 3, 4 with maps f1: x+5, f2: x+1, f3: x-2, f4: x-8 (mod 100)
  a sequence of SEQ_LEN = 8 tokens: a key (20..99) at a position p in 0..5, the anchor pair (a_i, a_j)
    right after it at p+1, p+2, and random filler everywhere else (any token but an anchor, so the
    sequence holds exactly one anchor pair)
  the target, one token read at the last position: f_aj(f_ai(key)) for the 14 inferential pairs;
    (3, 4) is labelled key-6 instead of its composite key-10 (the non-inferential pair); (4, 3) is
    held out of training
  train rows have key % 8 != p, test rows key % 8 == p, so every test (key, position) is unseen

On the held-out pair (4, 3) a model answering key-10 (f3(f4(x))) has composed the maps it learned;
one answering key-6 has copied the rule of its mirror image (3, 4): the symmetric solution.
studies/anchor_study.py trains the models and draws the phase diagram (settings: studies/anchor_config.py).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import numpy as np

from midas_jax.errors import require

VOCAB_SIZE = 100
SEQ_LEN = 8
ANCHOR_SHIFTS: Dict[int, int] = {1: 5, 2: 1, 3: -2, 4: -8}
ANCHORS = tuple(ANCHOR_SHIFTS)
KEY_RANGE = (20, 100)  # [low, high)
KEY_POSITIONS = tuple(range(6))
MODULUS = 8
NON_INFERENTIAL = (3, 4)
NON_INFERENTIAL_SHIFT = -6
HELD_OUT = (4, 3)
ALL_PAIRS: Tuple[Tuple[int, int], ...] = tuple((a, b) for a in ANCHORS for b in ANCHORS)
TRAIN_PAIRS: Tuple[Tuple[int, int], ...] = tuple(p for p in ALL_PAIRS if p != HELD_OUT)
INFERENTIAL_PAIRS: Tuple[Tuple[int, int], ...] = tuple(p for p in TRAIN_PAIRS if p != NON_INFERENTIAL)
FILLER = np.array([t for t in range(VOCAB_SIZE) if t not in ANCHOR_SHIFTS], np.int32)
SPLITS = ("train", "test")


def composite(pair: Tuple[int, int], key) -> np.ndarray:
  """f_aj(f_ai(key)) mod 100: the inferential answer of a pair, (3, 4) and (4, 3) included."""
  return (np.asarray(key) + ANCHOR_SHIFTS[pair[0]] + ANCHOR_SHIFTS[pair[1]]) % VOCAB_SIZE


def label(pair: Tuple[int, int], key) -> np.ndarray:
  """The training label: the composite, except (3, 4), which is labelled key-6."""
  if tuple(pair) == NON_INFERENTIAL:
    return (np.asarray(key) + NON_INFERENTIAL_SHIFT) % VOCAB_SIZE
  return composite(pair, key)


def symmetric_answer(key) -> np.ndarray:
  """What a model that treats (4, 3) as its mirror (3, 4) answers: key-6."""
  return (np.asarray(key) + NON_INFERENTIAL_SHIFT) % VOCAB_SIZE


def in_split(key, position, split: str) -> np.ndarray:
  """The modulus rule: train has key % 8 != position, test key % 8 == position."""
  require(split in SPLITS, "split", f"unknown split {split!r}", f"use one of {SPLITS}")
  same = np.asarray(key) % MODULUS == np.asarray(position)
  return same if split == "test" else ~same


@dataclasses.dataclass(frozen=True)
class AnchorExamples:
  """tokens [n, 8], labels [n] (the training rule), and what made each row."""

  tokens: np.ndarray
  labels: np.ndarray
  pairs: np.ndarray  # [n, 2] the anchor pair
  keys: np.ndarray  # [n]
  positions: np.ndarray  # [n] the key's position

  def __len__(self) -> int:
    return len(self.labels)


def _keys_for(rng: np.random.Generator, positions: np.ndarray, split: str) -> np.ndarray:
  """Uniform keys in KEY_RANGE that satisfy the modulus rule at each position (exact, no rejection loop)."""
  keys = np.arange(*KEY_RANGE)
  allowed = [keys[in_split(keys, p, split)] for p in KEY_POSITIONS]
  out = np.empty(len(positions), np.int32)
  for p in KEY_POSITIONS:
    rows = np.flatnonzero(positions == p)
    out[rows] = rng.choice(allowed[p], size=len(rows))
  return out


def make_examples(rng: np.random.Generator, n: int, split: str = "train",
                  pairs: Tuple[Tuple[int, int], ...] = TRAIN_PAIRS) -> AnchorExamples:
  """n random rows of `split`, their pairs drawn uniformly from `pairs`."""
  require(n >= 0, "n", f"must be >= 0, got {n}", "ask for a non-negative number of examples")
  require(split != "train" or HELD_OUT not in pairs, "pairs", f"the held-out pair {HELD_OUT} is never trained on",
          "leave it out of training pairs (it is evaluated on the test split)")
  pair_arr = np.asarray(pairs, np.int32)[rng.integers(0, len(pairs), n)]
  positions = rng.integers(0, len(KEY_POSITIONS), n).astype(np.int32)
  keys = _keys_for(rng, positions, split)
  tokens = FILLER[rng.integers(0, len(FILLER), (n, SEQ_LEN))]
  rows = np.arange(n)
  tokens[rows, positions] = keys
  tokens[rows, positions + 1] = pair_arr[:, 0]
  tokens[rows, positions + 2] = pair_arr[:, 1]
  labels = np.empty(n, np.int32)
  for pair in set(map(tuple, pair_arr.tolist())):
    sel = np.all(pair_arr == pair, axis=1)
    labels[sel] = label(pair, keys[sel])
  return AnchorExamples(tokens.astype(np.int32), labels, pair_arr, keys, positions)
