"""Any `tokenizer.json` (the Hugging Face `tokenizers` library) as a vocabulary, its ids unchanged.

GPT-2, Llama-3, SmolLM and Qwen ship their tokenizer (byte-level BPE, mostly) as a tokenizer.json;
this keeps its ids so weights trained with it can be trained further. Which tokens are EOS, pad,
unk and BOS comes from the tokenizer_config.json (or special_tokens_map.json) beside it, as
transformers reads them, else from the usual names among its tokens; a pad or eos it lacks, and the
sentinels and mode tokens it lacks, are appended above its ids (data/vocab/vocabulary.py).

`encode` adds no special tokens (no BOS, no EOS: the pipeline ends each document with EOS itself);
a special token's text inside a document ("<|endoftext|>") becomes that token, as in transformers.
"""

from __future__ import annotations

import json
from typing import Dict, Iterable, List, Optional

from tokenizers import Tokenizer

from midas_jax import fs
from midas_jax.data.vocab.vocabulary import Vocabulary, appended_names, appended_specials, check_extra_ids
from midas_jax.errors import ConfigError, require

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # where transformers finds the roles
# Names that commonly play each role, tried when no config file names it.
_USUAL_NAMES = {
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|padding|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]"),
}


def tokenizer_paths(path: str) -> tuple:
  """(the tokenizer.json, its directory) for a tokenizer.json or a directory that holds one."""
  path = fs.check(path, "DataConfig.tokenizer").rstrip("/")
  if path.endswith(".json"):
    return path, path.rsplit("/", 1)[0] if "/" in path else "."
  return fs.join(path, TOKENIZER_FILE), path


def _token_text(value) -> Optional[str]:
  """A config's role entry: a string, {"content": ...} (an AddedToken) or null."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def configured_roles(directory: str) -> Dict[str, Optional[str]]:
  """{role: token text} from the first config file beside the tokenizer that names any role."""
  for name in CONFIG_FILES:
    path = fs.join(directory, name)
    if not fs.exists(path):
      continue
    try:
      config = json.loads(fs.read_text(path))
    except ValueError as e:
      raise ConfigError("DataConfig.tokenizer", f"{path} is not JSON ({e})", "pass the tokenizer's own files") from None
    roles = {role: _token_text(config.get(f"{role}_token")) for role in _USUAL_NAMES}
    if any(roles.values()):
      return roles
  return {}


class TokenizersVocabulary(Vocabulary):
  """A tokenizer.json's ids, then `extra_ids` appended ids for the special tokens it lacks."""

  kind = "tokenizers"

  def __init__(self, tokenizer: str, extra_ids: int = 128):
    check_extra_ids(extra_ids)
    file, directory = tokenizer_paths(tokenizer)
    require(fs.isfile(file), "DataConfig.tokenizer", f"no tokenizer.json at {file!r}",
            "point it at a tokenizer.json or the directory of a transformers tokenizer (save_pretrained)")
    self._json = fs.read_text(file)
    try:
      self._tok = Tokenizer.from_str(self._json)
    except Exception as e:  # the Rust side raises its own exception type
      raise ConfigError("DataConfig.tokenizer", f"{file!r} is not a tokenizer.json ({e})",
                        "pass the tokenizer.json that transformers or tokenizers wrote") from None
    self.tokenizer_file, self.directory = file, directory
    self._vocab = self._tok.get_vocab(with_added_tokens=True)
    self._base_size = max(self._vocab.values()) + 1
    self._extra_ids = extra_ids
    self._specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    found = self._roles(configured_roles(directory))
    ids = appended_specials(self._base_size, extra_ids, found, f"DataConfig.tokenizer {file!r}")
    self._appended = appended_names(ids, self._base_size, lambda n: n in self._vocab)
    self.pad_id, self.eos_id, self.unk_id, self.bos_id = ids["pad"], ids["eos"], ids["unk"], ids["bos"]
    self._not_text = self._specials | {self.pad_id, self.eos_id}

  def _roles(self, configured: Dict[str, Optional[str]]) -> Dict[str, Optional[int]]:
    """Each role's id: the configured token, else the first usual name the tokenizer has."""
    ids = {}
    for role, usual in _USUAL_NAMES.items():
      text = configured.get(role)
      if text is not None:
        require(text in self._vocab, "DataConfig.tokenizer", f"its config names {text!r} as the {role} token, "
                "which the tokenizer.json does not have", "pass a tokenizer.json and config from the same tokenizer")
        ids[role] = self._vocab[text]
      elif configured and role != "unk":  # a config that names roles says which it lacks
        ids[role] = None
      else:
        ids[role] = next((self._vocab[n] for n in usual if n in self._vocab), None)
    return ids

  def own_token_id(self, name: str) -> Optional[int]:
    return self._vocab.get(name)

  def token_text(self, token_id: int) -> str:
    return self._tok.id_to_token(int(token_id))

  def encode(self, text: str) -> List[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, skipping special tokens, appended ids and ids past the vocabulary."""
    text_ids = [int(i) for i in ids if 0 <= int(i) < self._base_size and int(i) not in self._not_text]
    return self._tok.decode(text_ids, skip_special_tokens=True)

  def _defining_bytes(self) -> bytes:
    return self._json.encode("utf-8")

  def __repr__(self) -> str:
    return f"TokenizersVocabulary({self.tokenizer_file!r}, extra_ids={self._extra_ids})"
