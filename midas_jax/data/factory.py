"""The vocabulary and the step-addressed pipeline a run's config asks for.

A prepared store is read by index (data/store/); every other source is loaded into memory as token
documents. seqio Tasks are read once into a token cache (data/sources/seqio_reader.py). A mixture builds one
pipeline per source and draws each row from one of them (data/mixture.py).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from midas_jax.configs import RunConfig
from midas_jax.data.mixture import MixturePipeline, source_config
from midas_jax.data.pipeline import Pipeline, tokenize_documents
from midas_jax.data.sources import seqio_reader
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.sources.text_files import load_documents
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.data.vocab.vocabulary import Vocabulary
from midas_jax.errors import require

AnyPipeline = Union[Pipeline, PreparedPipeline, MixturePipeline]


def load_token_documents(config: RunConfig, vocab: Vocabulary,
                         cache_dir: Optional[str] = None) -> Dict[str, List[np.ndarray]]:
  """Every split's documents as token arrays. cache_dir: the seqio source's token cache (None:
  ~/.cache/midas_jax/seqio); other sources ignore it."""
  if config.data.source == "seqio":
    return {split: seqio_reader.load_token_documents_from_task(config.data, split, cache_dir, vocab)
            for split in SPLITS}
  data = config.data
  if data.source == "builtin" and data.vocab == "byte":  # generated and tokenized alike every time: kept
    key = (data.corpus_seed, data.corpus_holdout, data.corpus_documents, data.extra_ids)
    if key not in _BUILTIN_TOKENS:
      _BUILTIN_TOKENS.clear()  # one corpus at a time: a study's cells share it
      _BUILTIN_TOKENS[key] = {split: tokenize_documents(load_documents(data, split), vocab) for split in SPLITS}
    return dict(_BUILTIN_TOKENS[key])
  return {split: tokenize_documents(load_documents(data, split), vocab) for split in SPLITS}


# The built-in corpus with the byte vocabulary, tokenized: a study builds a pipeline per cell and per eval
# set over the same documents (the pipelines only read them).
_BUILTIN_TOKENS: Dict[tuple, Dict[str, List[np.ndarray]]] = {}


def load_data(config: RunConfig, stage_starts: Optional[Sequence[int]] = None) -> Tuple[Vocabulary, AnyPipeline]:
  """The vocabulary and the pipeline over the configured source. stage_starts: the first step of
  each stage (the run's StageSchedule.starts), which a mixture with StackingConfig.stage_mixtures
  needs to switch weights at the boundaries."""
  vocab = make_vocabulary(config.data)
  if config.data.source == "mixture":
    sources = {s.name: _pipeline(dataclasses.replace(config, data=source_config(config.data, s)), vocab)
               for s in config.data.mixture}
    return vocab, MixturePipeline(config.data, sources, config.stacking.stage_mixtures, stage_starts)
  require(config.stacking.stage_mixtures is None, "StackingConfig.stage_mixtures",
          f"is set, but DataConfig.source is {config.data.source!r}, not a mixture",
          "set DataConfig.source = 'mixture' and DataConfig.mixture, or leave stage_mixtures None")
  return vocab, _pipeline(config, vocab)


def _pipeline(config: RunConfig, vocab: Vocabulary) -> Union[Pipeline, PreparedPipeline]:
  if config.data.source == "prepared":
    return PreparedPipeline(config.data, vocab, mix=config.objectives)
  return Pipeline(config.data, load_token_documents(config, vocab), vocab.vocab_size, vocab, mix=config.objectives)
