"""The prepared store read by step: every document once per epoch, stateless rows, checked input.

Stores here are written by the store's own in-process writer (the Beam pipeline's twin, tested in
test_store_prepare.py) from the built-in corpus.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

from midas_jax.configs import DataConfig, ObjectivesConfig
from midas_jax.data.pipeline import tokenize_documents
from midas_jax.data.sources import text_files
from midas_jax.data.store import format as store_format
from midas_jax.data.store import permutation, writer
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.ul2 import streams
from midas_jax.data.ul2.packing import FIELDS, packing_efficiency
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError
from test_pipeline import UL2_FULL, examples_of, undo_span_corruption

VOCAB = ByteVocabulary(128)
SPLITS = ("train", "validation")


@pytest.fixture(scope="module")
def documents():
  """A few hundred built-in documents per split (some longer than a 64-token row)."""
  return {s: tokenize_documents(text_files.load_documents(DataConfig(), s), VOCAB)[:n]
          for s, n in (("train", 700), ("validation", 120))}


@pytest.fixture(scope="module")
def store(tmp_path_factory, documents):
  """The documents in shards of 128, so that windows cross shard and coarse-index boundaries."""
  path = str(tmp_path_factory.mktemp("store"))
  writer.write_store(path, documents, VOCAB, store_format.source_description(DataConfig()), documents_per_shard=128)
  return path


SPAN_ONLY = ObjectivesConfig(causal_rate=0.0, prefix_rate=0.0, span_rate=1.0)


def store_config(store, **kw):
  base = dict(source="prepared", prepared_dir=store, seq_len=64, batch_size=32)
  base.update(kw)
  return DataConfig(**base)


def global_tokens(docs):
  """Where each document starts in the split's token stream, and the stream."""
  lengths = np.array([len(d) for d in docs])
  return lengths.cumsum() - lengths, np.concatenate(docs)


def epoch_examples(pipeline, epoch, split="train"):
  """(row, objective, tokens, prefix_len, document, start, length) of every example of the rows of
  one epoch, in row order."""
  b, rows = pipeline.config.batch_size, pipeline.layouts[split].rows
  out = []
  for step in range(epoch * rows // b, -(-(epoch + 1) * rows // b)):
    batch, src = pipeline.batch_with_sources(step, split)
    for r, (obj, tokens, prefix_len) in zip(_example_rows(batch), examples_of(batch)):
      g = step * b + r[0]
      if epoch * rows <= g < (epoch + 1) * rows:
        k = r[1]
        out.append((g, obj, tokens, prefix_len, src["document"][r[0], k], src["start"][r[0], k],
                    src["length"][r[0], k]))
  return out


def _example_rows(batch):
  for r in range(batch["segment_ids"].shape[0]):
    for s in range(int(batch["segment_ids"][r].max())):
      yield r, s


def raw_tokens(obj, tokens, prefix_len, special, mode_tokens):
  """The document tokens an example was made of (mode token dropped, span corruption undone)."""
  modes = set(special.mode_ids.values())
  if mode_tokens and len(tokens) and int(tokens[0]) in modes:
    tokens, prefix_len = tokens[1:], prefix_len - 1
  if obj == 2:
    return undo_span_corruption(tokens[:prefix_len], tokens[prefix_len:], set(special.sentinel_ids))
  return tokens


# --- the permutation ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_that_the_key_changes(n):
  a = permutation.permute(np.arange(n), n, permutation.round_keys(streams.split_key(0, 3)))
  b = permutation.permute(np.arange(n), n, permutation.round_keys(streams.split_key(1, 3)))
  assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(n))
  if n >= 64:
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(n))
    assert abs(np.corrcoef(a, np.arange(n))[0, 1]) < 0.2  # no trace of the identity order
  with pytest.raises(ValueError):
    permutation.permute([n], n, permutation.round_keys(streams.split_key(0, 3)))


# --- the store on disk ----------------------------------------------------------------------------

