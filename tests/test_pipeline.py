"""Step-addressed batches over the built-in corpus (docs/architecture.md#data-addressed-by-step)."""

import numpy as np
import pytest

from midas_jax.configs import DataConfig, ObjectivesConfig
from midas_jax.data.pipeline import Pipeline, tokenize_documents
from midas_jax.data.sources import corpus, text_files
from midas_jax.data.ul2.packing import FIELD_DTYPES, FIELDS, packing_efficiency
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError

SPLITS = ("train", "validation")
EOS = ByteVocabulary.eos_id
DOC_SEP = b"\xfe"  # never in UTF-8, so never in an encoded segment


def load(config):
  vocab = ByteVocabulary(config.extra_ids)
  return {s: tokenize_documents(text_files.load_documents(config, s), vocab) for s in SPLITS}


@pytest.fixture(scope="module")
def documents():
  return load(DataConfig())


def to_bytes(tokens):
  """Byte ids 3..258 -> their byte, EOS -> 0xff (not UTF-8 either), so token windows are byte windows."""
  tokens = np.asarray(tokens)
  assert np.all((tokens == EOS) | ((tokens >= 3) & (tokens < 259)))
  return np.where(tokens == EOS, 0xFF, tokens - 3).astype(np.uint8).tobytes()


class DocumentIndex:
  """Answers: is this token sequence a whole document, or a contiguous window of one, of a split?"""

  def __init__(self, docs):
    encoded = [to_bytes(d) for d in docs]
    assert not any(DOC_SEP in e for e in encoded)
    self.whole = set(encoded)
    self.joined = DOC_SEP.join(encoded)

  def is_document(self, tokens):
    return to_bytes(tokens) in self.whole

  def is_window(self, tokens):
    return to_bytes(tokens) in self.joined


@pytest.fixture(scope="module")
def index(documents):
  return {s: DocumentIndex(documents[s]) for s in SPLITS}


VOCAB_SIZE = ByteVocabulary().vocab_size


CAUSAL_ONLY = ObjectivesConfig(causal_rate=1.0, prefix_rate=0.0, span_rate=0.0)


def CausalLMPipeline(cfg, docs):  # pylint: disable=invalid-name
  """Causal LM only, so every segment is a window of one document (the UL2 mixture is tested below)."""
  return Pipeline(cfg, docs, VOCAB_SIZE, mix=CAUSAL_ONLY)


def config(**kw):
  base = dict(seq_len=128, batch_size=8, seed=0)
  base.update(kw)
  return DataConfig(**base)


def assert_batches_equal(a, b):
  assert set(a) == set(b) == set(FIELDS)
  for f in FIELDS:
    np.testing.assert_array_equal(a[f], b[f], err_msg=f)


def batches_differ(a, b):
  return not np.array_equal(a["targets"], b["targets"])


def segments(batch, row):
  seg = batch["segment_ids"][row]
  return [np.flatnonzero(seg == i) for i in range(1, int(seg.max()) + 1)]


# --- tokenization --------------------------------------------------------------------------------

def test_tokenize_documents_appends_eos_to_the_byte_ids():
  docs = tokenize_documents(["ab", "é"], ByteVocabulary())
  assert [d.tolist() for d in docs] == [[ord("a") + 3, ord("b") + 3, EOS], [0xC3 + 3, 0xA9 + 3, EOS]]
  assert all(d.dtype == np.int32 for d in docs)


def test_the_builtin_corpus_is_what_the_tests_check_against(documents):
  cfg = DataConfig()
  assert len(documents["train"]) == corpus.SIZES["train"]
  assert len(documents["validation"]) == corpus.SIZES["validation"]
  texts = text_files.load_documents(cfg, "train")
  assert ByteVocabulary().decode(documents["train"][17]) == texts[17]


# --- addressing by step --------------------------------------------------------------------------

