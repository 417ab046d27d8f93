"""A registered seqio Task as a data source: its "targets" read once into a memory-mapped token cache.

Why materialize. Batches are addressed by step (docs/architecture.md#data-addressed-by-step): each row of each step picks
documents at random from the whole split, so the pipeline needs random access to every document,
which a tf.data stream cannot give. The first `DataConfig.max_documents` examples of the split are
therefore read once, in the task's own order (no shuffling, one epoch), and kept as one flat int32
token array plus document offsets. max_documents bounds the memory and the one-time read (100k C4
documents are about 50M tokens with a 32k SentencePiece model, 200 MB). A corpus too large for that
is prepared into a store instead (`midas data prepare`, data/store/), which reads the task's
shards in parallel through `task_documents`.

Why a cache. Reading a TFDS split through TensorFlow takes minutes at large max_documents, and every
restart would repeat it (resume must not stall on data). The
tokens are written once to `<cache_dir>/<task>_<split>_<max_documents>_<hash>/` as tokens.npy (flat)
and offsets.npy (n + 1 int64 offsets), into a temporary folder that is then renamed into place, so a
crash or a concurrent process never leaves half a cache. Later runs memory-map them without importing
seqio or TensorFlow. The hash covers the run's vocabulary and the exact task and split names. The key
does not cover the task's definition: after changing what a task name means, delete its folder.

The task's "targets" vocabulary must be the run's (`make_vocabulary(config)`): same size, same EOS,
same ids on a probe text, because the model's embedding and the sentinel and mode-token ids are taken
from the run's vocabulary. Every document ends with EOS: appended here unless the task's preprocessing
did it (Feature(add_eos=True) with seqio.preprocessors.append_eos). Examples without tokens are skipped.
"""

from __future__ import annotations

import difflib
import hashlib
import io
import json
import logging
import os
import re
import time
import uuid
from typing import Iterator, List, Optional

import numpy as np

from midas_jax import fs
from midas_jax.configs import DataConfig
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError, require

# Letters, digits, punctuation, repeated spaces, a newline and non-ASCII text: two vocabularies
# that agree here almost surely are the same one.
PROBE = "The quick brown fox, 42 + 7 = 49.\n  Über naïve café; 東京 🙂 <tag> a_b"
_READ_BATCH = 1024
_log = logging.getLogger(__name__)


def default_cache_dir() -> str:
  """$XDG_CACHE_HOME/midas_jax/seqio, i.e. ~/.cache/midas_jax/seqio by default."""
  return fs.join(os.environ.get("XDG_CACHE_HOME") or fs.check("~/.cache", "XDG_CACHE_HOME"), "midas_jax", "seqio")


def import_seqio():
  """seqio (which imports TensorFlow), or a ConfigError saying how to install the data extra."""
  try:
    import seqio  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError("DataConfig.source", f"seqio data sources need seqio and TensorFlow ({e})",
                      "pip install 'midas_jax[data]'") from e
  return seqio


