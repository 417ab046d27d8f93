"""Our vocabularies as transformers tokenizers (tokenizer.json, loadable offline by AutoTokenizer).

Both keep our id layout exactly: pad 0, eos 1, unk 2, the base pieces, then `extra_ids` sentinels
`<extra_id_N>` counting down from the top (T5 order). Neither adds special tokens when encoding,
as our `encode` does not: `tokenizer(text).input_ids == vocab.encode(text)`.
- byte: a BPE model with no merges whose only pieces are the 256 bytes `<0xNN>` (id byte + 3), so
  byte fallback spells every text as its UTF-8 bytes.
- sentencepiece: built from the .model's own normalizer and pieces by transformers' SentencePiece
  converter (the .model is copied beside it for users of the sentencepiece library).
"""

from __future__ import annotations

import os
import shutil
from typing import List

from midas_jax.configs import DataConfig
from midas_jax.data import vocab as vocab_lib
from midas_jax.errors import ConfigError

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2


def _sentinels(extra_ids: int) -> List[str]:
  """Sentinel names in id order: the first sentinel id holds <extra_id_{extra_ids-1}>."""
  return [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]


def _byte_tokenizer(extra_ids: int):
  """(tokenizers.Tokenizer, names of pad, eos, unk)."""
  from tokenizers import Tokenizer, decoders  # lazy: conversion only
  from tokenizers.models import BPE
  pieces = list(SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(vocab_lib.NUM_BYTES)] + _sentinels(extra_ids)
  tok = Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                      byte_fallback=True, fuse_unk=False))
  tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
  return tok, SPECIAL_TOKENS


def _sentencepiece_tokenizer(model_file: str, extra_ids: int):
  from transformers.convert_slow_tokenizer import SpmConverter  # lazy: the convert extra
  try:
    from sentencepiece import sentencepiece_model_pb2
  except ImportError as e:  # the generated module needs protobuf, which only the data extra brings
    raise ConfigError("DataConfig.spm_model", f"reading a SentencePiece model's pieces needs protobuf ({e})",
                      "pip install protobuf") from None
  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_file, "rb") as f:
    proto.ParseFromString(f.read())
  pieces = [(p.piece, p.score) for p in proto.pieces] + [(s, 0.0) for s in _sentinels(extra_ids)]
  # legacy=True reproduces SentencePiece's dummy prefix on text that already starts with a space.
  tok = SpmConverter.build_tokenizer_from_spm_proto(proto, pieces, legacy=True)
  return tok, tuple(p.piece for p in proto.pieces[:3])  # our layout: pad 0, eos 1, unk 2


def write_tokenizer(out_dir: str, data: DataConfig) -> str:
  """Writes tokenizer.json and tokenizer_config.json (and tokenizer.model for SentencePiece).

  Returns a short description of the token ids for the exported README.
  """
  from tokenizers import AddedToken
  from transformers import PreTrainedTokenizerFast
  if data.vocab == "byte":
    tok, (pad, eos, unk) = _byte_tokenizer(data.extra_ids)
    what = ("byte vocabulary (the ids of seqio.ByteVocabulary): pad 0, eos 1, unk 2, each UTF-8 byte b at id "
            f"b + 3, then {data.extra_ids} sentinels `<extra_id_N>` counting down from id "
            f"{vocab_lib.NUM_SPECIAL + vocab_lib.NUM_BYTES + data.extra_ids - 1} (`<extra_id_0>`)")
  else:
    model_file = os.path.expanduser(data.spm_model)
    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
    tok, (pad, eos, unk) = _sentencepiece_tokenizer(model_file, data.extra_ids)
    what = (f"SentencePiece vocabulary (tokenizer.model, a copy of {os.path.basename(model_file)}): pad 0, eos 1, "
            f"unk 2 and the rest of its {len(tok.get_vocab()) - data.extra_ids} pieces, then {data.extra_ids} sentinels "
            "`<extra_id_N>` counting down from the last id (`<extra_id_0>`)")
  specials = [pad, eos, unk] + _sentinels(data.extra_ids)
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token=unk)
  fast.save_pretrained(out_dir)
  return what
