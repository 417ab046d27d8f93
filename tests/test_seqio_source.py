"""A registered seqio Task as a data source: same tokens as our own path, a TF-free cache, clear errors.

Local data only: the built-in corpus, and C4 replaced by tfds.testing.mock_data.
"""

import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

seqio = pytest.importorskip("seqio")  # the data stack is an optional extra; CI installs it
tfds = pytest.importorskip("tensorflow_datasets")

from conftest import REPO_ROOT, tiny_run  # noqa: E402
from midas_jax import configs, gin_config  # noqa: E402
from midas_jax.data.pipeline import tokenize_documents  # noqa: E402
from midas_jax.data.sources import corpus, seqio_reader, seqio_tasks  # noqa: E402
from midas_jax.data.vocab.vocabulary import ByteVocabulary, SentencePieceVocabulary, train_sentencepiece  # noqa: E402
from midas_jax.errors import ConfigError  # noqa: E402
from midas_jax.train.run import train  # noqa: E402

BYTES = ByteVocabulary(extra_ids=128)


def _config(task, **kw):
  return configs.DataConfig(source="seqio", seqio_task=task, **kw)


def _builtin_task(name):
  return seqio_tasks.register_builtin_task(name, seed=0, vocab=BYTES)


def _assert_same(docs, expected):
  assert len(docs) == len(expected)
  for got, want in zip(docs, expected):
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
  """Two SentencePiece models of the same size trained on different text."""
  tmp = tmp_path_factory.mktemp("spm")
  texts = [d.text for d in corpus.documents("validation")[:300]]
  (tmp / "a.txt").write_text("\n".join(texts), encoding="utf-8")
  (tmp / "b.txt").write_text("\n".join(t[::-1].upper() for t in texts), encoding="utf-8")
  return [train_sentencepiece([str(tmp / f"{n}.txt")], str(tmp / n), vocab_size=400) for n in "ab"]


def test_builtin_task_gives_our_tokenization_in_order(tmp_path):
  _builtin_task("midas_src_builtin")
  config = _config("midas_src_builtin", max_documents=40)
  for split in ("train", "validation"):
    docs = seqio_reader.load_token_documents_from_task(config, split, str(tmp_path))
    texts = [d.text for d in corpus.documents(split)[:40]]
    _assert_same(docs, tokenize_documents(texts, BYTES))
    assert all(d[-1] == BYTES.eos_id for d in docs)


def test_tfds_c4_task_through_mock_data(tmp_path, spm_models):
  vocab = SentencePieceVocabulary(spm_models[0], extra_ids=128)
  config = _config("midas_src_c4_mock", vocab="sentencepiece", spm_model=spm_models[0], max_documents=5)
  with tfds.testing.mock_data(num_examples=8):
    seqio_tasks.register_c4("midas_src_c4_mock", spm_model=spm_models[0], tfds_name="c4/en:3.1.0")
    docs = seqio_reader.load_token_documents_from_task(config, "validation", str(tmp_path))
    raw = tfds.load("c4/en:3.1.0", split="validation", shuffle_files=False)
    texts = [ex["text"].decode("utf-8") for ex in raw.take(5).as_numpy_iterator()]
  assert len(docs) == 5 and all(len(d) > 1 for d in docs)
  _assert_same(docs, tokenize_documents(texts, vocab))


