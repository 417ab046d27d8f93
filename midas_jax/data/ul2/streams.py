"""Counter-based random numbers: draw `c` of row `r` is a pure function of (seed, split, r, c).

A draw is SplitMix64's output function (Steele, Lea & Flood 2014) at a position of the split's
stream: mix(key + n * gamma) is exactly the n-th output of SplitMix64 started from `key`, so any
position costs one vectorized hash and no generator has to be seeded per row (numpy's
default_rng([seed, split, row]) costs ~15 us, more than a whole row is allowed here).

Row r owns positions [r * 2**24, (r + 1) * 2**24) of its split's stream. n -> key + n * gamma is a
bijection mod 2**64 (gamma is odd), so two rows never share a draw, and a row's draws do not depend
on which other rows are built beside it: any process can build its own slice of a batch.
"""

from __future__ import annotations

import numpy as np

from midas_jax.errors import require

ROW_BITS = 24                  # counters per row: 2**24, far above the ~5 * seq_len a row uses
MAX_ROWS = 1 << (63 - ROW_BITS)  # positions are int64
GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix(z: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer, in place on a uint64 array (a bijection with full avalanche)."""
  z ^= z >> _S30
  z *= _M1
  z ^= z >> _S27
  z *= _M2
  z ^= z >> _S31
  return z


def split_key(seed: int, split: int) -> np.ndarray:
  """The stream key of one (seed, split): a 1-element uint64 array (arrays wrap silently on
  overflow, numpy scalars warn)."""
  z = mix(np.array([seed % (1 << 64)], np.uint64) + GAMMA)
  return mix(z + np.array([split % (1 << 64)], np.uint64) * GAMMA)


def positions(rows, counters) -> np.ndarray:
  """Stream positions (int64) of (row, counter) pairs; rows and counters broadcast together."""
  return (np.asarray(rows, np.int64) << ROW_BITS) + counters


def bits(key: np.ndarray, positions) -> np.ndarray:
  """64 random bits at each stream position."""
  z = np.asarray(positions, np.int64).view(np.uint64) * GAMMA  # positions are >= 0
  z += key + GAMMA  # SplitMix64's first output is at key + gamma
  return mix(z)


def uniforms(key: np.ndarray, positions) -> np.ndarray:
  """Uniform float64 in [0, 1) with 53 random bits, at each stream position."""
  return (bits(key, positions) >> np.uint64(11)) * (1.0 / (1 << 53))


def below(u: np.ndarray, n) -> np.ndarray:
  """floor(u * n) for uniforms u and integers 1 <= n < 2**53: uniform on {0, ..., n-1} up to
  n / 2**53. Never n: u <= 1 - 2**-53 keeps u * n at least half a float spacing below n."""
  return (u * n).astype(np.int64)


def rows_per_process(batch_size: int, step: int, process_count: int) -> int:
  """The rows of a `batch_size` global batch each of `process_count` processes reads at `step`,
  checked: the batch splits evenly, and the step addresses rows of the stream."""
  require(batch_size % process_count == 0, "DataConfig.batch_size",
          f"global batch {batch_size} does not split evenly over {process_count} processes",
          f"use a batch size that is a multiple of {process_count}")
  limit = MAX_ROWS // batch_size
  require(0 <= step < limit, "step", f"step {step} is outside [0, {limit:,})", "steps address rows of a 2**39-row stream")
  return batch_size // process_count