def test_batch_is_a_pure_function_of_config_seed_and_step(documents):
  cfg = config()
  first = CausalLMPipeline(cfg, documents)
  second = CausalLMPipeline(cfg, load(DataConfig()))  # built from scratch, documents included
  for step in (0, 1, 7, 1234):
    for split in SPLITS:
      assert_batches_equal(first.batch(step, split), second.batch(step, split))
  a = first.batch(3)
  assert batches_differ(a, first.batch(4))
  assert batches_differ(a, CausalLMPipeline(config(seed=1), documents).batch(3))
  assert batches_differ(a, first.batch(3, "validation"))
  # Every row of a step differs from every other (rows have their own streams).
  rows = {to_bytes(r[r > 0]) for r in a["targets"]}
  assert len(rows) == cfg.batch_size


def test_batch_shapes_and_dtypes(documents):
  cfg = config()
  batch = CausalLMPipeline(cfg, documents).batch(5)
  for f in FIELDS:
    assert batch[f].shape == (cfg.batch_size, cfg.seq_len) and batch[f].dtype == FIELD_DTYPES[f], f


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_one_process_batch(documents, process_count):
  pipeline = CausalLMPipeline(config(), documents)
  for step in (0, 9):
    for split in SPLITS:
      whole = pipeline.batch(step, split)
      # Each process builds its slice with its own pipeline object, as on a real multi-host run.
      parts = [CausalLMPipeline(config(), documents).batch(step, split, p, process_count)
               for p in range(process_count)]
      for part in parts:
        assert part["targets"].shape[0] == 8 // process_count
      assert_batches_equal({f: np.concatenate([p[f] for p in parts]) for f in FIELDS}, whole)


def test_resume_at_a_step_equals_the_uninterrupted_sequence(documents):
  cfg = config()
  uninterrupted = CausalLMPipeline(cfg, documents)
  sequence = [uninterrupted.batch(s) for s in range(8)]
  resumed = CausalLMPipeline(cfg, documents)
  for s in (5, 6, 7):
    assert_batches_equal(resumed.batch(s), sequence[s])
  # Out of order and repeated asks change nothing either.
  assert_batches_equal(resumed.batch(2), sequence[2])
  assert_batches_equal(resumed.batch(5), sequence[5])


def test_process_count_is_checked(documents):
  pipeline = CausalLMPipeline(config(batch_size=6), documents)
  with pytest.raises(ConfigError) as info:
    pipeline.batch(0, process_count=4)
  assert info.value.setting == "DataConfig.batch_size"
  pipeline.batch(0, process_count=3)  # 6 = 3 * 2 is fine


def test_empty_split_is_a_config_error(documents):
  with pytest.raises(ConfigError):
    CausalLMPipeline(config(), {"train": documents["train"], "validation": []})


# --- what the rows hold --------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len,min_chunk", [(256, 16), (64, 16), (512, 4)])
def test_segments_are_documents_or_windows_of_one(documents, index, seq_len, min_chunk):
  cfg = config(seq_len=seq_len, min_chunk=min_chunk)
  pipeline = CausalLMPipeline(cfg, documents)
  windows = 0
  for step in range(3):
    batch = pipeline.batch(step)
    assert batch["targets"].shape == (cfg.batch_size, seq_len)
    for r in range(cfg.batch_size):
      real = batch["segment_ids"][r] > 0
      used = int(real.sum())
      np.testing.assert_array_equal(real, np.arange(seq_len) < used)  # padding only at the end
      assert seq_len - used < min_chunk  # rows are filled until fewer than min_chunk slots remain
      segs = segments(batch, r)
      for i, where in enumerate(segs):
        tokens = batch["targets"][r, where]
        np.testing.assert_array_equal(batch["positions"][r, where], np.arange(where.size))
        assert batch["inputs"][r, where[0]] == 0
        np.testing.assert_array_equal(batch["inputs"][r, where[1:]], tokens[:-1])
        if index["train"].is_document(tokens):
          continue
        # Not a whole document: a window of a longer one, cut to fill the row exactly.
        assert i == len(segs) - 1 and where[-1] == seq_len - 1, (step, r, i)
        assert index["train"].is_window(tokens), (step, r, i)
        windows += 1
      # Causal LM: no prefix, every real token carries loss, objective 0.
      assert not batch["prefix_mask"][r].any()
      np.testing.assert_array_equal(batch["loss_weights"][r], real.astype(np.float32))
      assert not batch["objective_ids"][r].any()
  assert windows > 0  # the window path was exercised


