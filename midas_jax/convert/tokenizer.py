"""The run's vocabulary as a transformers tokenizer (tokenizer.json, loadable offline by AutoTokenizer).

- A tokenizer trained elsewhere (DataConfig.tokenizer: the transformers files `midas import`
  copied, or any tokenizer.json) is written back as it was, with the ids appended for the special
  tokens it lacked (data/vocab/vocabulary.py) added under their names, so `AutoTokenizer.from_pretrained(export)`
  encodes every text exactly as the original tokenizer does, its own special tokens and BOS
  included, and decodes the appended ids by name. The original files are also kept, untouched, in
  ORIGINALS_DIR, from which `midas import` of the export restores the run's vocabulary.
- Our vocabularies keep their layout exactly and add no special tokens when encoding, as our
  `encode` does not: `tokenizer(text).input_ids == vocab.encode(text)`.
  byte: a BPE model with no merges whose only pieces are the 256 bytes `<0xNN>` (id byte + 3), so
  byte fallback spells every text as its UTF-8 bytes.
  sentencepiece (any special-id layout): built from the .model's own normalizer and pieces by
  transformers' SentencePiece converter (the .model is copied beside it for users of the
  sentencepiece library).
"""

from __future__ import annotations

import tempfile
from typing import Dict, List, Optional, Tuple

from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import BPE

from midas_jax import fs
from midas_jax.configs import DataConfig
from midas_jax.data.vocab import vocabulary as vocab_lib
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.data.vocab.tokenizer_json import CONFIG_FILES, TOKENIZER_FILE, tokenizer_paths
from midas_jax.errors import ConfigError, require

ORIGINALS_DIR = "midas_jax_tokenizer"
# The files a transformers tokenizer may consist of; the ones present are copied.
TOKENIZER_FILES = (TOKENIZER_FILE, *CONFIG_FILES, "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")


def copy_tokenizer_files(source: str, out_dir: str) -> List[str]:
  """Copies the tokenizer files of `source` (a tokenizer.json, or a directory) into out_dir: the
  tokenizer.json and whatever of the other files lie beside it (where the vocabulary reads roles)."""
  file, directory = tokenizer_paths(source)
  fs.makedirs(out_dir)
  copied = []
  for name in TOKENIZER_FILES:
    src = file if name == TOKENIZER_FILE else fs.join(directory, name)
    if fs.exists(src):
      fs.copy(src, fs.join(out_dir, name))
      copied.append(name)
  return copied


def import_tokenizer(hf_dir: str, out_dir: str) -> Optional[Tuple[Dict[str, str], str]]:
  """Copies the tokenizer of a transformers directory into out_dir.

  Returns (the DataConfig settings that train with it, a note), or None when hf_dir has none. A
  tokenizer.json is taken as it is. A tokenizer.model alone is converted by transformers into the
  tokenizer.json that `AutoTokenizer.from_pretrained(hf_dir)` would build, so training, evaluation
  and the export all encode as transformers does; when transformers cannot convert it, the run uses
  the SentencePiece model itself (any special-id layout).
  """
  if fs.isfile(fs.join(hf_dir, TOKENIZER_FILE)):
    copied = copy_tokenizer_files(hf_dir, out_dir)
    return {"vocab": "tokenizers", "tokenizer": out_dir}, f"its own tokenizer ({', '.join(copied)})"
  spm = fs.join(hf_dir, "tokenizer.model")
  if not fs.isfile(spm):
    return None
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory(prefix="midas_tokenizer_") as local:
    copied = copy_tokenizer_files(hf_dir, local)
    fs.copy(fs.join(hf_dir, "config.json"), fs.join(local, "config.json"))  # names the tokenizer class
    try:
      tok = AutoTokenizer.from_pretrained(local)
      converted = tok.is_fast
    except (ValueError, OSError, ImportError, KeyError, TypeError):
      converted = False
    with fs.staged_dir(out_dir) as staged:
      fs.copy(spm, fs.join(staged, "tokenizer.model"))
      if converted:
        tok.save_pretrained(staged)
  if converted:
    return ({"vocab": "tokenizers", "tokenizer": out_dir},
            f"its own tokenizer ({', '.join(copied)}; tokenizer.json converted by transformers)")
  return ({"vocab": "sentencepiece", "spm_model": fs.join(out_dir, "tokenizer.model")},
          "its own SentencePiece model (tokenizer.model), read by the sentencepiece library")


def _name(vocab, token_id) -> Optional[str]:
  """The text of a special id: the tokenizer's own token or the appended one's name."""
  if token_id is None:
    return None
  if token_id >= vocab.base_size:
    return vocab.appended_tokens()[token_id - vocab.base_size]
  return vocab.token_text(token_id)


def _add_appended(tok, vocab) -> None:
  """Adds the appended ids to a transformers tokenizer under their names, at exactly their ids."""
  require(len(tok) == vocab.base_size, "DataConfig.tokenizer",
          f"the tokenizer files hold {len(tok)} tokens, the run's vocabulary {vocab.base_size} below its extra ids",
          "point DataConfig.tokenizer (and spm_model) at the files of one tokenizer")
  names = vocab.appended_tokens()
  tok.add_tokens([AddedToken(n, special=True, normalized=False) for n in names], special_tokens=True)
  got = tok.convert_tokens_to_ids(names)
  if got != list(range(vocab.base_size, vocab.vocab_size)):
    raise ConfigError("DataConfig.tokenizer", "transformers numbered the appended tokens differently "
                      f"({got[:3]}... instead of {vocab.base_size}...)", "report this with the tokenizer files")
  for role in ("pad", "eos"):
    if getattr(vocab, f"{role}_id") >= vocab.base_size:
      setattr(tok, f"{role}_token", _name(vocab, getattr(vocab, f"{role}_id")))


