"""Step-addressed UL2 batches: the global batch at step s is a pure function of (data config, seed, s).

Row r of step s is built from its own random draws, addressed by (seed, split, s * batch_size + r)
(ul2/streams.py), so any process can build exactly its own rows, resuming needs no iterator state, and
changing the number of processes changes nothing (docs/architecture.md#data-addressed-by-step). The
held-out split's seed is DataConfig.eval_seed when set, and its documents those of DataConfig.heldout_shard.

A row is filled example by example until fewer than `min_chunk` slots remain. Each example picks
its objective (causal / prefix LM / one of the span denoisers) at the configured rates, then a
document uniformly with replacement. A document longer than the objective can fit in the space
left contributes a random window of it; the window's raw length is chosen so that the example
after corruption (sentinels, mode token) fills the space exactly, which keeps packing dense.
Documents of a single token cannot be split: prefix LM and span corruption use them as causal LM.

For speed (one core must feed training many times over) rows are built many at once, a few steps
when batches are small: the fill loop runs over example slots with every row in step, the rest is
vectorized over all their examples (objectives.span_layout corrupts them in one call), and tokens
move once, from one flat pool per split. The draws are counter-based (ul2/streams.py), so no random
generator is seeded per row.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence, Tuple

import numpy as np

from midas_jax.configs import DataConfig, ObjectivesConfig
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.ul2 import objectives, streams
from midas_jax.data.ul2.packing import pack_rows
from midas_jax.data.ul2.rows import PREFIX_ID, SPAN_ID, example_tables, objective_mix, place_examples
from midas_jax.errors import require


def tokenize_documents(texts: Sequence[str], vocab) -> List[np.ndarray]:
  """Each document's token ids followed by EOS."""
  return [np.asarray(vocab.encode(t) + [vocab.eos_id], np.int32) for t in texts]


def heldout_documents(docs: Sequence[np.ndarray], shard) -> Sequence[np.ndarray]:
  """The held-out documents batches draw from: with DataConfig.heldout_shard (i, n), documents i, i + n,
  i + 2n, ... (so the n shards are disjoint evaluation sets); None: all."""
  if shard is None:
    return docs
  i, n = shard
  require(len(docs) > i, "DataConfig.heldout_shard", f"shard {tuple(shard)} of {len(docs)} held-out documents is empty",
          f"use fewer shards than the {len(docs)} held-out documents")
  return docs[i::n]


# Counters of a row's stream (ul2/streams.py): example slot t draws at 4t + (objective, document,
# window start, prefix split); the span key of the token at row slot i is 4 * seq_len + i.
_DRAWS_PER_SLOT = 4
_SLOTS_PER_DRAW = 4  # example slots drawn at a time: rows of ~256 tokens rarely hold more
_BLOCK_SLOTS, _BLOCK_STEPS = 1 << 15, 8  # Pipeline.batch builds up to 8 steps to fill 32768 slots
_SLOT_COUNTERS = (_DRAWS_PER_SLOT * np.arange(_SLOTS_PER_DRAW)[:, None, None]
                  + np.arange(_DRAWS_PER_SLOT)[:, None])  # (slots, draws, 1)


