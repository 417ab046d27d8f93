"""One evaluation set for every training seed (DataConfig.eval_seed), disjoint evaluation sets from one
held-out split (DataConfig.heldout_shard), and a built-in corpus of any size (DataConfig.corpus_documents):
the settings that let a study score its arms alike (issue #38). Defaults keep today's batches, pinned below."""

import dataclasses
import hashlib

import numpy as np
import pytest

from midas_jax.checkpoint.metadata import config_from_dict, config_to_dict
from midas_jax.configs import DataConfig, RunConfig
from midas_jax.configs.data import MixtureSource
from midas_jax.data import mixture
from midas_jax.data.factory import load_data
from midas_jax.data.pipeline import Pipeline, tokenize_documents
from midas_jax.data.sources import corpus, text_files
from midas_jax.data.store import format as store_format
from midas_jax.data.store import writer
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.ul2.packing import FIELDS
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError

VOCAB = ByteVocabulary()
STEPS = (0, 3, 11)


def digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()[:16]


def batch_digest(batch) -> str:
  return digest(b"".join(np.ascontiguousarray(batch[f]).tobytes() for f in FIELDS))


def same(a, b) -> bool:
  return all(np.array_equal(a[f], b[f]) for f in FIELDS)


@pytest.fixture(scope="module")
def documents():
  """A few hundred built-in documents per split, tokenized (the default corpus)."""
  return {"train": tokenize_documents([d.text for d in corpus.documents("train")[:300]], VOCAB),
          "validation": tokenize_documents([d.text for d in corpus.documents("validation")[:200]], VOCAB)}


def pipeline(documents, **kw):
  return Pipeline(DataConfig(**dict(dict(seq_len=64, batch_size=4), **kw)), documents, VOCAB.vocab_size, VOCAB)


# ----------------------------------------------------------------------------- eval_seed

def test_defaults_give_todays_batches_and_corpus(documents):
  """Digests taken with the code before these settings existed (same documents, seq_len 64, batch 4)."""
  today = {0: ("95d51a1ccdea91f2", "c8798d007c196095", "5828e851eaf449f6", "52f927cfd4216c59"),
           1: ("d3bd74b9b4b7f1ad", "bc8b4bb00c614d56", "be333c572e81c0e8", "20f1f4ce6965b032")}
  for seed, want in today.items():
    p = pipeline(documents, seed=seed)
    got = tuple(batch_digest(p.batch(step, split)) for split in ("train", "validation") for step in (0, 5))
    assert got == want, seed
  assert digest("\n\n".join(d.text for d in corpus.documents("train")).encode()) == "05fe014dd931c256"
  assert digest("\n\n".join(d.text for d in corpus.documents("validation")).encode()) == "0b305eb3359574c3"


def test_a_fixed_eval_seed_scores_every_training_seed_on_the_same_batches(documents):
  """Training seeds 0 and 1 with eval_seed 7: byte-identical validation batches at every step,
  different training batches; and the training batches are those of the seed alone (eval_seed moves
  only the held-out stream)."""
  a, b = pipeline(documents, seed=0, eval_seed=7), pipeline(documents, seed=1, eval_seed=7)
  alone = {seed: pipeline(documents, seed=seed) for seed in (0, 1)}
  for step in STEPS:
    assert same(a.batch(step, "validation"), b.batch(step, "validation"))
    assert not same(a.batch(step, "train"), b.batch(step, "train"))
    assert same(a.batch(step, "train"), alone[0].batch(step, "train"))
    assert same(b.batch(step, "train"), alone[1].batch(step, "train"))
    assert not same(a.batch(step, "validation"), alone[0].batch(step, "validation"))  # 7 is not 0


def test_eval_seed_none_is_the_training_seed(documents):
  """None keeps today's behaviour: seed 0's held-out batches are eval_seed 0's, and seeds 0 and 1 differ."""
  none = {seed: pipeline(documents, seed=seed) for seed in (0, 1)}
  same_seed = pipeline(documents, seed=1, eval_seed=1)
  for step in STEPS:
    for split in ("train", "validation"):
      assert same(none[1].batch(step, split), same_seed.batch(step, split))
    assert not same(none[0].batch(step, "validation"), none[1].batch(step, "validation"))
  assert DataConfig(seed=3).split_seed("validation") == 3
  assert DataConfig(seed=3, eval_seed=5).split_seed("validation") == 5
  assert DataConfig(seed=3, eval_seed=5).split_seed("train") == 3


def test_eval_seed_is_checked_and_saved():
  for bad in (-1, 1.5, "0"):
    with pytest.raises(ConfigError, match="DataConfig.eval_seed"):
      DataConfig(eval_seed=bad)
  run = RunConfig(data=DataConfig(eval_seed=4, heldout_shard=(1, 3), corpus_documents=500))
  assert config_from_dict(config_to_dict(run)).data == run.data


