"""Writing a store: shards streamed to temporary names and committed, part records, the manifest last.

A prepare is split into parts (a file, a slice of a TFDS split, a shard of a seqio source); each
part writes one shard per split it has documents for, then its part record. A shard's tokens are
streamed to a temporary name and renamed into place when complete, its offsets and index written
whole, and the part record only after all of them, so a part with a record is complete and one
without is redone. The manifest, written when every part has its record, is what makes the folder
a store: a reader never sees a half-written one. The Beam pipeline (prepare.py) and the in-process
writer below (tests, synthetic stores) use the same functions.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.store import format as store_format
from midas_jax.errors import ConfigError

_FLUSH_TOKENS = 1 << 20  # tokens buffered before a write


class ShardWriter:
  """One shard of one split: add token documents, then commit() (or abandon())."""

  def __init__(self, store: str, split: str, part: int, dtype: np.dtype):
    self.name = store_format.shard_name(split, part)
    self.files = store_format.shard_files(store, self.name)
    self.dtype = np.dtype(dtype)
    # Left by a prepare that died before the part's record: a temporary file, or files of the shard
    # that are not to be trusted (only a part record vouches for them).
    for stale in fs.glob(self.files["tokens"] + ".tmp-*") + list(self.files.values()):
      fs.remove(stale)
    self._tmp = f"{self.files['tokens']}.tmp-{uuid.uuid4().hex[:12]}"
    fs.makedirs(fs.join(store, split))
    self._file = fs.as_epath(self._tmp).open("wb")
    self._hash = hashlib.sha256()
    self._lengths: List[np.ndarray] = []
    self._documents = 0
    self._buffer: List[np.ndarray] = []
    self._buffered = 0
    self._max_id = np.iinfo(self.dtype).max

  def add(self, tokens: np.ndarray) -> None:
    """One document."""
    tokens = np.asarray(tokens)
    self.add_many(tokens, [len(tokens)])

  def add_many(self, tokens: np.ndarray, lengths) -> None:
    """Documents given as their tokens one after another and their lengths."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int64)
    if len(lengths) == 0:
      return
    if lengths.min() < 1 or lengths.sum() != len(tokens):
      raise ValueError("every document needs at least one token (its EOS), and the lengths must add up")
    if tokens.min() < 0 or tokens.max() > self._max_id:
      raise ValueError(f"token ids outside [0, {self._max_id}] for a {self.dtype.name} store")
    self._buffer.append(tokens.astype(self.dtype, copy=False))
    self._lengths.append(lengths)
    self._documents += len(lengths)
    self._buffered += len(tokens)
    if self._buffered >= _FLUSH_TOKENS:
      self._flush()

  @property
  def documents(self) -> int:
    return self._documents

  def _flush(self) -> None:
    if self._buffer:
      data = np.concatenate(self._buffer).tobytes()
      self._file.write(data)
      self._hash.update(data)
    self._buffer, self._buffered = [], 0

  def commit(self) -> Dict[str, object]:
    """Puts the shard in place and returns its manifest record."""
    self._flush()
    self._file.close()
    offsets = np.zeros(self._documents + 1, store_format.OFFSET_DTYPE)
    if self._documents:
      np.cumsum(np.concatenate(self._lengths), out=offsets[1:])
    offsets_bytes = offsets.tobytes()
    fs.write_bytes(self.files["offsets"], offsets_bytes)
    fs.write_bytes(self.files["index"], store_format.coarse_index(offsets).tobytes())
    fs.rename(self._tmp, self.files["tokens"])
    return {"name": self.name, "documents": self._documents, "tokens": int(offsets[-1]),
            "sha256": {"tokens": self._hash.hexdigest(), "offsets": hashlib.sha256(offsets_bytes).hexdigest()}}

  def abandon(self) -> None:
    self._file.close()
    fs.remove(self._tmp)


def write_part(store: str, part: int, documents: Iterable[Tuple[str, object]], dtype: np.dtype,
               identity: Mapping[str, str], describe: object = None) -> Dict[str, object]:
  """Writes the shards of one part and then the part's record.

  documents: (split, document) pairs, a document being a token array, or a (tokens, lengths) pair
  holding many documents one after another. A shard is opened for each split that gets any.
  """
  start = time.time()
  writers: Dict[str, ShardWriter] = {}
  try:
    for split, doc in documents:
      if split not in writers:
        writers[split] = ShardWriter(store, split, part, dtype)
      if isinstance(doc, tuple):
        writers[split].add_many(*doc)
      else:
        writers[split].add(doc)
  except BaseException:
    for w in writers.values():
      w.abandon()
    raise
  shards = {split: w.commit() for split, w in writers.items()}
  record = {"part": part, **identity, "source_part": describe, "shards": shards,
            "seconds": round(time.time() - start, 3)}
  fs.write_json(store_format.part_record_path(store, part), record)
  return record