def test_validation_batches_use_only_validation_documents(documents, index):
  pipeline = CausalLMPipeline(config(seq_len=256), documents)
  not_in_train = 0
  for step in range(4):
    batch = pipeline.batch(step, "validation")
    for r in range(batch["targets"].shape[0]):
      for where in segments(batch, r):
        tokens = batch["targets"][r, where]
        assert index["validation"].is_window(tokens)
        not_in_train += not index["train"].is_window(tokens)
  assert not_in_train > 0


def test_splits_are_kept_apart_with_disjoint_token_ranges():
  # Train documents use ids 3..99 and validation ids 150..249, so any crossing is visible.
  rng = np.random.default_rng(0)
  docs = {"train": [rng.integers(3, 100, rng.integers(5, 300)).astype(np.int32) for _ in range(50)],
          "validation": [rng.integers(150, 250, rng.integers(5, 300)).astype(np.int32) for _ in range(50)]}
  pipeline = CausalLMPipeline(config(seq_len=128, batch_size=4), docs)
  for step in range(5):
    train, val = pipeline.batch(step, "train"), pipeline.batch(step, "validation")
    t, v = train["targets"][train["segment_ids"] > 0], val["targets"][val["segment_ids"] > 0]
    assert t.size and v.size
    assert np.all(t < 100) and np.all(v >= 150)


def test_packing_efficiency_of_the_builtin_corpus_at_seq_len_256(documents):
  cfg = DataConfig(seq_len=256, batch_size=16)
  pipeline = CausalLMPipeline(cfg, documents)
  efficiency = np.mean([packing_efficiency(pipeline.batch(s)) for s in range(20)])
  print(f"packing efficiency over 20 batches of 16 x 256: {efficiency:.4f}")
  assert efficiency >= 0.95


# ----------------------------------------------------------------------------- the UL2 mixture

from hypothesis import given, settings, strategies as st  # noqa: E402

from midas_jax.data.ul2 import objectives  # noqa: E402

UL2_FULL = ((3.0, 0.15), (8.0, 0.15), (3.0, 0.5), (8.0, 0.5), (64.0, 0.15), (64.0, 0.5))


