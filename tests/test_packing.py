"""Packing examples into rows of the one shared format (docs/architecture.md#one-example-format)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from midas_jax.data.ul2.packing import (FIELD_DTYPES, FIELDS, Example, empty_rows, pack_row, pack_rows,
                                    packing_efficiency, stack_rows)

MAX_LEN = 24


@st.composite
def example(draw, min_len=1):
  n = draw(st.integers(min_len, MAX_LEN))
  tokens = np.asarray(draw(st.lists(st.integers(3, 400), min_size=n, max_size=n)), np.int32)
  prefix_len = draw(st.integers(0, n))  # n: the whole example is prefix, nothing to predict
  return Example(tokens=tokens, prefix_len=prefix_len, objective_id=draw(st.integers(0, 2)))


@st.composite
def fitting_row(draw):
  """Examples and a row length they fit in, with 0 to 10 slots of padding left."""
  examples = draw(st.lists(example(), min_size=0, max_size=6))
  used = sum(len(e.tokens) for e in examples)
  return examples, max(used + draw(st.integers(0, 10)), 1)


@settings(max_examples=300, deadline=None)
@given(fitting_row())
def test_row_fields_follow_the_examples(case):
  examples, seq_len = case
  row = pack_row(examples, seq_len)
  assert set(row) == set(FIELDS)
  for f in FIELDS:
    assert row[f].shape == (seq_len,) and row[f].dtype == FIELD_DTYPES[f], f

  start = 0
  for segment, ex in enumerate(examples, start=1):
    n, p = len(ex.tokens), ex.prefix_len
    s = slice(start, start + n)
    np.testing.assert_array_equal(row["targets"][s], ex.tokens)
    # Inputs: the example shifted right by one inside its own segment, BOS (0) first.
    assert row["inputs"][start] == 0
    np.testing.assert_array_equal(row["inputs"][start + 1:start + n], ex.tokens[:-1])
    np.testing.assert_array_equal(row["positions"][s], np.arange(n))
    assert np.all(row["segment_ids"][s] == segment)
    assert np.all(row["objective_ids"][s] == ex.objective_id)
    # The loss is on exactly the tokens past the prefix ...
    expected_weights = (np.arange(n) >= p).astype(np.float32)
    np.testing.assert_array_equal(row["loss_weights"][s], expected_weights)
    assert row["loss_weights"][s].sum() == n - p
    # ... and the bidirectional inputs are BOS plus the prefix tokens (none at all for causal LM).
    expected_prefix = (np.arange(n) <= p) & (p > 0)
    np.testing.assert_array_equal(row["prefix_mask"][s], expected_prefix)
    start += n

  used = sum(len(e.tokens) for e in examples)
  np.testing.assert_array_equal(row["targets"][:used],
                                np.concatenate([e.tokens for e in examples] + [np.zeros(0, np.int32)]))
  pad = slice(used, seq_len)
  for f in FIELDS:
    assert not np.any(row[f][pad]), f"padding is not zero in {f}"


@settings(max_examples=200, deadline=None)
@given(fitting_row())
def test_row_invariants_hold_without_knowing_the_examples(case):
  """What any consumer may rely on, read off the row alone."""
  examples, seq_len = case
  row = pack_row(examples, seq_len)
  seg, pos = row["segment_ids"], row["positions"]
  real = seg > 0
  # Segment ids run 1..n in order, then only padding.
  ids = seg[real]
  assert np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
  np.testing.assert_array_equal(real, np.arange(seq_len) < real.sum())  # padding only at the end
  if ids.size:
    assert ids[0] == 1 and ids[-1] == len(examples)
  for i in range(1, len(examples) + 1):
    where = np.flatnonzero(seg == i)
    np.testing.assert_array_equal(pos[where], np.arange(where.size))  # positions restart per segment
    np.testing.assert_array_equal(row["inputs"][where[1:]], row["targets"][where[:-1]])
    assert row["inputs"][where[0]] == 0
    prefix = row["prefix_mask"][where]
    weights = row["loss_weights"][where]
    if prefix.any():  # a prefix is a leading run starting at BOS
      k = int(prefix.sum())
      assert prefix[:k].all() and not prefix[k:].any()
      # inputs 0..k-1 are BOS and the prefix, so targets from k-1 on are predicted; when the prefix
      # fills the whole segment, nothing may be.
      assert not weights[:k - 1].any() and weights[k:].all()
      if k < where.size:
        assert weights[k - 1]
    else:
      assert weights.all()
  assert not np.any(row["loss_weights"][~real]) and not np.any(row["prefix_mask"][~real])
  assert set(np.unique(row["loss_weights"])) <= {0.0, 1.0}


@settings(max_examples=100, deadline=None)
@given(st.lists(example(), min_size=1, max_size=6), st.integers(1, 10))
def test_overflow_raises(examples, short_by):
  used = sum(len(e.tokens) for e in examples)
  if used - short_by < 1:
    return
  with pytest.raises(ValueError, match="row length"):
    pack_row(examples, used - short_by)
  pack_row(examples, used)  # an exact fit is fine


def test_example_filling_the_row_exactly_and_prefix_spanning_the_whole_example():
  a = Example(np.array([5, 6, 7], np.int32), prefix_len=3, objective_id=1)
  b = Example(np.array([8, 9], np.int32), prefix_len=0, objective_id=0)
  row = pack_row([a, b], 5)
  np.testing.assert_array_equal(row["inputs"], [0, 5, 6, 0, 8])
  np.testing.assert_array_equal(row["targets"], [5, 6, 7, 8, 9])
  np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2])
  np.testing.assert_array_equal(row["loss_weights"], [0, 0, 0, 1, 1])
  # The prefix of a must not leak into b's BOS: b is causal.
  np.testing.assert_array_equal(row["prefix_mask"], [True, True, True, False, False])
  np.testing.assert_array_equal(row["objective_ids"], [1, 1, 1, 0, 0])


@settings(max_examples=100, deadline=None)
@given(st.lists(fitting_row(), min_size=1, max_size=5))
def test_stack_rows_and_packing_efficiency(cases):
  seq_len = max(s for _, s in cases)
  rows = [pack_row(examples, seq_len) for examples, _ in cases]
  batch = stack_rows(rows)
  for f in FIELDS:
    assert batch[f].shape == (len(rows), seq_len) and batch[f].dtype == FIELD_DTYPES[f]
    for i, r in enumerate(rows):
      np.testing.assert_array_equal(batch[f][i], r[f])
  used = sum(len(e.tokens) for examples, _ in cases for e in examples)
  assert packing_efficiency(batch) == pytest.approx(used / (len(rows) * seq_len))


def test_packing_efficiency_extremes():
  assert packing_efficiency(empty_rows(3, 16)) == 0.0
  full = stack_rows([pack_row([Example(np.arange(3, 11, dtype=np.int32))] * 2, 16)])
  assert packing_efficiency(full) == 1.0
  half = stack_rows([pack_row([Example(np.arange(3, 11, dtype=np.int32))], 16)] * 2)
  assert packing_efficiency(half) == 0.5


@settings(max_examples=100, deadline=None)
@given(st.lists(fitting_row(), min_size=1, max_size=5))
def test_pack_rows_equals_pack_row_row_by_row(cases):
  """pack_rows (the pipeline's path, all rows at once) builds exactly what pack_row builds."""
  seq_len = max(s for _, s in cases)
  t = max(len(examples) for examples, _ in cases)
  targets = np.zeros((len(cases), seq_len), np.int32)
  per_example = np.zeros((3, len(cases), t), np.int64)  # length 0: no example
  for r, (examples, _) in enumerate(cases):
    if examples:
      targets[r, :sum(len(e.tokens) for e in examples)] = np.concatenate([e.tokens for e in examples])
    for i, e in enumerate(examples):
      per_example[:, r, i] = len(e.tokens), e.prefix_len, e.objective_id
  batch = pack_rows(targets, *per_example)
  expected = stack_rows([pack_row(examples, seq_len) for examples, _ in cases])
  for f in FIELDS:
    assert batch[f].dtype == FIELD_DTYPES[f]
    np.testing.assert_array_equal(batch[f], expected[f], err_msg=f)
