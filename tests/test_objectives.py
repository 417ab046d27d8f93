"""UL2 objectives: span corruption's layout and law, prefix split, special tokens, examples."""

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from midas_jax.data.ul2 import objectives as obj
from midas_jax.data.ul2.packing import pack_row
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError

TEXT_MAX = 1000                                 # text ids in [3, TEXT_MAX)
SENTINELS = tuple(range(5000, 5000 - 400, -1))  # far above the text, decreasing like T5's
SETTINGS = settings(max_examples=200, deadline=None)

lengths = st.integers(0, 400)
densities = st.floats(0.05, 0.95)
means = st.floats(1.0, 20.0)
seeds = st.integers(0, 2**32 - 1)


def _tokens(length, seed):
  return np.random.default_rng([seed, 1]).integers(3, TEXT_MAX, length).astype(np.int32)


def _chi2(counts, expected):
  counts, expected = np.asarray(counts, float), np.asarray(expected, float)
  return float(((counts - expected) ** 2 / expected).sum())


def reconstruct(inputs, targets, sentinels):
  """Independent of the implementation: walk the inputs, splice in each sentinel's target run."""
  runs, k = {}, None
  for t in targets:
    if t in sentinels:
      k = t
      runs[k] = []
    else:
      runs[k].append(t)  # KeyError if targets do not start with a sentinel
  out = []
  for t in inputs:
    out.extend(runs[t] if t in sentinels else [t])
  return out


@SETTINGS
@given(lengths, densities, means, seeds)
def test_inputs_and_targets_reconstruct_the_tokens(length, density, mean, seed):
  tokens = _tokens(length, seed)
  inputs, targets = obj.span_corruption(tokens, np.random.default_rng(seed), density, mean, SENTINELS)
  assert reconstruct(list(inputs), list(targets), set(SENTINELS)) == list(tokens)
  assert inputs.dtype == targets.dtype == np.int32


@SETTINGS
@given(lengths, densities, means, seeds)
def test_sentinel_layout_and_counts(length, density, mean, seed):
  tokens = _tokens(length, seed)
  inputs, targets = obj.span_corruption(tokens, np.random.default_rng(seed), density, mean, SENTINELS)
  n = obj.num_spans(length, density, mean)
  used = list(SENTINELS[:n])
  assert [t for t in inputs if t >= TEXT_MAX] == used
  assert [t for t in targets if t >= TEXT_MAX] == used
  assert len(inputs) + len(targets) == obj.corrupted_length(length, density, mean) == length + 2 * n
  if n:
    assert targets[0] == SENTINELS[0]
    assert inputs[-1] == SENTINELS[n - 1]  # random_roll=False: the last token is noise
    assert inputs[0] < TEXT_MAX            # ... and the first is not
    noise = len(targets) - n
    assert noise == min(max(int(np.rint(np.float32(length) * np.float32(density))), 1), length - 1)
    is_sentinel = targets >= TEXT_MAX
    assert not np.any(is_sentinel[:-1] & is_sentinel[1:]) and not is_sentinel[-1]  # no empty span
  else:
    assert list(inputs) == list(tokens) and len(targets) == 0


@SETTINGS
@given(lengths, densities, means, seeds)
def test_noise_mask_structure(length, density, mean, seed):
  mask = obj.random_spans_noise_mask(length, density, mean, np.random.default_rng(seed))
  assert mask.shape == (length,) and mask.dtype == bool
  starts = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int)])) == 1)
  assert len(starts) == obj.num_spans(length, density, mean)
  if len(starts):
    assert not mask[0] and mask[-1]


def test_counts_are_rounded_in_float32_like_tensorflow():
  # 190 * 0.15 is 28.4999... in float64 but 28.500001 in float32, which TF rounds to 29 noise tokens
  # and round(29 / 3) = 10 spans (checked against t5 in test_t5_reference.py).
  assert obj.num_spans(190, 0.15, 3.0) == 10
  assert obj.corrupted_length(190, 0.15, 3.0) == 210
  # Half to even, as tf.round: 0.5 * 5 = 2.5 noise tokens -> 2; 2 / 4 = 0.5 spans -> 0 -> at least 1.
  assert obj.num_spans(5, 0.5, 4.0) == 1
  assert obj.num_spans(1, 0.5, 3.0) == obj.num_spans(0, 0.5, 3.0) == 0


@pytest.mark.parametrize("density,mean", [(0.15, 3.0), (0.5, 3.0), (0.15, 64.0), (0.5, 8.0), (0.9, 1.0)])
def test_max_raw_length_is_maximal_and_fits(density, mean):
  table = [obj.corrupted_length(n, density, mean) for n in range(1200)]
  assert all(b > a for a, b in zip(table, table[1:]))  # strictly increasing: binary search is sound
  for budget in range(0, 1000, 7):
    n = obj.max_raw_length(budget, density, mean)
    assert table[n] <= budget < table[n + 1]
  for budget, cap in [(600, 5), (900, 30), (50, 100)]:
    n = obj.max_raw_length(budget, density, mean, max_spans=cap)
    ok = [m for m in range(1200) if table[m] <= budget and obj.num_spans(m, density, mean) <= cap]
    assert n == max(ok)
  with pytest.raises(ValueError):
    obj.max_raw_length(-1)


