"""Vocabularies: seqio's id layout (usable without TensorFlow), and tokenizers with their own ids.

seqio's layout, shared by ByteVocabulary and our SentencePiece models: pad=0, eos=1, unk=2, then
the base pieces, then `extra_ids` sentinel ids at the very top. Sentinels count down from the top
(T5 convention: `extra_id(0)` is the last id), so span corruption can take them without colliding
with text. `to_seqio()` returns the equivalent seqio vocabulary (imported lazily: seqio pulls in
TensorFlow).

A tokenizer trained elsewhere keeps its ids: a SentencePiece model with another special-id layout
(Llama's unk 0 / bos 1 / eos 2) or any `tokenizer.json` (TokenizersVocabulary, in
data/vocab/tokenizer_json.py). The objectives need an EOS, a pad, sentinels and mode tokens
(data/ul2/objectives.py): each is the tokenizer's own where it has one, else an id appended above its
vocabulary: a missing pad or eos takes the first extra ids, sentinels and mode tokens count down
from the top as in seqio's layout. So vocab_size = the tokenizer's ids + extra_ids, which the model's
(padded) vocab_size must hold; `special_ids()` is recorded in run configs and checkpoints, and
`appended_tokens()` names every appended id for an exported tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence

import sentencepiece

from midas_jax import fs
from midas_jax.errors import ConfigError, require

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
NUM_SPECIAL = 3
NUM_BYTES = 256


def sentinel_name(k: int) -> str:
  """T5's name of sentinel k."""
  return f"<extra_id_{k}>"


class Vocabulary:
  """The interface every vocabulary shares. Subclasses set `_base_size` (the ids below the extra
  ids), `_extra_ids`, the special ids and `_appended` (id -> name of a pad or eos they lacked)."""

  kind: str
  _base_size: int
  _extra_ids: int
  _appended: Dict[int, str] = {}

  pad_id: int = PAD_ID
  eos_id: int = EOS_ID
  unk_id: Optional[int] = UNK_ID
  bos_id: Optional[int] = None

  @property
  def extra_ids(self) -> int:
    return self._extra_ids

  @property
  def base_size(self) -> int:
    """Ids of the tokenizer itself, below every appended one."""
    return self._base_size

  @property
  def vocab_size(self) -> int:
    return self._base_size + self._extra_ids

  @property
  def start_id(self) -> int:
    """The token every example's inputs start with (packing's BOS): the tokenizer's BOS, else its
    EOS (a document boundary, as GPT-2 uses it); seqio's layout starts decoding from pad 0."""
    return self.bos_id if self.bos_id is not None else self.eos_id

  @property
  def reserved_extra_ids(self) -> int:
    """Extra ids at the bottom taken by a pad or eos the tokenizer lacks (data/ul2/objectives.py)."""
    return len(self._appended)

  def extra_id(self, i: int) -> int:
    """Id of sentinel i; sentinel 0 is the last id of the vocabulary."""
    if not 0 <= i < self._extra_ids:
      raise IndexError(f"sentinel {i} out of range: this vocabulary has {self._extra_ids} extra ids")
    return self.vocab_size - 1 - i

  def own_token_id(self, name: str) -> Optional[int]:
    """The id of the tokenizer's own token `name` (a sentinel or mode token), None when it has none.

    Vocabularies in seqio's layout never look: their sentinels are always the top extra ids.
    """
    del name
    return None

  def token_text(self, token_id: int) -> str:
    """The name of one of the tokenizer's own ids (below base_size), as its tokenizer spells it."""
    raise NotImplementedError

  def appended_tokens(self) -> List[str]:
    """Names of the ids [base_size, vocab_size): an appended pad or eos by its role, the others by
    their place from the top, T5's `<extra_id_k>` (k = vocab_size - 1 - id), unless the tokenizer
    has that name already."""
    names = []
    for i in range(self._base_size, self.vocab_size):
      name = self._appended.get(i) or sentinel_name(self.vocab_size - 1 - i)
      if i not in self._appended and self.own_token_id(name) is not None:
        name = f"<midas_extra_{i}>"
      names.append(name)
    return names

  def special_ids(self) -> Dict[str, object]:
    """What the ids mean, for config files and checkpoint metadata (sentinels: data/ul2/objectives.py)."""
    return {"kind": self.kind, "vocab_size": self.vocab_size, "base_size": self._base_size,
            "extra_ids": self._extra_ids, "pad_id": self.pad_id, "eos_id": self.eos_id, "unk_id": self.unk_id,
            "bos_id": self.bos_id, "start_id": self.start_id,
            "appended": {str(i): n for i, n in sorted(self._appended.items())}}

  def _defining_bytes(self) -> bytes:
    """The bytes of the files that define the vocabulary (none for bytes)."""
    return b""

  @property
  def fingerprint(self) -> str:
    """sha256 of what defines the vocabulary: kind, sizes, special ids and the model file's bytes."""
    h = hashlib.sha256(json.dumps(self.special_ids(), sort_keys=True).encode())
    h.update(self._defining_bytes())
    return h.hexdigest()

  def _text_ids(self, ids: Iterable[int]) -> List[int]:
    # Specials, sentinels and ids past the vocabulary (a padded model vocab can emit them): no text.
    return [int(i) for i in ids if NUM_SPECIAL <= int(i) < self._base_size]


def check_extra_ids(extra_ids: int) -> None:
  require(isinstance(extra_ids, int) and extra_ids >= 0, "DataConfig.extra_ids",
          f"must be a non-negative int, got {extra_ids!r}",
          "use 128 (enough sentinels for span corruption), or 0 for causal LM only")


