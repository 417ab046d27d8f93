"""Step-addressed batches: the global batch at step s is a pure function of (data config, seed, s).

Row r of step s is built from its own random stream, seeded by (seed, split, s * batch_size + r),
so any process can build exactly its own rows, resuming needs no iterator state, and changing the
number of processes changes nothing (DESIGN.md, decision 5). Each row draws documents uniformly
with replacement and packs chunks of them (a random window of a document longer than the space
left) until fewer than `min_chunk` slots remain.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from midas_jax.configs import DataConfig
from midas_jax.data.packing import Example, pack_row, stack_rows
from midas_jax.errors import require

SPLITS = {"train": 0, "validation": 1}


def tokenize_documents(texts: Sequence[str], vocab) -> List[np.ndarray]:
  """Each document's token ids followed by EOS."""
  return [np.asarray(vocab.encode(t) + [vocab.eos_id], np.int32) for t in texts]


class CausalLMPipeline:
  """Packed causal-LM rows over tokenized documents, addressed by (split, step, row)."""

  def __init__(self, config: DataConfig, documents: Dict[str, List[np.ndarray]]):
    for split, docs in documents.items():
      require(len(docs) > 0, "DataConfig", f"the {split} split has no documents",
              "check the data source (DataConfig.source / train_files / eval_files)")
    self.config = config
    self.documents = documents

  def _row_rng(self, split: str, global_row: int) -> np.random.Generator:
    return np.random.default_rng([self.config.seed, SPLITS[split], global_row])

  def examples_for_row(self, split: str, global_row: int) -> List[Example]:
    rng = self._row_rng(split, global_row)
    docs = self.documents[split]
    space = self.config.seq_len
    examples = []
    while space >= self.config.min_chunk:
      doc = docs[rng.integers(len(docs))]
      if len(doc) > space:
        start = int(rng.integers(len(doc) - space + 1))
        doc = doc[start:start + space]
      examples.append(Example(tokens=doc))
      space -= len(doc)
    return examples

  def batch(self, step: int, split: str = "train", process_index: int = 0,
            process_count: int = 1) -> Dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`: rows [i * B/P, (i + 1) * B/P)."""
    b = self.config.batch_size
    require(b % process_count == 0, "DataConfig.batch_size",
            f"global batch {b} does not split evenly over {process_count} processes",
            f"use a batch size that is a multiple of {process_count}")
    per_process = b // process_count
    first = step * b + process_index * per_process
    rows = (pack_row(self.examples_for_row(split, first + r), self.config.seq_len)
            for r in range(per_process))
    return stack_rows(rows)
