"""Function-preserving depth growth: each new layer starts as the identity on the residual stream.

A pre-norm layer adds `attn.out(...)` and `mlp.down(...)` (`mlp.proj` without a gate) to the residual
stream. With those output projections (and their biases) at zero, a copied layer adds nothing, so the
grown model's logits are the old model's, while its other weights (the copy) still give the zeroed
matrices non-zero gradients from the first step. The identity-start of new layers goes back to Net2Net's
deeper-net map (Chen et al. 2016); zeroing the copied blocks' output projections is LLaMA Pro's block
expansion (Wu et al. 2024): docs/stacking.md#function-preserving-growth.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax.train_state import TrainState

LAYERS = "layers"

# The parameters that write a layer's output into the residual stream (midas_jax/model/layers.py).
RESIDUAL_OUTPUTS: Dict[str, Tuple[str, ...]] = {"attn": ("out", "out_bias"), "mlp": ("down", "proj", "proj_bias")}


def _names(path) -> Tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _is_residual_output(names: Tuple[str, ...], outputs: Dict[str, Tuple[str, ...]]) -> bool:
  """True for a leaf whose path ends in ('layers', module, param) with param one of outputs[module]."""
  return len(names) >= 3 and names[-3] == LAYERS and names[-1] in outputs.get(names[-2], ())


def zero_rows(tree: Any, logical: Any, new_mask: np.ndarray,
              outputs: Dict[str, Tuple[str, ...]] = RESIDUAL_OUTPUTS) -> Any:
  """`tree` with the new layers' rows of every residual-output leaf at zero (params, or the optimizer
  moments that mirror them: Adam's mu/nu, Adafactor's v_row/v_col, matched by their path's end)."""
  mask = np.asarray(new_mask, bool)
  specs = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)

  def one(path, x, spec):
    if not _is_residual_output(_names(path), outputs) or LAYERS not in tuple(spec) or not mask.any():
      return x
    axis = tuple(spec).index(LAYERS)
    rows = mask.reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    return jnp.where(rows, jnp.zeros((), x.dtype), x)

  return jax.tree_util.tree_unflatten(treedef, [one(p, x, s) for (p, x), s in zip(flat, specs)])


def zero_residual_outputs(state: TrainState, logical: TrainState, new_mask: np.ndarray, stacking: Any,
                          outputs: Dict[str, Tuple[str, ...]] = RESIDUAL_OUTPUTS) -> TrainState:
  """The grown state with each new layer's residual output projections at zero (a GrowthOperator
  transform). Their optimizer moments follow StackingConfig.zeroed_moments: "zero" zeroes them, "copy"
  keeps what the gather gave them (the source layer's, under new_moments="copy")."""
  setting = getattr(stacking, "zeroed_moments", "zero")
  params = zero_rows(state.params, logical.params, new_mask, outputs)
  opt_state = state.opt_state
  if setting == "zero":
    opt_state = zero_rows(opt_state, logical.opt_state, new_mask, outputs)
  return TrainState(step=state.step, params=params, opt_state=opt_state)