def test_too_many_spans_for_the_sentinels_raises():
  with pytest.raises(ValueError, match="sentinel"):
    obj.span_corruption(np.arange(3, 103), np.random.default_rng(0), 0.5, 3.0, SENTINELS[:5])
  n = obj.max_raw_length(10_000, 0.5, 3.0, max_spans=5)
  obj.span_corruption(np.arange(n) % 900 + 3, np.random.default_rng(0), 0.5, 3.0, SENTINELS[:5])


def test_segmentation_is_uniform_over_compositions():
  # 7 items into 3 positive parts: C(6, 2) = 15 compositions, each equally likely.
  rng = np.random.default_rng(0)
  draws = collections.Counter(tuple(obj._random_segmentation(7, 3, rng)) for _ in range(15_000))
  assert len(draws) == 15 and all(sum(c) == 7 and min(c) >= 1 for c in draws)
  assert _chi2(list(draws.values()), [1000] * 15) < 36.1  # chi2(df=14) at p = 0.001


def test_noise_masks_are_uniform_given_the_counts():
  # L=12, density 0.5, mean 2: 6 noise tokens in 3 spans, 6 non-noise in 3: C(5,2)^2 = 100 masks.
  rng = np.random.default_rng(1)
  draws = collections.Counter(
      obj.random_spans_noise_mask(12, 0.5, 2.0, rng).tobytes() for _ in range(20_000))
  assert len(draws) == 100
  assert _chi2(list(draws.values()), [200] * 100) < 148.2  # chi2(df=99) at p = 0.001


def test_prefix_split_is_uniform_over_1_to_length_minus_1():
  rng = np.random.default_rng(2)
  splits = [obj.prefix_lm_split(11, rng) for _ in range(20_000)]
  counts = np.bincount(splits, minlength=11)
  assert counts[0] == 0 and counts[1:].sum() == 20_000  # k in [1, 10]: never empty, never everything
  assert _chi2(counts[1:], [2000] * 10) < 27.9  # chi2(df=9) at p = 0.001
  assert obj.prefix_lm_split(2, rng) == 1
  assert obj.prefix_lm_split(1, rng) == obj.prefix_lm_split(0, rng) == 0


def test_special_token_layout_matches_the_vocabulary():
  vocab = ByteVocabulary(extra_ids=128)
  sp = obj.special_tokens(vocab.vocab_size, vocab.extra_ids)
  assert sp.sentinel_ids == tuple(vocab.extra_id(k) for k in range(100))
  assert sp.sentinel_ids[0] == vocab.vocab_size - 1
  assert sp.mode_ids == {"[NLU]": vocab.extra_id(100), "[NLG]": vocab.extra_id(101),
                         "[S2S]": vocab.extra_id(102)}
  ids = list(sp.sentinel_ids) + list(sp.mode_ids.values())
  assert len(set(ids)) == 103 and min(ids) >= vocab.vocab_size - vocab.extra_ids  # no text ids
  round_trip = obj.SpecialTokens.from_json(json.loads(json.dumps(sp.to_json())))
  assert round_trip == sp
  exact = obj.special_tokens(1000, 13, num_sentinels=10)
  assert exact.sentinel_ids == tuple(range(999, 989, -1)) and min(exact.mode_ids.values()) == 987


def test_too_few_extra_ids_is_a_config_error():
  with pytest.raises(ConfigError, match="103") as e:
    obj.special_tokens(359, 100)
  assert e.value.setting == "DataConfig.extra_ids"
  obj.special_tokens(359, 100, modes=())  # sentinels alone fit
  with pytest.raises(ConfigError, match="12"):
    obj.special_tokens(1000, 11, num_sentinels=10, modes=("a", "b"))


def test_default_ul2_denoisers():
  ds = obj.default_ul2_denoisers()
  spans = {(d.mean_noise_span_length, d.noise_density, d.mode) for d in ds if d.kind == "span"}
  assert spans == {(3.0, 0.15, "[NLU]"), (8.0, 0.15, "[NLU]"), (3.0, 0.5, "[NLG]"), (8.0, 0.5, "[NLG]"),
                   (64.0, 0.15, "[NLG]"), (64.0, 0.5, "[NLG]")}
  assert [(d.kind, d.mode) for d in ds if d.kind != "span"] == [("prefix", "[S2S]")]
  assert len({d.name for d in ds}) == len(ds)
  json.dumps([d.to_json() for d in ds])
  with pytest.raises(ValueError):
    obj.Denoiser("bad", "mlm")
  with pytest.raises(ValueError):
    obj.Denoiser("bad", "span", 3.0, 1.0)


@SETTINGS
@given(st.integers(2, 120), st.sampled_from(obj.default_ul2_denoisers() + (obj.Denoiser("C", "causal"),)),
       st.booleans(), seeds)
