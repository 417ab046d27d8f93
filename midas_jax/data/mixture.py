"""Weighted mixtures of sources (DataConfig.mixture): each packed row of a batch comes from one source.

Why per row, not per example. A row is packed from one source's documents by that source's own
pipeline (in memory: pipeline.py; a prepared store: store/pipeline.py), so packing, the store's
windows and its exactly-once epochs stay exactly as they are for a single source, and a row's loss
belongs to one source. The fractions then hold in rows, and so, rows being ~99.7% full, in tokens.
seqio and MaxText mix per example; at rows of a few examples that makes no difference to what is
trained, and per row keeps every source's stream whole.

Which rows a source gets. Weights w (normalized) become a cycle of N rows that holds n_i = w_i * N
rows of source i exactly (the smallest whole number of steps that makes every n_i whole, up to
2**16 rows; else 2**16 rows rounded by largest remainder, each fraction then within 2**-16). In
the cycle, source i's n_i rows sit at the ranks of the times (k + 1/2) / n_i, k = 0 .. n_i - 1,
sorted with the other sources' (ties by source order), so every source is spread evenly and each
step holds its share within a row or so. Row r of step s is row g = (s - start) * B + r of its
stage; it reads cycle slot j = g mod N of cycle c = g div N: source i = source[j], and that
source's own row

    local = before_i + c * n_i + rank[j]

where rank[j] is k, the slot's place among source i's slots in the cycle, and before_i the rows
source i got in the earlier stages (whole cycles and a counted partial one: a few numbers per
stage, computed once). So a row's source and its place in that source's stream cost a table
lookup and no pass over earlier steps: the batch at step s is a pure function of (config, seed,
s), each process computes only its own rows, and a resume or a new process count needs no state.

What "exactly once within each source" means here. Ranks grow with the slot and cycles follow one
another, so the k-th row that source i is given, counting rows in (step, row) order over the whole
run, reads row k of that source's own stream: the source is read in its own order, with no row
skipped or repeated, exactly as a run on that source alone would read it. For a prepared store
that is its exactly-once epochs (rows [e * R, (e + 1) * R) of its stream are epoch e, every
document once), so each store keeps its epochs whatever the other sources and the weights do; an
in-memory source keeps its sampling with replacement. A source of weight 0 in a stage is paused,
not skipped over: it resumes at its next row when a later stage weighs it again.

Stages. StackingConfig.stage_mixtures gives each stage its own weights; stage k's cycle starts at
its first step, so the rows of the boundary step already follow the new weights. Validation
batches use the sources' own weights (MixtureSource.weight) throughout, and the run also evaluates
each source on its own validation batches (train/run.py records `loss/<name>`).

Each source has its own seed, derived from the run's DataConfig.seed and the source's name, so two
sources never share random draws and reordering the mixture changes no source's stream; its eval_seed
is derived from DataConfig.eval_seed alike. Which rows of a step each source gets depends on the
weights only, not on a seed, so a fixed eval_seed fixes the whole validation batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import zlib
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np

from midas_jax.configs import DataConfig
from midas_jax.configs.data import MixtureSource
from midas_jax.data.pipeline import Pipeline
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.ul2 import streams
from midas_jax.data.ul2.packing import FIELDS, empty_rows
from midas_jax.errors import require

MAX_CYCLE_ROWS = 1 << 16
_SEED_STREAMS = 1 << 33  # stream ids of the sources' seeds, apart from the pipelines' split ids
SourcePipeline = Union[Pipeline, PreparedPipeline]


def source_seed(seed: int, name: str) -> int:
  """The data seed of source `name` in a run of DataConfig.seed `seed`."""
  return int(streams.split_key(seed, _SEED_STREAMS + zlib.crc32(name.encode("utf-8")))[0] >> np.uint64(2))


def source_config(data: DataConfig, source: MixtureSource) -> DataConfig:
  """The DataConfig one source's pipeline is built from: the run's, with the source's settings and seeds
  (its eval_seed derived from the run's as its seed is, so a fixed eval_seed fixes every source's
  held-out rows; heldout_shard and corpus_documents are the run's)."""
  eval_seed = None if data.eval_seed is None else source_seed(data.eval_seed, source.name)
  return dataclasses.replace(
      data, source=source.source, train_files=source.train_files, eval_files=source.eval_files,
      jsonl_field=source.jsonl_field, corpus_seed=source.corpus_seed, prepared_dir=source.prepared_dir,
      prepared_from=source.prepared_from, mixture=(), seed=source_seed(data.seed, source.name), eval_seed=eval_seed)


@dataclasses.dataclass(frozen=True)
class Cycle:
  """One stage's cycle of rows: counts[i] rows of source i; slot j is source[j]'s rank[j]-th of them."""

  counts: np.ndarray
  source: np.ndarray
  rank: np.ndarray

  @property
  def size(self) -> int:
    return len(self.source)

  def rows_in(self, n: int) -> np.ndarray:
    """Rows of each source among the stage's first n rows."""
    whole, rest = divmod(int(n), self.size)
    return whole * self.counts + np.bincount(self.source[:rest], minlength=len(self.counts))


def cycle(weights: Sequence[float], batch_size: int) -> Cycle:
  """The cycle of weights w (relative): see the module doc."""
  w = np.asarray(weights, np.float64)
  w = w / w.sum()
  longest = max(1, MAX_CYCLE_ROWS // batch_size)
  for steps in range(1, longest + 1):
    exact = w * steps * batch_size
    if np.all(np.abs(exact - np.rint(exact)) < 1e-6):
      counts = np.rint(exact).astype(np.int64)
      break
  else:
    size = longest * batch_size
    counts = np.floor(w * size).astype(np.int64)
    counts[np.argsort(-(w * size - counts), kind="stable")[:size - counts.sum()]] += 1
  source = np.repeat(np.arange(len(w)), counts)
  rank = np.arange(len(source)) - np.repeat(counts.cumsum() - counts, counts)
  order = np.lexsort((source, (2 * rank + 1) / (2 * counts[source])))  # by time, ties by source
  return Cycle(counts, source[order], rank[order])


class RowSchedule:
  """Which source, and which row of that source's own stream, each row of each step reads."""

  def __init__(self, stage_weights: Sequence[Sequence[float]], starts: Sequence[int], batch_size: int):
    self.starts, self.batch_size = tuple(int(s) for s in starts), batch_size
    self.cycles = [cycle(w, batch_size) for w in stage_weights]
    before = [np.zeros(len(self.cycles[0].counts), np.int64)]
    for k in range(len(self.cycles) - 1):
      before.append(before[-1] + self.cycles[k].rows_in((self.starts[k + 1] - self.starts[k]) * batch_size))
    self.before = before

  def stage_of(self, step: int) -> int:
    """The 0-indexed stage that `step` belongs to."""
    return bisect.bisect_right(self.starts, step) - 1

  def assign(self, step: int, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(source index, the source's own row) of rows `rows` (indices in the global batch) of `step`."""
    k = self.stage_of(step)
    c = self.cycles[k]
    at, slot = np.divmod((step - self.starts[k]) * self.batch_size + np.asarray(rows, np.int64), c.size)
    source = c.source[slot]
    return source, self.before[k][source] + at * c.counts[source] + c.rank[slot]

  def rows_before(self, step: float) -> np.ndarray:
    """Rows each source was given in steps [0, step)."""
    k = self.stage_of(step)
    return self.before[k] + self.cycles[k].rows_in(int((step - self.starts[k]) * self.batch_size))


def _source_rows(pipeline: SourcePipeline, split: str, rows: np.ndarray):
  """Rows `rows` of one source's own stream: (batch, per-example origins in its store or None)."""
  if isinstance(pipeline, PreparedPipeline):
    return pipeline._rows(split, rows, pipeline._read(split, rows))  # pylint: disable=protected-access
  return pipeline._rows(split, rows), None  # pylint: disable=protected-access


class MixturePipeline:
  """Packed rows from several sources at their weights, addressed by (split, step, row); see the module doc.

  sources: {name: that source's pipeline}, in DataConfig.mixture's order. stage_weights: one weight
  tuple per stage (StackingConfig.stage_mixtures), with stage_starts the stages' first steps (the
  run's schedule); None: the sources' own weights throughout.
  """

  def __init__(self, config: DataConfig, sources: Dict[str, SourcePipeline],
               stage_weights: Optional[Sequence[Sequence[float]]] = None,
               stage_starts: Optional[Sequence[int]] = None):
    names = [s.name for s in config.mixture]
    if list(sources) != names:
      raise ValueError(f"the pipelines {list(sources)} are not the mixture's sources {names}")
    s = "StackingConfig.stage_mixtures"
    own = tuple(float(e.weight) for e in config.mixture)
    if stage_weights is None:
      stage_weights, stage_starts = (own,), (0,)
    else:
      require(all(len(w) == len(names) for w in stage_weights), s,
              f"{[len(w) for w in stage_weights]} weights per stage for the {len(names)} sources {names}",
              "give every stage one weight per DataConfig.mixture source, in its order")
      require(stage_starts is not None, s, "the data was built without the run's stage schedule",
              "build it with load_data(config, stage_starts=stacking.checks.schedule_for(config).starts)")
      require(len(stage_starts) == len(stage_weights) and stage_starts[0] == 0, s,
              f"{len(stage_weights)} weight tuples for stages starting at {tuple(stage_starts)}",
              "list one weight tuple per stage")
    self.config, self.sources = config, dict(sources)
    self.names = names
    self.stage_weights = tuple(tuple(float(x) for x in w) for w in stage_weights)
    self.schedules = {"train": RowSchedule(self.stage_weights, stage_starts, config.batch_size),
                      "validation": RowSchedule((own,), (0,), config.batch_size)}
    first = next(iter(self.sources.values()))
    self.special, self.mix, self.entries = first.special, first.mix, first.entries

  def batch(self, step: int, split: str = "train", process_index: int = 0,
            process_count: int = 1) -> Dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`: rows [i * B/P, (i + 1) * B/P)."""
    return self.batch_with_sources(step, split, process_index, process_count)[0]

  def batch_with_sources(self, step: int, split: str = "train", process_index: int = 0,
                         process_count: int = 1) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """batch() and per row its source's name ("source"); per row and segment (segment k + 1 at
    column k) the example's document in its store, first token and raw length ("document", "start",
    "length"; -1 / 0 where no example or the source is in memory)."""
    per_process = streams.rows_per_process(self.config.batch_size, step, process_count)
    source, local = self.schedules[split].assign(step, process_index * per_process + np.arange(per_process))
    out = empty_rows(per_process, self.config.seq_len)
    origins = []
    for i, pipeline in enumerate(self.sources.values()):
      here = np.flatnonzero(source == i)
      if len(here):
        rows, where = _source_rows(pipeline, split, local[here])
        for f in FIELDS:
          out[f][here] = rows[f]
        if where is not None:
          origins.append((here, where))
    width = max([int(out["segment_ids"].max(initial=0)), 1] + [w["document"].shape[1] for _, w in origins])
    found = {"source": np.asarray(self.names)[source], "document": np.full((per_process, width), -1, np.int64),
             "start": np.full((per_process, width), -1, np.int64), "length": np.zeros((per_process, width), np.int64)}
    for here, where in origins:
      for k in ("document", "start", "length"):
        found[k][here, :where[k].shape[1]] = where[k]
    return out, found

  def progress(self, steps: int) -> Dict[str, float]:
    """Each source's own progress measure (`epoch/<name>` for a store, `corpus_passes/<name>` in
    memory) after the rows it was given in `steps` steps."""
    out = {}
    for (name, pipeline), rows in zip(self.sources.items(), self.schedules["train"].rows_before(steps)):
      out.update({f"{k}/{name}": v for k, v in pipeline.progress(rows / self.config.batch_size).items()})
    return out

  def describe(self) -> Dict[str, object]:
    """The objectives and special tokens (the sources share them), and per source its weights and its own record."""
    first = next(iter(self.sources.values())).describe()
    shared = ("objectives", "special_tokens", "mode_tokens", "vocabulary")
    sources = {}
    for i, (name, pipeline) in enumerate(self.sources.items()):
      sources[name] = {"stage_weights": [w[i] / sum(w) for w in self.stage_weights],
                       **{k: v for k, v in pipeline.describe().items() if k not in shared}}
    return {**{k: first[k] for k in shared if k in first},
            "sources": {"stage_starts": list(self.schedules["train"].starts), "by_name": sources}}

  def close(self, wait: bool = False) -> None:
    for pipeline in self.sources.values():
      if isinstance(pipeline, PreparedPipeline):
        pipeline.close(wait)
