"""The documents of a split, as plain strings, from the source a DataConfig names.

source "builtin": the generated corpus (`corpus.documents(split, config.corpus_seed, ...)`, of
`DataConfig.corpus_documents` training documents).
source "text": the files matched by the glob patterns in `train_files` / `eval_files` (patterns in
their order, each one's matches sorted; `~` is expanded, `**` recurses; a file matched twice is read
once; local paths or gs:// URLs, through midas_jax.fs). Formats, by extension:
  .txt               documents separated by blank lines (empty or whitespace-only lines)
  .jsonl             one JSON object per line, the text in field `DataConfig.jsonl_field`
  .txt.gz, .jsonl.gz the same, gzip-compressed
  .parquet           one document per row, the text in column `DataConfig.jsonl_field` (pyarrow)
Documents that are empty or whitespace only are skipped silently, as are blank .jsonl lines and
null parquet values; .txt documents lose their surrounding whitespace, .jsonl and parquet texts are
kept exactly. Files are read as streams (`iter_file_documents`), which the store's prepare shares.

Validation without eval_files: every HOLDOUT_EVERY-th training document (the 50th, 100th, ...) is
held out for validation, and the train split then excludes exactly those.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import zlib
from typing import IO, Iterator, List, Sequence

from midas_jax import fs
from midas_jax.configs import DataConfig
from midas_jax.data.sources import corpus
from midas_jax.data.sources.splits import SPLITS
from midas_jax.errors import ConfigError, require

HOLDOUT_EVERY = 50
FORMATS = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".parquet")
_PARQUET_BATCH = 1024


def load_documents(config: DataConfig, split: str) -> List[str]:
  """The texts of `split` ("train" or "validation") from the configured source."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
  if config.source == "builtin":
    return [d.text for d in corpus.documents(split, config.corpus_seed, config.corpus_holdout, config.corpus_documents)]
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
    matches = [p for p in fs.glob(fs.check(pattern, setting)) if fs.isfile(p)]
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
    docs.extend(iter_file_documents(path, setting, jsonl_field))
  require(len(docs) > 0, setting, f"the files matched by {list(patterns)} hold no documents",
          "check that the files are not empty (for .jsonl, that DataConfig.jsonl_field names the text)")
  return docs


def iter_file_documents(path: str, setting: str, jsonl_field: str = "text") -> Iterator[str]:
  """The documents of one file, in order, read as a stream."""
  if path.endswith(".parquet"):
    yield from _parquet_documents(path, jsonl_field, setting)
    return
  lines = _lines(path, setting)
  yield from (_jsonl_documents(lines, path, jsonl_field, setting) if path.endswith((".jsonl", ".jsonl.gz"))
              else _txt_documents(lines))


@contextlib.contextmanager
def _binary(path: str, setting: str) -> Iterator[IO[bytes]]:
  try:
    with fs.open_file(path, "rb") as raw:
      yield gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
  except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
    raise ConfigError(setting, f"cannot read {path!r}: {e}",
                      "check that the file is readable (and, for .gz, a complete gzip file)") from e


def _lines(path: str, setting: str) -> Iterator[str]:
  """The file's lines split at "\n" only (str.splitlines would also break at U+2028 and friends
  inside JSON strings), decoded as UTF-8, without the "\n" and a BOM at the start."""
  offset = 0
  with _binary(path, setting) as f:
    for raw in f:
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        where = "byte offset {} of the decompressed data" if path.endswith(".gz") else "byte offset {}"
        raise ConfigError(setting, f"{path!r} is not valid UTF-8 at {where.format(offset + e.start)}",
                          "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)") from e
      yield line.removeprefix("\ufeff") if offset == 0 else line
      offset += len(raw)


def _txt_documents(lines: Iterator[str]) -> Iterator[str]:
  """Documents: runs of lines that are not blank (whitespace only), joined by "\n" and stripped."""
  run: List[str] = []
  for line in lines:
    line = line.removesuffix("\n").removesuffix("\r")  # "\r\n" ends a line too
    if line.strip():
      run.append(line)
    elif run:
      yield "\n".join(run).strip()
      run = []
  if run:
    yield "\n".join(run).strip()


def _jsonl_documents(lines: Iterator[str], path: str, field: str, setting: str) -> Iterator[str]:
  for number, line in enumerate(lines, start=1):
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
      yield value


def _parquet_documents(path: str, column: str, setting: str) -> Iterator[str]:
  try:
    import pyarrow  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError(setting, f"reading {path!r} needs pyarrow ({e})", "pip install 'midas_jax[data]'") from e
  with _binary(path, setting) as f:
    try:
      table = pq.ParquetFile(f)
    except pyarrow.ArrowException as e:
      raise ConfigError(setting, f"{path!r} is not a parquet file ({e})", "check the file") from e
    names = table.schema_arrow.names
    require(column in names, "DataConfig.jsonl_field", f"{path!r} has no column {column!r} (it has {names[:8]})",
            "set DataConfig.jsonl_field to the column that holds the document text")
    kind = table.schema_arrow.field(column).type
    require(pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind), "DataConfig.jsonl_field",
            f"{path!r}: column {column!r} holds {kind}, not strings",
            "set DataConfig.jsonl_field to the column that holds the document text")
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH, columns=[column]):
      for value in batch.column(0).to_pylist():
        if value is not None and value.strip():
          yield value