def test_make_example_layout(length, denoiser, use_mode, seed):
  vocab = ByteVocabulary(extra_ids=128)
  sp = obj.special_tokens(vocab.vocab_size, vocab.extra_ids)
  tokens = np.random.default_rng(seed).integers(3, 259, length).astype(np.int32)
  ex = obj.make_example(tokens, denoiser, np.random.default_rng(seed), sp, use_mode)
  assert len(ex.tokens) == obj.example_length(length, denoiser, use_mode)
  assert ex.objective_id == obj.OBJECTIVE_IDS[denoiser.kind]
  body, prefix_len = ex.tokens, ex.prefix_len
  if use_mode and denoiser.kind != "causal":
    assert body[0] == sp.mode_ids[denoiser.mode]
    body, prefix_len = body[1:], prefix_len - 1
  else:
    assert body[0] not in sp.mode_ids.values()
  if denoiser.kind == "causal":
    assert prefix_len == 0 and list(body) == list(tokens)
  elif denoiser.kind == "prefix":
    assert 1 <= prefix_len <= length - 1 and list(body) == list(tokens)
  else:
    inputs, targets = body[:prefix_len], body[prefix_len:]
    assert targets[0] == sp.sentinel_ids[0]
    assert reconstruct(list(inputs), list(targets), set(sp.sentinel_ids)) == list(tokens)
  row = pack_row([ex], len(ex.tokens) + 3)
  assert row["loss_weights"].sum() == len(ex.tokens) - ex.prefix_len  # loss on targets only


def test_make_example_objective_id_override_and_determinism():
  sp = obj.special_tokens(387, 128)
  tokens = np.arange(3, 203)
  for d in obj.default_ul2_denoisers():
    a = obj.make_example(tokens, d, np.random.default_rng(7), sp, True, objective_id=5)
    b = obj.make_example(tokens, d, np.random.default_rng(7), sp, True, objective_id=5)
    assert a.objective_id == 5 and a.prefix_len == b.prefix_len
    np.testing.assert_array_equal(a.tokens, b.tokens)
  masks = {obj.random_spans_noise_mask(200, 0.15, 3.0, np.random.default_rng(s)).tobytes()
           for s in range(20)}
  assert len(masks) == 20  # different seeds, different masks
  twice = [obj.random_spans_noise_mask(200, 0.15, 3.0, np.random.default_rng(3)) for _ in range(2)]
  np.testing.assert_array_equal(*twice)


def test_mode_token_missing_from_special_tokens_raises():
  sp = obj.special_tokens(359, 100, modes=())
  obj.make_example(np.arange(3, 40), obj.default_ul2_denoisers()[0], np.random.default_rng(0), sp, False)
  with pytest.raises(ValueError, match="NLU"):
    obj.make_example(np.arange(3, 40), obj.default_ul2_denoisers()[0], np.random.default_rng(0), sp, True)


def test_numpy_only():
  import subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  code = ("import sys, midas_jax.data.ul2.objectives; "
          "print(any(m in sys.modules for m in ('tensorflow', 'jax', 'seqio')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"



@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 150), densities, means), min_size=1, max_size=6), seeds)
def test_many_examples_at_once_equal_one_at_a_time(cases, seed):
  """span_layout over a batch (what the pipeline runs) equals span_corruption example by example."""
  rng = np.random.default_rng(seed)
  counts = [obj._noise_counts(n, d, mu) for n, d, mu in cases]
  lengths = np.array([n for n, _, _ in cases])
  noise, spans = np.array([c[0] for c in counts]), np.array([c[1] for c in counts])
  keys = obj.random_keys(rng, len(cases), int(lengths.max()) + 3)  # extra columns are ignored
  tokens = rng.integers(3, TEXT_MAX, 2000).astype(np.int32)
  in_offsets = rng.integers(0, 2000 - 150, len(cases))
  out_lengths = lengths + 2 * spans
  out_offsets = np.cumsum(out_lengths + rng.integers(0, 4, len(cases))) - out_lengths  # gaps between
  src, dest, size, sentinel_dest, rank = obj.span_layout(lengths, noise, spans, keys, in_offsets, out_offsets)
  out = np.full(int(out_offsets[-1] + out_lengths[-1]), -1)
  out[obj.ranges(dest, size)] = tokens[obj.ranges(src, size)]
  out[sentinel_dest] = np.asarray(SENTINELS)[rank]
  assert (out >= 0).sum() == out_lengths.sum()  # nothing written twice or outside the examples

  class Keys:  # hands span_corruption the example's own row of keys
    def __init__(self, row):
      self.row = row

    def integers(self, *args, **kwargs):  # pylint: disable=unused-argument
      return self.row[None, :]

  for e, (n, d, mu) in enumerate(cases):
    inputs, targets = obj.span_corruption(tokens[in_offsets[e]:in_offsets[e] + n], Keys(keys[e, :n]), d, mu,
                                          SENTINELS)
    np.testing.assert_array_equal(out[out_offsets[e]:out_offsets[e] + out_lengths[e]],
                                  np.concatenate([inputs, targets]))
