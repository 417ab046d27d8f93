"""Our span corruption and prefix split against t5 0.9.4's, on the same documents.

Needs t5 installed with --no-deps plus what t5.data imports (docs/dependencies.md); skipped
otherwise. What must agree:
  - exactly: per document, the number of noise tokens, of spans, the output lengths, the sentinel
    ids and their order, and the layout (one reconstruction reads both outputs back to the text);
    these are functions of the length alone, so any difference is a bug, not noise;
  - within sampling error: the random parts (span-length distribution, where noise falls). Each
    statistic is a mean over spans or documents; the tolerance is 4 standard errors of the
    difference of two independent samples (a false alarm about once in 16,000 per statistic; the
    seeds are fixed, so the test is deterministic). Spans of one document are negatively correlated
    (their lengths sum to a fixed total), so the i.i.d. standard error overstates the real one and
    the check is, if anything, lenient by a little; the histogram tests add a chi-square at p > 0.001.
"""

import numpy as np
import pytest

preprocessors = pytest.importorskip("t5.data.preprocessors")
import seqio  # noqa: E402  (installed whenever t5 imports)
import tensorflow as tf  # noqa: E402
from scipy import stats  # noqa: E402  (a t5 dependency)

from midas_jax.data.ul2 import objectives as obj  # noqa: E402

NUM_DOCS = 500
VOCAB = seqio.ByteVocabulary(extra_ids=100)  # 359 ids: bytes at 3..258, sentinels 358 down to 259
SENTINELS = obj.special_tokens(VOCAB.vocab_size, VOCAB.extra_ids, modes=()).sentinel_ids
CONFIGS = [(0.15, 3.0), (0.5, 8.0)]  # an R and an X denoiser


