"""What a prepare reads: the run's source (DataConfig.origin) cut into parts that workers read alone.

  builtin   one part per split: the generated corpus
  text      one part per file (train_files, eval_files; .txt/.jsonl/.gz/.parquet, data/sources/text_files.py
            reads them, as the in-memory path does). Without eval_files every 50th training
            document goes to validation, numbered across files as data/sources/text_files.py numbers them: a
            part then needs the document counts of the files before it (`count`).
  tfds      a TFDS data set (tfds_name, in tfds_data_dir): each split cut into contiguous slices of
            examples ("train[0:356321]", ...), one per file of the split unless --num_shards says
            otherwise
  seqio     a registered seqio Task: each split read as num_shards shards of its source
            (seqio.ShardInfo); the task tokenizes, and its vocabulary must be the run's

A part's documents keep the source's order, and parts are numbered in source order, so the store's
documents are the source's in a fixed order whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Tuple

import numpy as np

from midas_jax.configs import DataConfig
from midas_jax.data.sources import corpus, seqio_reader, text_files
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.store import format as store_format
from midas_jax.errors import ConfigError, require


@dataclasses.dataclass(frozen=True)
class Part:
  """One unit of work: `ref` of source kind `kind`, feeding store split `split`."""

  index: int
  kind: str
  split: str
  ref: str
  holdout: bool = False  # text training files without eval_files: every 50th document to validation
  shards: int = 1        # seqio: the source is read as `shards` shards, `ref` the index of this one

  def describe(self) -> dict:
    return dataclasses.asdict(self)


def plan(config: DataConfig, num_shards: int = 0) -> List[Part]:
  """The parts of a prepare, in source order; num_shards: parts per split (0: the source's own)."""
  kind = config.origin
  require(num_shards >= 0, "--num_shards", f"must be >= 0, got {num_shards}", "0 takes the source's own sharding")
  refs: List[Tuple[str, str, bool, int]] = []
  if kind == "builtin":
    refs = [(split, split, False, 1) for split in SPLITS]
  elif kind == "text":
    holdout = not config.eval_files
    refs = [("train", path, holdout, 1) for path in text_files.resolve_files(config.train_files, "DataConfig.train_files")]
    if config.eval_files:
      refs += [("validation", path, False, 1)
               for path in text_files.resolve_files(config.eval_files, "DataConfig.eval_files")]
  elif kind == "tfds":
    refs = [(split, spec, False, 1) for split in SPLITS for spec in _tfds_slices(config, split, num_shards)]
  elif kind == "seqio":
    for split in SPLITS:
      count = num_shards or _seqio_shards(config, split)
      refs += [(split, str(i), False, count) for i in range(count)]
  else:
    store_format.source_description(config)  # raises: nothing to prepare from
  return [Part(i, kind, split, ref, holdout, shards) for i, (split, ref, holdout, shards) in enumerate(refs)]


def count(part: Part, config: DataConfig) -> int:
  """The documents a text part reads (for the holdout numbering of the parts after it)."""
  return sum(1 for _ in text_files.iter_file_documents(part.ref, _setting(part), config.jsonl_field))


def token_documents(part: Part, config: DataConfig, vocab, first_index: int = 0
                    ) -> Iterator[Tuple[str, np.ndarray]]:
  """(store split, token document ending in EOS) for each document of the part, in order.

  first_index: the number of documents of the text parts before this one (holdout numbering).
  """
  if part.kind == "seqio":
    for doc in seqio_reader.task_documents(config, part.split, vocab, (int(part.ref), part.shards)):
      yield part.split, doc
    return
  eos = [vocab.eos_id]
  for i, text in enumerate(_texts(part, config), start=first_index):
    split = "validation" if part.holdout and (i + 1) % text_files.HOLDOUT_EVERY == 0 else part.split
    yield split, np.asarray(vocab.encode(text) + eos, np.int32)


def _setting(part: Part) -> str:
  return "DataConfig.train_files" if part.split == "train" else "DataConfig.eval_files"


def _texts(part: Part, config: DataConfig) -> Iterator[str]:
  if part.kind == "builtin":
    return (d.text for d in corpus.documents(part.ref, config.corpus_seed, config.corpus_holdout,
                                             config.corpus_documents))
  if part.kind == "text":
    return text_files.iter_file_documents(part.ref, _setting(part), config.jsonl_field)
  if part.kind == "tfds":
    return _tfds_texts(config, part.ref)
  raise ValueError(f"unknown part kind {part.kind!r}")


def _seqio_shards(config: DataConfig, split: str) -> int:
  seqio = seqio_reader.import_seqio()
  task = seqio_reader.get_task(seqio, config.seqio_task)
  return max(1, len(task.source.list_shards(seqio_reader.task_split(config, split))))


# ----------------------------------------------------------------------------- TFDS

def _tfds():
  try:
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError("DataConfig.prepared_from", f"TFDS sources need tensorflow-datasets ({e})",
                      "pip install 'midas_jax[data]'") from e
  return tfds


def _builder(config: DataConfig):
  tfds = _tfds()
  try:
    return tfds.builder(config.tfds_name, data_dir=config.tfds_data_dir)
  except Exception as e:  # pylint: disable=broad-except  (TFDS raises several kinds for a missing set)
    raise ConfigError("DataConfig.tfds_name",
                      f"cannot load the TFDS data set {config.tfds_name!r} from "
                      f"{config.tfds_data_dir or 'the default data_dir'} ({type(e).__name__}: {e})",
                      "check DataConfig.tfds_name and tfds_data_dir: the data set must be prepared there") from e


def _tfds_slices(config: DataConfig, split: str, num_shards: int) -> List[str]:
  builder = _builder(config)
  name = config.tfds_train_split if split == "train" else config.tfds_eval_split
  setting = "DataConfig.tfds_train_split" if split == "train" else "DataConfig.tfds_eval_split"
  available = list(builder.info.splits)
  require(name in available, setting, f"{config.tfds_name!r} has no split {name!r} (it has {available})",
          f"set {setting} to one of {available}")
  features = builder.info.features
  require(config.tfds_text_feature in features, "DataConfig.tfds_text_feature",
          f"{config.tfds_name!r} has no feature {config.tfds_text_feature!r} (it has {sorted(features)})",
          "set DataConfig.tfds_text_feature to the feature that holds the text")
  examples = builder.info.splits[name].num_examples
  count = num_shards or max(1, builder.info.splits[name].num_shards)
  bounds = [i * examples // count for i in range(count + 1)]  # contiguous, sizes within one of each other
  return [f"{name}[{a}:{b}]" for a, b in zip(bounds[:-1], bounds[1:])]


def _tfds_texts(config: DataConfig, spec: str) -> Iterator[str]:
  tfds = _tfds()
  builder = _builder(config)
  ds = builder.as_dataset(split=spec, shuffle_files=False, read_config=tfds.ReadConfig(add_tfds_id=False))
  feature = config.tfds_text_feature
  for example in tfds.as_numpy(ds):
    value: Optional[bytes] = example[feature]
    text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    if text.strip():
      yield text
