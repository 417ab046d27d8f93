"""Weighted mixtures of sources (data/mixture.py): measured fractions against the weights, batches as
a pure function of (config, seed, step) whatever the process split or the order of calls, weights
that switch at a stage boundary, a prepared store's exactly-once epochs kept inside a mixture, the
sources named by `midas data sample`, and per-source eval losses in a real training run."""

import dataclasses
import json
import os
import shutil

import gin
import numpy as np
import pytest

from conftest import tiny_gin
from midas_jax import cli, gin_config
from midas_jax.checkpoint import available_steps, checkpoint_dir
from midas_jax.checkpoint.metadata import config_from_dict, config_to_dict
from midas_jax.configs import DataConfig, RunConfig, StackingConfig
from midas_jax.configs.data import MixtureSource
from midas_jax.data import mixture
from midas_jax.data.factory import load_data
from midas_jax.data.pipeline import tokenize_documents
from midas_jax.data.sources import corpus
from midas_jax.data.store import format as store_format
from midas_jax.data.store import writer
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.ul2.packing import FIELDS
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train

VOCAB = ByteVocabulary(128)
NAMES = ("facts", "notes", "store")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Three sources of three kinds: the built-in corpus, .jsonl text files and a small prepared store
  (written in-process by the writer `midas data prepare` uses)."""
  root = tmp_path_factory.mktemp("mixture")
  train_docs = [d.text for d in corpus.documents("train")]
  for name, docs in (("notes.jsonl", train_docs[:80]), ("notes_eval.jsonl", train_docs[80:100])):
    (root / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
  store = str(root / "store")
  held = [d.text for d in corpus.documents("validation")[:10]]
  writer.write_store(store, {"train": tokenize_documents(train_docs[100:130], VOCAB),
                             "validation": tokenize_documents(held, VOCAB)},
                     VOCAB, store_format.source_description(DataConfig()), documents_per_shard=8)
  entries = ({"name": "facts", "weight": 0.5, "source": "builtin"},
             {"name": "notes", "weight": 0.3, "source": "text", "train_files": [str(root / "notes.jsonl")],
              "eval_files": [str(root / "notes_eval.jsonl")]},
             {"name": "store", "weight": 0.2, "source": "prepared", "prepared_dir": store})
  return {"root": root, "entries": entries, "store": store}


def mixture_data(sources, weights=None, **kw):
  entries = [dict(e, weight=w) for e, w in zip(sources["entries"], weights)] if weights else sources["entries"]
  return DataConfig(**dict(dict(source="mixture", mixture=entries, seq_len=32, batch_size=16), **kw))


@pytest.fixture(scope="module")
def pipeline(sources):
  return load_data(RunConfig(data=mixture_data(sources)))[1]


def test_measured_fractions_are_within_binomial_bounds_of_the_weights(sources):
  """Over 6,400 rows (weights 0.5 / 0.3 / 0.2, and 0.123 / 0.654 / 0.223, whose cycle of 8,000 rows
  is longer than that) each source's share of rows is within 4 binomial sigmas of its weight; the
  allocation is in fact exact to a row or so, and every step holds each share within 2 rows.
  Weights that no cycle of 2**16 rows holds exactly are rounded to within 2**-16."""
  for weights in ((0.5, 0.3, 0.2), (0.123, 0.654, 0.223)):
    data = mixture_data(sources, weights, batch_size=64)
    p = load_data(RunConfig(data=data))[1]
    steps = 100
    names = np.concatenate([p.batch_with_sources(s)[1]["source"] for s in range(steps)])
    n = len(names)
    for name, w in zip(NAMES, weights):
      measured = float(np.mean(names == name))
      print(f"weights {weights}: {name} {measured:.4f} of {n} rows (weight {w})")
      assert abs(measured - w) <= 4 * np.sqrt(w * (1 - w) / n)
      assert abs(measured - w) <= 1 / n + mixture.cycle(weights, 64).size / n  # exact per cycle
      per_step = (names.reshape(steps, 64) == name).sum(axis=1)
      assert np.all(np.abs(per_step - w * 64) <= 2)
  rounded = mixture.cycle((np.pi, np.e, 1.0), 64)
  assert rounded.size == mixture.MAX_CYCLE_ROWS and rounded.counts.sum() == rounded.size
  weights = np.array([np.pi, np.e, 1.0]) / (np.pi + np.e + 1.0)
  assert np.all(np.abs(rounded.counts / rounded.size - weights) <= 1 / rounded.size)


def test_the_kth_row_of_a_source_is_its_own_row_k_across_stages_and_pauses():
  """Stage weights (1, 1, 0), then (0, 1, 3), then (2, 1, 1): each source's rows, in (step, row)
  order, are its own rows 0, 1, 2, ... with none skipped or repeated, a paused source resuming at
  the row after its last."""
  schedule = mixture.RowSchedule([(1, 1, 0), (0, 1, 3), (2, 1, 1)], (0, 7, 13), batch_size=12)
  seen = [[] for _ in range(3)]
  for step in range(30):
    source, local = schedule.assign(step, np.arange(12))
    for i in range(3):
      seen[i].extend(local[source == i].tolist())
    if 7 <= step < 13:
      assert not np.any(source == 0)
  for i in range(3):
    assert seen[i] == list(range(len(seen[i])))
  np.testing.assert_array_equal(schedule.rows_before(30), [len(s) for s in seen])


def test_a_step_is_the_same_built_cold_after_other_steps_or_by_other_processes(sources, pipeline):
  fresh = load_data(RunConfig(data=mixture_data(sources)))[1]
  in_order = [pipeline.batch(s) for s in range(6)]  # a run from step 0
  resumed = fresh.batch(5)                             # a run resumed at step 5, in a new process
  for f in FIELDS:
    np.testing.assert_array_equal(resumed[f], in_order[5][f])
  for count in (2, 4):
    parts = [pipeline.batch_with_sources(5, "train", i, count) for i in range(count)]
    whole = pipeline.batch_with_sources(5)
    for f in FIELDS:
      np.testing.assert_array_equal(np.concatenate([b[f] for b, _ in parts]), whole[0][f])
    np.testing.assert_array_equal(np.concatenate([s["source"] for _, s in parts]), whole[1]["source"])
  other_seed = load_data(RunConfig(data=mixture_data(sources, seed=1)))[1].batch(5)
  assert not np.array_equal(other_seed["targets"], resumed["targets"])


def test_a_source_in_a_mixture_reads_what_it_reads_alone(sources, pipeline):
  """The store source's k-th row in the mixture is row k of the store's own pipeline (with the
  source's seed): the mixture only chooses rows, it builds none of its own."""
  alone = PreparedPipeline(mixture.source_config(pipeline.config, MixtureSource(**sources["entries"][2])), VOCAB)
  got = []
  for step in range(8):
    batch, found = pipeline.batch_with_sources(step)
    got.extend(batch["targets"][found["source"] == "store"])
  b = pipeline.config.batch_size
  for k, row in enumerate(got):
    np.testing.assert_array_equal(row, alone.batch(k // b)["targets"][k % b])


def test_weights_switch_at_the_stage_boundary_step(sources):
  data = mixture_data(sources)
  config = RunConfig(data=data, stacking=StackingConfig(num_stages=2, stage_mixtures=((0, 1, 0), (1, 0, 1))))
  p = load_data(config, stage_starts=(0, 5))[1]
  for step in range(9):
    names = set(p.batch_with_sources(step)[1]["source"].tolist())
    assert names == ({"notes"} if step < 5 else {"facts", "store"}), step
  assert p.progress(9)["corpus_passes/notes"] == pytest.approx(
      5 * 16 * 32 / sum(len(d) for d in p.sources["notes"].documents["train"]))
  validation = set(np.concatenate([p.batch_with_sources(s, "validation")[1]["source"] for s in range(4)]).tolist())
  assert validation == set(NAMES)  # validation uses the sources' own weights throughout
  with pytest.raises(ConfigError, match="stage schedule"):
    load_data(config)
  with pytest.raises(ConfigError, match="StackingConfig.stage_mixtures"):
    load_data(dataclasses.replace(config, stacking=StackingConfig(num_stages=2, stage_mixtures=((1, 0), (0, 1)))),
              stage_starts=(0, 5))


def test_a_store_in_a_mixture_trains_every_token_once_per_epoch(sources, pipeline):
  """The store source's rows of its first epoch, read from `batch_with_sources`, cover each token of
  each of its documents exactly once."""
  alone = pipeline.sources["store"]
  rows_per_epoch, reader = alone.layouts["train"].rows, alone.readers["train"]
  _, _, lengths = reader.pieces(0, reader.tokens)  # every document's length
  covered, taken, step = {}, 0, 0
  while taken < rows_per_epoch:
    _, found = pipeline.batch_with_sources(step)
    for r in np.flatnonzero(found["source"] == "store")[:rows_per_epoch - taken]:
      for doc, start, n in zip(found["document"][r], found["start"][r], found["length"][r]):
        if doc >= 0:
          covered.setdefault(int(doc), []).append((int(start), int(n)))
      taken += 1
    step += 1
  assert sorted(covered) == list(range(len(lengths)))  # every document ...
  for doc, pieces in covered.items():                   # ... as consecutive pieces, whole, none twice
    pieces.sort()
    assert pieces[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    assert pieces[-1][0] + pieces[-1][1] == lengths[doc]
  assert sum(n for p in covered.values() for _, n in p) == alone.readers["train"].tokens


def test_bad_mixtures_are_refused_naming_the_setting(sources):
  entry = sources["entries"][0]
  cases = [(dict(source="mixture"), "DataConfig.mixture"),
           (dict(mixture=[entry]), "DataConfig.mixture"),  # source not 'mixture'
           (dict(source="mixture", mixture=[entry, entry]), "DataConfig.mixture"),  # names repeat
           (dict(source="mixture", mixture=[dict(entry, colour="red")]), "DataConfig.mixture"),
           (dict(source="mixture", mixture=[dict(entry, name="span")]), "MixtureSource.name"),
           (dict(source="mixture", mixture=[dict(entry, weight=-1)]), "MixtureSource.weight"),
           (dict(source="mixture", mixture=[dict(entry, source="prepared")]), "MixtureSource.prepared_dir")]
  for kw, setting in cases:
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
      DataConfig(**kw)
  with pytest.raises(ConfigError, match="StackingConfig.stage_mixtures"):
    StackingConfig(num_stages=2, stage_mixtures=((1, 0),))
  with pytest.raises(ConfigError, match="StackingConfig.stage_mixtures"):
    load_data(RunConfig(stacking=StackingConfig(stage_mixtures=((1, 0),))))
  config = RunConfig(data=mixture_data(sources))
  assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config  # a checkpoint's config


GIN = """
DataConfig.source = 'mixture'
DataConfig.mixture = {mixture}
StackingConfig.num_stages = 2
StackingConfig.stage_steps = [2, 2]
StackingConfig.stage_mixtures = [(1.0, 1.0, 0.0), (1.0, 1.0, 2.0)]
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 1
TrainerConfig.num_steps = 4
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 2
TrainerConfig.eval_batches = 1
CheckpointConfig.every = 2
CheckpointConfig.keep = 10
"""


@pytest.fixture(scope="module")
def gin_file(sources):
  path = sources["root"] / "mixture.gin"
  path.write_text(tiny_gin(GIN.format(mixture=json.dumps(list(sources["entries"])))))
  return str(path)


def test_data_sample_records_each_examples_source(gin_file, tmp_path):
  out = tmp_path / "sample.jsonl"
  assert cli.main(["data", "sample", f"--gin_file={gin_file}", "--steps=3", f"--out={out}"]) == 0
  gin.clear_config()
  records = [json.loads(line) for line in out.read_text().splitlines()]
  by_step = {s: {r["source"] for r in records if r["step"] == s} for s in range(3)}
  assert by_step[0] == by_step[1] == {"facts", "notes"} and by_step[2] == set(NAMES)  # stage 2 from step 2
  assert all(("document" in r) == (r["source"] == "store") for r in records)


def test_a_run_records_eval_loss_per_source_and_resumes_on_the_same_rows(gin_file, tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  gin_config.parse([gin_file], [])
  config = gin_config.run_config_from_gin()
  gin.clear_config()
  run = str(tmp_path / "run")
  train(config, run, devices=jax.devices()[:1])
  evals = {r["step"]: r for r in read_metrics(run, "eval")}
  for step in (2, 4):
    assert all(np.isfinite(evals[step][f"loss/{name}"]) for name in NAMES), evals[step]
  first = {r["step"]: r for r in read_metrics(run, "train")}
  assert first[2]["corpus_passes/facts"] > 0 and first[2]["epoch/store"] == 0  # stage 1 reads no store rows
  assert first[4]["epoch/store"] > 0
  for step in available_steps(run):  # back to the boundary: the resumed run trains stage 2 again
    if step > 2:
      shutil.rmtree(os.path.join(checkpoint_dir(run), str(step)))
  assert train(config, run, devices=jax.devices()[:1]).start_step == 2
  again = {r["step"]: r for r in read_metrics(run, "train")}
  assert [again[s]["loss"] for s in (3, 4)] == [first[s]["loss"] for s in (3, 4)]
  assert again[4]["epoch/store"] == first[4]["epoch/store"]
