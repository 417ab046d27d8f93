"""seqio Tasks this package defines: our sources, for users of seqio-based pipelines (t5x, mixtures,
caching), and C4, the data of real pretraining runs.

seqio and TensorFlow are imported inside the functions only: importing this module stays free of TF.
Each Task of our sources has splits "train" and "validation" and one output feature, "targets": the
document text tokenized by the vocabulary's seqio twin, with EOS appended. Registering a name again
with the same arguments returns the registered Task; with other arguments it replaces it.

C4 (TFDS) is tokenized by a SentencePiece model. The default TFDS version, c4/en:3.0.1, is the one
T5 trained on; TFDS's current code builds 3.1.0, so 3.0.1 loads only from prepared files in
`data_dir` (None: TFDS's default, $TFDS_DATA_DIR or ~/tensorflow_datasets). Building C4 yourself
(`tfds build c4/en`) needs Apache Beam and a Common Crawl download. gin files register it by
importing data/sources/c4_en.py.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from midas_jax import fs
from midas_jax.configs import DataConfig
from midas_jax.data.sources import corpus, seqio_reader, text_files
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.vocab.vocabulary import ByteVocabulary

C4_TFDS_NAME = "c4/en:3.0.1"

_REGISTERED: Dict[str, Tuple[object, object]] = {}  # name -> (arguments, seqio vocabulary)


def register_builtin_task(name: str = "midas_builtin", seed: int = 0, vocab=None):
  """Registers the built-in corpus of `seed` as a seqio Task (default vocab: ByteVocabulary())."""
  return _register(name, ("builtin", seed),
                   lambda split: [d.text for d in corpus.documents(split, seed)], vocab)


def register_text_task(name: str, train_files: Sequence[str], eval_files: Sequence[str] = (),
                       vocab=None, jsonl_field: str = "text"):
  """Registers local .txt/.jsonl(.gz) files as a seqio Task, with the splits `load_documents` makes.

  The patterns are resolved now, so a wrong path fails at registration; files are read when a split's
  dataset is built.
  """
  as_tuple = lambda p: (p,) if isinstance(p, str) else tuple(p)
  config = DataConfig(source="text", train_files=as_tuple(train_files),
                      eval_files=as_tuple(eval_files), jsonl_field=jsonl_field)
  text_files.resolve_files(config.train_files, "DataConfig.train_files")
  if config.eval_files:
    text_files.resolve_files(config.eval_files, "DataConfig.eval_files")
  return _register(name, ("text", config), lambda split: text_files.load_documents(config, split), vocab)


def _register(name: str, arguments: object, texts: Callable[[str], List[str]], vocab: Optional[object]):
  import seqio  # lazy: TensorFlow
  import tensorflow as tf

  vocab = ByteVocabulary() if vocab is None else vocab
  seqio_vocab = vocab.to_seqio() if hasattr(vocab, "to_seqio") else vocab  # ours, or seqio's own
  if name in seqio.TaskRegistry.names():
    if _REGISTERED.get(name) == (arguments, seqio_vocab):
      return seqio.TaskRegistry.get(name)
    seqio.TaskRegistry.remove(name)

  def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
    del shuffle_files, seed  # one in-memory source: the Task's own shuffle orders the examples
    return tf.data.Dataset.from_tensor_slices({"text": tf.constant(texts(split), dtype=tf.string)})

  task = seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn, splits=SPLITS),
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
          seqio.preprocessors.tokenize,
          seqio.preprocessors.append_eos,
      ],
      output_features={"targets": seqio.Feature(vocabulary=seqio_vocab, add_eos=True)},
      metric_fns=[],
  )
  _REGISTERED[name] = (arguments, seqio_vocab)
  return task


def register_c4(name: str = "c4_en", *, spm_model: str, tfds_name: str = C4_TFDS_NAME,
                data_dir: Optional[str] = None, extra_ids: int = 128):
  """Registers (or re-registers) `name`: C4's "text" as "targets", SentencePiece ids, then EOS.

  The model file is read when the task is first used, not here, so registering never fails on it.
  Its extra_ids must equal DataConfig.extra_ids (the run checks the vocabularies agree).
  """
  seqio = seqio_reader.import_seqio()  # lazy: TensorFlow

  vocab = seqio.SentencePieceVocabulary(fs.check(spm_model, "DataConfig.spm_model"), extra_ids=extra_ids)
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.TfdsDataSource(tfds_name=tfds_name, tfds_data_dir=data_dir),
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
          functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
          seqio.preprocessors.append_eos,
      ],
      output_features={"targets": seqio.Feature(vocabulary=vocab, add_eos=True)},
      metric_fns=[],
  )
