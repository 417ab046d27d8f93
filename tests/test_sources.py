"""Document sources: the built-in corpus, text formats, the validation fallback, and every error."""

import gzip
import json

import pytest

from midas_jax.configs import DataConfig
from midas_jax.data.sources import corpus
from midas_jax.data.sources.text_files import HOLDOUT_EVERY, load_documents
from midas_jax.errors import ConfigError


def _text_config(tmp_path, train, eval_=(), **kwargs):
  return DataConfig(source="text", train_files=tuple(str(tmp_path / p) for p in train),
                    eval_files=tuple(str(tmp_path / p) for p in eval_), **kwargs)


def _jsonl(records):
  return "\n".join(json.dumps(r) for r in records) + "\n"


def test_builtin_source_is_the_corpus():
  for split in corpus.SPLITS:
    assert load_documents(DataConfig(), split) == [d.text for d in corpus.documents(split)]
  assert load_documents(DataConfig(corpus_seed=3), "validation") == [
      d.text for d in corpus.documents("validation", 3)]


def test_unknown_split():
  with pytest.raises(ValueError, match="unknown split"):
    load_documents(DataConfig(), "test")


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
  (tmp_path / "a.txt").write_text(
      "\ufefffirst doc\nsecond line\n\n\n  \nsecond doc  \r\n\r\nthird\n \t \n\n", encoding="utf-8")
  config = _text_config(tmp_path, ["a.txt"], ["a.txt"])
  assert load_documents(config, "train") == ["first doc\nsecond line", "second doc", "third"]


def test_jsonl_documents(tmp_path):
  (tmp_path / "a.jsonl").write_text(
      _jsonl([{"text": "one", "id": 1}, {"text": "  "}, {"text": "two\u2028still two"}]) + "\n\n" +
      _jsonl([{"text": " three "}]), encoding="utf-8")
  (tmp_path / "b.jsonl").write_text(_jsonl([{"body": "x"}]), encoding="utf-8")
  config = _text_config(tmp_path, ["a.jsonl"], ["b.jsonl"], jsonl_field="text")
  assert load_documents(config, "train") == ["one", "two\u2028still two", " three "]
  other_field = _text_config(tmp_path, ["b.jsonl"], ["b.jsonl"], jsonl_field="body")
  assert load_documents(other_field, "validation") == ["x"]


def test_gzip_of_both_formats(tmp_path):
  with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
    f.write("héllo\n\nwörld\n")
  with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
    f.write(_jsonl([{"text": "日本"}]))
  config = _text_config(tmp_path, ["a.txt.gz", "b.jsonl.gz"], ["b.jsonl.gz"])
  assert load_documents(config, "train") == ["héllo", "wörld", "日本"]


def test_globs_are_sorted_ordered_and_deduplicated(tmp_path):
  (tmp_path / "sub").mkdir()
  for name, text in [("b.txt", "B"), ("a.txt", "A"), ("sub/c.txt", "C"), ("z.txt", "Z")]:
    (tmp_path / name).write_text(text, encoding="utf-8")
  config = _text_config(tmp_path, ["z.txt", "*.txt", "**/c.txt"], ["z.txt"])
  assert load_documents(config, "train") == ["Z", "A", "B", "C"]