def test_cache_is_reused_without_the_task_or_tensorflow(tmp_path, monkeypatch):
  _builtin_task("midas_src_cached")
  config = _config("midas_src_cached", max_documents=30)
  first = seqio_reader.load_token_documents_from_task(config, "validation", str(tmp_path))
  (folder,) = os.listdir(tmp_path)  # no temporary folder is left behind
  assert folder.startswith("midas_src_cached_validation_30_")
  assert sorted(os.listdir(tmp_path / folder)) == ["meta.json", "offsets.npy", "tokens.npy"]
  assert json.loads((tmp_path / folder / "meta.json").read_text())["documents"] == 30

  seqio.TaskRegistry.remove("midas_src_cached")
  monkeypatch.setattr(seqio_reader, "_read_task", lambda *a: pytest.fail("the TF pipeline ran again"))
  second = seqio_reader.load_token_documents_from_task(config, "validation", str(tmp_path))
  _assert_same(second, first)
  assert isinstance(second[0], np.memmap)

  code = ("import sys\n"
          "from midas_jax.configs import DataConfig\n"
          "from midas_jax.data.sources import seqio_reader\n"
          "c = DataConfig(source='seqio', seqio_task='midas_src_cached', max_documents=30)\n"
          f"docs = seqio_reader.load_token_documents_from_task(c, 'validation', {str(tmp_path)!r})\n"
          "print(len(docs), 'tensorflow' in sys.modules, 'seqio' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       check=True, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
  assert out.stdout.split() == ["30", "False", "False"]


def test_cache_key_separates_vocabularies_and_sizes():
  config = _config("t", max_documents=30)
  base = seqio_reader.cache_path(config, "train", BYTES, "/c")
  assert seqio_reader.cache_path(config, "train", ByteVocabulary(64), "/c") != base
  assert seqio_reader.cache_path(_config("t", max_documents=31), "train", BYTES, "/c") != base
  assert seqio_reader.cache_path(config, "validation", BYTES, "/c") != base
  assert seqio_reader.cache_path(config, "train", ByteVocabulary(128), "/c") == base


def test_unknown_task_names_the_setting_and_lists_tasks(tmp_path):
  _builtin_task("midas_src_known")
  with pytest.raises(ConfigError) as e:
    seqio_reader.load_token_documents_from_task(_config("midas_src_knwon"), "train", str(tmp_path))
  assert e.value.setting == "DataConfig.seqio_task"
  assert "midas_src_known" in e.value.problem and "did you mean midas_src_known" in e.value.fix


def test_vocabulary_mismatches_fail_before_reading(tmp_path, spm_models):
  _builtin_task("midas_src_vocab")
  with pytest.raises(ConfigError) as e:
    seqio_reader.load_token_documents_from_task(_config("midas_src_vocab", extra_ids=64), "train",
                                                str(tmp_path))
  assert e.value.setting == "DataConfig.vocab" and "387 != 323" in e.value.problem

  a, b = spm_models
  seqio_tasks.register_builtin_task("midas_src_spm", vocab=SentencePieceVocabulary(a, extra_ids=8))
  with pytest.raises(ConfigError) as e:  # same size, other pieces
    config = _config("midas_src_spm", vocab="sentencepiece", spm_model=b, extra_ids=8)
    seqio_reader.load_token_documents_from_task(config, "train", str(tmp_path))
  assert e.value.setting == "DataConfig.spm_model" and "probe" in e.value.problem
  assert os.listdir(tmp_path) == []


def test_missing_split_and_missing_task_model(tmp_path):
  _builtin_task("midas_src_split")
  with pytest.raises(ConfigError) as e:
    config = _config("midas_src_split", seqio_eval_split="test")
    seqio_reader.load_token_documents_from_task(config, "validation", str(tmp_path))
  assert e.value.setting == "DataConfig.seqio_eval_split" and "'validation'" in e.value.problem

  seqio_tasks.register_c4("midas_src_c4_nomodel", spm_model=str(tmp_path / "missing.model"))
  with pytest.raises(ConfigError) as e:
    seqio_reader.load_token_documents_from_task(_config("midas_src_c4_nomodel"), "train", str(tmp_path))
  assert e.value.setting == "DataConfig.seqio_task" and "missing.model" in e.value.problem


@pytest.fixture
def clean_gin():
  yield
  gin.clear_config()  # the parsed bindings (and the task's import) are this test's alone


def test_c4_gin_file_registers_the_task_by_import(monkeypatch, spm_models, clean_gin):
  monkeypatch.setenv("MIDAS_C4_SPM_MODEL", spm_models[0])
  monkeypatch.delitem(sys.modules, "midas_jax.data.sources.c4_en", raising=False)
  gin_config.parse(["data/c4_seqio.gin"], [f"DataConfig.spm_model='{spm_models[0]}'"])
  data = gin_config.run_config_from_gin().data
  assert (data.source, data.seqio_task, data.vocab) == ("seqio", "c4_en", "sentencepiece")
  task = seqio.TaskRegistry.get("c4_en")
  assert task.output_features["targets"].vocabulary.vocab_size == (
      SentencePieceVocabulary(spm_models[0], data.extra_ids).vocab_size)
  assert "import midas_jax.data.sources.c4_en" in gin_config.operative_config()


def test_train_three_steps_on_a_seqio_source(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default cache_dir
  _builtin_task("midas_src_train")
  data = _config("midas_src_train", seq_len=32, batch_size=8, max_documents=200)
  trainer = configs.TrainerConfig(num_steps=3, log_every=1, eval_every=0, eval_batches=1,
                                  progress_bar=False, peak_flops_per_device=1e11)
  result = train(tiny_run(data=data, trainer=trainer), str(tmp_path / "run"))
  assert np.isfinite(result.final_loss)
  lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert len(lines) >= 3
  assert len(os.listdir(tmp_path / "xdg" / "midas_jax" / "seqio")) == 2  # train and validation