def appended_specials(base_size: int, extra_ids: int, have: Dict[str, Optional[int]],
                      setting: str) -> Dict[str, int]:
  """Ids for a pad and an eos the tokenizer lacks (`have[role]` None), from the first extra ids.

  Returns {role: id} with the appended ones set.
  """
  missing = [role for role in ("pad", "eos") if have.get(role) is None]
  require(len(missing) <= extra_ids, "DataConfig.extra_ids",
          f"the tokenizer of {setting} has no {' and no '.join(missing)} token, and {extra_ids} extra ids "
          "leave no room to append one", "set DataConfig.extra_ids >= 2 (128 is the default)")
  ids = dict(have)
  for j, role in enumerate(missing):
    ids[role] = base_size + j
  return ids


def appended_names(ids: Dict[str, int], base_size: int, taken) -> Dict[int, str]:
  """id -> token name for the appended pad / eos: "<pad>" and "</s>", or a name the tokenizer lacks."""
  preferred = {"pad": "<pad>", "eos": "</s>"}
  out = {}
  for role, i in ids.items():
    if role in preferred and i >= base_size:
      out[i] = preferred[role] if not taken(preferred[role]) else f"<midas_{role}>"
  return out


class ByteVocabulary(Vocabulary):
  """UTF-8 bytes: byte b has id b + 3; ids identical to `seqio.ByteVocabulary(extra_ids)`."""

  kind = "byte"
  start_id = PAD_ID

  def __init__(self, extra_ids: int = 128):
    check_extra_ids(extra_ids)
    self._extra_ids = extra_ids
    self._base_size = NUM_SPECIAL + NUM_BYTES

  def encode(self, text: str) -> List[int]:
    """Token ids of `text`, without EOS."""
    return [b + NUM_SPECIAL for b in text.encode("utf-8")]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, skipping pad/eos/unk and sentinels; broken UTF-8 becomes U+FFFD."""
    return bytes(i - NUM_SPECIAL for i in self._text_ids(ids)).decode("utf-8", errors="replace")

  def token_text(self, token_id: int) -> str:
    return ("<pad>", "</s>", "<unk>")[token_id] if token_id < NUM_SPECIAL else f"<0x{token_id - NUM_SPECIAL:02X}>"

  def to_seqio(self):
    import seqio  # lazy: TensorFlow
    return seqio.ByteVocabulary(extra_ids=self._extra_ids)

  def __repr__(self) -> str:
    return f"ByteVocabulary(extra_ids={self._extra_ids})"


class SentencePieceVocabulary(Vocabulary):
  """A trained SentencePiece model with `extra_ids` ids appended on top, in one of two layouts.

  - seqio's (pad 0, eos 1, unk 2, as `train_sentencepiece` writes): the extra ids are sentinels,
    exactly as seqio.SentencePieceVocabulary numbers them. seqio registers its sentinels as pieces
    named "<extra_id_N>", so a text that literally contains that string tokenizes to the sentinel
    there and to plain pieces here; every other text gets equal ids.
  - any other (Llama's unk 0 / bos 1 / eos 2, no pad): the model's own ids and special pieces; a
    pad or eos it lacks is appended, and its own `<extra_id_N>` or mode-token pieces are used.
  """

  kind = "sentencepiece"

  def __init__(self, model_file: str, extra_ids: int = 128):
    check_extra_ids(extra_ids)
    model_file = fs.check(model_file, "DataConfig.spm_model")
    require(fs.isfile(model_file), "DataConfig.spm_model", f"no model file at {model_file!r}",
            "fix the path, or train one with midas_jax.data.vocab.vocabulary.train_sentencepiece")
    self._model_bytes = fs.read_bytes(model_file)
    self._processor = p = sentencepiece.SentencePieceProcessor()
    try:
      p.LoadFromSerializedProto(self._model_bytes)
    except (OSError, RuntimeError) as e:
      raise ConfigError("DataConfig.spm_model", f"{model_file!r} is not a SentencePiece model ({e})",
                        "point it at the .model file that spm training wrote") from e
    self.model_file = model_file
    self._extra_ids = extra_ids
    self._base_size = p.GetPieceSize()
    self.seqio_layout = (p.pad_id(), p.eos_id(), p.unk_id()) == (PAD_ID, EOS_ID, UNK_ID)
    own = lambda i: i if i >= 0 else None  # noqa: E731  (-1: the model has no such piece)
    ids = appended_specials(self._base_size, extra_ids, {"pad": own(p.pad_id()), "eos": own(p.eos_id())},
                            f"DataConfig.spm_model {model_file!r}")
    self._appended = appended_names(ids, self._base_size, self._has_piece)
    self.pad_id, self.eos_id = ids["pad"], ids["eos"]
    self.unk_id, self.bos_id = p.unk_id(), own(p.bos_id())

  @property
  def start_id(self) -> int:
    return PAD_ID if self.seqio_layout else super().start_id

  def _has_piece(self, name: str) -> bool:
    i = self._processor.PieceToId(name)
    return self._processor.IdToPiece(i) == name and not self._processor.IsUnknown(i)

  def own_token_id(self, name: str) -> Optional[int]:
    if self.seqio_layout or not self._has_piece(name):
      return None
    return self._processor.PieceToId(name)

  def token_text(self, token_id: int) -> str:
    return self._processor.IdToPiece(int(token_id))

  def encode(self, text: str) -> List[int]:
    return list(self._processor.EncodeAsIds(text))

  def decode(self, ids: Iterable[int]) -> str:
    p = self._processor
    if self.seqio_layout:
      return p.DecodeIds(self._text_ids(ids))
    text_ids = [int(i) for i in ids if 0 <= int(i) < self._base_size]
    return p.DecodeIds([i for i in text_ids if not (p.IsControl(i) or p.IsUnknown(i))])

  def _defining_bytes(self) -> bytes:
    return self._model_bytes

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
