"""seqio Tasks over our sources: the examples equal our own tokenization plus EOS; TF stays lazy."""

import json
import pathlib
import subprocess
import sys

import pytest

seqio = pytest.importorskip("seqio")  # the data stack is an optional extra; CI installs it

from midas_jax.data.sources import corpus, seqio_tasks  # noqa: E402
from midas_jax.data.vocab.vocabulary import (ByteVocabulary, SentencePieceVocabulary,  # noqa: E402
                                  train_sentencepiece)
from midas_jax.errors import ConfigError  # noqa: E402


def _targets(task, split, n):
  ds = task.get_dataset(sequence_length=None, split=split, shuffle=False)
  return [ex["targets"].tolist() for ex in ds.take(n).as_numpy_iterator()]


def test_importing_the_data_package_imports_no_tensorflow():
  code = ("import sys\n"
          "import midas_jax.data, midas_jax.data.vocab.vocabulary, midas_jax.data.sources.corpus\n"
          "import midas_jax.data.sources.text_files, midas_jax.data.sources.seqio_tasks\n"
          "print(sorted(m for m in ('seqio', 'tensorflow', 'tensorflow_text') if m in sys.modules))\n")
  repo = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "[]"


def test_builtin_task_yields_our_byte_ids_plus_eos():
  vocab = ByteVocabulary(extra_ids=128)
  task = seqio_tasks.register_builtin_task("midas_builtin_test", seed=0, vocab=vocab)
  assert "midas_builtin_test" in seqio.TaskRegistry.names()
  assert task.output_features["targets"].vocabulary.vocab_size == vocab.vocab_size
  for split, n in (("validation", 20), ("train", 5)):
    texts = [d.text for d in corpus.documents(split)[:n]]
    assert _targets(task, split, n) == [vocab.encode(t) + [vocab.eos_id] for t in texts]


def test_registration_is_idempotent_and_new_arguments_replace():
  first = seqio_tasks.register_builtin_task("midas_builtin_idem", seed=0)
  assert seqio_tasks.register_builtin_task("midas_builtin_idem", seed=0) is first
  assert seqio.get_mixture_or_task("midas_builtin_idem") is first
  other = seqio_tasks.register_builtin_task("midas_builtin_idem", seed=1)
  assert other is not first and seqio.get_mixture_or_task("midas_builtin_idem") is other
  text = corpus.documents("validation", 1)[0].text
  assert _targets(other, "validation", 1) == [ByteVocabulary().encode(text) + [1]]


def test_text_task_with_sentencepiece(tmp_path):
  train_docs = [d.text for d in corpus.documents("validation")[:60]]
  (tmp_path / "train.txt").write_text("\n\n".join(train_docs), encoding="utf-8")
  (tmp_path / "eval.jsonl").write_text(
      "".join(json.dumps({"text": t}) + "\n" for t in ["héllo wörld", "two\nlines"]), encoding="utf-8")
  model = train_sentencepiece([str(tmp_path / "train.txt")], str(tmp_path / "spm"), vocab_size=400,
                              hard_vocab_limit=False)
  vocab = SentencePieceVocabulary(model, extra_ids=8)
  task = seqio_tasks.register_text_task("midas_text_test", [str(tmp_path / "*.txt")],
                                        [str(tmp_path / "eval.jsonl")], vocab=vocab)
  expected = [vocab.encode(t) + [1] for t in ["héllo wörld", "two\nlines"]]
  assert _targets(task, "validation", 5) == expected
  assert _targets(task, "train", 3) == [vocab.encode(t) + [1] for t in train_docs[:3]]


def test_text_task_with_a_wrong_path_fails_at_registration(tmp_path):
  with pytest.raises(ConfigError) as e:
    seqio_tasks.register_text_task("midas_text_bad", [str(tmp_path / "none*.txt")])
  assert e.value.setting == "DataConfig.train_files"
  assert "midas_text_bad" not in seqio.TaskRegistry.names()