def test_validation_falls_back_to_every_50th_training_document(tmp_path):
  docs = [f"doc {i}" for i in range(120)]
  (tmp_path / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")
  config = _text_config(tmp_path, ["a.txt"])
  train, validation = load_documents(config, "train"), load_documents(config, "validation")
  assert validation == [docs[HOLDOUT_EVERY - 1], docs[2 * HOLDOUT_EVERY - 1]] == ["doc 49", "doc 99"]
  assert len(train) == 118 and not set(train) & set(validation)
  assert sorted(train + validation, key=lambda d: int(d.split()[1])) == docs
  # With eval files, training keeps every document.
  (tmp_path / "v.txt").write_text("held", encoding="utf-8")
  with_eval = _text_config(tmp_path, ["a.txt"], ["v.txt"])
  assert load_documents(with_eval, "train") == docs
  assert load_documents(with_eval, "validation") == ["held"]


def test_builtin_corpus_round_trips_through_text_files(tmp_path):
  paths = corpus.write_text_files(str(tmp_path))
  config = DataConfig(source="text", train_files=(paths["train"],), eval_files=(paths["validation"],))
  for split in corpus.SPLITS:
    assert load_documents(config, split) == [d.text for d in corpus.documents(split)]


# ---------------------------------------------------------------------------------------------
# Errors: each names the setting and says how to fix it.

def _error(config, split="train"):
  with pytest.raises(ConfigError) as e:
    load_documents(config, split)
  assert e.value.fix
  return e.value


def test_pattern_without_match(tmp_path):
  (tmp_path / "a.txt").write_text("x", encoding="utf-8")
  e = _error(_text_config(tmp_path, ["nope/*.txt"]))
  assert e.setting == "DataConfig.train_files" and "nope/*.txt" in e.problem
  e = _error(_text_config(tmp_path, ["a.txt"], ["missing.txt"]), "validation")
  assert e.setting == "DataConfig.eval_files" and "missing.txt" in e.problem


def test_unknown_extension(tmp_path):
  (tmp_path / "a.csv").write_text("x", encoding="utf-8")
  (tmp_path / "b.txt").write_text("x", encoding="utf-8")
  e = _error(_text_config(tmp_path, ["*"]))
  assert e.setting == "DataConfig.train_files" and "a.csv" in e.problem and ".jsonl" in e.fix


@pytest.mark.parametrize("name", ["bad.txt", "bad.txt.gz"])
def test_invalid_utf8_names_file_and_offset(tmp_path, name):
  good = "ok ok\n\nlatin1: ".encode()
  data = good + "é".encode("latin-1") + b"\n"
  (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
  e = _error(_text_config(tmp_path, [name]))
  assert e.setting == "DataConfig.train_files" and name in e.problem
  assert f"byte offset {len(good)}" in e.problem and "UTF-8" in e.fix


def test_corrupt_gzip(tmp_path):
  (tmp_path / "a.txt.gz").write_bytes(b"this is not gzip")
  e = _error(_text_config(tmp_path, ["a.txt.gz"]))
  assert e.setting == "DataConfig.train_files" and "a.txt.gz" in e.problem


def test_jsonl_line_that_is_not_json(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": oops}\n', encoding="utf-8")
  e = _error(_text_config(tmp_path, ["a.jsonl"]))
  assert e.setting == "DataConfig.train_files" and "line 3" in e.problem and "a.jsonl" in e.problem


@pytest.mark.parametrize("line, words", [('{"body": "x"}', "'body'"), ('["x"]', "no JSON object"),
                                         ('{"text": 3}', "int")])
def test_jsonl_line_without_a_text_field(tmp_path, line, words):
  (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
  e = _error(_text_config(tmp_path, ["a.jsonl"], ["a.jsonl"]), "validation")
  assert e.setting == "DataConfig.jsonl_field" and "line 2" in e.problem and words in e.problem


def test_no_documents_at_all(tmp_path):
  (tmp_path / "a.txt").write_text("\n  \n\n", encoding="utf-8")
  (tmp_path / "b.jsonl").write_text(_jsonl([{"text": ""}]), encoding="utf-8")
  e = _error(_text_config(tmp_path, ["a.txt", "b.jsonl"]))
  assert e.setting == "DataConfig.train_files" and "no documents" in e.problem


def test_too_few_documents_to_hold_out(tmp_path):
  (tmp_path / "a.txt").write_text("one\n\ntwo", encoding="utf-8")
  config = _text_config(tmp_path, ["a.txt"])
  assert load_documents(config, "train") == ["one", "two"]
  e = _error(config, "validation")
  assert e.setting == "DataConfig.eval_files" and str(HOLDOUT_EVERY) in e.fix
