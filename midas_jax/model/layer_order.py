"""Looped models: a block of layers whose weights are applied several times in a row.

The MIDAS paper explains stacking's inductive bias by its likeness to looped models. Two uses:
training a looped model (ModelConfig.loop_*: the block's weights are tied, its gradient is the sum
over its applications) and looping a grown model's middle block at inference only. Both run the
stacked per-layer parameters in a layer order that repeats the block: parameters keep their
`layers` axis of num_layers unique layers, so checkpoints, growth and sharding are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import numpy as np


def loop_order(num_layers: int, start: int, size: int, repeats: int) -> np.ndarray:
  """Layer indices in execution order: [0, start), then [start, start + size) `repeats` times, then the rest."""
  if not (0 <= start and size >= 1 and start + size <= num_layers and repeats >= 1):
    raise ValueError(f"loop block [{start}, {start + size}) x {repeats} does not fit {num_layers} layers")
  block = list(range(start, start + size))
  return np.asarray(list(range(start)) + block * repeats + list(range(start + size, num_layers)), np.int32)


def middle_block(num_layers: int, block_size: int) -> int:
  """The first layer of block ceil(n/2) (1-indexed), the block MIDAS duplicates."""
  n = num_layers // block_size
  return (math.ceil(n / 2) - 1) * block_size


def run_in_order(block_fn, layer_params, x, order: Sequence[int], remat_policy=None):
  """Applies block_fn(params_of_one_layer, x) -> x for each layer index in `order`, as one scan.

  Gathering the stacked parameters by `order` ties the repeated layers: their gradients add up.
  """
  gathered = jax.tree.map(lambda p: p[np.asarray(order)], layer_params)

  def body(carry, params):
    return block_fn(params, carry), None

  if remat_policy is not None:
    body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
  out, _ = jax.lax.scan(body, x, gathered)
  return out


def order_for(cfg) -> Optional[np.ndarray]:
  """The layer order a ModelConfig asks for, or None for the plain stack."""
  if cfg.loop_repeats == 1:
    return None
  return loop_order(cfg.num_layers, cfg.loop_start, cfg.loop_size, cfg.loop_repeats)


def execution_order(cfg) -> np.ndarray:
  """Every layer index in the order the layers run: a looped model repeats its block."""
  order = order_for(cfg)
  return np.arange(cfg.num_layers, dtype=np.int32) if order is None else order


def loop_middle_block(cfg, block_size: int, repeats: int):
  """The ModelConfig that applies a grown model's middle block (the one MIDAS copies) `repeats` times.

  For inference-time looping: the parameters are the grown model's, unchanged.
  """
  return dataclasses.replace(cfg, loop_start=middle_block(cfg.num_layers, block_size), loop_size=block_size,
                             loop_repeats=repeats)