def examples_of(batch):
  """Yields (objective_id, tokens, prefix_len) for every packed example of a batch."""
  for r in range(batch["segment_ids"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in range(1, seg.max() + 1):
      where = seg == s
      yield (int(batch["objective_ids"][r][where][0]), batch["targets"][r][where],
             int((~batch["loss_weights"][r][where].astype(bool)).sum()))


def undo_span_corruption(inputs, targets, sentinels):
  """Independent decoder: put each target span back where its sentinel sits in the inputs."""
  spans, current = {}, None
  for t in targets:
    if t in sentinels:
      current = int(t)
      spans[current] = []
    else:
      spans[current].append(int(t))
  out = []
  for t in inputs:
    out.extend(spans[int(t)] if t in sentinels else [int(t)])
  return np.asarray(out)


def test_examples_follow_the_mixture_rates(documents):
  pipeline = Pipeline(DataConfig(seq_len=256, batch_size=16), documents, VOCAB_SIZE)
  ids = np.array([obj for step in range(50) for obj, _, _ in examples_of(pipeline.batch(step))])
  rates = np.bincount(ids, minlength=3) / len(ids)
  assert len(ids) > 800
  np.testing.assert_allclose(rates, [0.6, 0.2, 0.2], atol=0.05)  # ~3 standard errors at n > 1000


@pytest.mark.parametrize("mode_tokens", [False, True])
def test_every_example_decodes_to_a_window_of_a_document(documents, index, mode_tokens):
  cfg = DataConfig(seq_len=256, batch_size=8)
  mix = ObjectivesConfig(span_denoisers=UL2_FULL, mode_tokens=mode_tokens)
  pipeline = Pipeline(cfg, documents, VOCAB_SIZE, mix=mix)
  special = pipeline.special
  sentinels = set(special.sentinel_ids)
  modes = set(special.mode_ids.values())
  seen = set()
  for obj, tokens, prefix_len in examples_of(pipeline.batch(0)):
    seen.add(obj)
    starts_with_mode = bool(len(tokens)) and int(tokens[0]) in modes
    assert starts_with_mode == (mode_tokens and obj != 0)
    body, prefix_len = (tokens[1:], prefix_len - 1) if starts_with_mode else (tokens, prefix_len)
    if obj == 2:
      raw = undo_span_corruption(body[:prefix_len], body[prefix_len:], sentinels)
      assert int(body[prefix_len]) == special.sentinel_ids[0]
    else:
      assert not sentinels & set(body.tolist())
      raw = body
    assert index["train"].is_window(raw)
  assert seen == {0, 1, 2}


def test_ul2_packing_efficiency_at_the_demo_length(documents):
  pipeline = Pipeline(DataConfig(seq_len=256, batch_size=16), documents, VOCAB_SIZE)
  assert np.mean([packing_efficiency(pipeline.batch(s)) for s in range(20)]) >= 0.95


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.integers(0, 10**6), seq_len=st.sampled_from([32, 64, 200]),
       span=st.sampled_from(UL2_FULL), mode_tokens=st.booleans())
def test_row_invariants_hold_for_any_step_and_mixture(documents, seed, step, seq_len, span, mode_tokens):
  cfg = DataConfig(seq_len=seq_len, batch_size=2, seed=seed, min_chunk=8)
  mix = ObjectivesConfig(causal_rate=0.2, prefix_rate=0.3, span_rate=0.5, span_denoisers=(span,),
                         mode_tokens=mode_tokens)
  batch = Pipeline(cfg, documents, VOCAB_SIZE, mix=mix).batch(step)
  assert batch["targets"].shape == (2, seq_len)
  seg = batch["segment_ids"]
  for r in range(2):
    for s in range(1, seg[r].max() + 1):
      where = np.flatnonzero(seg[r] == s)
      assert np.all(np.diff(where) == 1)  # contiguous
      assert np.array_equal(batch["positions"][r][where], np.arange(len(where)))
      weights = batch["loss_weights"][r][where]
      prefix_len = int((weights == 0).sum())
      assert np.all(weights[prefix_len:] == 1)  # loss exactly on the targets, after the prefix
      expected_bidir = prefix_len + 1 if prefix_len else 0
      assert np.array_equal(np.flatnonzero(batch["prefix_mask"][r][where]), np.arange(expected_bidir))
  assert np.all(batch["loss_weights"][seg == 0] == 0)


def test_too_few_extra_ids_for_the_sentinels_is_refused(documents):
  with pytest.raises(ConfigError, match="DataConfig.extra_ids"):
    Pipeline(DataConfig(extra_ids=50), documents, ByteVocabulary(50).vocab_size)


# ----------------------------------------------------------------------------- speed machinery

from midas_jax.data.ul2 import streams  # noqa: E402


def test_span_examples_have_the_t5_counts(documents):
  cfg = DataConfig(seq_len=256, batch_size=16)
  pipeline = Pipeline(cfg, documents, VOCAB_SIZE, mix=ObjectivesConfig(span_denoisers=UL2_FULL, mode_tokens=False))
  sentinels = set(pipeline.special.sentinel_ids)
  spans = 0
  for step in range(4):
    for obj, tokens, prefix_len in examples_of(pipeline.batch(step)):
      if obj != 2:
        continue
      inputs, targets = tokens[:prefix_len], tokens[prefix_len:]
      n = int(np.isin(targets, list(sentinels)).sum())
      raw = len(tokens) - 2 * n
      # Some (mu, r) of the mixture fits these counts: the lengths alone decide them.
      assert any(objectives.num_spans(raw, r, mu) == n and
                 len(targets) - n == objectives._noise_counts(raw, r, mu)[0] for mu, r in UL2_FULL)
      assert list(targets[np.isin(targets, list(sentinels))]) == list(pipeline.special.sentinel_ids[:n])
      assert int(inputs[-1]) == pipeline.special.sentinel_ids[n - 1]  # the last token is noise
      spans += n
  assert spans > 100


def test_steps_built_in_one_block_are_handed_out_once_and_equal_cold_builds(documents):
  pipeline = Pipeline(DataConfig(seq_len=64, batch_size=4), documents, VOCAB_SIZE)
  first = pipeline.batch(10)  # builds a block of steps 10, 11, ...
  kept = {f: v.copy() for f, v in first.items()}
  first["targets"][:] = -1  # a consumer's change reaches no later answer
  assert_batches_equal(pipeline.batch(10), kept)
  for step in (11, 12, 30, 11):
    cold = Pipeline(DataConfig(seq_len=64, batch_size=4), documents, VOCAB_SIZE).batch(step)
    assert_batches_equal(pipeline.batch(step), cold)


def test_counter_streams_are_uniform_and_address_rows_alone():
  key = streams.split_key(0, 0)
  u = streams.uniforms(key, streams.positions(np.arange(1000)[:, None], np.arange(100)))
  assert u.shape == (1000, 100) and 0 <= u.min() and u.max() < 1
  counts = np.bincount((u * 20).astype(int).ravel(), minlength=20)
  assert ((counts - 5000) ** 2 / 5000).sum() < 45.3  # chi2(df=19) at p = 0.001
  assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01  # neighbouring counters
  # A row's draws are the same whoever else is drawn with it; other seeds and splits differ.
  np.testing.assert_array_equal(streams.bits(key, streams.positions(7, np.arange(5))),
                                streams.bits(key, streams.positions(np.array([[3], [7]]), np.arange(5)))[1])
  for other in (streams.split_key(1, 0), streams.split_key(0, 1)):
    assert not np.array_equal(streams.bits(other, np.arange(5)), streams.bits(key, np.arange(5)))
  top = np.full(10, 1 - 2.0**-53)
  assert np.all(streams.below(top, np.arange(1, 11)) == np.arange(10))  # never n


def test_span_masks_from_counter_keys_are_uniform():
  # The pipeline's keys come from streams, not a numpy Generator: the law must hold for them too.
  # L=12, density 0.5, mean 2: 6 noise tokens in 3 spans, 6 non-noise in 3: C(5,2)^2 = 100 masks.
  import collections  # pylint: disable=import-outside-toplevel
  n = 20_000
  keys = streams.bits(streams.split_key(3, 0), streams.positions(np.arange(n)[:, None], np.arange(12)))
  src, _, size, _, _ = objectives.span_layout(np.full(n, 12), np.full(n, 6), np.full(n, 3), keys)
  mask = np.zeros(n * 12, bool)
  mask[objectives.ranges(src[:3 * n], size[:3 * n])] = True  # the noise spans come first
  draws = collections.Counter(m.tobytes() for m in mask.reshape(n, 12))
  assert len(draws) == 100
  assert sum((c - 200) ** 2 / 200 for c in draws.values()) < 148.2  # chi2(df=99) at p = 0.001


def test_documents_shorter_than_a_span_become_causal_examples():
  """A one-token document cannot be split: span corruption and prefix LM take it as causal LM."""
  docs = [np.array([EOS], np.int32), np.array([10, EOS], np.int32), np.array([10, 11, 12, EOS], np.int32)]
  cfg = DataConfig(seq_len=32, batch_size=4, min_chunk=2)
  mix = ObjectivesConfig(causal_rate=0.0, prefix_rate=0.5, span_rate=0.5)
  pipeline = Pipeline(cfg, {"train": docs, "validation": docs}, VOCAB_SIZE, mix=mix)
  sentinels = set(pipeline.special.sentinel_ids)
  seen = set()
  for step in range(5):
    for obj, tokens, prefix_len in examples_of(pipeline.batch(step)):
      body = tokens[prefix_len:]
      if len(tokens) == 1:
        assert obj == 0 and prefix_len == 0 and tokens.tolist() == [EOS]
      elif obj == 2:
        raw = undo_span_corruption(tokens[:prefix_len], body, sentinels).tolist()
        assert any(raw == d[i:i + len(raw)].tolist() for d in docs for i in range(len(d)))  # a window
      seen.add((obj, len(tokens)))
  assert (0, 1) in seen and any(o == 2 for o, _ in seen) and any(o == 1 for o, _ in seen)
