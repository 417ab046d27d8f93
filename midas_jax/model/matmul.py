"""The model's two matmuls, and the dtype policy they carry (docs/model.md#which-ops-run-in-which-dtype).

Every matmul of the model, forward and backward, takes its operands in the compute dtype
(ModelConfig.dtype); the hardware accumulates inside the dot in float32 (the TPU's MXU and the
GPU's tensor cores always do for bfloat16). What differs is the result:

  dot             a result in the compute dtype: the projections and the attention-weighted values.
                  JAX's transpose rules then hand the backward matmuls a cotangent in the compute
                  dtype too, so forward, backward and remat recomputation all run on it.
  dot_to_float32  a float32 result, for the values a softmax reads (attention scores, the LM
                  head's logits): their rounding would be the loss's. A plain float32-result einsum
                  would give its backward matmuls a float32 cotangent, which promotes the other
                  operand and runs them at float32 rates on twice the bytes; so its gradient rounds
                  the cotangent to the compute dtype first, then runs the compute-dtype einsum's
                  own backward.

In float32 both are the plain float32 einsum, unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def dot(equation: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """einsum of x and w in `dtype`, its result in `dtype`."""
  return jnp.einsum(equation, x.astype(dtype), w.astype(dtype), preferred_element_type=dtype)


def dot_to_float32(equation: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """einsum of x and w in `dtype` with a float32 result; its backward matmuls run in `dtype` too."""
  x, w = x.astype(dtype), w.astype(dtype)
  if jnp.dtype(dtype) == jnp.float32:
    return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
  return _float32_result(equation, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float32_result(equation, x, w):
  return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def _float32_result_forward(equation, x, w):
  return _float32_result(equation, x, w), (x, w)


def _float32_result_backward(equation, operands, cotangent):
  x, w = operands
  _, backward = jax.vjp(lambda a, b: jnp.einsum(equation, a, b, preferred_element_type=x.dtype), x, w)
  return backward(cotangent.astype(x.dtype))


_float32_result.defvjp(_float32_result_forward, _float32_result_backward)