@pytest.fixture(scope="module")
def store(tmp_path_factory, documents):
  path = str(tmp_path_factory.mktemp("store"))
  writer.write_store(path, {"train": documents["train"][:120], "validation": documents["validation"][:60]},
                     VOCAB, store_format.source_description(DataConfig()), documents_per_shard=32)
  return path


def _eval_seed_fixes_validation_only(make, eval_seed):
  """Pipelines from make(seed=..., eval_seed=...): two training seeds with one eval seed share their validation
  batches and not their training ones; the eval seed leaves training rows alone; eval_seed == seed is None."""
  a, b, none = make(seed=0, eval_seed=eval_seed), make(seed=1, eval_seed=eval_seed), make(seed=0)
  for step in STEPS:
    assert same(a.batch(step, "validation"), b.batch(step, "validation"))
    assert not same(a.batch(step, "train"), b.batch(step, "train"))
    assert same(a.batch(step, "train"), none.batch(step, "train"))
  assert not all(same(a.batch(s, "validation"), none.batch(s, "validation")) for s in STEPS)
  assert all(same(none.batch(s, "validation"), make(seed=0, eval_seed=0).batch(s, "validation")) for s in STEPS)


def test_a_prepared_store_keeps_its_held_out_rows_under_a_fixed_eval_seed(store):
  """The store's layout and draws of the held-out split follow eval_seed; its training rows follow seed."""
  def prepared(**kw):
    return PreparedPipeline(DataConfig(**dict(dict(source="prepared", prepared_dir=store, seq_len=64,
                                                   batch_size=4), **kw)), VOCAB)
  _eval_seed_fixes_validation_only(prepared, 9)


def test_a_mixture_derives_each_sources_eval_seed_from_the_runs(documents, tmp_path):
  """Every source's held-out seed comes from DataConfig.eval_seed (as its seed from seed), so two
  training seeds of a mixture see the same validation batches and different training batches."""
  notes = tmp_path / "notes.txt"
  notes.write_text("\n\n".join(d.text for d in corpus.documents("validation")[200:400]), encoding="utf-8")
  entries = (MixtureSource("facts", 0.6, "builtin"), MixtureSource("notes", 0.4, "text", train_files=(str(notes),)))

  def mixed(**kw):
    data = DataConfig(**dict(dict(source="mixture", mixture=entries, seq_len=64, batch_size=8), **kw))
    sources = {}
    for entry in entries:
      config = mixture.source_config(data, entry)
      docs = (documents if entry.source == "builtin" else
              {s: tokenize_documents(text_files.load_documents(config, s), VOCAB) for s in ("train", "validation")})
      sources[entry.name] = Pipeline(config, docs, VOCAB.vocab_size, VOCAB)
    return mixture.MixturePipeline(data, sources)

  data = DataConfig(source="mixture", mixture=entries, seed=2, eval_seed=5)
  assert mixture.source_config(data, entries[0]).eval_seed == mixture.source_seed(5, "facts")
  assert mixture.source_config(dataclasses.replace(data, eval_seed=None), entries[0]).eval_seed is None
  _eval_seed_fixes_validation_only(mixed, 5)


# ----------------------------------------------------------------------------- heldout_shard

LETTERS = "ABCDEFGHIJK"  # held-out document k is letter k repeated: any window of it names it


@pytest.fixture(scope="module")
def letter_files(tmp_path_factory):
  root = tmp_path_factory.mktemp("letters")
  (root / "train.txt").write_text("\n\n".join(f"train text {i} " * 3 for i in range(60)), encoding="utf-8")
  (root / "eval.txt").write_text("\n\n".join(c * (5 + 2 * k) for k, c in enumerate(LETTERS)), encoding="utf-8")
  return {"train_files": (str(root / "train.txt"),), "eval_files": (str(root / "eval.txt"),)}


def letter_run(letter_files, **kw):
  return load_data(RunConfig(data=DataConfig(source="text", seq_len=64, batch_size=4, **letter_files, **kw)))[1]


def letters_read(p, split="validation", steps=range(12)):
  """The held-out documents that the batches of `steps` read, by their letters."""
  tokens = np.concatenate([p.batch(step, split)["targets"].ravel() for step in steps])
  return {c for c in LETTERS if (tokens == VOCAB.encode(c)[0]).any()}


