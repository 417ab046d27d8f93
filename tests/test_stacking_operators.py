"""Growth operators: provenance maps against block lists built by hand, the registry, lineage."""

import math

import numpy as np
import pytest

from midas_jax.errors import ConfigError
from midas_jax.stacking import operators as ops


def blocks_of(num_blocks, b):
  return [[n * b + j for j in range(b)] for n in range(num_blocks)]


def flatten(blocks):
  return [layer for block in blocks for layer in block]


def midas_by_hand(num_blocks, b):
  blocks = blocks_of(num_blocks, b)
  middle = math.ceil(num_blocks / 2)  # 1-indexed, as in the paper
  return flatten(blocks[:middle] + [list(blocks[middle - 1])] + blocks[middle:])


def gradstack_by_hand(num_blocks, b):
  blocks = blocks_of(num_blocks, b)
  return flatten(blocks + [list(blocks[-1])])


@pytest.mark.parametrize("b", [1, 2, 3, 4])
@pytest.mark.parametrize("n", range(1, 9))
def test_provenance_matches_hand_built_blocks(n, b):
  for fn, by_hand in ((ops.midas, midas_by_hand), (ops.gradstack, gradstack_by_hand)):
    prov = fn(n, b)
    assert prov.dtype.kind == "i" and prov.ndim == 1
    assert prov.tolist() == by_hand(n, b)
    assert len(prov) == (n + 1) * b


def test_midas_middle_block_sequence():
  def copied_block(n):
    prov = ops.midas(n, 1)
    return int(prov[np.flatnonzero(ops.new_layer_mask(prov))[0]]) + 1  # 1-indexed block copied
  assert [copied_block(n) for n in range(1, 7)] == [1, 1, 2, 2, 3, 3]


def test_midas_inserts_the_copy_right_after_the_original():
  prov = ops.midas(4, 3)  # middle block 2 = layers 3, 4, 5
  assert prov.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11]
  assert np.flatnonzero(ops.new_layer_mask(prov)).tolist() == [6, 7, 8]


@pytest.mark.parametrize("n", range(1, 9))
def test_gradstack_always_copies_the_top(n):
  b = 3
  prov = ops.gradstack(n, b)
  assert prov[-b:].tolist() == prov[-2 * b:-b].tolist() == list(range((n - 1) * b, n * b))
  assert ops.new_layer_mask(prov).tolist() == [False] * (n * b) + [True] * b


def test_fresh_block_and_gstack():
  prov = ops.fresh_block(3, 2)
  assert prov.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
  assert ops.new_layer_mask(prov).tolist() == [False] * 6 + [True] * 2
  doubled = ops.gstack(3, 2)
  assert doubled.tolist() == list(range(6)) * 2 and len(doubled) == 12
  assert ops.new_layer_mask(doubled).tolist() == [False] * 6 + [True] * 6
  assert ops.stage_depths("gstack", 4, 2) == (2, 4, 8, 16)
  assert ops.stage_depths("midas", 4, 2) == (2, 4, 6, 8)
  assert ops.stage_depths("fresh_block", 3, 5) == (5, 10, 15)


def test_registry():
  assert {"midas", "gradstack", "fresh_block", "gstack"} <= set(ops.known_operators())
  assert ops.get_operator("midas") is ops.midas
  with pytest.raises(ConfigError) as e:
    ops.get_operator("middle")
  assert e.value.setting == "StackingConfig.operator"
  assert "gradstack" in e.value.fix and "midas" in e.value.fix

  @ops.register_operator("_test_bottom")
  def bottom(num_blocks, block_size):  # copies the first block onto the top
    layers = np.arange(num_blocks * block_size)
    return np.concatenate([layers, layers[:block_size]])

  try:
    assert bottom(2, 2).tolist() == [0, 1, 2, 3, 0, 1]  # the decorator returns the function
    assert ops.get_operator("_test_bottom") is bottom
    assert ops.provenance_for("_test_bottom", 4, 2).tolist() == [0, 1, 2, 3, 0, 1]
    ops.register_operator("_test_bad", lambda n, b: np.arange(n * b))  # does not grow
    with pytest.raises(ConfigError, match="invalid provenance"):
      ops.provenance_for("_test_bad", 4, 2)
  finally:
    ops._REGISTRY.pop("_test_bottom", None)
    ops._REGISTRY.pop("_test_bad", None)
  with pytest.raises(ConfigError):
    ops.register_operator("", ops.midas)
  with pytest.raises(ConfigError, match="block_size"):
    ops.provenance_for("midas", 6, 4)


