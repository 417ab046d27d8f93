"""Transformer building blocks with logical axis names on every parameter.

Kernels are kept in their natural multi-dimensional shapes (e.g. the query kernel is
[embed, heads, kv]) so that sharding rules and Hugging Face conversion both read them directly.
Every matmul runs on compute-dtype operands (model/matmul.py); norms and rotary run in float32.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from midas_jax.configs import ModelConfig
from midas_jax.model import attention as attn_lib
from midas_jax.model.matmul import dot


def dtype_of(name: str):
  return jnp.dtype(name)


def operand_dtype(cfg: ModelConfig):
  """What the matmuls multiply: the compute dtype, or float32 operands (ModelConfig.matmul_operands;
  model/dot_support.py says when)."""
  return jnp.float32 if cfg.matmul_operands == "float32" else dtype_of(cfg.dtype)


def weight_init(cfg: ModelConfig, fan_in: int, residual: bool = False):
  """The initializer of one weight matrix or embedding table (see ModelConfig.init)."""
  if cfg.init == "gamma":
    std = float(fan_in) ** -cfg.init_gamma
  else:
    std = cfg.init_std / math.sqrt(2 * cfg.residual_depth) if residual else cfg.init_std
  return nn.initializers.normal(stddev=std)


def param(module: nn.Module, name: str, init, shape: Sequence[int], axes: Sequence[str],
          cfg: ModelConfig):
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      dtype_of(cfg.param_dtype))


class Norm(nn.Module):
  """RMSNorm (llama) or LayerNorm (gpt2) over the last axis, computed in float32."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    d = x.shape[-1]
    x32 = x.astype(jnp.float32)
    scale = param(self, "scale", nn.initializers.ones, (d,), ("embed",), cfg)
    if cfg.family == "llama":
      y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + cfg.norm_eps)
      y = y * scale
    else:
      mean = jnp.mean(x32, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
      y = (x32 - mean) * jax.lax.rsqrt(var + cfg.norm_eps)
      y = y * scale + param(self, "bias", nn.initializers.zeros, (d,), ("embed",), cfg)
    return y.astype(dtype_of(cfg.dtype))


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, half-rotation layout (as Hugging Face Llama applies it).

  x: [batch, length, heads, head_dim]; positions: [batch, length].
  """
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, half]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nn.Module):
  """Multi-head (or grouped-query) self-attention under `mask`, an attention.AttentionMask. With a
  `cache` (decoding, model/kv_cache.py) the new tokens' keys and values are written into it and the
  queries attend over every token it holds; it returns (y, updated cache)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, mask, cache=None):
    cfg = self.cfg
    dtype, ops = dtype_of(cfg.dtype), operand_dtype(cfg)
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
    in_init = weight_init(cfg, fan_in=d)
    q = dot("btd,dhk->bthk", x, param(self, "query", in_init, (d, h, hd), ("embed", "heads", "kv"), cfg), dtype,
            operands=ops)
    k = dot("btd,dhk->bthk", x, param(self, "key", in_init, (d, kv, hd), ("embed", "heads", "kv"), cfg), dtype,
            operands=ops)
    v = dot("btd,dhk->bthk", x, param(self, "value", in_init, (d, kv, hd), ("embed", "heads", "kv"), cfg), dtype,
            operands=ops)
    if cfg.family == "gpt2" or cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q = q + param(self, "query_bias", zeros, (h, hd), ("heads", "kv"), cfg).astype(dtype)
      k = k + param(self, "key_bias", zeros, (kv, hd), ("heads", "kv"), cfg).astype(dtype)
      v = v + param(self, "value_bias", zeros, (kv, hd), ("heads", "kv"), cfg).astype(dtype)
    if cfg.family == "llama":
      q = rotary(q, positions, cfg.rope_theta)
      k = rotary(k, positions, cfg.rope_theta)
    if cache is not None:
      k, v, cache = cache.append(k, v)
    # Initializing only needs the parameters' shapes, and XLA drops the unused output: no kernel.
    out = attn_lib.attend(q, k, v, mask, "dot_product" if self.is_initializing() else cfg.attention, operands=ops,
                          flash_blocks=(cfg.flash_block_q, cfg.flash_block_kv))
    out_kernel = param(self, "out", weight_init(cfg, fan_in=h * hd, residual=True), (h, hd, d),
                       ("heads", "kv", "embed"), cfg)
    y = dot("bthk,hkd->btd", out, out_kernel, dtype, operands=ops)
    if cfg.family == "gpt2":
      y = y + param(self, "out_bias", nn.initializers.zeros, (d,), ("embed",), cfg).astype(dtype)
    return y if cache is None else (y, cache)


class Mlp(nn.Module):
  """SwiGLU (llama) or GELU (gpt2, tanh approximation as in GPT-2)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dtype, ops = dtype_of(cfg.dtype), operand_dtype(cfg)
    d, f = cfg.d_model, cfg.d_ff
    in_init = weight_init(cfg, fan_in=d)
    out_init = weight_init(cfg, fan_in=f, residual=True)
    if cfg.family == "llama":
      gate = dot("btd,df->btf", x, param(self, "gate", in_init, (d, f), ("embed", "mlp"), cfg), dtype, operands=ops)
      up = dot("btd,df->btf", x, param(self, "up", in_init, (d, f), ("embed", "mlp"), cfg), dtype, operands=ops)
      hidden = nn.silu(gate) * up
      return dot("btf,fd->btd", hidden, param(self, "down", out_init, (f, d), ("mlp", "embed"), cfg), dtype,
                 operands=ops)
    zeros = nn.initializers.zeros
    hidden = dot("btd,df->btf", x, param(self, "fc", in_init, (d, f), ("embed", "mlp"), cfg), dtype, operands=ops)
    hidden = nn.gelu(hidden + param(self, "fc_bias", zeros, (f,), ("mlp",), cfg).astype(dtype),
                     approximate=True)
    y = dot("btf,fd->btd", hidden, param(self, "proj", out_init, (f, d), ("mlp", "embed"), cfg), dtype, operands=ops)
    return y + param(self, "proj_bias", zeros, (d,), ("embed",), cfg).astype(dtype)


class Block(nn.Module):
  """One pre-norm transformer layer. Returns (x, None) so it can be scanned; (x, cache) given a cache."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, mask, cache=None):
    x = checkpoint_name(x, "layer_input")  # what remat_policy="offload" keeps, in host memory
    attended = Attention(self.cfg, name="attn")(Norm(self.cfg, name="attn_norm")(x), positions, mask, cache)
    if cache is not None:
      attended, cache = attended
    x = x + attended
    x = x + Mlp(self.cfg, name="mlp")(Norm(self.cfg, name="mlp_norm")(x))
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x, cache
