"""Growing a TrainState in depth: one gather along the `layers` axis (docs/architecture.md#growth-is-a-gather).

`provenance[j]` is the old layer that new layer j copies (-1: a freshly initialized layer); the
operators in `operators.py` compute it. Every parameter with a `layers` axis, and every optimizer
moment mirroring one (Adam's mu/nu, Adafactor's factored v_row/v_col), becomes
`take(x, provenance, axis=layers)`. Embeddings, final norm, head, step and optax counts pass through.

The `layers` axis is found from the logical axis names, never from shapes, and is never sharded
(MeshConfig refuses rules that map it), so growth changes only that axis: every other dimension keeps
its mesh layout and the gather moves no data between devices. The new model's layout comes from a
stage built for the deeper model (train/build.py):

  deeper = build_stage(config, data=(build.vocab, build.pipeline), num_layers=len(provenance))
  grower = make_grower(build.layout, deeper.layout, provenance, new_moments="copy")
  state = grower(state)            # grower(state, fresh_state) when provenance has -1 entries
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from midas_jax.configs import GROWTH_MOMENTS
from midas_jax.errors import require
from midas_jax.stacking.operators import GrowthOperator, get_operator, new_layer_mask
from midas_jax.train_state import StateLayout, TrainState

LAYERS = "layers"


def _is_spec(x) -> bool:
  return isinstance(x, P)


def layers_axis(spec) -> Optional[int]:
  """The index of the `layers` logical axis in a logical PartitionSpec, or None."""
  axes = [i for i, name in enumerate(spec) if name == LAYERS]
  if len(axes) > 1:
    raise ValueError(f"logical spec {spec} names the '{LAYERS}' axis more than once")
  return axes[0] if axes else None


def _rows(mask: np.ndarray, axis: int, ndim: int) -> np.ndarray:
  """A per-layer mask shaped to broadcast against an array whose layers axis is `axis`."""
  return mask.reshape([-1 if i == axis else 1 for i in range(ndim)])


def grow_tree(tree: Any, logical_specs: Any, provenance: Sequence[int], new_mask=None,
              zero_new: bool = False, fresh: Any = None) -> Any:
  """Gathers every leaf of `tree` whose logical spec has a `layers` axis: take(x, provenance, axis).

  provenance: static (host) ints, -1 for a fresh layer, whose values then come from `fresh` (a tree
  like `tree` at the new depth). zero_new: rows where new_mask is True become zero (optimizer
  moments of new layers); fresh rows take `fresh` regardless. Leaves without a layers axis (embeddings,
  final norm, counts) are returned as they are.
  """
  prov = np.asarray(provenance)
  require(prov.ndim == 1 and np.issubdtype(prov.dtype, np.integer) and bool(np.all(prov >= -1)),
          "provenance", f"must be a 1-D int array of old layer indices or -1, got {prov!r}",
          "pass the map an operator returned")
  fresh_rows = prov < 0
  require(fresh is not None or not fresh_rows.any(), "provenance",
          "has fresh (-1) layers but no fresh values were given", "pass fresh (or fresh_state)")
  index = np.where(fresh_rows, 0, prov)
  zero_rows = None
  if zero_new:
    require(new_mask is not None and len(new_mask) == len(prov), "new_mask",
            f"zero_new needs one bool per new layer ({len(prov)})", "pass new_layer_mask(provenance)")
    zero_rows = np.asarray(new_mask, bool) & ~fresh_rows

  def grow(x, spec, new):
    axis = layers_axis(spec)
    if axis is None:
      return x
    depth = x.shape[axis]
    if prov.max(initial=-1) >= depth:
      raise ValueError(f"provenance {prov.tolist()} refers to layers beyond the old depth {depth}")
    out = jnp.take(x, index, axis=axis)
    if zero_rows is not None and zero_rows.any():
      out = jnp.where(_rows(zero_rows, axis, out.ndim), jnp.zeros((), out.dtype), out)
    if fresh_rows.any():
      out = jnp.where(_rows(fresh_rows, axis, out.ndim), new, out)
    return out

  if fresh is None:
    return jax.tree.map(lambda x, spec: grow(x, spec, None), tree, logical_specs)
  return jax.tree.map(grow, tree, logical_specs, fresh)


def grow_state(state: TrainState, logical: TrainState, provenance: Sequence[int],
               new_moments: str = "copy", fresh_state: Optional[TrainState] = None,
               new_mask=None) -> TrainState:
  """The TrainState of the grown model; `logical` holds the old state's logical specs (layout.logical).

  Parameters are gathered (fresh layers from fresh_state.params). Every optimizer leaf with a layers
  axis is gathered the same way; a new layer (new_mask, by default operators.new_layer_mask: a copy
  other than its source's first occurrence) keeps its source's moments ("copy") or starts from zero
  ("zero"); fresh layers' moments are zero. The step is unchanged, so the schedule continues. optax's
  counts are global, so zeroed rows get no bias correction of their own: Adam's first update of them is
  (1 - b1) / sqrt(1 - b2) * sign(grad), not the sign(grad) of a fresh optimizer.
  """
  require(new_moments in GROWTH_MOMENTS, "StackingConfig.new_moments",
          f"must be one of {GROWTH_MOMENTS}, got {new_moments!r}", "copy the source's moments or zero them")
  prov = np.asarray(provenance)
  mask = new_layer_mask(prov) if new_mask is None else np.asarray(new_mask, bool)
  params = grow_tree(state.params, logical.params, prov,
                     fresh=None if fresh_state is None else fresh_state.params)
  # Fresh rows of moments are zero: what tx.init gives Adam and Adafactor, without a fresh opt state.
  zeros = None
  if (prov < 0).any():
    zeros = jax.tree.map(lambda x: jnp.zeros((), x.dtype), state.opt_state)
  opt_state = grow_tree(state.opt_state, logical.opt_state, prov, mask, zero_new=new_moments == "zero",
                        fresh=zeros)
  return TrainState(step=state.step, params=params, opt_state=opt_state)


def _specs(layout: StateLayout):
  return jax.tree.leaves(layout.logical, is_leaf=_is_spec)


def _depth(layout: StateLayout) -> int:
  depths = {a.shape[layers_axis(s)] for a, s in zip(jax.tree.leaves(layout.abstract), _specs(layout))
            if layers_axis(s) is not None}
  if len(depths) != 1:
    raise ValueError(f"expected one depth along the '{LAYERS}' axis of the layout, found {sorted(depths)}")
  return depths.pop()


def _check_layers_unsharded(layout: StateLayout, which: str) -> None:
  for sharding, spec in zip(jax.tree.leaves(layout.shardings), _specs(layout)):
    axis = layers_axis(spec)
    mesh_spec = tuple(sharding.spec)
    require(axis is None or axis >= len(mesh_spec) or mesh_spec[axis] is None, "MeshConfig.rules",
            f"the {which} layout shards the '{LAYERS}' axis ({sharding.spec})",
            "map 'layers' to None: growth must never change the other axes' layout")


def _check_shapes(grown, expected) -> None:
  got = jax.tree_util.tree_flatten_with_path(grown)
  want = jax.tree_util.tree_flatten_with_path(expected)
  if got[1] != want[1]:
    raise ValueError(f"the grown state's structure differs from the new layout's:\n{got[1]}\nvs\n{want[1]}")
  bad = [f"{jax.tree_util.keystr(p)}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
         for (p, a), (_, b) in zip(got[0], want[0]) if (a.shape, a.dtype) != (b.shape, b.dtype)]
  if bad:
    raise ValueError("the grown state does not match the new model's layout (did a depth change alter "
                     "how the optimizer factors a moment?):\n  " + "\n  ".join(bad))


def make_grower(old_layout: StateLayout, new_layout: StateLayout, provenance: Sequence[int],
                new_moments: str = "copy", new_mask=None, operator=None,
                stacking: Any = None) -> Callable[..., TrainState]:
  """grower(state[, fresh_state]) -> the grown state, laid out in new_layout.shardings.

  One jitted grow_state, donating the old state (leaves that keep their shape reuse its buffers).
  operator (a registered name or a GrowthOperator; default stacking.operator, or none): its transform,
  if any, runs on the gathered state inside the same jitted function, with stacking (the run's
  StackingConfig) as its settings.
  fresh_state (a TrainState at the new depth; only its params are read) is required when provenance
  has -1 entries. Shapes are checked against the new layout before anything is compiled.
  """
  prov = np.asarray(provenance)
  old_depth, new_depth = _depth(old_layout), _depth(new_layout)
  require(len(prov) == new_depth and bool(np.all((prov >= -1) & (prov < old_depth))), "provenance",
          f"{prov.tolist()} does not map {old_depth} old layers to the new layout's {new_depth}",
          "build the new stage at depth len(provenance) (build_stage(..., num_layers=))")
  _check_layers_unsharded(old_layout, "old")
  _check_layers_unsharded(new_layout, "new")
  needs_fresh = bool((prov < 0).any())
  if operator is None and stacking is not None:
    operator = stacking.operator
  op = get_operator(operator) if isinstance(operator, str) else operator
  require(op is None or isinstance(op, GrowthOperator), "StackingConfig.operator",
          f"expected an operator name or a GrowthOperator, got {operator!r}", "pass a registered name")
  transform = None if op is None else op.transform
  mask = new_layer_mask(prov) if new_mask is None else np.asarray(new_mask, bool)

  def grow(state, fresh_params):
    fresh = None if fresh_params is None else TrainState(step=state.step, params=fresh_params, opt_state=None)
    grown = grow_state(state, old_layout.logical, prov, new_moments, fresh, mask)
    return grown if transform is None else transform(grown, new_layout.logical, mask, stacking)

  fresh_abstract = new_layout.abstract.params if needs_fresh else None
  _check_shapes(jax.eval_shape(grow, old_layout.abstract, fresh_abstract), new_layout.abstract)
  fresh_shardings = new_layout.shardings.params if needs_fresh else None
  jitted = jax.jit(grow, in_shardings=(old_layout.shardings, fresh_shardings),
                   out_shardings=new_layout.shardings, donate_argnums=0)

  def grower(state: TrainState, fresh_state: Optional[TrainState] = None) -> TrainState:
    require(fresh_state is not None or not needs_fresh, "provenance",
            "has fresh (-1) layers but no fresh_state was given", "pass the new experiment's init_state()")
    with warnings.catch_warnings():
      # Layer leaves change shape, so only the untouched leaves' donated buffers can be reused.
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      return jitted(state, fresh_state.params if needs_fresh else None)

  return grower
