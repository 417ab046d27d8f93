"""Step-addressed UL2 batches: the global batch at step s is a pure function of (data config, seed, s).

Row r of step s is built from its own random stream, seeded by (seed, split, s * batch_size + r),
so any process can build exactly its own rows, resuming needs no iterator state, and changing the
number of processes changes nothing (DESIGN.md, decision 5).

A row is filled example by example until fewer than `min_chunk` slots remain. Each example picks
its objective (causal / prefix LM / one of the span denoisers) at the configured rates, then a
document uniformly with replacement. A document longer than the objective can fit in the space
left contributes a random window of it; the window's raw length is chosen so that the example
after corruption (sentinels, mode token) fills the space exactly, which keeps packing dense.
Documents of a single token cannot be split: prefix LM and span corruption use them as causal LM.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np

from midas_jax.configs import DataConfig
from midas_jax.data import objectives
from midas_jax.data.packing import Example, pack_row, stack_rows
from midas_jax.errors import require

SPLITS = {"train": 0, "validation": 1}
CAUSAL = objectives.Denoiser("causal", "causal")


def tokenize_documents(texts: Sequence[str], vocab) -> List[np.ndarray]:
  """Each document's token ids followed by EOS."""
  return [np.asarray(vocab.encode(t) + [vocab.eos_id], np.int32) for t in texts]


@dataclasses.dataclass(frozen=True)
class MixtureEntry:
  denoiser: objectives.Denoiser
  probability: float


def span_mode(mean_span: float, density: float) -> str:
  """UL2's rule: extreme (X, [NLG]) when spans are long (>= 12) or dense (>= 30%), else R ([NLU])."""
  return "[NLG]" if mean_span >= 12 or density >= 0.3 else "[NLU]"


def mixture(config: DataConfig) -> List[MixtureEntry]:
  """The objectives of the UL2 mixture with their per-example probabilities."""
  entries = []
  if config.causal_rate > 0:
    entries.append(MixtureEntry(CAUSAL, config.causal_rate))
  if config.prefix_rate > 0:
    entries.append(MixtureEntry(objectives.Denoiser("prefix", "prefix", mode="[S2S]"), config.prefix_rate))
  for mean, density in config.span_denoisers if config.span_rate > 0 else ():
    d = objectives.Denoiser(f"span_mu{mean:g}_r{density:g}", "span", float(mean), float(density),
                            span_mode(mean, density))
    entries.append(MixtureEntry(d, config.span_rate / len(config.span_denoisers)))
  return entries


class Pipeline:
  """Packed UL2 rows over tokenized documents, addressed by (split, step, row)."""

  def __init__(self, config: DataConfig, documents: Dict[str, List[np.ndarray]], vocab_size: int):
    for split, docs in documents.items():
      require(len(docs) > 0, "DataConfig", f"the {split} split has no documents",
              "check the data source (DataConfig.source / train_files / eval_files)")
    self.config = config
    self.documents = documents
    self.special = objectives.special_tokens(vocab_size, config.extra_ids, config.num_sentinels)
    self.entries = mixture(config)
    self._span_budgets = {e.denoiser.name: self._span_budget_table(e.denoiser)
                          for e in self.entries if e.denoiser.kind == "span"}
    self._cumulative = np.cumsum([e.probability for e in self.entries])
    self._cumulative[-1] = 1.0

  def _row_rng(self, split: str, global_row: int) -> np.random.Generator:
    return np.random.default_rng([self.config.seed, SPLITS[split], global_row])

  def _raw_budget(self, denoiser: objectives.Denoiser, space: int) -> int:
    """The longest raw window whose finished example fits in `space` slots."""
    mode = int(self.config.mode_tokens and denoiser.kind != "causal")
    if denoiser.kind != "span":
      return space - mode
    return int(self._span_budgets[denoiser.name][space - mode])

  def _span_budget_table(self, denoiser: objectives.Denoiser) -> np.ndarray:
    """table[b] = the longest raw length whose corrupted length is <= b, for b in [0, seq_len].

    Span corruption also needs a sentinel per span: windows are capped so that they never need more
    than num_sentinels (long rows with dense noise then hold several shorter examples). A table,
    because this is asked once per example on the input hot path.
    """
    d, mu = denoiser.noise_density, denoiser.mean_noise_span_length
    raw = np.arange(self.config.seq_len + 1)
    spans = np.array([objectives.num_spans(int(n), d, mu) for n in raw])
    usable = raw[spans <= self.config.num_sentinels]  # span counts only grow with length
    corrupted = usable + 2 * spans[usable]
    return usable[np.searchsorted(corrupted, raw, side="right") - 1]

  def examples_for_row(self, split: str, global_row: int) -> List[Example]:
    rng = self._row_rng(split, global_row)
    docs = self.documents[split]
    space = self.config.seq_len
    examples = []
    while space >= self.config.min_chunk:
      entry = self.entries[int(np.searchsorted(self._cumulative, rng.random(), side="right"))]
      doc = docs[rng.integers(len(docs))]
      budget = self._raw_budget(entry.denoiser, space)
      if budget < 2:  # too little room left for this objective's overhead
        break
      if len(doc) > budget:
        start = int(rng.integers(len(doc) - budget + 1))
        doc = doc[start:start + budget]
      denoiser = entry.denoiser if len(doc) >= 2 else CAUSAL
      example = objectives.make_example(doc, denoiser, rng, self.special, self.config.mode_tokens)
      examples.append(example)
      space -= len(example.tokens)
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

  def describe(self) -> Dict[str, object]:
    """The mixture and the pinned special-token ids, for config files and checkpoint metadata."""
    return {"objectives": [dict(e.denoiser.to_json(), probability=e.probability) for e in self.entries],
            "special_tokens": self.special.to_json(), "mode_tokens": self.config.mode_tokens}
