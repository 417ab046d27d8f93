"""Growth operators: which old layer each layer of the grown model copies, and what happens after.

An operator (`GrowthOperator`) has three parts:
- `provenance(num_blocks, block_size) -> provenance` over a model of `num_blocks * block_size` layers.
  `provenance[j]` is the old layer that new layer j copies, or -1 for a freshly initialized layer; the
  grower gathers parameters (and optimizer moments) with `x[..., provenance, ...]` along the `layers`
  axis and takes the new depth from `len(provenance)`.
- `transform(state, logical, new_mask, stacking) -> state` (optional): a pure function over the
  gathered TrainState (logical: its logical specs; new_mask: True for each new layer, new_layer_mask;
  stacking: the run's StackingConfig), run inside the
  grower's one jitted function, so its output lands in the grown layout's shardings.
- `preserves_function`: whether the grown model computes what the old one did (a plain copy does not:
  the copied layer adds its update to the residual stream a second time).
Index-map operators (midas, gradstack, gstack, fresh_block) are only a provenance; registering a plain
function `fn(num_blocks, block_size)` makes one. The function-preserving ones live in `preserve.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from midas_jax.errors import ConfigError, require
from midas_jax.stacking import preserve

Provenance = Callable[[int, int], np.ndarray]
Transform = Callable[[Any, Any, np.ndarray, Any], Any]


@dataclasses.dataclass(frozen=True)
class GrowthOperator:
  """A placement (provenance), an optional post-gather transform of the grown TrainState, and whether
  the two together preserve the model's function. Calling it runs the provenance, so an operator is
  still usable where a plain index map was."""

  provenance: Provenance
  transform: Optional[Transform] = None
  preserves_function: bool = False

  def __call__(self, num_blocks: int, block_size: int) -> np.ndarray:
    return self.provenance(num_blocks, block_size)


Operator = Union[GrowthOperator, Provenance]

_REGISTRY: Dict[str, GrowthOperator] = {}


def register_operator(name: str, fn: Optional[Operator] = None):
  """Registers `fn` under `name`; usable as `register_operator("x", fn)` or `@register_operator("x")`.

  fn: a GrowthOperator, or a plain `fn(num_blocks, block_size) -> provenance` (an index-map operator
  that does not preserve the function). Returns the registered GrowthOperator.
  """
  require(isinstance(name, str) and name != "", "StackingConfig.operator",
          f"operator names must be non-empty strings, got {name!r}", "register under a plain name")

  def add(f: Operator) -> GrowthOperator:
    op = f if isinstance(f, GrowthOperator) else GrowthOperator(provenance=f)
    _REGISTRY[name] = op
    return op

  return add if fn is None else add(fn)


def known_operators() -> Tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def get_operator(name: str) -> GrowthOperator:
  if name not in _REGISTRY:
    raise ConfigError("StackingConfig.operator", f"unknown growth operator {name!r}",
                      f"use one of {known_operators()}, or register one with "
                      "midas_jax.stacking.operators.register_operator before building the config")
  return _REGISTRY[name]


def _blocks(num_blocks: int, block_size: int) -> np.ndarray:
  require(isinstance(num_blocks, (int, np.integer)) and num_blocks >= 1, "num_blocks",
          f"must be a positive int, got {num_blocks!r}", "grow a model of at least one block")
  require(isinstance(block_size, (int, np.integer)) and block_size >= 1, "StackingConfig.block_size",
          f"must be a positive int, got {block_size!r}", "use a positive number of layers per block")
  return np.arange(num_blocks * block_size, dtype=np.int64).reshape(num_blocks, block_size)


@register_operator("midas")
def midas(num_blocks: int, block_size: int) -> np.ndarray:
  """MIDAS: copy block ceil(n/2) (1-indexed) and insert the copy right after it."""
  blocks = _blocks(num_blocks, block_size)
  middle = (num_blocks + 1) // 2 - 1  # ceil(n/2) - 1, 0-indexed
  order = list(range(middle + 1)) + [middle] + list(range(middle + 1, num_blocks))
  return blocks[order].reshape(-1)


@register_operator("gradstack")
def gradstack(num_blocks: int, block_size: int) -> np.ndarray:
  """Gradual stacking: copy the top block and put the copy on top."""
  blocks = _blocks(num_blocks, block_size)
  return blocks[list(range(num_blocks)) + [num_blocks - 1]].reshape(-1)


@register_operator("fresh_block")
def fresh_block(num_blocks: int, block_size: int) -> np.ndarray:
  """Extension example: a freshly initialized block on top (no copying; the control for copying)."""
  blocks = _blocks(num_blocks, block_size)
  return np.concatenate([blocks.reshape(-1), np.full(block_size, -1, dtype=np.int64)])


@register_operator("gstack")
def gstack(num_blocks: int, block_size: int) -> np.ndarray:
  """Extension example: G_stack (Du et al. 2024), the whole model stacked on itself, so depth doubles.

  This breaks the "stage i has i blocks" rule of MIDAS and GradStack: stage i has 2^(i-1) blocks.
  `schedule.schedule_from_config` accounts for it by running the operator (`growth_maps`), so the
  config must satisfy num_layers == block_size * 2^(num_stages - 1); the trainer takes each new depth
  from len(provenance), never from the stage number.
  """
  layers = _blocks(num_blocks, block_size).reshape(-1)
  return np.concatenate([layers, layers])


register_operator("midas_zero", GrowthOperator(provenance=midas, transform=preserve.zero_residual_outputs,
                                                preserves_function=True))
register_operator("gradstack_zero", GrowthOperator(provenance=gradstack, transform=preserve.zero_residual_outputs,
                                                   preserves_function=True))


def provenance_for(name: str, num_layers: int, block_size: int) -> np.ndarray:
  """Runs operator `name` on a model of `num_layers` layers and checks the map it returns.

  A map must be a 1-D int array of entries in [-1, num_layers) that keeps whole blocks (its length a
  multiple of block_size, so the next growth sees whole blocks) and grows the model.
  """
  require(num_layers % block_size == 0, "StackingConfig.block_size",
          f"block_size={block_size} does not divide the current depth {num_layers}",
          "pick a block size that divides every stage's depth")
  prov = np.asarray(get_operator(name)(num_layers // block_size, block_size))
  ok = (prov.ndim == 1 and np.issubdtype(prov.dtype, np.integer) and len(prov) > num_layers
        and len(prov) % block_size == 0 and bool(np.all((prov >= -1) & (prov < num_layers))))
  require(ok, "StackingConfig.operator",
          f"operator {name!r} returned an invalid provenance map for {num_layers} layers: {prov!r}",
          "return a 1-D int array, longer than the old depth and a multiple of block_size, of old "
          "layer indices (or -1 for a fresh layer)")
  return prov.astype(np.int64)


def growth_maps(name: str, num_stages: int, block_size: int, start_blocks: int = 1) -> List[np.ndarray]:
  """The provenance map of every growth when growth starts from `start_blocks` blocks and applies
  `name` num_stages - 1 times: maps[i] grows stage i + 1 into stage i + 2."""
  maps: List[np.ndarray] = []
  depth = start_blocks * block_size
  for _ in range(num_stages - 1):
    maps.append(provenance_for(name, depth, block_size))
    depth = len(maps[-1])
  return maps


def stage_depths(name: str, num_stages: int, block_size: int, start_blocks: int = 1) -> Tuple[int, ...]:
  """Depth of every stage when growth starts from `start_blocks` blocks and applies `name` num_stages-1 times."""
  maps = growth_maps(name, num_stages, block_size, start_blocks)
  return (start_blocks * block_size,) + tuple(len(m) for m in maps)


def new_layer_mask(provenance: Sequence[int]) -> np.ndarray:
  """True where a grown layer is new: fresh (-1), or a copy other than its source's first occurrence."""
  prov = np.asarray(provenance)
  seen = set()
  mask = np.zeros(len(prov), dtype=bool)
  for j, p in enumerate(prov.tolist()):
    mask[j] = p == -1 or p in seen
    seen.add(p)
  return mask


