"""Loss, train step and eval step: pure functions, jitted by the loop with explicit shardings."""

from __future__ import annotations

from typing import Callable, Mapping, Tuple

import jax
import jax.numpy as jnp
import optax

from midas_jax.model import Decoder
from midas_jax.train.state import TrainState

# Objective ids carried by every row (docs/architecture.md#one-example-format); metrics report each beside the total.
OBJECTIVES = ("causal", "prefix", "span")


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                           objective_ids: jax.Array, z_loss: float = 0.0) -> Tuple[jax.Array, dict]:
  """Mean token cross-entropy under `weights`, plus z_loss * mean(logsumexp ** 2).

  Returns the scalar to minimise and sums from which per-objective losses are derived, so they
  average correctly across steps and hosts.
  """
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  token_loss = lse - target_logit
  weight_sum = jnp.maximum(weights.sum(), 1e-9)
  loss = (token_loss * weights).sum() / weight_sum
  z_term = z_loss * (jnp.square(lse) * weights).sum() / weight_sum
  one_hot = jax.nn.one_hot(objective_ids, len(OBJECTIVES), dtype=jnp.float32) * weights[..., None]
  aux = {
      "loss": loss,
      "z_loss": z_term,
      "tokens": weights.sum(),
      "objective_loss_sum": jnp.einsum("bt,bto->o", token_loss, one_hot),
      "objective_weight_sum": one_hot.sum(axis=(0, 1)),
  }
  return loss + z_term, aux


def make_train_step(model: Decoder, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    z_loss: float) -> Callable:
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch)
    return weighted_cross_entropy(logits, batch["targets"], batch["loss_weights"],
                                  batch["objective_ids"], z_loss)

  def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(aux, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(model: Decoder) -> Callable:
  def eval_step(params, batch: Mapping[str, jax.Array]):
    logits = model.apply({"params": params}, batch)
    _, aux = weighted_cross_entropy(logits, batch["targets"], batch["loss_weights"], batch["objective_ids"])
    return aux

  return eval_step


def per_objective_losses(objective_loss_sum, objective_weight_sum) -> dict:
  """Host-side: {"loss/causal": ...} for the objectives that had any tokens."""
  out = {}
  for name, total, weight in zip(OBJECTIVES, objective_loss_sum, objective_weight_sum):
    if weight > 0:
      out[f"loss/{name}"] = float(total) / float(weight)
  return out
