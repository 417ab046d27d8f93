"""The one attention mask every objective uses, and the attention call itself.

A query may see a key when both belong to the same packed segment and either the key is not later
than the query (causal) or both lie in the segment's bidirectional prefix. Causal LM is the case of
an empty prefix; prefix LM and span corruption put their inputs in the prefix (docs/architecture.md#one-example-format).
"""

import jax
import jax.numpy as jnp


def make_attention_mask(segment_ids: jax.Array, positions: jax.Array,
                        prefix_mask: jax.Array) -> jax.Array:
  """[batch, length] ids, positions and prefix flags -> boolean mask [batch, 1, length, length].

  Padding has segment id 0. Every token may see itself, so padding rows are never empty (an
  all-masked softmax row would otherwise be undefined).
  """
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
  causal = positions[:, None, :] <= positions[:, :, None]
  prefix = prefix_mask.astype(bool)
  both_in_prefix = prefix[:, :, None] & prefix[:, None, :]
  valid = (segment_ids != 0)[:, :, None] & (segment_ids != 0)[:, None, :]
  mask = same_segment & valid & (causal | both_in_prefix)
  length = segment_ids.shape[1]
  mask = mask | jnp.eye(length, dtype=bool)[None]
  return mask[:, None, :, :]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Scaled dot-product attention; k and v may have fewer heads than q (grouped-query attention).

  jax.nn.dot_product_attention lets XLA (or cuDNN on GPU) choose the kernel.
  """
  return jax.nn.dot_product_attention(q, k, v, mask=mask)