def test_the_store_holds_the_documents_in_order(store, documents):
  pipeline = PreparedPipeline(store_config(store), VOCAB)
  for split in reversed(SPLITS):
    reader = pipeline.readers[split]
    starts, stream = global_tokens(documents[split])
    assert (reader.documents, reader.tokens) == (len(documents[split]), len(stream))
    np.testing.assert_array_equal(reader.read_tokens(0, reader.tokens), stream)
    last = len(documents[split]) - 1
    for d in {0, min(127, last), min(128, last), min(300, last), last}:  # shard edges included
      a, n = int(starts[d]), len(documents[split][d])
      doc, first, size = reader.pieces(a, a + n)
      assert (doc.tolist(), first.tolist(), size.tolist()) == ([d], [0], [n])
  doc, first, size = pipeline.readers["train"].pieces(int(starts[5]) + 3, int(starts[200]) + 1)  # across shards
  assert doc.tolist() == list(range(5, 201)) and first[0] == 3 and size[-1] == 1
  manifest = json.loads(open(os.path.join(store, "manifest.json")).read())
  assert manifest["vocabulary"]["fingerprint"] == VOCAB.fingerprint and manifest["dtype"] == "<u2"
  assert len(manifest["splits"]["train"]["shards"]) == 6


# --- epochs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode_tokens", [False, True])
def test_an_epoch_trains_on_every_token_once_and_the_next_one_in_another_order(store, documents, mode_tokens):
  config = store_config(store)
  pipeline = PreparedPipeline(config, VOCAB, mix=ObjectivesConfig(span_denoisers=UL2_FULL, mode_tokens=mode_tokens))
  starts, stream = global_tokens(documents["train"])
  orders = []
  for epoch in (0, 1):
    covered = np.zeros(len(stream), np.int64)
    examples = epoch_examples(pipeline, epoch)
    for _, obj, tokens, prefix_len, doc, start, length in examples:
      raw = raw_tokens(obj, tokens, prefix_len, pipeline.special, mode_tokens)
      first = starts[doc] + start
      np.testing.assert_array_equal(raw, stream[first:first + length])  # the example is that range
      covered[first:first + length] += 1
    assert covered.min() == covered.max() == 1  # every token once, none twice, none dropped
    assert {obj for _, obj, *_ in examples} == {0, 1, 2}
    orders.append([(doc, start) for _, _, _, _, doc, start, _ in examples])
  assert orders[0] != orders[1] and sorted(orders[0]) != sorted(orders[1])  # other order, other cuts


def test_long_documents_become_consecutive_pieces(store, documents):
  pipeline = PreparedPipeline(store_config(store), VOCAB, mix=SPAN_ONLY)
  long = [d for d, doc in enumerate(documents["train"]) if len(doc) > 3 * 64]
  assert long
  pieces = {d: [] for d in long}
  for _, _, _, _, doc, start, length in epoch_examples(pipeline, 0):
    if doc in pieces:
      pieces[doc].append((start, length))
  for d in long:
    ends = sorted(pieces[d])
    assert ends[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ends, ends[1:]))
    assert ends[-1][0] + ends[-1][1] == len(documents["train"][d])


def test_rows_are_dense_and_follow_the_mixture(store):
  pipeline = PreparedPipeline(store_config(store, seq_len=128), VOCAB)
  batches = [pipeline.batch(s) for s in range(12)]
  assert np.mean([packing_efficiency(b) for b in batches]) > 0.97
  assert pipeline.counts["demoted_tokens"] <= 0.01 * pipeline.counts["tokens"]
  row_objective = np.concatenate([b["objective_ids"][:, 0] for b in batches])  # one objective per row
  np.testing.assert_allclose(np.bincount(row_objective, minlength=3) / len(row_objective), [0.6, 0.2, 0.2],
                             atol=0.08)
  assert pipeline.progress(10) == {"epoch": pytest.approx(10 * 32 / pipeline.layouts["train"].rows)}


def test_rows_that_run_out_of_room_make_their_last_examples_causal(tmp_path):
  """Long documents, then a run of 2-token ones: windows there hold far more document boundaries
  (each a span example of 4 slots) than the window size planned for."""
  rng = np.random.default_rng(0)
  docs = [np.append(rng.integers(3, 259, 299), 1).astype(np.int32) for _ in range(60)]
  docs += [np.asarray([rng.integers(3, 259), 1], np.int32) for _ in range(300)]
  writer.write_store(str(tmp_path), {"train": docs, "validation": docs[:5]}, VOCAB,
                     store_format.source_description(DataConfig()))
  config = store_config(str(tmp_path))
  pipeline = PreparedPipeline(config, VOCAB, mix=dataclasses.replace(SPAN_ONLY, mode_tokens=True))
  starts, stream = global_tokens(docs)
  covered = np.zeros(len(stream), np.int64)
  for _, obj, tokens, prefix_len, doc, start, length in epoch_examples(pipeline, 0):
    raw = raw_tokens(obj, tokens, prefix_len, pipeline.special, True)
    np.testing.assert_array_equal(raw, stream[starts[doc] + start:starts[doc] + start + length])
    covered[starts[doc] + start:starts[doc] + start + length] += 1
  assert covered.min() == covered.max() == 1
  assert 0 < pipeline.counts["demoted_tokens"] < 0.05 * pipeline.counts["tokens"]


