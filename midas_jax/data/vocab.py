"""Vocabularies with seqio's id layout, usable without TensorFlow.

Both kinds share one layout: pad=0, eos=1, unk=2, then the base pieces, then `extra_ids` sentinel ids
at the very top. Sentinels count down from the top (T5 convention: `extra_id(0)` is the last id), so
span corruption can take them without colliding with text. `to_seqio()` returns the equivalent seqio
vocabulary (imported lazily: seqio pulls in TensorFlow).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, List, Sequence

from midas_jax import fs
from midas_jax.configs import DataConfig
from midas_jax.errors import ConfigError, require

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
NUM_SPECIAL = 3
NUM_BYTES = 256


class _Layout:
  """The shared interface; subclasses set `_base_size` (ids below the sentinels) and `_extra_ids`."""

  _base_size: int
  _extra_ids: int

  pad_id = PAD_ID
  eos_id = EOS_ID
  unk_id = UNK_ID

  @property
  def extra_ids(self) -> int:
    return self._extra_ids

  @property
  def vocab_size(self) -> int:
    return self._base_size + self._extra_ids

  def extra_id(self, i: int) -> int:
    """Id of sentinel i; sentinel 0 is the last id of the vocabulary."""
    if not 0 <= i < self._extra_ids:
      raise IndexError(f"sentinel {i} out of range: this vocabulary has {self._extra_ids} extra ids")
    return self.vocab_size - 1 - i

  @property
  def fingerprint(self) -> str:
    """sha256 of what defines the ids: kind, size, extra ids and (SentencePiece) the model's bytes.

    Stable across machines and paths, so a prepared store can check that it was tokenized by this
    vocabulary."""
    h = hashlib.sha256(f"{type(self).__name__}|{self.vocab_size}|{self._extra_ids}|".encode())
    h.update(self._definition_bytes())
    return h.hexdigest()

  def _definition_bytes(self) -> bytes:
    return b""

  def _text_ids(self, ids: Iterable[int]) -> List[int]:
    # Specials, sentinels and ids past the vocabulary (a padded model vocab can emit them): no text.
    return [int(i) for i in ids if NUM_SPECIAL <= int(i) < self._base_size]


def _check_extra_ids(extra_ids: int) -> None:
  require(isinstance(extra_ids, int) and extra_ids >= 0, "DataConfig.extra_ids",
          f"must be a non-negative int, got {extra_ids!r}",
          "use 128 (enough sentinels for span corruption), or 0 for causal LM only")


class ByteVocabulary(_Layout):
  """UTF-8 bytes: byte b has id b + 3; ids identical to `seqio.ByteVocabulary(extra_ids)`."""

  def __init__(self, extra_ids: int = 128):
    _check_extra_ids(extra_ids)
    self._extra_ids = extra_ids
    self._base_size = NUM_SPECIAL + NUM_BYTES

  def encode(self, text: str) -> List[int]:
    """Token ids of `text`, without EOS."""
    return [b + NUM_SPECIAL for b in text.encode("utf-8")]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, skipping pad/eos/unk and sentinels; broken UTF-8 becomes U+FFFD."""
    return bytes(i - NUM_SPECIAL for i in self._text_ids(ids)).decode("utf-8", errors="replace")

  def to_seqio(self):
    import seqio  # lazy: TensorFlow
    return seqio.ByteVocabulary(extra_ids=self._extra_ids)

  def __repr__(self) -> str:
    return f"ByteVocabulary(extra_ids={self._extra_ids})"


class SentencePieceVocabulary(_Layout):
  """A trained SentencePiece model (pad 0, eos 1, unk 2) with `extra_ids` sentinels appended on top.

  seqio registers its sentinels as pieces named "<extra_id_N>", so a text that literally contains that
  string tokenizes to the sentinel there and to plain pieces here; every other text gets equal ids.
  """

  def __init__(self, model_file: str, extra_ids: int = 128):
    import sentencepiece  # no TensorFlow; kept local so the byte path never needs it
    _check_extra_ids(extra_ids)
    model_file = fs.check(model_file, "DataConfig.spm_model")  # a local path or a gs:// URL
    require(fs.isfile(model_file), "DataConfig.spm_model", f"no model file at {model_file!r}",
            "fix the path, or train one with midas_jax.data.vocab.train_sentencepiece")
    self._processor = sentencepiece.SentencePieceProcessor()
    try:
      self._processor.LoadFromSerializedProto(fs.read_bytes(model_file))
    except (OSError, RuntimeError) as e:
      raise ConfigError("DataConfig.spm_model", f"{model_file!r} is not a SentencePiece model ({e})",
                        "point it at the .model file that spm training wrote") from e
    p = self._processor
    layout = (p.pad_id(), p.eos_id(), p.unk_id())
    require(layout == (PAD_ID, EOS_ID, UNK_ID), "DataConfig.spm_model",
            f"{model_file!r} has (pad, eos, unk) ids {layout}, not (0, 1, 2)",
            "retrain it with train_sentencepiece, which sets pad_id=0 eos_id=1 unk_id=2 bos_id=-1")
    self.model_file = model_file
    self._extra_ids = extra_ids
    self._base_size = p.GetPieceSize()

  def encode(self, text: str) -> List[int]:
    return list(self._processor.EncodeAsIds(text))

  def _definition_bytes(self) -> bytes:
    return self._processor.serialized_model_proto()

  def decode(self, ids: Iterable[int]) -> str:
    return self._processor.DecodeIds(self._text_ids(ids))

  def to_seqio(self):
    import seqio  # lazy: TensorFlow
    return seqio.SentencePieceVocabulary(self.model_file, extra_ids=self._extra_ids)

  def __repr__(self) -> str:
    return f"SentencePieceVocabulary({self.model_file!r}, extra_ids={self._extra_ids})"


def train_sentencepiece(text_files: Sequence[str], model_prefix: str, vocab_size: int = 8000,
                        model_type: str = "unigram", **trainer_options) -> str:
  """Trains a SentencePiece model on local text files (one sentence per line) in our id layout.

  Returns the path of the written `<model_prefix>.model`. The defaults make tokenization lossless,
  since an LM must reproduce its text exactly: no normalization, whitespace kept, newline a piece
  of its own (the trainer reads lines, so it would never see one), and characters outside the
  vocabulary spelled as UTF-8 byte pieces (so vocab_size must exceed 260 + the kept characters).
  `trainer_options` go to the SentencePiece trainer and override these (e.g. `byte_fallback=False`,
  `input_sentence_size=1_000_000`, `hard_vocab_limit=False` for tiny corpora).
  """
  import sentencepiece
  if isinstance(text_files, (str, os.PathLike)):
    text_files = [text_files]
  text_files = [os.fspath(p) for p in text_files]
  require(len(text_files) > 0, "text_files", "no training text given", "pass at least one text file")
  for path in text_files:
    require(os.path.isfile(path), "text_files", f"no file at {path!r}", "fix the path")
  os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
  options = dict(normalization_rule_name="identity", remove_extra_whitespaces=False,
                 user_defined_symbols=["\n"], byte_fallback=True, character_coverage=0.9995,
                 minloglevel=2)
  options.update(trainer_options)
  sentencepiece.SentencePieceTrainer.Train(
      input=text_files, model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1, **options)
  return model_prefix + ".model"


def make_vocabulary(config: DataConfig):
  """The vocabulary that `config.vocab` names."""
  _check_extra_ids(config.extra_ids)
  if config.vocab == "byte":
    return ByteVocabulary(config.extra_ids)
  return SentencePieceVocabulary(config.spm_model, config.extra_ids)