def _from_tokenizer_files(out_dir: str, data: DataConfig, vocab) -> str:
  from transformers import AutoTokenizer, PreTrainedTokenizerFast  # lazy: the convert extra
  originals = fs.join(out_dir, ORIGINALS_DIR)
  copied = copy_tokenizer_files(data.tokenizer, originals)
  if any(name in copied for name in CONFIG_FILES):
    tok = AutoTokenizer.from_pretrained(originals)
  else:  # a bare tokenizer.json: its roles as the vocabulary found them
    roles = {f"{r}_token": _name(vocab, getattr(vocab, f"{r}_id")) for r in ("bos", "eos", "unk")
             if getattr(vocab, f"{r}_id") is not None and getattr(vocab, f"{r}_id") < vocab.base_size}
    tok = PreTrainedTokenizerFast(tokenizer_file=fs.join(originals, TOKENIZER_FILE), **roles)
  _add_appended(tok, vocab)
  tok.save_pretrained(out_dir)
  return (f"The tokenizer the model was trained with ({', '.join(copied)}), written back as it was: "
          "`AutoTokenizer.from_pretrained` encodes every text as the original tokenizer does, its special "
          f"tokens (and a BOS, if it adds one) included; the originals are in {ORIGINALS_DIR}/. midas_jax trained on "
          f"documents encoded without special tokens, each ended by eos id {vocab.eos_id}. "
          + _appended_note(vocab))


def _appended_note(vocab) -> str:
  if not vocab.extra_ids:
    return ""
  return (f"Ids {vocab.base_size} to {vocab.vocab_size - 1} were appended to the tokenizer's {vocab.base_size} "
          f"for the special tokens it lacked: {_describe_roles(vocab)}, then the span-corruption sentinels "
          f"`<extra_id_N>` counting down from id {vocab.vocab_size - 1} (`<extra_id_0>`) and the UL2 mode tokens "
          "below them.")


def _describe_roles(vocab) -> str:
  appended = [f"{r} {getattr(vocab, f'{r}_id')} (`{_name(vocab, getattr(vocab, f'{r}_id'))}`)"
              for r in ("pad", "eos") if getattr(vocab, f"{r}_id") >= vocab.base_size]
  return ", ".join(appended) or "no pad or eos (it has both)"


def _byte_tokenizer(vocab):
  """(tokenizers.Tokenizer, names of pad, eos, unk)."""
  specials = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2
  pieces = list(specials) + [f"<0x{b:02X}>" for b in range(vocab_lib.NUM_BYTES)] + vocab.appended_tokens()
  tok = Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                      byte_fallback=True, fuse_unk=False))
  tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
  return tok, specials


def _sentencepiece_tokenizer(vocab) -> Tuple[object, tuple]:
  from transformers.convert_slow_tokenizer import SpmConverter  # lazy: the convert extra
  try:
    from sentencepiece import sentencepiece_model_pb2
  except ImportError as e:  # the generated module needs protobuf, which only the data extra brings
    raise ConfigError("DataConfig.spm_model", f"reading a SentencePiece model's pieces needs protobuf ({e})",
                      "pip install protobuf") from None
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(fs.read_bytes(vocab.model_file))
  pieces = [(p.piece, p.score) for p in proto.pieces] + [(s, 0.0) for s in vocab.appended_tokens()]
  # legacy=True reproduces SentencePiece's dummy prefix on text that already starts with a space.
  tok = SpmConverter.build_tokenizer_from_spm_proto(proto, pieces, legacy=True)
  return tok, tuple(_name(vocab, i) for i in (vocab.pad_id, vocab.eos_id, vocab.unk_id))


def write_tokenizer(out_dir: str, data: DataConfig, vocab=None) -> str:
  """Writes tokenizer.json and tokenizer_config.json (and tokenizer.model for SentencePiece) into
  out_dir, a local directory. Returns what the README says about the token ids."""
  from transformers import PreTrainedTokenizerFast
  vocab = vocab or make_vocabulary(data)
  if data.tokenizer:
    return _from_tokenizer_files(out_dir, data, vocab)
  if data.vocab == "byte":
    tok, (pad, eos, unk) = _byte_tokenizer(vocab)
    what = ("The byte vocabulary (the ids of seqio.ByteVocabulary): pad 0, eos 1, unk 2, each UTF-8 byte b at id "
            f"b + 3, then {data.extra_ids} sentinels `<extra_id_N>` counting down from id "
            f"{vocab.vocab_size - 1} (`<extra_id_0>`).")
  else:
    fs.copy(vocab.model_file, fs.join(out_dir, "tokenizer.model"))
    tok, (pad, eos, unk) = _sentencepiece_tokenizer(vocab)
    what = (f"The SentencePiece vocabulary (tokenizer.model, a copy of {vocab.model_file.rsplit('/', 1)[-1]}): "
            f"pad {vocab.pad_id}, eos {vocab.eos_id}, unk {vocab.unk_id} and the rest of its {vocab.base_size} "
            f"pieces, then {data.extra_ids} extra ids: " + (_appended_note(vocab) if not vocab.seqio_layout else
                                                           "sentinels `<extra_id_N>` counting down from the last id "
                                                           "(`<extra_id_0>`)."))
  specials = [pad, eos, unk] + vocab.appended_tokens()
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(specials)])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token=unk)
  fast.save_pretrained(out_dir)
  return what + (" `tok(text).input_ids` equals midas_jax's `vocab.encode(text)`: no BOS and no EOS are added "
                 f"(documents end with eos id {vocab.eos_id}). Literal strings such as `<extra_id_0>` in a text "
                 "become those special ids here and plain text in midas_jax.")
