"""The documents of a split, as plain strings, from the source a DataConfig names.

source "builtin": the generated corpus (`corpus.documents(split, config.corpus_seed)`).
source "text": the files matched by the glob patterns in `train_files` / `eval_files` (patterns in
their order, each one's matches sorted; `~` is expanded, `**` recurses; a file matched twice is read
once). Formats, by extension:
  .txt               documents separated by blank lines (empty or whitespace-only lines)
  .jsonl             one JSON object per line, the text in field `DataConfig.jsonl_field`
  .txt.gz, .jsonl.gz the same, gzip-compressed
Documents that are empty or whitespace only are skipped silently, as are blank .jsonl lines; .txt
documents lose their surrounding whitespace, .jsonl texts are kept exactly. Files are read whole.

Validation without eval_files: every HOLDOUT_EVERY-th training document (the 50th, 100th, ...) is
held out for validation, and the train split then excludes exactly those.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import zlib
from typing import List, Sequence

from midas_jax.configs import DataConfig
from midas_jax.data import corpus
from midas_jax.errors import ConfigError, require

HOLDOUT_EVERY = 50
FORMATS = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
_BLANK_LINES = re.compile(r"\n\s*\n")


def load_documents(config: DataConfig, split: str) -> List[str]:
  """The texts of `split` ("train" or "validation") from the configured source."""
  if split not in corpus.SPLITS:
    raise ValueError(f"unknown split {split!r}; use one of {corpus.SPLITS}")
  if config.source == "builtin":
    return [d.text for d in corpus.documents(split, config.corpus_seed)]
  if split == "validation" and config.eval_files:
    return read_documents(config.eval_files, "DataConfig.eval_files", config.jsonl_field)
  docs = read_documents(config.train_files, "DataConfig.train_files", config.jsonl_field)
  if config.eval_files:
    return docs
  held_out = [(i + 1) % HOLDOUT_EVERY == 0 for i in range(len(docs))]
  if split == "train":
    return [d for d, held in zip(docs, held_out) if not held]
  validation = [d for d, held in zip(docs, held_out) if held]
  require(len(validation) > 0, "DataConfig.eval_files",
          f"it is empty, and the {len(docs)} training documents are too few to hold out every "
          f"{HOLDOUT_EVERY}th for validation",
          f"set DataConfig.eval_files to validation files, or give >= {HOLDOUT_EVERY} training documents")
  return validation


def resolve_files(patterns: Sequence[str], setting: str) -> List[str]:
  """The files the glob `patterns` match, checked to exist and to have a known format."""
  if isinstance(patterns, str):  # one pattern given bare, e.g. from a gin string
    patterns = (patterns,)
  files: List[str] = []
  for pattern in patterns:
    matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                     if os.path.isfile(p))
    require(len(matches) > 0, setting, f"pattern {pattern!r} matches no file (from {os.getcwd()})",
            "fix the path or glob; relative patterns are resolved from the current directory")
    for path in matches:
      require(path.endswith(FORMATS), setting, f"{path!r} has an unknown format",
              f"use files ending in one of {FORMATS}, or narrow the pattern to exclude it")
      if path not in files:
        files.append(path)
  return files


def read_documents(patterns: Sequence[str], setting: str, jsonl_field: str = "text") -> List[str]:
  """All documents of the files `patterns` match, in file order; `setting` names them in errors."""
  docs: List[str] = []
  for path in resolve_files(patterns, setting):
    text = _read_text(path, setting)
    if path.endswith((".jsonl", ".jsonl.gz")):
      docs.extend(_jsonl_documents(text, path, jsonl_field, setting))
    else:
      docs.extend(_txt_documents(text))
  require(len(docs) > 0, setting, f"the files matched by {list(patterns)} hold no documents",
          "check that the files are not empty (for .jsonl, that DataConfig.jsonl_field names the text)")
  return docs


def _read_text(path: str, setting: str) -> str:
  is_gzip = path.endswith(".gz")
  try:
    with (gzip.open(path, "rb") if is_gzip else open(path, "rb")) as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
    raise ConfigError(setting, f"cannot read {path!r}: {e}",
                      "check that the file is readable (and, for .gz, a complete gzip file)") from e
  try:
    return data.decode("utf-8").removeprefix("\ufeff")
  except UnicodeDecodeError as e:
    where = "byte offset {} of the decompressed data" if is_gzip else "byte offset {}"
    raise ConfigError(setting, f"{path!r} is not valid UTF-8 at {where.format(e.start)}",
                      "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)") from e


def _txt_documents(text: str) -> List[str]:
  text = text.replace("\r\n", "\n")
  return [d.strip() for d in _BLANK_LINES.split(text) if d.strip()]


def _jsonl_documents(text: str, path: str, field: str, setting: str) -> List[str]:
  docs = []
  # Split on "\n" only: str.splitlines would also break at U+2028 and friends inside JSON strings.
  for number, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(setting, f"{path!r} line {number} is not JSON ({e.msg})",
                        "fix or remove that line: a .jsonl file holds one JSON object per line") from e
    if not isinstance(record, dict) or field not in record:
      is_object = isinstance(record, dict)
      has = f"its fields are {sorted(record)[:8]}" if is_object else "it is no JSON object"
      raise ConfigError("DataConfig.jsonl_field",
                        f"{path!r} line {number} has no field {field!r} ({has})",
                        "set DataConfig.jsonl_field to the field that holds the document text")
    value = record[field]
    require(isinstance(value, str), "DataConfig.jsonl_field",
            f"{path!r} line {number}: field {field!r} is a {type(value).__name__}, not a string",
            "set DataConfig.jsonl_field to the field that holds the document text")
    if value.strip():
      docs.append(value)
  return docs
