"""The prepared store on disk: file names, the manifest, and the checks a run makes at start.

  <store>/manifest.json                  written last: a store without it is not a store
  <store>/parts/part-00007.json          a finished part of a prepare (the shards it wrote)
  <store>/<split>/shard-00007.tokens     every document's tokens (EOS included) one after another,
                                         little-endian uint16 (vocabularies up to 65,536 ids) or int32
  <store>/<split>/shard-00007.offsets    int64 little-endian, documents + 1 of them: document d of the
                                         shard is tokens[offsets[d]:offsets[d + 1]]
  <store>/<split>/shard-00007.index      int64: offsets[::INDEX_EVERY] and the last offset, the coarse
                                         index a reader keeps in memory (8 bytes per 1024 documents)

Plain little-endian arrays with no header, so that a token range or a run of offsets is one ranged
read at a computed byte position, through midas_jax.fs on a local disk and on gs:// alike, with
numpy and nothing else. Documents are numbered across the split's shards in shard order.

The manifest records per split its shards (documents, tokens, sha256 of each file), the
vocabulary's fingerprint, what the documents were read from (`source`, hashed into
`source_fingerprint`) and the package versions. A run on the store refuses another vocabulary, or
other source settings when its config names them (DataConfig.prepared_from), and checks before
anything compiles that every shard exists at the size its counts give (process 0, one listing per
split, the result shared: check_shards). Those counts give every file's size, so a reader needs
no metadata request to read any byte of a store.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from midas_jax import fs, hosts, versions
from midas_jax.configs import DataConfig
from midas_jax.errors import ConfigError, require
from midas_jax.fs import ranges as fs_ranges

FORMAT = "midas_jax.token_store"
VERSION = 1
MANIFEST = "manifest.json"
INDEX_EVERY = 1024
OFFSET_DTYPE = np.dtype("<i8")
HOLDOUT_EVERY = 50  # text_files.HOLDOUT_EVERY, recorded so that a store says how it split text
_PACKAGES = ("midas_jax", "numpy", "apache-beam", "sentencepiece", "seqio", "tensorflow-datasets", "pyarrow")
_FIX_DAMAGED = "run the same `midas data prepare` command again (it rewrites what is missing), or prepare anew"


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def shard_name(split: str, part: int) -> str:
  return f"{split}/shard-{part:05d}"


def part_record_path(store: str, part: int) -> str:
  return fs.join(store, "parts", f"part-{part:05d}.json")


def shard_files(store: str, name: str) -> Dict[str, str]:
  return {kind: fs.join(store, f"{name}.{kind}") for kind in ("tokens", "offsets", "index")}


def index_length(documents: int) -> int:
  return -(-documents // INDEX_EVERY) + 1


def coarse_index(offsets: np.ndarray) -> np.ndarray:
  return np.append(offsets[:-1:INDEX_EVERY], offsets[-1]).astype(OFFSET_DTYPE)


def source_description(config: DataConfig) -> Dict[str, object]:
  """The settings that decide which documents a store holds, for its manifest and fingerprint."""
  kind = config.origin
  if kind == "builtin":
    held = {"corpus_holdout": config.corpus_holdout} if config.corpus_holdout != "none" else {}
    if config.corpus_documents != DataConfig.corpus_documents:  # the default's stores keep their fingerprint
      held["corpus_documents"] = config.corpus_documents
    return {"kind": kind, "corpus_seed": config.corpus_seed, **held}
  if kind == "text":
    return {"kind": kind, "train_files": list(config.train_files), "eval_files": list(config.eval_files),
            "jsonl_field": config.jsonl_field, "holdout_every": HOLDOUT_EVERY}
  if kind == "seqio":
    return {"kind": kind, "task": config.seqio_task, "train_split": config.seqio_train_split,
            "eval_split": config.seqio_eval_split}
  if kind == "tfds":
    return {"kind": kind, "name": config.tfds_name, "train_split": config.tfds_train_split,
            "eval_split": config.tfds_eval_split, "text_feature": config.tfds_text_feature}
  raise ConfigError("DataConfig.prepared_from", "no source to prepare from is set",
                    "set DataConfig.prepared_from to one of builtin, text, seqio, tfds (with its settings)")


def fingerprint(description: Dict[str, object]) -> str:
  return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def package_versions() -> Dict[str, str]:
  return versions.installed(_PACKAGES)


def vocabulary_record(vocab) -> Dict[str, object]:
  return {"fingerprint": vocab.fingerprint, "description": repr(vocab), "vocab_size": vocab.vocab_size}


def read_manifest(store: str, setting: str = "DataConfig.prepared_dir") -> Dict[str, object]:
  """The store's manifest, checked to be one; a missing folder or manifest is a ConfigError."""
  store = fs.check(store, setting)
  path = fs.join(store, MANIFEST)
  try:
    text = fs_ranges.read_file(path)  # one request on gs://; what is missing is asked only when it is
  except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
    require(fs.isdir(store), setting, f"{store!r} does not exist",
            "prepare the store first: midas data prepare --gin_file=... --out=" + store)
    parts = fs.exists(fs.join(store, "parts"))
    raise ConfigError(setting, f"{store!r} holds no {MANIFEST}" +
                      (" (a prepare of it began but did not finish)" if parts else ""),
                      "run `midas data prepare` with this --out (again, to finish it)" if parts else
                      "point it at the --out folder of `midas data prepare`") from None
  try:
    manifest = json.loads(text)
  except ValueError as e:
    raise ConfigError(setting, f"{path!r} is not JSON ({e})", _FIX_DAMAGED) from e
  require(isinstance(manifest, dict) and manifest.get("format") == FORMAT, setting,
          f"{path!r} is not the manifest of a prepared store", "point it at the --out of `midas data prepare`")
  require(manifest.get("version") == VERSION, setting,
          f"the store has format version {manifest.get('version')}; this code reads version {VERSION}",
          "prepare the store again with this version of midas_jax")
  return manifest


