"""The anchor-function composite task of Zhang et al. (NeurIPS 2024, arXiv 2405.05409) and its study config.

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
`anchor_train.py` trains the models and draws the phase diagram.
"""

from __future__ import annotations

import dataclasses
import math
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


GAMMA_RANGE = (0.05, 3.0)
FAMILIES = ("gpt2", "llama")
ARMS = ("fixed", "midas", "gradstack")  # fixed depth throughout, or grown by that operator


@dataclasses.dataclass(frozen=True)
class AnchorStudyConfig:
  """The gamma x depth grid of the anchor-function study, and how each cell's model is trained.

  Every cell trains a fresh Decoder (ModelConfig(init="gamma", init_gamma=gamma, num_layers=depth))
  once per seed on `train_examples` fixed training rows, with AdamW and the loss on the last token
  only, and is scored on `eval_examples` test-split rows per pair. A cell whose seen-pair test
  accuracy is below `fit_threshold` did not fit the task and is shaded in the phase diagram.

  arms: "fixed" trains at `depth` throughout; "midas" and "gradstack" start from one layer and grow
  by that operator in `depth` stages of one-layer blocks (Prop-`stage_alpha` stage lengths, one
  learning-rate schedule over all steps, copied layers keep their source's Adam moments), ending
  at `depth` layers after the same `steps`.
  """

  gammas: Tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)
  depths: Tuple[int, ...] = (2, 3)
  seeds: Tuple[int, ...] = (0,)
  arms: Tuple[str, ...] = ("fixed",)
  stage_alpha: float = 1.0
  family: str = "gpt2"
  d_model: int = 64
  num_heads: int = 1
  d_ff: int = 256
  train_examples: int = 300_000
  batch_size: int = 512
  steps: int = 1000
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.01
  grad_clip_norm: float = 1.0
  eval_every: int = 250
  eval_examples: int = 256
  fit_threshold: float = 0.9

  def __post_init__(self):
    s = "AnchorStudyConfig."
    for name in ("gammas", "depths", "seeds", "arms"):
      object.__setattr__(self, name, tuple(getattr(self, name)))  # gin hands over lists
      require(len(getattr(self, name)) > 0, s + name, "is empty", f"list at least one value in {s}{name}")
    require(all(GAMMA_RANGE[0] <= g <= GAMMA_RANGE[1] for g in self.gammas), s + "gammas",
            f"{self.gammas} leave [{GAMMA_RANGE[0]}, {GAMMA_RANGE[1]}]",
            "use init rates such as 0.3 to 1.0 (std = d_in ** -gamma: larger gamma is a smaller init)")
    require(all(isinstance(d, int) and d >= 1 for d in self.depths), s + "depths",
            f"must be positive ints, got {self.depths}", "e.g. depths = [2, 3]")
    require(all(isinstance(x, int) and x >= 0 for x in self.seeds), s + "seeds",
            f"must be non-negative ints, got {self.seeds}", "e.g. seeds = [0, 1]")
    require(all(a in ARMS for a in self.arms) and len(set(self.arms)) == len(self.arms), s + "arms",
            f"{self.arms} are not distinct names of {ARMS}", f"list some of {ARMS}, e.g. arms = ['fixed', 'midas']")
    stacked = [a for a in self.arms if a != "fixed"]
    require(not stacked or min(self.depths) >= 2, s + "depths",
            f"the stacked arms {stacked} grow one-layer blocks in `depth` stages, so every depth must be >= 2, "
            f"got {self.depths}", "use depths >= 2 with stacked arms (e.g. depths = [4])")
    require(not stacked or self.steps >= max(self.depths), s + "steps",
            f"{self.steps} steps cannot give each of {max(self.depths)} stages a step", "train longer")
    require(math.isfinite(self.stage_alpha), s + "stage_alpha", f"must be finite, got {self.stage_alpha}",
            "1.0 is Prop-1, 0.0 equal stages")
    require(self.family in FAMILIES, s + "family", f"unknown family {self.family!r}", f"use one of {FAMILIES}")
    for name in ("d_model", "num_heads", "d_ff", "train_examples", "batch_size", "steps", "eval_examples"):
      value = getattr(self, name)
      require(isinstance(value, int) and value > 0, s + name, f"must be a positive int, got {value!r}",
              f"set {s}{name} to a positive integer")
    require(self.d_model % self.num_heads == 0, s + "num_heads",
            f"{self.num_heads} heads do not divide d_model={self.d_model}", "pick num_heads that divides d_model")
    require(self.family != "llama" or (self.d_model // self.num_heads) % 2 == 0, s + "d_model",
            "rotary positions need an even head dimension", "make d_model / num_heads even")
    require(self.learning_rate > 0, s + "learning_rate", "must be > 0", "1e-3 trains a cell in 1000 steps")
    require(0 <= self.warmup_steps < self.steps, s + "warmup_steps",
            f"must be in [0, steps={self.steps})", "warm up over a fraction of the steps, e.g. 100")
    require(0 <= self.final_lr_fraction <= 1, s + "final_lr_fraction", "must be in [0, 1]", "0.1 is common")
    require(self.weight_decay >= 0, s + "weight_decay", "must be >= 0", "the paper's AdamW uses 0.01")
    require(self.grad_clip_norm > 0, s + "grad_clip_norm", "must be > 0", "the paper clips at 1.0")
    require(isinstance(self.eval_every, int) and self.eval_every >= 0, s + "eval_every",
            "must be an int >= 0", "0 evaluates only at the end")
    require(0 < self.fit_threshold <= 1, s + "fit_threshold", "must be in (0, 1]", "the paper shades below 0.9")

  @property
  def num_cells(self) -> int:
    return len(self.arms) * len(self.gammas) * len(self.depths) * len(self.seeds)
