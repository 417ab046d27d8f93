"""Decoding with a key/value cache: the prompt is run once, then one position per new token.

Every layer keeps the keys and values of all the tokens of a row so far in a buffer of fixed
width; a decoding step computes the new token's query, key and value, writes the key and value at
the token's position (`LayerCache.append`, called by model/layers.Attention) and attends over the
buffer. Only new tokens are computed, so a step costs one position instead of the whole sequence.

The prefill runs the prompt buffer with the training mask (docs/architecture.md#one-example-format),
described per token as in training (model/attention.py), so it takes the same attention kernel:
rows are one segment each, padding is segment 0, and the first `prefix_lengths[r]` tokens of row r
attend bidirectionally, as an example's prefix does in training. A generated token attends to every
earlier token of its row and to itself, which is what the training mask gives a target token; the
prefix's keys and values never depend on later tokens, so decoding with the cache computes what a
full forward pass over the grown sequence computes.

The parameters are the Decoder's (nothing is stored differently); a looped model keeps one cache
entry per application of a layer (model/layer_order.py).
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

from midas_jax.configs import ModelConfig
from midas_jax.model import layer_order
from midas_jax.model.attention import AttentionMask, describe_mask
from midas_jax.model.layers import dtype_of
from midas_jax.model.transformer import Decoder


class LayerCache(NamedTuple):
  """One layer's keys and values [batch, width, kv_heads, head_dim], and where each row writes next."""

  keys: jax.Array
  values: jax.Array
  index: jax.Array  # [batch] int32: the position of the row's first new token

  def append(self, keys: jax.Array, values: jax.Array) -> Tuple[jax.Array, jax.Array, "LayerCache"]:
    """Writes [batch, t, ...] new keys and values at each row's index; returns the whole buffers."""
    write = jax.vmap(lambda buf, new, at: jax.lax.dynamic_update_slice_in_dim(buf, new, at, axis=0))
    k = write(self.keys, keys.astype(self.keys.dtype), self.index)
    v = write(self.values, values.astype(self.values.dtype), self.index)
    return k, v, LayerCache(k, v, self.index + keys.shape[1])


def empty_cache(cfg: ModelConfig, batch_size: int, width: int) -> LayerCache:
  """Zeros for every layer application, stacked on a leading axis (as the parameters are)."""
  n = len(layer_order.execution_order(cfg))
  shape = (n, batch_size, width, cfg.kv_heads, cfg.resolved_head_dim)
  zeros = jnp.zeros(shape, dtype_of(cfg.dtype))
  return LayerCache(zeros, zeros, jnp.zeros((n, batch_size), jnp.int32))


def _forward(params, cfg: ModelConfig, tokens, positions, mask, cache: LayerCache, last):
  """Logits [batch, vocab] at position `last[r]` of each row's new tokens, and the updated cache."""
  decoder = Decoder(cfg)
  x = decoder.apply({"params": params}, tokens, positions, method=Decoder.embed)
  x, cache = decoder.apply({"params": params}, x, positions, mask, cache, method=Decoder.cached_layers)
  x = jnp.take_along_axis(x, last[:, None, None], axis=1)
  return decoder.apply({"params": params}, x, method=Decoder.logits)[:, 0], cache


def prefill(params, cfg: ModelConfig, tokens, lengths, prefix_lengths) -> Tuple[jax.Array, LayerCache]:
  """Runs the prompt buffer tokens [batch, width] (row r's prompt: its first lengths[r] tokens).

  Returns the logits after each prompt's last token [batch, vocab] and the cache of width `width`.
  """
  batch_size, width = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
  segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
  mask = describe_mask(segment_ids, positions, positions < prefix_lengths[:, None])
  return _forward(params, cfg, tokens, positions, mask, empty_cache(cfg, batch_size, width), lengths - 1)


def step(params, cfg: ModelConfig, cache: LayerCache, tokens, at) -> Tuple[jax.Array, LayerCache]:
  """Feeds one token per row (tokens [batch]) at position at[r] < width; returns its logits and the cache.

  The token sees the row's positions 0..at[r]: the prompt, the tokens generated before it, itself.
  """
  batch_size, width = cache.keys.shape[1:3]
  positions = at[:, None].astype(jnp.int32)
  # One segment per row; the new token (causal position at[r]) sees the buffer's positions <= at[r].
  ones = lambda n: jnp.ones((batch_size, n), jnp.int32)
  mask = AttentionMask(segment_ids=ones(1), causal_positions=positions, key_segment_ids=ones(width),
                       key_causal_positions=jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch_size, width)))
  cache = cache._replace(index=jnp.broadcast_to(at, cache.index.shape).astype(jnp.int32))
  return _forward(params, cfg, tokens[:, None], positions, mask, cache, jnp.zeros_like(at))