def check_matches(manifest: Dict[str, object], config: DataConfig, vocab, store: str) -> None:
  """Refuses a store tokenized by another vocabulary, or read from other source settings."""
  ours, theirs = vocab.fingerprint, manifest["vocabulary"]["fingerprint"]
  require(ours == theirs, "DataConfig.vocab",
          f"the store {store!r} was prepared with the vocabulary {manifest['vocabulary']['description']} "
          f"(fingerprint {theirs[:16]}), this run uses {vocab!r} (fingerprint {ours[:16]})",
          "make DataConfig.vocab / spm_model / extra_ids the store's, or prepare a store with this run's")
  if config.prepared_from:
    described = source_description(config)
    ours, theirs = fingerprint(described), manifest["source_fingerprint"]
    require(ours == theirs, "DataConfig.prepared_from",
            f"the store {store!r} was prepared from {json.dumps(manifest['source'])} (fingerprint "
            f"{theirs[:16]}), this run's settings describe {json.dumps(described)} (fingerprint {ours[:16]})",
            "point DataConfig.prepared_dir at a store of these settings, prepare one, or leave "
            "DataConfig.prepared_from '' to skip this check")


def split_shards(manifest: Dict[str, object], split: str, store: str) -> List[Dict[str, object]]:
  entry = manifest["splits"].get(split)
  require(bool(entry) and entry["documents"] > 0, "DataConfig.prepared_dir",
          f"the store {store!r} has no {split} documents", "prepare it from a source with that split")
  return entry["shards"]


def expected_sizes(shard: Dict[str, object], dtype: np.dtype) -> Dict[str, int]:
  return {"tokens": shard["tokens"] * dtype.itemsize, "offsets": (shard["documents"] + 1) * 8,
          "index": index_length(shard["documents"]) * 8}


def shard_problem(store: str, shards: List[Dict[str, object]], dtype: np.dtype,
                  sizes: Dict[str, int]) -> Tuple[int, Optional[str]]:
  """The first file of `shards` (in order: each shard's tokens, offsets, index) that `sizes` (a listing of
  the split's folder, name -> bytes) lacks or gives another size than the manifest: (its position, what
  is wrong), or (-1, None)."""
  for i, shard in enumerate(shards):
    want = expected_sizes(shard, dtype)
    for j, (kind, path) in enumerate(shard_files(store, shard["name"]).items()):
      have = sizes.get(fs.basename(path))
      if have is None:
        return 3 * i + j, f"shard {shard['name']} is missing its {kind} file {path!r}"
      if have != want[kind]:
        return 3 * i + j, (f"shard {shard['name']} is damaged: {path!r} has {have:,} bytes, the manifest says "
                           f"{want[kind]:,}")
  return -1, None


def check_shards(store: str, manifest: Dict[str, object], splits: Sequence[str]) -> None:
  """Every file of every shard of `splits` exists at the size the manifest gives, or a ConfigError names it.

  Process 0 lists each split's folder once (one request per 1,000 files on gs://, where checking
  each file would cost two) and broadcasts the position of the first bad file, -1 if none, -2 if it
  could not list; every process then stops with the same error or goes on. One collective, never a
  file in the workdir: the processes are connected already, and a file would need a workdir and
  the others polling the bucket for it.
  """
  dtype = np.dtype(manifest["dtype"])
  files = [(split, shard, kind) for split in splits for shard in split_shards(manifest, split, store)
           for kind in ("tokens", "offsets", "index")]
  code, problem, error = -1, None, None
  if jax.process_index() == 0:
    try:
      offset = 0
      for split in splits:
        shards = split_shards(manifest, split, store)
        at, problem = shard_problem(store, shards, dtype, fs_ranges.file_sizes(fs.join(store, split)))
        if problem:
          code = offset + at
          break
        offset += 3 * len(shards)
    except Exception as e:  # pylint: disable=broad-except
      code, error = -2, e  # told to the others before it is raised, so that none waits for a broadcast
  code = hosts.from_process_0(code)
  if error is not None:
    raise error
  require(code != -2, "DataConfig.prepared_dir", f"process 0 could not list the store {store!r}",
          "see process 0's error; check the credentials and the bucket")
  if code >= 0:
    split, shard, kind = files[code]
    path = shard_files(store, shard["name"])[kind]
    raise ConfigError("DataConfig.prepared_dir", problem or (
        f"shard {shard['name']}: process 0 found {path!r} missing or not at the size the manifest gives "
        f"({expected_sizes(shard, dtype)[kind]:,} bytes)"), _FIX_DAMAGED)