@dataclasses.dataclass(frozen=True)
class LayerRecord:
  """Where one layer came from.

  born_stage / born_index: the stage (1-indexed) it first appeared in and its layer index then.
  origin: the stage-1 layer it ultimately descends from (None for a fresh layer or its copies).
  copied_from: the layer index, in the previous stage's model, it was copied from (None if it was
    initialized, at stage 1 or fresh).
  """

  born_stage: int
  born_index: int
  origin: Optional[int]
  copied_from: Optional[int] = None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "LayerRecord":
    return cls(**d)


def initial_lineage(num_layers: int) -> List[LayerRecord]:
  """Stage 1: every layer is initialized and is its own origin."""
  return [LayerRecord(born_stage=1, born_index=i, origin=i) for i in range(num_layers)]


def compose_lineage(lineage: Sequence[LayerRecord], provenance: Sequence[int],
                    stage: int) -> List[LayerRecord]:
  """The records of the model grown by `provenance` into stage `stage`.

  A layer that is its source's first occurrence is the same layer, moved: it keeps its record.
  A new copy inherits the source's origin and is born now, copied_from the source's old index.
  """
  prov = np.asarray(provenance).tolist()
  require(all(-1 <= p < len(lineage) for p in prov), "provenance",
          f"entries must be in [-1, {len(lineage)}), got {prov}", "pass the map the operator returned")
  mask = new_layer_mask(prov)
  out = []
  for j, (p, new) in enumerate(zip(prov, mask)):
    if p == -1:
      out.append(LayerRecord(born_stage=stage, born_index=j, origin=None))
    elif new:
      out.append(LayerRecord(born_stage=stage, born_index=j, origin=lineage[p].origin, copied_from=p))
    else:
      out.append(lineage[p])
  return out