class Pipeline:
  """Packed UL2 rows over tokenized documents, addressed by (split, step, row)."""

  def __init__(self, config: DataConfig, documents: Dict[str, List[np.ndarray]], vocab_size: int, vocab=None,
               mix: ObjectivesConfig = ObjectivesConfig()):
    """vocab: the vocabulary (data/vocab/), whose own special tokens are then used and recorded;
    without it the sentinels and mode tokens are the top extra ids of vocab_size. mix: the UL2
    objective mix the examples are drawn from."""
    for split, docs in documents.items():
      require(len(docs) > 0, "DataConfig", f"the {split} split has no documents",
              "check the data source (DataConfig.source / train_files / eval_files)")
    require((_DRAWS_PER_SLOT + 2) * config.seq_len < 1 << streams.ROW_BITS, "DataConfig.seq_len",
            f"{config.seq_len} needs more random draws per row than a row has", "use seq_len < 2,000,000")
    self.config, self.mix = config, mix
    self.documents = documents  # as given: data_bench builds its own pipeline over them
    held_out = {split: heldout_documents(docs, config.heldout_shard) for split, docs in documents.items()
                if split != "train"}
    self.special = (objectives.special_tokens(vocab_size, config.extra_ids, mix.num_sentinels) if vocab is None
                    else objectives.vocabulary_special_tokens(vocab, mix.num_sentinels))
    self._vocabulary = None if vocab is None else vocab.special_ids()
    self._bos_id = 0 if vocab is None else vocab.start_id
    self.entries = objective_mix(mix)
    self._cumulative = np.cumsum([e.probability for e in self.entries])
    self._cumulative[-1] = 1.0
    tables = example_tables(config.seq_len, mix, self.entries, self.special)
    self._table = {k: v.ravel() for k, v in tables.items()}
    self._keys = {split: streams.split_key(config.split_seed(split), i) for i, split in enumerate(SPLITS)}
    self._pools = {split: _Pool(held_out.get(split, docs)) for split, docs in documents.items()}
    self._cache: Dict[tuple, Dict[int, Dict[str, np.ndarray]]] = {}  # (split, process) -> step -> batch
    self._lock = threading.Lock()  # batch() may be called from a prefetch thread and the main one
    self._sentinel_ids = np.asarray(self.special.sentinel_ids, np.int32)

  def _slot_draws(self, key: np.ndarray, rows: np.ndarray, t: int, pool: "_Pool") -> Tuple[np.ndarray, ...]:
    """For example slots t.. t + _SLOTS_PER_DRAW - 1 of each row: the table offset of the objective
    entry, the document, its length, the uniforms for the window start and the prefix split, each
    (slots, rows)."""
    counters = _SLOT_COUNTERS + _DRAWS_PER_SLOT * t
    u = streams.uniforms(key, streams.positions(rows, counters))  # (slots, draws, rows)
    entry = np.searchsorted(self._cumulative, u[:, 0], side="right")
    doc = streams.below(u[:, 1], len(pool.lengths))
    return entry * (self.config.seq_len + 1), doc, pool.lengths[doc], u[:, 2], u[:, 3]

  def _fill(self, key: np.ndarray, rows: np.ndarray, pool: "_Pool") -> Tuple[np.ndarray, ...]:
    """The fill loop, all rows in step: each slot takes an example while its row has min_chunk
    slots left and the example's objective fits. Returns (entry_at, doc, doc_len, u_start, u_split,
    n), each (rows, slots); n is the example's raw length (0: no example)."""
    budget_table, length_table = self._table["budget"], self._table["length"]
    space = np.full(len(rows), self.config.seq_len)  # 0 once the row is done
    draws, raw = [], []
    while space.any():
      c = len(raw) % _SLOTS_PER_DRAW
      if c == 0:
        draws.append(self._slot_draws(key, rows, len(raw), pool))
        entry_at, _, doc_len, _, _ = draws[-1]
      budget = budget_table[entry_at[c] + space]
      n = np.minimum(doc_len[c], budget)  # a window of the document when it is longer
      left = space - length_table[entry_at[c] + n]
      space = np.where((budget > 0) & (left >= self.config.min_chunk), left, 0)
      raw.append(n)
    t = len(raw)
    return tuple(np.concatenate(d)[:t].T for d in zip(*draws)) + (np.stack(raw, axis=1),)

  def _rows(self, split: str, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """Rows `rows` (global indices) of `split`, in the ul2/packing.py format."""
    s, pool, key, table = self.config.seq_len, self._pools[split], self._keys[split], self._table
    entry_at, doc, doc_len, u_start, u_split, n = self._fill(key, rows, pool)
    at = entry_at + n
    kind, mode_id, lengths = table["kind"][at], table["mode_id"][at], table["length"][at]
    mode = mode_id > 0
    offset = lengths.cumsum(axis=1) - lengths  # examples one after another from slot 0
    first = pool.starts[doc] + streams.below(u_start, doc_len - n + 1)  # the window, in the pool
    body = (np.arange(len(rows)) * s)[:, None] + offset + mode  # after the mode token, in the batch
    prefix_lens = table["prefix"][at]
    drawn = kind == PREFIX_ID  # prefix LM: the split is drawn
    if drawn.any():
      prefix_lens[drawn] = mode[drawn] + objectives.prefix_lengths(n[drawn], u_split[drawn])

    # The tokens: mode tokens, sentinels, and blocks moved from the pool. Span keys: the token at
    # row slot i draws at counter 4 * seq_len + i (the table's columns past an example's length are
    # drawn too, and ignored).
    span = kind == SPAN_ID
    keys = None
    if span.any():
      at_key = streams.positions(rows[:, None], _DRAWS_PER_SLOT * s + offset)[span]
      keys = streams.bits(key, at_key[:, None] + np.arange(n[span].max()))
    targets = place_examples(len(rows) * s, pool.tokens, first.ravel(), body.ravel(), n.ravel(), kind.ravel(),
                             mode_id.ravel(), table["num_noise"][at].ravel(), table["num_spans"][at].ravel(),
                             keys, self._sentinel_ids)
    return pack_rows(targets.reshape(len(rows), s), lengths, prefix_lens, kind, self._bos_id)

  def batch(self, step: int, split: str = "train", process_index: int = 0,
            process_count: int = 1) -> Dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`: rows [i * B/P, (i + 1) * B/P).

    Small batches are built several consecutive steps at a time (numpy's cost per call would
    dominate them); the later steps wait in a cache, each handed out once.
    Which step a block starts at changes nothing: a row depends on (seed, split, row) only.
    """
    b = self.config.batch_size
    require(b % process_count == 0, "DataConfig.batch_size",
            f"global batch {b} does not split evenly over {process_count} processes",
            f"use a batch size that is a multiple of {process_count}")
    per_process = b // process_count
    steps = np.arange(step, step + min(_BLOCK_STEPS, -(-_BLOCK_SLOTS // (per_process * self.config.seq_len))))
    steps = steps[steps < streams.MAX_ROWS // b]
    require(step >= 0 and len(steps) > 0, "step", f"step {step} is outside [0, {streams.MAX_ROWS // b:,})",
            "steps address rows of a 2**39-row stream")
    where = (split, process_index, process_count)
    with self._lock:
      cached = self._cache.get(where, {}).pop(step, None)
    if cached is not None:
      return cached
    rows = steps[:, None] * b + process_index * per_process + np.arange(per_process)
    block = self._rows(split, rows.ravel())
    batches = {int(s): {f: v[i * per_process:(i + 1) * per_process] for f, v in block.items()}
               for i, s in enumerate(steps)}
    mine = batches.pop(step)
    with self._lock:
      self._cache[where] = batches
    return mine

  def progress(self, steps: int) -> Dict[str, float]:
    """How far `steps` steps are through the data, for the train records: "corpus_passes", the row
    slots trained per token of the train split. Rows draw windows of documents at random (with
    replacement), so this counts corpus-sizes of training, not epochs: no document is promised once
    per pass (a prepared store's pipeline reports true epochs)."""
    return {"corpus_passes": steps * self.config.batch_size * self.config.seq_len / len(self._pools["train"].tokens)}

  def describe(self) -> Dict[str, object]:
    """The objective mix and the pinned special-token ids, for config files and checkpoint metadata."""
    out = {"objectives": [dict(e.denoiser.to_json(), probability=e.probability) for e in self.entries],
           "special_tokens": self.special.to_json(), "mode_tokens": self.mix.mode_tokens}
    if self._vocabulary is not None:
      out["vocabulary"] = self._vocabulary
    return out


class _Pool:
  """A split's documents as one flat token array, so that a batch's windows move in one gather."""

  def __init__(self, docs: Sequence[np.ndarray]):
    self.lengths = np.array([len(d) for d in docs], np.int64)
    self.starts = self.lengths.cumsum() - self.lengths
    self.tokens = np.concatenate(docs).astype(np.int32)
