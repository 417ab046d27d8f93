"""Which (query block, key block) pairs of the UL2 mask can hold a visible pair at all.

The mask is described per token by a segment id and a causal position (see model/attention.py):
query q sees key k iff seg[q] == seg[k] and cpos[k] <= cpos[q]. Summarising each block by the
range of its segment ids and the extreme causal positions gives a test that is exact in one
direction: a block pair it calls invisible holds no visible pair, so a kernel may skip it. For
packed rows (segments in order, causal inside each) it skips everything above the diagonal
outside the prefixes and every pair of blocks in different examples.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockTables(NamedTuple):
  """Per-block summaries, each [batch, num_blocks] int32."""

  seg_min: jax.Array
  seg_max: jax.Array
  cpos_min: jax.Array
  cpos_max: jax.Array


def block_tables(segment_ids: jax.Array, causal_positions: jax.Array, block: int) -> BlockTables:
  """[batch, length] (length a multiple of `block`) -> summaries of each run of `block` tokens."""
  b, t = segment_ids.shape
  seg = segment_ids.reshape(b, t // block, block)
  cpos = causal_positions.reshape(b, t // block, block)
  return BlockTables(seg.min(-1), seg.max(-1), cpos.min(-1), cpos.max(-1))


def visible(q: BlockTables, k: BlockTables) -> jax.Array:
  """[batch, q_blocks, k_blocks] bool: False only where no query of the one block sees a key of the other."""
  segments_meet = ((k.seg_min[:, None, :] <= q.seg_max[:, :, None])
                   & (k.seg_max[:, None, :] >= q.seg_min[:, :, None]))
  some_key_early_enough = k.cpos_min[:, None, :] <= q.cpos_max[:, :, None]
  return segments_meet & some_key_early_enough


def flat_table(tables: BlockTables) -> jax.Array:
  """[batch * 4 * num_blocks] int32, the layout the kernels read scalars from (see table_entry)."""
  return jnp.stack(tables, axis=1).reshape(-1).astype(jnp.int32)


def table_entry(ref, row, field: int, block, num_blocks: int):
  """One scalar of a flat_table: field 0..3 = seg_min, seg_max, cpos_min, cpos_max."""
  return ref[(row * 4 + field) * num_blocks + block]


def blocks_visible_in_kernel(q_ref, k_ref, row, qi, kj, num_q_blocks: int, num_k_blocks: int):
  """visible() for one block pair, from the flat tables (scalar reads: SMEM on TPU)."""
  seg_meet = ((table_entry(k_ref, row, 0, kj, num_k_blocks) <= table_entry(q_ref, row, 1, qi, num_q_blocks))
              & (table_entry(k_ref, row, 1, kj, num_k_blocks) >= table_entry(q_ref, row, 0, qi, num_q_blocks)))
  early = table_entry(k_ref, row, 2, kj, num_k_blocks) <= table_entry(q_ref, row, 3, qi, num_q_blocks)
  return seg_meet & early