# --- addressed by step ----------------------------------------------------------------------------

def test_a_step_built_cold_equals_it_built_after_the_steps_before(store):
  config = store_config(store)
  warm = PreparedPipeline(config, VOCAB)
  rows = warm.layouts["train"].rows
  last = rows // 32 + 2  # past the end of the first epoch
  for step in range(last):
    expected = warm.batch(step)
  cold = PreparedPipeline(config, VOCAB)
  for f in FIELDS:
    np.testing.assert_array_equal(cold.batch(last - 1)[f], expected[f], err_msg=f)
  np.testing.assert_array_equal(cold.batch(3, "validation")["targets"], warm.batch(3, "validation")["targets"])
  other_seed = PreparedPipeline(store_config(store, seed=1), VOCAB)
  assert not np.array_equal(other_seed.batch(last - 1)["targets"], expected["targets"])


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_process_slices_concatenate_to_the_global_batch(store, process_count):
  pipeline = PreparedPipeline(store_config(store), VOCAB)
  whole = pipeline.batch(7)
  parts = [pipeline.batch(7, "train", i, process_count) for i in range(process_count)]
  for f in FIELDS:
    np.testing.assert_array_equal(np.concatenate([p[f] for p in parts]), whole[f], err_msg=f)
  with pytest.raises(ConfigError, match="DataConfig.batch_size"):
    pipeline.batch(0, "train", 0, 3)


# --- bad input ------------------------------------------------------------------------------------

def _error(config, vocab=VOCAB):
  with pytest.raises(ConfigError) as e:
    PreparedPipeline(config, vocab)
  assert e.value.fix
  return e.value


def test_a_store_of_another_vocabulary_or_source_is_refused_naming_both(store, tmp_path):
  other = ByteVocabulary(100)
  e = _error(store_config(store, extra_ids=100), other)
  assert e.setting == "DataConfig.vocab"
  assert VOCAB.fingerprint[:16] in e.problem and other.fingerprint[:16] in e.problem
  text = DataConfig(source="text", train_files=(str(tmp_path / "x.txt"),)).origin
  assert text == "text"
  e = _error(store_config(store, prepared_from="text", train_files=(str(tmp_path / "x.txt"),)))
  assert e.setting == "DataConfig.prepared_from" and "builtin" in e.problem and "x.txt" in e.problem
  PreparedPipeline(store_config(store, prepared_from="builtin"), VOCAB)  # its own settings: accepted


def test_missing_truncated_and_unfinished_stores_are_named(store, tmp_path, documents):
  broken = tmp_path / "broken"
  writer.write_store(str(broken), documents, VOCAB, store_format.source_description(DataConfig()),
                     documents_per_shard=256)
  tokens = broken / "train" / "shard-00001.tokens"
  data = tokens.read_bytes()
  tokens.write_bytes(data[:-2])
  e = _error(store_config(str(broken)))
  assert "train/shard-00001" in e.problem and f"{len(data) - 2:,} bytes" in e.problem
  tokens.unlink()
  e = _error(store_config(str(broken)))
  assert "train/shard-00001" in e.problem and "missing" in e.problem
  e = _error(store_config(str(tmp_path / "nowhere")))
  assert e.setting == "DataConfig.prepared_dir" and "does not exist" in e.problem
  os.remove(broken / "manifest.json")
  e = _error(store_config(str(broken)))
  assert "no manifest.json" in e.problem and "did not finish" in e.problem
  (tmp_path / "empty").mkdir()
  assert "no manifest.json" in _error(store_config(str(tmp_path / "empty"))).problem
  with pytest.raises(ConfigError, match="DataConfig.prepared_dir"):
    DataConfig(source="prepared")
  with pytest.raises(ConfigError, match="DataConfig.tfds_name"):
    DataConfig(source="prepared", prepared_dir=store, prepared_from="tfds")
