"""Which tokens row g of a split reads: fixed windows of the token stream, permuted per epoch.

The split's documents, one after another, are a stream of T tokens. An epoch cuts it into windows
that tile it exactly, each window one row, so every token (every document, whole or in consecutive
pieces) is trained on once per epoch. Each row has one objective of the mix; the windows come in
a fixed cycle of C slots holding each objective in proportion to its rate (0.6 / 0.2 / 0.2: 3
causal, 1 prefix, 1 span slot), and a window's size is its objective's: the most raw tokens whose
examples still fit seq_len (span corruption adds sentinels, a mode token adds one per example). So
where window w starts is arithmetic, (w // C) * S + P[w % C], with no prefix sums over what came
before. Epoch e rotates the stream by a seeded offset (a document's split points and objective
change each epoch) and visits the windows in a seeded order: row i of epoch e is window
permute_e(i) (permutation.py).

Rows per epoch R = the windows that cover T (the last one shorter); row g is row g % R of epoch
g // R. Everything is a function of (config, seed, the store's token and document counts).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np

from midas_jax.data.store import permutation
from midas_jax.data.ul2 import streams

_MAX_CYCLE = 1000
# A document boundary inside a window may cost, beyond its objective's per-token rate, one mode
# token and the rounding of two span counts (T5's counts are rounded per example): up to 4 tokens.
_CUT_COST_SPAN = 4


def cycle(probabilities: Sequence[float]) -> np.ndarray:
  """Objective entries in one cycle of slots, each as often as its probability says: the smallest
  cycle that holds them exactly (up to 1000 slots), else 1000 slots by largest remainder."""
  p = np.asarray(probabilities, np.float64)
  for size in range(1, _MAX_CYCLE + 1):
    counts = p * size
    if np.all(np.abs(counts - np.rint(counts)) < 1e-6):
      counts = np.rint(counts).astype(np.int64)
      break
  else:
    counts = np.floor(p * _MAX_CYCLE).astype(np.int64)
    counts[np.argsort(-(p * _MAX_CYCLE - counts))[:_MAX_CYCLE - counts.sum()]] += 1
  return np.repeat(np.arange(len(p)), counts)


def window_size(seq_len: int, lengths: np.ndarray, chunk: int, cut_cost: int, cuts_per_token: float) -> int:
  """The most raw tokens a window of one objective may hold.

  lengths[n]: the example length of n raw tokens; pieces longer than `chunk` are cut into chunks
  (span corruption: at most num_sentinels spans each). A window of W tokens holds about
  W * cuts_per_token document boundaries, each costing up to cut_cost more slots; the rare row
  that still overflows turns its last examples into causal ones (store/pipeline.py).
  """
  def fits(w: int) -> bool:
    whole, rest = divmod(w, chunk)
    used = whole * int(lengths[chunk]) + int(lengths[rest])
    return used + int(np.ceil(w * cuts_per_token)) * cut_cost <= seq_len

  lo, hi = 1, seq_len  # one token always fits: it is a causal example of length 1
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo


@dataclasses.dataclass(frozen=True)
class Windows:
  """Rows' windows: the objective entry, the first stream position (in [0, T)) and the length."""
  entry: np.ndarray
  start: np.ndarray
  length: np.ndarray


class EpochLayout:
  """The windows of one split (tokens T, documents N) under an objective mix and a seed."""

  def __init__(self, seq_len: int, entries: Sequence, lengths: np.ndarray, chunks: Sequence[int],
               tokens: int, documents: int, key: np.ndarray, use_mode_tokens: bool):
    if tokens < 1:
      raise ValueError("a split needs at least one token")
    self.tokens, self.documents = int(tokens), int(documents)
    cuts_per_token = documents / tokens
    sizes = []
    for i, entry in enumerate(entries):
      kind = entry.denoiser.kind
      cost = (int(use_mode_tokens and kind != "causal" and entry.denoiser.mode is not None) +
              (_CUT_COST_SPAN if kind == "span" else 0))
      sizes.append(window_size(seq_len, lengths[i], chunks[i], cost, cuts_per_token))
    self.window = np.asarray(sizes, np.int64)                       # raw tokens per entry
    self.pattern = cycle([e.probability for e in entries])          # entry of each cycle slot
    slot_sizes = self.window[self.pattern]
    self.slot_starts = slot_sizes.cumsum() - slot_sizes             # P
    self.cycle_tokens = int(slot_sizes.sum())                       # S
    full, rest = divmod(self.tokens, self.cycle_tokens)
    self.rows = full * len(self.pattern) + int(np.count_nonzero(self.slot_starts < rest))  # R
    self._rotation_key = streams.mix(key + streams.GAMMA)           # per epoch: stream offset
    self._order_key = streams.mix(key + streams.GAMMA + streams.GAMMA)          # per epoch: window order

  def windows(self, rows) -> Windows:
    """The windows of global rows `rows` (any epochs)."""
    rows = np.asarray(rows, np.int64)
    epoch, i = np.divmod(rows, self.rows)
    window = np.empty_like(rows)
    for e in np.unique(epoch):
      here = epoch == e
      keys = permutation.round_keys(streams.bits(self._order_key, [e]))
      window[here] = permutation.permute(i[here], self.rows, keys)
    c, slot = np.divmod(window, len(self.pattern))
    start = c * self.cycle_tokens + self.slot_starts[slot]
    entry = self.pattern[slot]
    length = np.minimum(self.window[entry], self.tokens - start)
    rotation = streams.below(streams.uniforms(self._rotation_key, epoch), self.tokens)
    return Windows(entry, (start + rotation) % self.tokens, length)

  def ranges(self, windows: Windows) -> List[List[Tuple[int, int]]]:
    """Per row, the stream ranges [a, b) it reads: one, or two where the window wraps past T."""
    out = []
    for a, n in zip(windows.start.tolist(), windows.length.tolist()):
      b = a + n
      out.append([(a, b)] if b <= self.tokens else [(a, self.tokens), (0, b - self.tokens)])
    return out

  def describe(self) -> Dict[str, object]:
    return {"rows_per_epoch": self.rows, "tokens": self.tokens, "documents": self.documents,
            "window_tokens": self.window.tolist(), "cycle": self.pattern.tolist()}