def finished_part(store: str, part: int, identity: Mapping[str, str], dtype: np.dtype,
                  describe: object = None) -> Optional[Dict[str, object]]:
  """The record of a part a previous prepare finished (its shards intact), else None.

  A record written for other settings, another vocabulary or another cut of the source into parts
  (`describe`, when given) is a ConfigError: the folder holds another prepare, and mixing the two
  would corrupt both.
  """
  path = store_format.part_record_path(store, part)
  if not fs.exists(path):
    return None
  record = fs.read_json(path)
  for key, value in identity.items():
    if record.get(key) != value:
      raise ConfigError("--out", f"{store!r} holds a prepare with another {key.replace('_', ' ')} "
                        f"({record.get(key, '?')[:16]} here, {value[:16]} now)",
                        "use a new --out folder, or delete this one")
  if describe is not None and record.get("source_part") != describe:
    raise ConfigError("--out", f"{store!r} holds a prepare whose part {part} read {record.get('source_part')}, "
                      f"not {describe} (the files or --num_shards changed)",
                      "run it with the settings it began with, use a new --out folder, or delete this one")
  for shard in record["shards"].values():
    for kind, path in store_format.shard_files(store, shard["name"]).items():
      if not fs.exists(path) or fs.size(path) != store_format.expected_sizes(shard, dtype)[kind]:
        return None
  return record


def write_manifest(store: str, records: List[Dict[str, object]], header: Dict[str, object]) -> Dict[str, object]:
  """Collects the parts' shards per split (in part order) and writes the manifest, last."""
  records = sorted(records, key=lambda r: r["part"])
  parts = [r["part"] for r in records]
  if parts != list(range(header["parts"])):
    missing = sorted(set(range(header["parts"])) - set(parts))
    raise RuntimeError(f"parts {missing[:10]} of {header['parts']} have no record; the prepare is incomplete")
  splits = {}
  for split in SPLITS:
    shards = [r["shards"][split] for r in records if split in r["shards"] and r["shards"][split]["documents"]]
    splits[split] = {"documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                     "shards": shards}
  manifest = {"format": store_format.FORMAT, "version": store_format.VERSION, **header, "splits": splits,
              "index_every": store_format.INDEX_EVERY, "versions": store_format.package_versions(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  fs.write_json(fs.join(store, store_format.MANIFEST), manifest)
  return manifest


def store_header(vocab, source: Dict[str, object], parts: int) -> Dict[str, object]:
  return {"dtype": store_format.token_dtype(vocab.vocab_size).str, "vocabulary": store_format.vocabulary_record(vocab),
          "source": source, "source_fingerprint": store_format.fingerprint(source), "parts": parts}


def identity(header: Dict[str, object]) -> Dict[str, str]:
  """What every part record carries, so that a resumed prepare never mixes two prepares."""
  return {"source_fingerprint": header["source_fingerprint"],
          "vocabulary_fingerprint": header["vocabulary"]["fingerprint"]}


def write_parts(store: str, parts: List[Mapping[str, Iterable]], vocab,
                source: Dict[str, object]) -> Dict[str, object]:
  """The in-process writer: parts (each split -> its documents, as write_part takes them) -> a store."""
  header = store_header(vocab, source, len(parts))
  dtype = np.dtype(header["dtype"])
  records = [write_part(store, i, ((split, d) for split, docs in part.items() for d in docs), dtype,
                        identity(header)) for i, part in enumerate(parts)]
  return write_manifest(store, records, header)


def write_store(store: str, documents: Mapping[str, List[np.ndarray]], vocab, source: Dict[str, object],
                documents_per_shard: int = 1 << 16) -> Dict[str, object]:
  """Token documents per split -> a store of shards of up to documents_per_shard documents."""
  parts = [{split: docs[i:i + documents_per_shard]} for split, docs in documents.items()
           for i in range(0, len(docs), documents_per_shard)]
  return write_parts(store, parts, vocab, source)
