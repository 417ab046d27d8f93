"""A keyed bijection of [0, n), computed for any index on the fly: the order of an epoch.

A Feistel network permutes [0, 2**k) for the smallest k with 2**k >= n: each round splits a k-bit
value into its top a and bottom b bits (a + b = k) and maps (L, R) to (R, L xor F(R)), a bijection
of [0, 2**k) whatever the split. Indices that land at or past n go through it again (cycle
walking) until they land inside, which keeps it a bijection of [0, n) (Black & Rogaway 2002). The
domain is under 2n, so a walk takes under 2 passes on average; nothing of size n is ever built, so
a host finds where row i of an epoch reads from with a few vectorized hashes, whatever the corpus.
"""

from __future__ import annotations

import numpy as np

from midas_jax.data.ul2 import streams

ROUNDS = 4  # Luby & Rackoff: 4 rounds of a pseudo-random function make a strong pseudo-random permutation


def round_keys(key: np.ndarray) -> np.ndarray:
  """ROUNDS uint64 round keys from a stream key (streams.split_key and friends)."""
  return streams.bits(key, np.arange(ROUNDS))


def permute(index, n: int, keys: np.ndarray) -> np.ndarray:
  """The images of `index` (ints in [0, n)) under the bijection of [0, n) that `keys` selects."""
  if n < 1:
    raise ValueError(f"cannot permute an empty range (n={n})")
  x = np.asarray(index, np.int64)
  if x.size and (x.min() < 0 or x.max() >= n):
    raise ValueError(f"indices must lie in [0, {n})")
  bits = max(1, (n - 1).bit_length())
  out = _feistel(x.astype(np.uint64), bits, keys)
  outside = out >= np.uint64(n)
  while outside.any():  # cycle walking: ends, since x's cycle holds x itself, which is inside
    out[outside] = _feistel(out[outside], bits, keys)
    outside = out >= np.uint64(n)
  return out.astype(np.int64)


def _feistel(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
  low = bits // 2
  a, b = np.uint64(bits - low), np.uint64(low)
  mask_a, mask_b = np.uint64((1 << (bits - low)) - 1), np.uint64((1 << low) - 1)
  for k in keys:
    left, right = x >> b, x & mask_b
    f = right * streams.GAMMA
    f += k
    x = (right << a) | ((left ^ streams.mix(f)) & mask_a)
  return x
