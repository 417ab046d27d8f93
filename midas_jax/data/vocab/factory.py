"""The vocabulary a DataConfig names: bytes, a SentencePiece model or a tokenizers tokenizer.json."""

from __future__ import annotations

from midas_jax.configs import DataConfig
from midas_jax.data.vocab.tokenizer_json import TokenizersVocabulary
from midas_jax.data.vocab.vocabulary import ByteVocabulary, SentencePieceVocabulary, Vocabulary, check_extra_ids


def make_vocabulary(config: DataConfig) -> Vocabulary:
  """The vocabulary that `config.vocab` names."""
  check_extra_ids(config.extra_ids)
  if config.vocab == "byte":
    return ByteVocabulary(config.extra_ids)
  if config.vocab == "tokenizers":
    return TokenizersVocabulary(config.tokenizer, config.extra_ids)
  return SentencePieceVocabulary(config.spm_model, config.extra_ids)