def test_held_out_shards_are_disjoint_and_cover_the_split(letter_files):
  """Shards (0, 2) and (1, 2) read held-out documents 0, 2, 4, ... and 1, 3, 5, ... (each of them,
  none of the other's); the training rows are the unsharded run's."""
  whole = letter_run(letter_files)
  shards = [letter_run(letter_files, heldout_shard=(i, 2)) for i in range(2)]
  assert letters_read(whole) == set(LETTERS)
  assert letters_read(shards[0]) == set(LETTERS[0::2])
  assert letters_read(shards[1]) == set(LETTERS[1::2])
  for step in STEPS:
    assert same(shards[1].batch(step, "train"), whole.batch(step, "train"))
  assert [len(d) for d in whole.documents["validation"]] == [len(d) for d in shards[1].documents["validation"]]
  third = letter_run(letter_files, heldout_shard=(2, 3))
  assert letters_read(third) == set(LETTERS[2::3])
  assert letters_read(letter_run(letter_files, heldout_shard=(0, 1))) == set(LETTERS)


def test_a_mixtures_sources_are_sharded_alike(letter_files):
  entry = MixtureSource("letters", 1.0, "text", **letter_files)
  run = RunConfig(data=DataConfig(source="mixture", mixture=(entry,), seq_len=64, batch_size=4, heldout_shard=(1, 2)))
  assert letters_read(load_data(run)[1]) == set(LETTERS[1::2])


def test_bad_shards_are_refused_naming_the_setting(letter_files, store):
  for bad in ((2, 2), (-1, 2), (0, 0), (1,), (0, 1, 2), (0.5, 2), "ab"):
    with pytest.raises(ConfigError, match="DataConfig.heldout_shard"):
      DataConfig(heldout_shard=bad)
  assert DataConfig(heldout_shard=[1, 2]).heldout_shard == (1, 2)  # gin and JSON lists
  assert DataConfig(heldout_shard=(np.int64(0), 2)).heldout_shard == (0, 2)
  with pytest.raises(ConfigError, match="DataConfig.heldout_shard.*11 held-out documents is empty"):
    letter_run(letter_files, heldout_shard=(11, 12))
  with pytest.raises(ConfigError, match="DataConfig.heldout_shard.*prepared"):
    DataConfig(source="prepared", prepared_dir=store, heldout_shard=(0, 2))
  with pytest.raises(ConfigError, match="DataConfig.heldout_shard.*'kept' is 'prepared'"):
    DataConfig(source="mixture", mixture=(MixtureSource("kept", source="prepared", prepared_dir=store),),
               heldout_shard=(0, 2))


# ----------------------------------------------------------------------------- corpus_documents

def test_the_default_corpus_size_is_todays_corpus():
  assert DataConfig().corpus_documents == corpus.SIZES["train"] == 20_000
  for split in ("train", "validation"):
    assert corpus.documents(split, 0, "none", 20_000) == corpus.documents(split)
  assert text_files.load_documents(DataConfig(corpus_documents=20_000), "validation") == \
      [d.text for d in corpus.documents("validation")]
  assert store_format.source_description(DataConfig(corpus_documents=20_000)) == \
      store_format.source_description(DataConfig())


def test_a_larger_corpus_is_deterministic_and_holds_the_smaller_one():
  """40,000 training documents: that many, each kind at its share, the same on a second generation
  (cache cleared), a superset of the default's, all distinct; validation keeps 1,000, none in train."""
  size = 40_000
  first = corpus.documents("train", 0, "none", size)
  corpus._documents.cache_clear()  # pylint: disable=protected-access
  again = corpus.documents("train", 0, "none", size)
  assert first == again
  assert len(first) == size and len({d.text for d in first}) == size
  kinds = {}
  for d in first:
    kinds[d.kind] = kinds.get(d.kind, 0) + 1
  assert kinds == corpus.kind_counts("train", size) == {k: int(share * size) for k, share in corpus.KIND_SHARES}
  texts = {d.text for d in first}
  assert {d.text for d in corpus.documents("train")} <= texts
  validation = corpus.documents("validation", 0, "none", size)
  assert len(validation) == 1_000 and not texts & {d.text for d in validation}


def test_corpus_documents_reaches_every_reader_of_the_builtin_corpus():
  """The in-memory source, a mixture's builtin source and a store's description all see the size."""
  data = DataConfig(corpus_documents=300)
  assert len(text_files.load_documents(data, "train")) == 300
  assert text_files.load_documents(data, "train") == [d.text for d in corpus.documents("train", 0, "none", 300)]
  assert len(text_files.load_documents(data, "validation")) == 1_000
  mixed = DataConfig(source="mixture", mixture=(MixtureSource("c", source="builtin"),), corpus_documents=300)
  assert len(text_files.load_documents(mixture.source_config(mixed, mixed.mixture[0]), "train")) == 300
  assert store_format.source_description(data)["corpus_documents"] == 300
  for bad in (99, 10 ** 9, 2.5):
    with pytest.raises(ConfigError, match="DataConfig.corpus_documents"):
      DataConfig(corpus_documents=bad)