def _documents(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(200, 501, NUM_DOCS)
  lengths[:2] = 350, 390  # where float32 and float64 rounding of L * 0.15 disagree (t5 is float32)
  return [rng.integers(3, 259, n).astype(np.int32) for n in lengths]


def _t5_span_corruption(docs, density, mean):
  """t5's preprocessor, one output per document: no merging, and a length that never splits one."""
  features = {k: seqio.Feature(VOCAB, add_eos=False) for k in ("inputs", "targets")}
  ds = tf.data.Dataset.from_generator(lambda: ({"targets": d} for d in docs),
                                      output_signature={"targets": tf.TensorSpec([None], tf.int32)})
  with seqio.map_seed_manager(1234):
    ds = preprocessors.span_corruption(ds, {"inputs": 1024, "targets": 4096}, features,
                                       mean_noise_span_length=mean, noise_density=density,
                                       merge_examples_to_reduce_padding=False)
  return [(x["inputs"], x["targets"]) for x in ds.as_numpy_iterator()]


def _ours(docs, density, mean):
  rng = np.random.default_rng(4321)
  return [obj.span_corruption(d, rng, density, mean, SENTINELS) for d in docs]


def _decode(inputs, targets):
  """(mask, text) read back from an output pair without either implementation's code."""
  sentinel = set(SENTINELS)
  inputs, targets = inputs.tolist(), targets.tolist()
  runs, k = {}, None
  for t in targets:
    if t in sentinel:
      k = t
      runs[k] = []
    else:
      runs[k].append(t)
  mask, text = [], []
  for t in inputs:
    piece = runs[t] if t in sentinel else [t]
    text += piece
    mask += [t in sentinel] * len(piece)
  return np.asarray(mask, bool), text


def _spans(mask):
  """Lengths of noise runs and of non-noise runs."""
  edges = np.flatnonzero(np.diff(np.concatenate([[-1], mask.astype(int), [-1]])) != 0)
  runs = np.diff(edges)
  first_is_noise = bool(mask[0])
  noise = runs[(np.arange(len(runs)) % 2 == 0) == first_is_noise]
  return noise, runs[(np.arange(len(runs)) % 2 == 0) != first_is_noise]


def _z(a, b):
  a, b = np.asarray(a, float), np.asarray(b, float)
  se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
  return abs(a.mean() - b.mean()) / se if se > 0 else float(a.mean() != b.mean()) * np.inf


def _histogram_p(a, b, top):
  """Two-sample chi-square p-value of two integer samples, values >= top pooled in one bin."""
  table = np.stack([np.bincount(np.minimum(x, top), minlength=top + 1)[1:] for x in (a, b)])
  table = table[:, table.sum(0) > 0]
  return stats.chi2_contingency(table)[1]


@pytest.mark.parametrize("density,mean", CONFIGS)
def test_span_corruption_matches_t5(density, mean):
  docs = _documents()
  theirs, ours = _t5_span_corruption(docs, density, mean), _ours(docs, density, mean)
  assert len(theirs) == len(ours) == NUM_DOCS
  stats_ = {"t5": {"noise": [], "nonnoise": [], "first_noise_at": [], "profile": []},
            "ours": {"noise": [], "nonnoise": [], "first_noise_at": [], "profile": []}}
  for doc, pair_t5, pair_ours in zip(docs, theirs, ours):
    n = obj.num_spans(len(doc), density, mean)
    for who, (inputs, targets) in (("t5", pair_t5), ("ours", pair_ours)):
      # Exact: layout, sentinel ids in order, counts and lengths.
      assert list(inputs[np.isin(inputs, SENTINELS)]) == list(SENTINELS[:n]), who
      assert list(targets[np.isin(targets, SENTINELS)]) == list(SENTINELS[:n]), who
      assert targets[0] == SENTINELS[0] and inputs[-1] == SENTINELS[n - 1], who
      assert len(inputs) + len(targets) == obj.corrupted_length(len(doc), density, mean), who
      mask, text = _decode(inputs, targets)
      assert text == doc.tolist(), who
      noise, nonnoise = _spans(mask)
      s = stats_[who]
      s["noise"] += list(noise)
      s["nonnoise"] += list(nonnoise)
      s["first_noise_at"].append(np.argmax(mask) / len(mask))
      s["profile"].append([m.mean() for m in np.array_split(mask, 5)])
    assert len(pair_t5[0]) == len(pair_ours[0])  # same noise count, hence same input length

  t5s, us = stats_["t5"], stats_["ours"]
  report = {
      "density": (sum(t5s["noise"]) / sum(map(len, docs)), sum(us["noise"]) / sum(map(len, docs))),
      "mean_span": (np.mean(t5s["noise"]), np.mean(us["noise"])),
      "spans": (len(t5s["noise"]), len(us["noise"])),
  }
  assert report["density"][0] == report["density"][1] and report["spans"][0] == report["spans"][1]
  assert report["mean_span"][0] == report["mean_span"][1]
  # Random parts, within sampling error.
  checks = {
      "noise span length": _z(t5s["noise"], us["noise"]),
      "noise spans of length 1": _z(np.equal(t5s["noise"], 1), np.equal(us["noise"], 1)),
      "noise span length^2": _z(np.square(t5s["noise"]), np.square(us["noise"])),
      "non-noise span length^2": _z(np.square(t5s["nonnoise"]), np.square(us["nonnoise"])),
      "first noise position": _z(t5s["first_noise_at"], us["first_noise_at"]),
  }
  for q in range(5):
    checks[f"density in fifth {q}"] = _z(np.asarray(t5s["profile"])[:, q], np.asarray(us["profile"])[:, q])
  print(f"\n(density={density}, mean={mean}) exact: {report}; z-scores:",
        {k: round(float(v), 2) for k, v in checks.items()})
  for name, z in checks.items():
    assert z < 4.0, (name, z)
  p_noise = _histogram_p(t5s["noise"], us["noise"], top=12)
  p_nonnoise = _histogram_p(t5s["nonnoise"], us["nonnoise"], top=60)
  print(f"span-length histograms: p(noise) = {p_noise:.3f}, p(non-noise) = {p_nonnoise:.3f}")
  assert p_noise > 1e-3 and p_nonnoise > 1e-3


def test_noise_counts_match_t5_for_every_length():
  """t5's mask, run for lengths 1..1200 under each UL2 density and mean: same counts as ours."""
  configs = [(d.noise_density, d.mean_noise_span_length)
             for d in obj.default_ul2_denoisers() if d.kind == "span"]
  lengths = np.arange(1, 1201)
  seeds = tf.constant([[1, 2], [3, 4]])
  for density, mean in configs:
    def counts(length, density=density, mean=mean):
      mask = tf.cast(preprocessors.random_spans_noise_mask(length, density, seeds, mean), tf.int32)
      starts = tf.reduce_sum(tf.cast(mask[1:] > mask[:-1], tf.int32)) + mask[0]
      return tf.reduce_sum(mask), starts, mask[-1]
    ds = tf.data.Dataset.from_tensor_slices(lengths.astype(np.int32)).map(counts).batch(len(lengths))
    theirs = np.stack(next(ds.as_numpy_iterator()), axis=1)  # one batch: far faster than per element
    ours_spans = np.asarray([obj.num_spans(n, density, mean) for n in lengths])
    long = lengths >= 2  # length 1: no noise in either
    np.testing.assert_array_equal(theirs[:, 1], ours_spans, err_msg=f"spans, {density}, {mean}")
    for n, (noise_t5, _, last) in zip(lengths[long], theirs[long]):
      mask = obj.random_spans_noise_mask(int(n), density, mean, np.random.default_rng(int(n)))
      assert noise_t5 == mask.sum() and last == 1, (n, density, mean)


def test_prefix_split_matches_t5():
  """t5's random_prefix_noise_mask (prefix_lm's default density 0.5) and ours: both uniform on [1, L-1]."""
  length, n = 11, 10_000

  def split(i):
    seeds = tf.stack([tf.stack([i, 7]), tf.stack([i, 8])])
    return tf.reduce_sum(tf.cast(preprocessors.random_prefix_noise_mask(length, 0.5, seeds), tf.int32))
  ds = tf.data.Dataset.range(n).map(lambda i: split(tf.cast(i, tf.int32))).batch(n)
  theirs = next(ds.as_numpy_iterator())
  rng = np.random.default_rng(5)
  ours = np.asarray([obj.prefix_lm_split(length, rng) for _ in range(n)])
  assert theirs.min() == ours.min() == 1 and theirs.max() == ours.max() == length - 1
  p = _histogram_p(theirs, ours, top=length)
  print(f"\nprefix split on [1, {length - 1}]: mean t5 {theirs.mean():.3f}, ours {ours.mean():.3f}, "
        f"two-sample p = {p:.3f}")
  assert p > 1e-3 and _z(theirs, ours) < 4.0
