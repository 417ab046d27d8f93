"""The model's two matmuls, and the dtype policy they carry (docs/architecture.md#matmuls-carry-the-dtype-policy;
which op runs in which dtype: docs/model.md#which-ops-run-in-which-dtype).

Every matmul of the model, forward and backward, takes its operands in the compute dtype
(ModelConfig.dtype) and accumulates in float32, asked for in the program itself (a float32 dot
result), not left to the backend: XLA's CPU backend runs a bfloat16-result dot on a slow path,
the TPU and GPU backends fuse the rounding into the dot either way. What differs is the result:

  dot             rounded to the compute dtype: the projections and the attention-weighted values;
  dot_to_float32  kept in float32, for the values a softmax reads (attention scores, the LM head's
                  logits), whose rounding would be the loss's.

Both carry their own gradient (a custom VJP): the cotangent is rounded to the compute dtype and
the two backward matmuls are einsums of compute-dtype operands with float32 accumulation, like the
forward one. JAX's own transpose of a float32-result dot would multiply by a float32 cotangent,
which promotes the other operand: the backward pass, two thirds of the matmul FLOPs, would run at
float32 rates on twice the bytes. Each gradient comes back in its input's dtype, so a float32
parameter's weight gradient is never rounded to the compute dtype on the way.

A custom VJP hides its matmuls from the remat policies that look for dot_general, so each result is
named (checkpoint_name) and the policies of model/transformer.py save names where they save dots.

In float32 both are the plain float32 einsum, JAX's own gradient and all: unchanged, bit for bit.
Where a backend cannot run compute-dtype matmuls (model/dot_support.py decides, per
ModelConfig.matmul_operands), `operands=float32` multiplies the same values as float32 operands:
the same products and float32 accumulation, the result rounded as before, at float32 speed.
"""

from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# What the remat policies save by name (model/transformer.py): the outputs of matmuls without batch
# dimensions (projections, the head) and of those with them (attention's scores and values).
PROJECTION = "projection"
ATTENTION = "attention"


def dot(equation: str, x: jax.Array, w: jax.Array, dtype, name: str = PROJECTION, operands=None) -> jax.Array:
  """einsum of x and w in `dtype`, accumulated in float32, its result rounded to `dtype`.

  operands: the dtype the operands are multiplied in (None: `dtype`; float32 where the backend
  cannot multiply `dtype`, model/dot_support.py)."""
  return _einsum(equation, x, w, jnp.dtype(dtype), jnp.dtype(dtype), name, operands)


def dot_to_float32(equation: str, x: jax.Array, w: jax.Array, dtype, name: str = PROJECTION,
                   operands=None) -> jax.Array:
  """einsum of x and w in `dtype` with a float32 result; operands as for `dot`."""
  return _einsum(equation, x, w, jnp.dtype(dtype), jnp.dtype(jnp.float32), name, operands)


def _einsum(equation, x, w, dtype, result_dtype, name, operands):
  if dtype == jnp.float32:
    return jnp.einsum(equation, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  wide = operands is not None and jnp.dtype(operands) == jnp.float32
  return checkpoint_name(_mixed(equation, dtype, result_dtype, (x.dtype, w.dtype), wide, x, w), name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _mixed(equation, dtype, result_dtype, input_dtypes, wide, x, w):
  return _mixed_forward(equation, dtype, result_dtype, input_dtypes, wide, x, w)[0]


def _mixed_forward(equation, dtype, result_dtype, input_dtypes, wide, x, w):
  del input_dtypes  # the backward pass's
  x, w = x.astype(dtype), w.astype(dtype)
  return _accumulate(equation, x, w, result_dtype, wide), (x, w)


def _mixed_backward(equation, dtype, result_dtype, input_dtypes, wide, operands, cotangent):
  del result_dtype
  x, w = operands
  x_from, w_from = _gradient_equations(equation)
  g = cotangent.astype(dtype)
  return (_accumulate(x_from, g, w, input_dtypes[0], wide), _accumulate(w_from, x, g, input_dtypes[1], wide))


_mixed.defvjp(_mixed_forward, _mixed_backward)


def _accumulate(equation, a, b, result_dtype, wide: bool):
  """einsum with float32 accumulation; `wide` multiplies the (compute-dtype) values as float32
  operands, which gives the same products on a backend that cannot multiply the compute dtype."""
  if wide:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32).astype(result_dtype)


@functools.lru_cache(maxsize=None)
def _gradient_equations(equation: str) -> Tuple[str, str]:
  """'x,w->out' -> ('out,w->x', 'x,out->w'): the einsums of the two gradients.

  Each is the product of the cotangent and the other operand, summed over what the forward kept;
  that holds when every index of an operand appears in the other operand or in the result (no index
  summed over one operand alone), as in every matmul of the model.
  """
  inputs, out = equation.replace(" ", "").split("->")
  x, w = inputs.split(",")
  for mine, other in ((x, w), (w, x)):
    if not set(mine) <= set(other) | set(out):
      raise ValueError(f"{equation!r}: an index of {mine!r} is in neither the other operand nor the result")
  return f"{out},{w}->{x}", f"{x},{out}->{w}"
