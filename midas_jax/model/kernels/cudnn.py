"""Attention through cuDNN's fused flash-attention kernel, on NVIDIA GPUs (ModelConfig.attention = 'cudnn').

This is jax's own path, `jax.nn.dot_product_attention(..., implementation='cudnn')`: a kernel NVIDIA
ships and jax's GPU builds run, so `attention='auto'` takes it on GPU where it applies, while our
Triton build of the flash kernels has been lowered but never run. cuDNN does not take our mask's
description (segment ids and causal positions): the UL2 mask goes in as the dense boolean
[batch, 1, T, T] array (cuDNN turns it into a bias), so the T x T mask is built once per layer,
but the scores and probabilities are never stored and the backward pass is cuDNN's too.

What cuDNN accepts (jax 0.10.2's checks, cudnn/fused_attention_stablehlo.py): bfloat16 or float16
inputs, a head dimension that is a multiple of 8 and at most 128 (256 from Hopper on; 128 is asked
here so the choice does not depend on the GPU), and an even sequence length when training with a
mask. `supported` says whether a model meets the first two; an odd length is attended densely.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128  # before Hopper; 256 from Hopper on


def unsupported_reason(dtype: str, head_dim: int) -> Optional[str]:
  """None where cuDNN's kernel takes this model's attention, else why not (for 'auto' and for errors)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN's fused attention needs bfloat16 or float16 inputs, not {dtype}"
  if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
    return f"cuDNN's fused attention needs a head dimension that is a multiple of 8 and at most 128, not {head_dim}"
  return None


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                    implementation: Optional[str] = "cudnn") -> jax.Array:
  """q [batch, T, heads, head_dim], k and v [batch, T, kv_heads, head_dim] (GQA allowed) under the boolean
  mask `visible` [batch, 1, T, T]. implementation=None runs the same call through XLA (the tests, on CPU)."""
  return jax.nn.dot_product_attention(q, k, v, mask=visible, implementation=implementation)
