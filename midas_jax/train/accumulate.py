"""Gradient accumulation over microbatches, with the batch axes' reductions run once per step.

Under XLA's automatic partitioning a gradient is always its full value: each microbatch's gradient
is reduced over every mesh axis the batch is split along before it is added to the sum, so with n
microbatches those reductions run n times a step (over DCN too, where `data` spans slices).

To defer the reductions over some batch axes (`deferred_axes`), each microbatch's rows are split
into one group per device position along those axes, and the gradient is taken per group
(jax.vmap, its group axis split over those mesh axes by spmd_axis_name): a device computes and adds
up its own group's gradient, which no other device's rows touch, so nothing is reduced over those
axes inside the loop. One sum over the group axis after the loop is the one all-reduce (or
reduce-scatter) a step. Inside the vmap the logical-axis rules drop the deferred axes (the group
axis carries them), so the model's sharding constraints name each mesh axis once.

(A shard_map manual over the deferred axes says the same more directly, but XLA's SPMD partitioner
aborts partitioning the embedding gather inside one when the table is also split over fsdp and
tensor: a check in ExpandDeviceGroupsWithIota, jax 0.10.2.)

Which axes are deferred (docs/training.md#which-gradient-reductions-run-once-per-step):
  * `data` (with its cross-slice part, dcn_data): the parameters are replicated along it, so a
    group's gradient sum has the parameters' own shard shape; deferring costs no memory.
  * `fsdp` only with TrainerConfig.defer_fsdp_reduction: the parameters are split along it, so a
    device holds the whole (fsdp-unsplit) parameters and a float32 gradient sum of that size
    through the loop, and the per-layer reduce-scatters of ZeRO-3 become one per step.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from midas_jax.sharding import BATCH_AXES


def deferred_axes(mesh, microbatches: int, defer_fsdp: bool) -> Tuple[str, ...]:
  """The batch axes whose gradient reductions run once per step, in BATCH_AXES order: none with one
  microbatch (a single pass reduces once anyway, inside the layer loop where the reductions overlap
  the backward pass), else `data` (and `fsdp` when asked), each only where its size is > 1."""
  if microbatches == 1 or mesh is None or mesh.empty:
    return ()
  wanted = ("data", "fsdp") if defer_fsdp else ("data",)
  return tuple(a for a in BATCH_AXES if a in wanted and dict(mesh.shape).get(a, 1) > 1)


def _entry_axes(entry) -> Tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _without(entry, axes: Sequence[str]):
  """A spec or rule entry less the mesh axes `axes` (None when none is left)."""
  kept = tuple(a for a in _entry_axes(entry) if a not in axes)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def rules_without(rules, axes: Sequence[str]) -> Tuple[Tuple[str, Any], ...]:
  """The logical-axis rules with the mesh axes `axes` removed."""
  return tuple((logical, _without(mesh_axes, axes)) for logical, mesh_axes in rules)


def accumulate(micro_grads: Callable, params, micro: Mapping[str, jax.Array], weight_total: jax.Array,
               zero_aux: Mapping[str, jax.Array], sum_shardings=None, unroll: bool = False) -> Tuple[dict, Any]:
  """(summed metrics, float32 gradient sums) of micro_grads(params, microbatch, weight_total) over
  the leading axis of `micro`, inside one lax.scan; the sums are kept in `sum_shardings` when given.
  unroll: the scan unrolled (for a compiler's cost analysis, which counts a loop's body once)."""
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  return _scan(micro_grads, params, micro, weight_total, zeros, dict(zero_aux), sum_shardings, unroll)


def _scan(micro_grads: Callable, params, micro, weight_total, zeros, zero_aux, sum_shardings, unroll: bool):
  """The loop: each microbatch's gradients (cast to float32) and metrics added to `zeros`, `zero_aux`.
  The sums' placement is set on `zeros`; the loop's carry keeps it."""
  if sum_shardings is not None:
    zeros = jax.lax.with_sharding_constraint(zeros, sum_shardings)

  def body(carry, one):
    grad_sum, aux_sum = carry
    grads, aux = micro_grads(params, one, weight_total)
    grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
    return (grad_sum, jax.tree.map(jnp.add, aux_sum, aux)), None

  (grads, aux), _ = jax.lax.scan(body, (zeros, zero_aux), micro, unroll=bool(unroll))
  return aux, grads


def accumulate_deferred(micro_grads: Callable, params, micro: Mapping[str, jax.Array], weight_total: jax.Array,
                        zero_aux: Mapping[str, jax.Array], param_specs, axes: Sequence[str], rules,
                        mesh, unroll: bool = False) -> Tuple[dict, Any]:
  """accumulate(), with the reductions over the mesh axes `axes` run once, after the loop.

  micro: [microbatches, rows, ...], rows split over BATCH_AXES as the step's batch is; param_specs:
  the parameters' PartitionSpecs; rules: the step's logical-axis rules; mesh: the step's mesh.
  Returns the sums in the parameters' specs (the caller's constraint places them).
  """
  axes = tuple(axes)
  groups = math.prod(dict(mesh.shape)[a] for a in axes)
  rest = _without(BATCH_AXES, axes)  # the batch axes still split within a group
  is_spec = lambda x: isinstance(x, P)
  inside = jax.tree.map(lambda s: P(*(_without(e, axes) for e in s)), param_specs, is_leaf=is_spec)
  grouped = jax.tree.map(lambda s: P(axes, *s), inside, is_leaf=is_spec)
  constrain = jax.lax.with_sharding_constraint

  def split(x):  # [microbatches, rows, ...] -> [microbatches, groups, rows / groups, ...], no data moved
    x = x.reshape((x.shape[0], groups, x.shape[1] // groups) + x.shape[2:])
    return constrain(x, P(None, axes, rest))

  if "fsdp" in axes:  # each device gathers the whole parameters once, not once per microbatch and layer
    params = constrain(params, inside)
  per_group = jax.vmap(micro_grads, in_axes=(None, 0, None), spmd_axis_name=axes)

  def group_grads(params, one, weight_total):
    with nn.logical_axis_rules(list(rules_without(rules, axes))):
      return per_group(params, one, weight_total)

  zeros = jax.tree.map(lambda p: jnp.zeros((groups,) + p.shape, jnp.float32), params)
  zero_aux = jax.tree.map(lambda a: jnp.zeros((groups,) + a.shape, a.dtype), dict(zero_aux))
  micro = jax.tree.map(split, dict(micro))
  aux, grads = _scan(group_grads, params, micro, weight_total, zeros, zero_aux, grouped, unroll)
  # The group axis summed away: XLA's one all-reduce (reduce-scatter into fsdp shards) a step.
  return jax.tree.map(lambda a: a.sum(0), aux), jax.tree.map(lambda g: g.sum(0), grads)
