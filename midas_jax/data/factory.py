"""The vocabulary and the step-addressed pipeline a run's config asks for.

A prepared store is read by index (data/store/); every other source is loaded into memory as token
documents. seqio Tasks are read once into a token cache (data/seqio_source.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from midas_jax.configs import RunConfig
from midas_jax.data import seqio_source
from midas_jax.data.pipeline import Pipeline, tokenize_documents
from midas_jax.data.sources import load_documents
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.vocab import Vocabulary
from midas_jax.data.vocabularies import make_vocabulary

SPLITS = ("train", "validation")
AnyPipeline = Union[Pipeline, PreparedPipeline]


def load_token_documents(config: RunConfig, vocab: Vocabulary,
                         cache_dir: Optional[str] = None) -> Dict[str, List[np.ndarray]]:
  """Every split's documents as token arrays. cache_dir: the seqio source's token cache (None:
  ~/.cache/midas_jax/seqio); other sources ignore it."""
  if config.data.source == "seqio":
    return {split: seqio_source.load_token_documents_from_task(config.data, split, cache_dir, vocab)
            for split in SPLITS}
  return {split: tokenize_documents(load_documents(config.data, split), vocab) for split in SPLITS}


def load_data(config: RunConfig) -> Tuple[Vocabulary, AnyPipeline]:
  """The vocabulary and the pipeline over the configured source."""
  vocab = make_vocabulary(config.data)
  if config.data.source == "prepared":
    return vocab, PreparedPipeline(config.data, vocab, mix=config.objectives)
  return vocab, Pipeline(config.data, load_token_documents(config, vocab), vocab.vocab_size, vocab,
                         mix=config.objectives)