def task_split(config: DataConfig, split: str) -> str:
  """The seqio split that our split ("train" or "validation") reads."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
  return config.seqio_train_split if split == "train" else config.seqio_eval_split


def load_token_documents_from_task(config: DataConfig, split: str, cache_dir: Optional[str] = None,
                                   vocab=None) -> List[np.ndarray]:
  """The token documents (int32, each ending in EOS) of `split` of the Task `config.seqio_task`.

  cache_dir: None means `default_cache_dir()`. vocab: the run's vocabulary (default
  make_vocabulary(config)). The first call for a (task, split, max_documents, vocabulary) runs the
  TF pipeline and writes the cache; later calls only memory-map it.
  """
  require(bool(config.seqio_task), "DataConfig.seqio_task", "no task name given",
          "set DataConfig.seqio_task to a registered seqio Task")
  vocab = make_vocabulary(config) if vocab is None else vocab
  name = task_split(config, split)
  path = cache_path(config, name, vocab, cache_dir)
  if not _is_complete(path):
    start = time.time()
    # Visible by default: a long one-time read must not look like a hang.
    _log.warning("reading up to %d documents of seqio task %s, split %s, through TensorFlow once; "
                 "caching their tokens in %s", config.max_documents, config.seqio_task, name, path)
    docs = _read_task(config, split, vocab)
    _write_cache(path, docs, dict(task=config.seqio_task, split=name, max_documents=config.max_documents,
                                  documents=len(docs), tokens=int(sum(len(d) for d in docs)),
                                  vocabulary=repr(vocab), seconds=round(time.time() - start, 1)))
    _log.warning("cached %d documents (%d tokens) in %.1f s", len(docs), sum(len(d) for d in docs),
                 time.time() - start)
  return _load_cache(path)


def cache_path(config: DataConfig, name: str, vocab, cache_dir: Optional[str] = None) -> str:
  """The folder caching the tokens of split `name` of the task under `vocab`."""
  key = json.dumps([config.seqio_task, name, config.max_documents, vocab.fingerprint])
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  safe = lambda s: re.sub(r"[^\w.-]", "_", s)
  folder = f"{safe(config.seqio_task)}_{safe(name)}_{config.max_documents}_{digest}"
  return fs.join(fs.check(cache_dir or default_cache_dir(), "seqio cache_dir"), folder)


def check_vocabulary(task_vocab, vocab, config: DataConfig) -> None:
  """Fails unless the task tokenizes with the run's vocabulary (size, EOS and ids on PROBE)."""
  setting = "DataConfig.spm_model" if config.vocab == "sentencepiece" else "DataConfig.vocab"
  described = f"task {config.seqio_task!r} tokenizes with {_describe(task_vocab)}, the run with {vocab!r}"
  fix = ("make DataConfig.vocab, spm_model and extra_ids describe the vocabulary the task was "
         "registered with (or register the task with the run's vocabulary)")
  require(task_vocab.vocab_size == vocab.vocab_size, setting,
          f"vocabulary sizes differ ({task_vocab.vocab_size} != {vocab.vocab_size}): {described}", fix)
  require(task_vocab.eos_id == vocab.eos_id, setting,
          f"EOS ids differ ({task_vocab.eos_id} != {vocab.eos_id}): {described}", fix)
  theirs, ours = [int(i) for i in task_vocab.encode(PROBE)], [int(i) for i in vocab.encode(PROBE)]
  require(theirs == ours, setting, f"same size, but the ids of a probe text differ: {described}", fix)


def _describe(seqio_vocab) -> str:
  model_file = getattr(seqio_vocab, "_sentencepiece_model_file", None)
  where = f" {model_file!r}" if model_file else ""
  return f"seqio.{type(seqio_vocab).__name__}{where} ({seqio_vocab.vocab_size} ids)"


def get_task(seqio, name: str):
  if name in seqio.TaskRegistry.names():
    return seqio.TaskRegistry.get(name)
  if name in seqio.MixtureRegistry.names():
    raise ConfigError("DataConfig.seqio_task", f"{name!r} is a seqio Mixture, not a Task",
                      "name one of its Tasks; mixing several Tasks is not supported yet")
  names = sorted(seqio.TaskRegistry.names())
  close = difflib.get_close_matches(name, names, n=3)
  shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "none"
  raise ConfigError(
      "DataConfig.seqio_task", f"no seqio Task named {name!r} is registered ({len(names)} are: {shown})",
      (f"did you mean {', '.join(close)}? " if close else "") +
      "fix the name, or import the module that registers the task first (in a gin file: an "
      "`import module` line, as gin/data/c4_seqio.gin does)")


def _targets_vocabulary(task, config: DataConfig, tf):
  features = task.output_features
  require("targets" in features, "DataConfig.seqio_task",
          f"task {config.seqio_task!r} has no 'targets' feature (it has {sorted(features)})",
          "use a task whose output feature 'targets' holds the document tokens")
  task_vocab = features["targets"].vocabulary
  try:
    task_vocab.vocab_size  # a SentencePiece model file is read lazily, here
  except (tf.errors.OpError, OSError) as e:
    model_file = getattr(task_vocab, "_sentencepiece_model_file", "?")
    raise ConfigError("DataConfig.seqio_task",
                      f"task {config.seqio_task!r} cannot load its vocabulary {model_file!r} "
                      f"({type(e).__name__})",
                      "register the task with an existing SentencePiece model (gin/data/c4_seqio.gin: set "
                      "MIDAS_C4_SPM_MODEL)") from e
  return task_vocab


def _check_split(task, config: DataConfig, split: str) -> None:
  name = task_split(config, split)
  try:
    available = list(task.splits)
  except ValueError:  # a source that lists no splits (e.g. TFDS info without split metadata)
    return
  bases = [re.sub(r"\[.*\]$", "", part.strip()) for part in name.split("+")]  # TFDS slicing syntax
  setting = "DataConfig.seqio_train_split" if split == "train" else "DataConfig.seqio_eval_split"
  require(all(b in available for b in bases), setting,
          f"task {config.seqio_task!r} has no split {name!r} (it has {available})",
          f"set {setting} to one of {available}")