def test_operator_argument_checks():
  with pytest.raises(ConfigError):
    ops.midas(0, 2)
  with pytest.raises(ConfigError):
    ops.gradstack(2, 0)


def test_new_layer_mask():
  assert ops.new_layer_mask([0, 1, 0, 1, -1, 2]).tolist() == [False, False, True, True, True, False]
  assert ops.new_layer_mask([]).tolist() == []
  assert ops.new_layer_mask(np.array([-1, -1])).tolist() == [True, True]


def grow(operator, num_blocks_final, b):
  """Grows from one block to num_blocks_final blocks; returns the lineage after each stage."""
  lineage = ops.initial_lineage(b)
  history = [lineage]
  for stage in range(2, num_blocks_final + 1):
    prov = ops.provenance_for(operator, len(lineage), b)
    lineage = ops.compose_lineage(lineage, prov, stage)
    history.append(lineage)
  return history


def test_midas_lineage_from_one_to_four_blocks():
  b = 3
  history = grow("midas", 4, b)
  final = history[-1]
  assert len(final) == 4 * b
  assert all(0 <= r.origin < b for r in final)
  # Layer j of every block descends from stage-1 layer j: stacking copies whole blocks.
  assert [r.origin for r in final] == list(range(b)) * 4
  # Births: the block layout of 1 -> 2 -> 3 -> 4 blocks with MIDAS middle copies.
  # stage 2: [B1 B1'] (copy of block 1); stage 3: [B1 B1'' B1'] (block 1 again, copy after it);
  # stage 4: [B1 B1'' B1''' B1'] (block 2 is B1'', copy after it).
  assert [final[n * b].born_stage for n in range(4)] == [1, 3, 4, 2]
  assert [final[n * b].copied_from for n in range(4)] == [None, 0, b, 0]
  assert [r.born_index for r in final[b:2 * b]] == [b, b + 1, b + 2]
  assert [r.born_index for r in final[2 * b:3 * b]] == [2 * b, 2 * b + 1, 2 * b + 2]
  assert [r.born_index for r in final[3 * b:]] == [b, b + 1, b + 2]  # B1' was born at index b, since moved
  assert all(r.copied_from is None and r.born_stage == 1 for r in final[:b])
  assert all(ops.LayerRecord.from_dict(r.to_dict()) == r for r in final)


def test_gradstack_and_fresh_lineage():
  b = 2
  final = grow("gradstack", 3, b)[-1]
  assert [r.born_stage for r in final] == [1, 1, 2, 2, 3, 3]
  assert [r.copied_from for r in final] == [None, None, 0, 1, 2, 3]
  assert [r.origin for r in final] == [0, 1] * 3
  fresh = grow("fresh_block", 3, b)[-1]
  assert [r.origin for r in fresh] == [0, 1, None, None, None, None]
  assert [r.born_stage for r in fresh] == [1, 1, 2, 2, 3, 3]
  # A copy of a fresh layer stays without a stage-1 origin.
  again = ops.compose_lineage(fresh, ops.gradstack(3, b), 4)
  assert again[-1].origin is None and again[-1].copied_from == 5 and again[-1].born_stage == 4


def test_compose_lineage_checks_the_map():
  with pytest.raises(ConfigError):
    ops.compose_lineage(ops.initial_lineage(2), [0, 1, 2], 2)
