"""UL2 batches from a prepared store: row g of a split is a window of its token stream (layout.py).

Data stays addressed by step (docs/architecture.md#data-addressed-by-step): the global batch at
step s is rows [s * B, (s + 1) * B) of the split, each a pure function of (config, seed, the store,
row), so each process builds only its own rows and a resume needs no iterator state (the held-out
split's seed is DataConfig.eval_seed when set). Within an epoch every document is read once, whole
or as consecutive pieces (a window boundary or a chunk cut splits it), and none twice.

A row holds one objective of the mix (its window's, layout.py). Each document piece in the
window is one example of it: causal LM; prefix LM split uniformly; span corruption with T5's counts
(pieces longer than num_sentinels spans allow are cut into consecutive chunks first). The windows
are sized so that the examples fit seq_len; in the rare row where document boundaries cost more
than the window allowed, its last examples are made causal LM instead (never dropped): `counts`
tallies how often. Examples are laid out and packed by the same code as the in-memory pipeline.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.configs import DataConfig, ObjectivesConfig
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.store import format as store_format
from midas_jax.data.store.layout import EpochLayout
from midas_jax.data.store.read_ahead import ReadAhead
from midas_jax.data.store.reader import SplitReader
from midas_jax.data.ul2 import objectives, streams
from midas_jax.data.ul2.packing import pack_rows
from midas_jax.data.ul2.rows import CAUSAL_ID, PREFIX_ID, SPAN_ID, example_tables, objective_mix, place_examples
from midas_jax.errors import require

_LAYOUT_STREAMS, _DRAW_STREAMS = 16, 24  # stream ids, apart from the in-memory pipeline's (0, 1)


class PreparedPipeline:
  """Packed UL2 rows over a prepared store, addressed by (split, step, row); see the module doc."""

  def __init__(self, config: DataConfig, vocab, store: Optional[str] = None,
               mix: ObjectivesConfig = ObjectivesConfig()):
    store = fs.check(store or config.prepared_dir, "DataConfig.prepared_dir")
    manifest = store_format.read_manifest(store)
    store_format.check_matches(manifest, config, vocab, store)
    require(2 * config.seq_len < 1 << streams.ROW_BITS, "DataConfig.seq_len",
            f"{config.seq_len} needs more random draws per row than a row has", "use seq_len < 8,000,000")
    self.config, self.mix, self.store, self.manifest = config, mix, store, manifest
    self.special = objectives.vocabulary_special_tokens(vocab, mix.num_sentinels)
    self._vocabulary, self._bos_id = vocab.special_ids(), vocab.start_id
    self.entries = objective_mix(mix)
    tables = example_tables(config.seq_len, mix, self.entries, self.special)
    self._table = {k: v.ravel() for k, v in tables.items()}
    self._chunk = np.asarray([self._chunk_size(tables, i) for i in range(len(self.entries))], np.int64)
    self._sentinel_ids = np.asarray(self.special.sentinel_ids, np.int32)
    dtype = np.dtype(manifest["dtype"])
    store_format.check_shards(store, manifest, SPLITS)
    self.readers: Dict[str, SplitReader] = {}
    self.layouts: Dict[str, EpochLayout] = {}
    self._keys: Dict[str, np.ndarray] = {}
    for index, split in enumerate(SPLITS):
      seed = config.split_seed(split)  # the held-out split's: DataConfig.eval_seed when set
      reader = SplitReader(store, store_format.split_shards(manifest, split, store), dtype, config.read_threads,
                           config.read_merge_gap_bytes, config.read_retry_timeout_s)
      self.readers[split] = reader
      self.layouts[split] = EpochLayout(config.seq_len, self.entries, tables["length"], self._chunk, reader.tokens,
                                        reader.documents, streams.split_key(seed, _LAYOUT_STREAMS + index),
                                        mix.mode_tokens)
      self._keys[split] = streams.split_key(seed, _DRAW_STREAMS + index)
    # A remote store's reads wait on round trips: the next `read_ahead` steps' reads run while this one is
    # built. Local reads take microseconds and are made in line.
    self._ahead = ReadAhead(config.read_ahead if fs.is_remote(store) else 0)
    self._lock = threading.Lock()
    self.counts = {"examples": 0, "demoted_examples": 0, "tokens": 0, "demoted_tokens": 0}
    self.steps_read = 0  # batches' reads made, in line or ahead

  def _chunk_size(self, tables, i: int) -> int:
    """The longest piece that is one example: span corruption needs a sentinel per span."""
    if self.entries[i].denoiser.kind != "span":
      return self.config.seq_len
    return int(np.flatnonzero(tables["num_spans"][i] <= self.mix.num_sentinels).max())

  # ----------------------------------------------------------------------------- reading

  def _read(self, split: str, rows: np.ndarray):
    """The rows' windows, and per piece of them (row, document, first token in it, size) with every
    row's raw tokens one after another: one batched read of the split (reader.py)."""
    layout = self.layouts[split]
    windows = layout.windows(rows)
    jobs = layout.ranges(windows)
    read = self.readers[split].read([r for job in jobs for r in job])
    with self._lock:
      self.steps_read += 1
    row_of_range = np.repeat(np.arange(len(rows)), [len(job) for job in jobs])
    row = np.repeat(row_of_range, [len(p[0][0]) for p in read])
    doc, first, size = (np.concatenate([p[0][k] for p in read]) for k in range(3))
    return windows, row, doc, first, size, np.concatenate([p[1] for p in read])

  # ----------------------------------------------------------------------------- rows

  def _rows(self, split: str, rows: np.ndarray, read) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """Rows `rows` (global indices) in the ul2/packing.py format, and per example its (document, start,
    length) in the store; `read`: what _read(split, rows) returns."""
    s, table, key = self.config.seq_len, self._table, self._keys[split]
    windows, row, doc, first, size, raw = read
    entry = windows.entry[row]
    row, doc, entry, first, src, n = _chunks(row, doc, entry, first, size, self._chunk[entry])

    at = entry * (s + 1) + n
    kind, mode_id, lengths = table["kind"][at], table["mode_id"][at], table["length"][at]
    prefix_lens = table["prefix"][at]
    row_start = np.searchsorted(row, np.arange(len(rows)))  # first example of each row
    slot = np.arange(len(row)) - row_start[row]             # the example's index in its row
    extra = lengths - n
    over = _within_rows(extra, row_start, row) > (s - windows.length)[row]
    kind[over], mode_id[over], lengths[over], prefix_lens[over] = CAUSAL_ID, 0, n[over], 0

    mode = mode_id > 0
    drawn = kind == PREFIX_ID
    if drawn.any():
      u = streams.uniforms(key, streams.positions(rows[row[drawn]], slot[drawn]))
      prefix_lens[drawn] = mode[drawn] + objectives.prefix_lengths(n[drawn], u)
    offset = _within_rows(lengths, row_start, row) - lengths  # examples one after another from slot 0
    body = row * s + offset + mode
    span = kind == SPAN_ID
    keys = None
    if span.any():  # the raw token at window position i draws at counter seq_len + i
      in_window = src[span] - (windows.length.cumsum() - windows.length)[row[span]]
      keys = streams.bits(key, streams.positions(rows[row[span]], s + in_window)[:, None]
                          + np.arange(n[span].max()))
    targets = place_examples(len(rows) * s, raw, src, body, n, kind, mode_id, table["num_noise"][at],
                             table["num_spans"][at], keys, self._sentinel_ids)

    width = int(slot.max()) + 1 if len(slot) else 1
    per_row = {k: np.zeros((len(rows), width), np.int64) for k in ("length", "prefix", "kind", "document",
                                                                    "start", "raw")}
    for k, v in (("length", lengths), ("prefix", prefix_lens), ("kind", kind), ("document", doc),
                 ("start", first), ("raw", n)):
      per_row[k][row, slot] = v
    with self._lock:
      self.counts["examples"] += len(n)
      self.counts["demoted_examples"] += int(over.sum())
      self.counts["tokens"] += int(n.sum())
      self.counts["demoted_tokens"] += int(n[over].sum())
    batch = pack_rows(targets.reshape(len(rows), s), per_row["length"], per_row["prefix"], per_row["kind"],
                      self._bos_id)
    used = per_row["length"] > 0
    sources = {"document": np.where(used, per_row["document"], -1), "start": np.where(used, per_row["start"], -1),
               "length": np.where(used, per_row["raw"], 0)}
    return batch, sources

  def _global_rows(self, step: int, process_index: int, process_count: int) -> np.ndarray:
    b = self.config.batch_size
    per_process = streams.rows_per_process(b, step, process_count)
    return step * b + process_index * per_process + np.arange(per_process)

  def batch(self, step: int, split: str = "train", process_index: int = 0,
            process_count: int = 1) -> Dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`: rows [i * B/P, (i + 1) * B/P)."""
    return self._step(step, split, process_index, process_count)[0]

  def batch_with_sources(self, step: int, split: str = "train", process_index: int = 0,
                         process_count: int = 1) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """batch() and, per row and segment (segment k + 1 at column k), the example's document index
    in the split, its first token in that document and its raw length (-1 / 0 where no example)."""
    return self._step(step, split, process_index, process_count)

  def _step(self, step: int, split: str, process_index: int, process_count: int):
    """This process's rows at `step`, from their read (started ahead on a remote store: read_ahead.py)."""
    rows_at = lambda s: self._global_rows(s, process_index, process_count)  # noqa: E731
    read = self._ahead.get((split, process_index, process_count), step, lambda s: self._read(split, rows_at(s)),
                           streams.MAX_ROWS // self.config.batch_size - 1)
    return self._rows(split, rows_at(step), read)

  def progress(self, steps: int) -> Dict[str, float]:
    """How far `steps` steps are through the data, for the train records: "epoch", the epochs of
    the train split completed (fractional; every document once per epoch)."""
    return {"epoch": steps * self.config.batch_size / self.layouts["train"].rows}

  def describe(self) -> Dict[str, object]:
    """The objective mix, the pinned special-token ids and the store, for config files and checkpoints."""
    return {"objectives": [dict(e.denoiser.to_json(), probability=e.probability) for e in self.entries],
            "special_tokens": self.special.to_json(), "mode_tokens": self.mix.mode_tokens,
            "vocabulary": self._vocabulary,
            "store": {"path": self.store, "vocabulary": self.manifest["vocabulary"],
                      "source": self.manifest["source"],
                      "splits": {k: v.describe() for k, v in self.layouts.items()}}}

  def close(self, wait: bool = False) -> None:
    """Stops the reads started ahead; wait: until those already running have ended (a benchmark's count)."""
    self._ahead.close(wait)


def _chunks(row, doc, entry, first, size, chunk):
  """Pieces cut into consecutive chunks of at most `chunk` tokens: the same per-piece arrays per
  chunk, with each chunk's first token in its document, its place in the raw tokens, its size."""
  src = size.cumsum() - size  # each piece's tokens among the rows' raw tokens
  cuts = -(-size // chunk)
  j = np.arange(cuts.sum()) - np.repeat(cuts.cumsum() - cuts, cuts)  # the chunk's index in its piece
  row, doc, entry, chunk = (np.repeat(a, cuts) for a in (row, doc, entry, chunk))
  return (row, doc, entry, np.repeat(first, cuts) + j * chunk, np.repeat(src, cuts) + j * chunk,
          np.minimum(chunk, np.repeat(size, cuts) - j * chunk))


def _within_rows(values: np.ndarray, row_start: np.ndarray, row: np.ndarray) -> np.ndarray:
  """Running sums of `values` restarted at each row (examples sorted by row)."""
  total = values.cumsum()
  before = np.concatenate([[0], total])[row_start]
  return total - before[row]

