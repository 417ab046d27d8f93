"""seqio Tasks over our sources, for users of seqio-based pipelines (t5x, mixtures, caching).

seqio and TensorFlow are imported inside the functions only: importing this module stays free of TF.
Each Task has splits "train" and "validation" and one output feature, "targets": the document text
tokenized by the vocabulary's seqio twin, with EOS appended. Registering a name again with the same
arguments returns the registered Task; with other arguments it replaces it.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from midas_jax.configs import DataConfig
from midas_jax.data import corpus, sources
from midas_jax.data.vocab import ByteVocabulary

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
  sources.resolve_files(config.train_files, "DataConfig.train_files")
  if config.eval_files:
    sources.resolve_files(config.eval_files, "DataConfig.eval_files")
  return _register(name, ("text", config), lambda split: sources.load_documents(config, split), vocab)


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
      source=seqio.FunctionDataSource(dataset_fn, splits=corpus.SPLITS),
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
