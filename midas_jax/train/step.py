"""Loss, train step and eval step: pure functions, jitted by the loop with explicit shardings.

The loss is built from sums (token loss, z-loss, tokens, per objective) divided once by the
batch's total loss weight, so the same numbers come out whether the sums are taken over the whole
sequence, chunk by chunk (TrainerConfig.loss_chunk) or microbatch by microbatch
(TrainerConfig.microbatches).
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from midas_jax.data.ul2.objectives import OBJECTIVES
from midas_jax.model import Decoder
from midas_jax.train import accumulate
from midas_jax.train_state import TrainState


def loss_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array,
              objective_ids: jax.Array) -> Dict[str, jax.Array]:
  """Weighted sums over every token: cross-entropy, logsumexp ** 2 (for the z-loss), weights, per objective."""
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  token_loss = lse - target_logit
  one_hot = jax.nn.one_hot(objective_ids, len(OBJECTIVES), dtype=jnp.float32) * weights[..., None]
  return {"loss": (token_loss * weights).sum(), "z": (jnp.square(lse) * weights).sum(), "tokens": weights.sum(),
          # A sum of products: as an einsum it would be a float32 matmul in a bfloat16 step, which
          # tests/test_mixed_precision.py refuses (docs/model.md#which-ops-run-in-which-dtype).
          "objective_loss_sum": (token_loss[..., None] * one_hot).sum(axis=(0, 1)),
          "objective_weight_sum": one_hot.sum(axis=(0, 1))}


def chunked_loss_sums(head: Callable[[jax.Array], jax.Array], features: jax.Array, targets: jax.Array,
                      weights: jax.Array, objective_ids: jax.Array, chunk: int) -> Dict[str, jax.Array]:
  """loss_sums(head(features), ...) taken over `chunk` positions at a time.

  Each chunk's logits are made, reduced to sums and dropped; the backward pass makes them again
  (jax.checkpoint), so float32 logits [rows, chunk, vocab] are the most ever held. A ragged last
  chunk is padded with zero-weight positions, which add nothing to any sum.
  """
  length = features.shape[1]
  if chunk <= 0 or chunk >= length:
    return loss_sums(head(features), targets, weights, objective_ids)
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length

  def chunks(x):  # [rows, length, ...] -> [num_chunks, rows, chunk, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.swapaxes(x.reshape((x.shape[0], num_chunks, chunk) + x.shape[2:]), 0, 1)

  @jax.checkpoint
  def one_chunk(x, t, w, o):
    return loss_sums(head(x), t, w, o)

  def body(total, xs):
    return jax.tree.map(jnp.add, total, one_chunk(*xs)), None

  total, _ = jax.lax.scan(body, _zero_sums(), tuple(chunks(a) for a in (features, targets, weights, objective_ids)))
  return total


def _zero_sums() -> Dict[str, jax.Array]:
  zero = jnp.zeros((), jnp.float32)
  return {"loss": zero, "z": zero, "tokens": zero, "objective_loss_sum": jnp.zeros(len(OBJECTIVES), jnp.float32),
          "objective_weight_sum": jnp.zeros(len(OBJECTIVES), jnp.float32)}


def loss_and_metrics(sums: Dict[str, jax.Array], weight_total: jax.Array, z_loss: float) -> Tuple[jax.Array, dict]:
  """(the scalar to minimise, metrics): mean token cross-entropy + z_loss * mean(logsumexp ** 2)."""
  loss = sums["loss"] / weight_total
  z_term = z_loss * sums["z"] / weight_total
  aux = {"loss": loss, "z_loss": z_term, "tokens": sums["tokens"],
         "objective_loss_sum": sums["objective_loss_sum"], "objective_weight_sum": sums["objective_weight_sum"]}
  return loss + z_term, aux


def _weight_total(weights: jax.Array) -> jax.Array:
  return jnp.maximum(weights.sum(), 1e-9)


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                           objective_ids: jax.Array, z_loss: float = 0.0) -> Tuple[jax.Array, dict]:
  """Mean token cross-entropy under `weights`, plus z_loss * mean(logsumexp ** 2), from whole logits.

  Returns the scalar to minimise and sums from which per-objective losses are derived, so they
  average correctly across steps and hosts.
  """
  return loss_and_metrics(loss_sums(logits, targets, weights, objective_ids), _weight_total(weights), z_loss)


def split_microbatches(batch: Mapping[str, jax.Array], microbatches: int) -> Dict[str, jax.Array]:
  """[rows, ...] -> [microbatches, rows / microbatches, ...]; microbatch i holds rows i, i + n, i + 2n, ...

  Striding keeps each microbatch spread over every device: a device's contiguous rows split
  locally (its rows divide by n whenever the global batch divides by n x data x fsdp).
  """
  def split(x):
    x = jnp.swapaxes(x.reshape((x.shape[0] // microbatches, microbatches) + x.shape[1:]), 0, 1)
    return nn.with_logical_constraint(x, (None, "batch", "length")) if x.ndim == 3 else x

  return {k: split(v) for k, v in batch.items()}


def make_loss_fn(model: Decoder, z_loss: float, loss_chunk: int) -> Callable:
  """(params, batch, weight_total) -> (scalar loss, metrics), the head applied chunk by chunk."""
  def loss_fn(params, batch, weight_total):
    variables = {"params": params}
    features = model.apply(variables, batch, method=Decoder.features)
    head = lambda x: model.apply(variables, x, method=Decoder.head_logits)
    sums = chunked_loss_sums(head, features, batch["targets"], batch["loss_weights"], batch["objective_ids"],
                             loss_chunk)
    return loss_and_metrics(sums, weight_total, z_loss)

  return loss_fn


def accumulated_gradients(loss_fn: Callable, params, batch: Mapping[str, jax.Array], microbatches: int,
                          grad_shardings=None, defer_fsdp: bool = False,
                          unroll: bool = False) -> Tuple[dict, object]:
  """(metrics, gradients) of the whole batch, summed over microbatches inside one lax.scan.

  Every microbatch's loss is divided by the whole batch's weight, so the sums are the full batch's
  loss and gradient. Gradients accumulate in float32 (in the parameters' shardings when given).
  With grad_shardings under a mesh (jax.set_mesh), the reductions over the `data` axis (and over
  `fsdp` with defer_fsdp) run once after the loop, not once per microbatch (train/accumulate.py).
  unroll: the microbatch loop unrolled, for a compiler's cost analysis (it counts a loop's body once).
  """
  weight_total = _weight_total(batch["loss_weights"])
  grad_fn = jax.grad(loss_fn, has_aux=True)
  if microbatches == 1:
    grads, aux = grad_fn(params, batch, weight_total)
    return aux, grads
  micro = split_microbatches(batch, microbatches)
  aux_zeros = loss_and_metrics(_zero_sums(), weight_total, 0.0)[1]
  specs = None if grad_shardings is None else jax.tree.map(lambda s: s.spec, grad_shardings)
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if specs is None else accumulate.deferred_axes(mesh, microbatches, defer_fsdp)
  if axes:
    aux, grads = accumulate.accumulate_deferred(grad_fn, params, micro, weight_total, aux_zeros, specs, axes,
                                                nn.get_logical_axis_rules(), mesh, unroll)
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
  else:
    aux, grads = accumulate.accumulate(grad_fn, params, micro, weight_total, aux_zeros, grad_shardings, unroll)
  return aux, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def make_train_step(model: Decoder, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    z_loss: float, microbatches: int = 1, loss_chunk: int = 0,
                    grad_shardings: Optional[object] = None, defer_fsdp: bool = False,
                    unroll_microbatches: bool = False) -> Callable:
  loss_fn = make_loss_fn(model, z_loss, loss_chunk)

  def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
    aux, grads = accumulated_gradients(loss_fn, state.params, batch, microbatches, grad_shardings, defer_fsdp,
                                       unroll_microbatches)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(aux, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(model: Decoder, loss_chunk: int = 0) -> Callable:
  loss_fn = make_loss_fn(model, 0.0, loss_chunk)

  def eval_step(params, batch: Mapping[str, jax.Array]):
    return loss_fn(params, batch, _weight_total(batch["loss_weights"]))[1]

  return eval_step


def per_objective_losses(objective_loss_sum, objective_weight_sum) -> dict:
  """Host-side: {"loss/causal": ...} for the objectives that had any tokens."""
  out = {}
  for name, total, weight in zip(OBJECTIVES, objective_loss_sum, objective_weight_sum):
    if weight > 0:
      out[f"loss/{name}"] = float(total) / float(weight)
  return out
