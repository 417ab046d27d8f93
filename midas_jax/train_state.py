"""The train state and its creation, already sharded, on a mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from midas_jax import sharding
from midas_jax.model import Decoder, dummy_batch


@flax.struct.dataclass
class TrainState:
  """step counts optimizer updates; params is the model's "params" collection (unboxed)."""

  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Shapes, logical axis names and mesh shardings of a TrainState; computed without allocating."""

  abstract: TrainState
  logical: TrainState
  shardings: TrainState


def _init_fn(model: Decoder, tx: optax.GradientTransformation, seq_len: int):
  def init(rng):
    params = nn.unbox(model.init(rng, dummy_batch(1, seq_len))["params"])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  return init


def abstract_state(model: Decoder, tx: optax.GradientTransformation, seq_len: int) -> Tuple[TrainState, TrainState]:
  """(shapes, logical axis names) of the TrainState: all growth needs, before any mesh (stacking/grow.py)."""
  boxed = jax.eval_shape(model.init, jax.random.key(0), dummy_batch(1, seq_len))["params"]
  param_specs = nn.get_partition_spec(boxed)
  abstract = jax.eval_shape(_init_fn(model, tx, seq_len), jax.random.key(0))
  logical = TrainState(step=P(), params=param_specs,
                       opt_state=sharding.mirror_param_specs(abstract.opt_state, abstract.params, param_specs))
  return abstract, logical


def state_layout(model: Decoder, tx: optax.GradientTransformation, mesh: Mesh, rules,
                 seq_len: int) -> StateLayout:
  abstract, logical = abstract_state(model, tx, seq_len)
  return StateLayout(abstract=abstract, logical=logical,
                     shardings=sharding.logical_to_sharding(logical, mesh, rules))


def create_train_state(model: Decoder, tx: optax.GradientTransformation, layout: StateLayout,
                       rng: jax.Array, seq_len: int) -> TrainState:
  """Initializes parameters and optimizer state directly into their shardings."""
  return jax.jit(_init_fn(model, tx, seq_len), out_shardings=layout.shardings)(rng)
