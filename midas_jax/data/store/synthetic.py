"""Synthetic stores of any size, written by the store's own writer: for benchmarks of the reader.

Document lengths are log-normal around `mean_length` (web text is: C4's documents have a long
tail), at least 2 tokens, the last one EOS; the other tokens are uniform over the vocabulary's text
ids. Deterministic in `seed`.
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import numpy as np

from midas_jax.data.store import writer
from midas_jax.data.vocab.vocabulary import EOS_ID, NUM_SPECIAL

_CHUNK = 1 << 16  # documents generated at a time


def _documents(count: int, mean_length: float, vocab_size: int, rng: np.random.Generator
               ) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
  sigma = 1.0
  mu = np.log(mean_length) - sigma ** 2 / 2  # the log-normal's mean is mean_length
  for start in range(0, count, _CHUNK):
    n = min(_CHUNK, count - start)
    lengths = np.maximum(2, rng.lognormal(mu, sigma, n).astype(np.int64))
    tokens = rng.integers(NUM_SPECIAL, vocab_size, int(lengths.sum()), dtype=np.int32)
    tokens[lengths.cumsum() - 1] = EOS_ID
    yield tokens, lengths


def write(store: str, documents: int, vocab, mean_length: float = 64.0, validation_documents: int = 1000,
          documents_per_shard: int = 1 << 20, seed: int = 0) -> Dict[str, object]:
  """A store of `documents` train and `validation_documents` validation documents."""
  rng = np.random.default_rng(seed)
  text_ids = vocab.vocab_size - vocab.extra_ids
  parts = []
  for split, count in (("train", documents), ("validation", validation_documents)):
    for start in range(0, count, documents_per_shard):
      n = min(documents_per_shard, count - start)
      parts.append({split: _documents(n, mean_length, text_ids, np.random.default_rng(rng.integers(1 << 62)))})
  source = {"kind": "synthetic", "documents": documents, "mean_length": mean_length, "seed": seed}
  return writer.write_parts(store, parts, vocab, source)