def task_documents(config: DataConfig, split: str, vocab, shard: Optional[tuple] = None) -> Iterator[np.ndarray]:
  """The task's token documents of `split` (int32, each ending in EOS, all-EOS ones skipped), in
  the task's order, after checking its vocabulary and split. shard: (index, count) reads only that
  shard of the task's source (seqio.ShardInfo), as a parallel prepare does."""
  seqio = import_seqio()  # lazy: TensorFlow
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  task = get_task(seqio, config.seqio_task)
  check_vocabulary(_targets_vocabulary(task, config, tf), vocab, config)
  _check_split(task, config, split)
  shard_info = seqio.ShardInfo(index=shard[0], num_shards=shard[1]) if shard else None
  ds = task.get_dataset(sequence_length=None, split=task_split(config, split), shuffle=False,
                        use_cached=False, num_epochs=1, try_in_mem_cache=False, shard_info=shard_info)
  spec = ds.element_spec["targets"]
  require(spec.shape.rank == 1 and spec.dtype.is_integer, "DataConfig.seqio_task",
          f"task {config.seqio_task!r} yields 'targets' of shape {spec.shape} and dtype {spec.dtype.name}",
          "use a task whose 'targets' are 1-D token ids (tokenized text, not yet packed or padded)")
  options = tf.data.Options()
  options.deterministic = True  # the cache must not depend on thread timing
  # Ragged batches as (flat values, row splits): one Python step per batch, not per document.
  batched = (ds.with_options(options).map(lambda ex: ex["targets"])
             .ragged_batch(min(_READ_BATCH, config.max_documents))
             .map(lambda r: (r.values, r.row_splits)))
  eos = np.int32(vocab.eos_id)
  for values, bounds in batched.as_numpy_iterator():
    values = values.astype(np.int32)
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
      doc = values[a:b]
      if np.any(doc != eos):
        yield doc if doc[-1] == eos else np.append(doc, eos)


def _read_task(config: DataConfig, split: str, vocab) -> List[np.ndarray]:
  """The first max_documents non-empty documents of the split."""
  docs: List[np.ndarray] = []
  for doc in task_documents(config, split, vocab):
    docs.append(doc)
    if len(docs) == config.max_documents:
      return docs
  require(len(docs) > 0, "DataConfig.seqio_task",
          f"split {task_split(config, split)!r} of task {config.seqio_task!r} yields no documents",
          "check the task's data source (for TFDS: that the data set is prepared in its data_dir)")
  return docs


_FILES = ("tokens.npy", "offsets.npy", "meta.json")


def _is_complete(path: str) -> bool:
  return all(fs.isfile(fs.join(path, f)) for f in _FILES)


def _save(path: str, array: np.ndarray) -> None:
  with fs.open_file(path, "wb") as f:
    np.save(f, array)


def _write_cache(path: str, docs: List[np.ndarray], meta: dict) -> None:
  """Writes the cache where no reader can see a part of it: locally into a temporary folder that
  is then renamed into place; on an object store straight into place, meta.json last (a folder
  without it is incomplete and rewritten)."""
  local = not fs.is_remote(path)
  folder = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if local else path
  try:
    fs.makedirs(folder)
  except OSError as e:
    raise ConfigError("seqio cache_dir", f"cannot write the token cache in {folder} ({e.strerror})",
                      "pass a writable cache_dir, or set XDG_CACHE_HOME to a writable folder") from e
  try:
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    _save(fs.join(folder, "tokens.npy"), np.concatenate(docs).astype(np.int32))
    _save(fs.join(folder, "offsets.npy"), offsets)
    fs.write_json(fs.join(folder, "meta.json"), meta)
    if local:
      fs.rename(folder, path)
  except OSError:
    if local:
      fs.rmtree(folder)
    if not _is_complete(path):  # else another process wrote the same cache first: use it
      raise


def _load_cache(path: str) -> List[np.ndarray]:
  """Local caches are memory-mapped; one on an object store is read whole."""
  fix = "delete that folder; the next run rebuilds it"
  try:
    if fs.is_remote(path):
      tokens = np.load(io.BytesIO(fs.read_bytes(fs.join(path, "tokens.npy"))))
    else:
      tokens = np.load(fs.join(path, "tokens.npy"), mmap_mode="r")
    offsets = np.load(io.BytesIO(fs.read_bytes(fs.join(path, "offsets.npy"))))
  except (OSError, ValueError) as e:
    raise ConfigError("seqio cache_dir", f"cannot read the token cache {path} ({e})", fix) from e
  require(tokens.dtype == np.int32 and offsets.ndim == 1 and len(offsets) >= 2 and offsets[0] == 0
          and offsets[-1] == len(tokens), "seqio cache_dir",
          f"the token cache {path} is damaged (its tokens and offsets disagree)", fix)
  return [tokens[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
