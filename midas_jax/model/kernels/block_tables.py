"""Which (query block, key block) pairs of the UL2 mask hold a visible pair, which hold nothing else,
and the per-block lists of pairs the kernels visit.

The mask is described per token by a segment id and a causal position (see model/attention.py):
query q sees key k iff seg[q] == seg[k] and cpos[k] <= cpos[q]. Summarising each block by the
range of its segment ids and the extreme causal positions gives two tests, each exact in its own
direction:
  visible        False only where no query of the one block sees a key of the other: the pair
                 may be skipped. For packed rows (segments in order, causal inside each) it skips
                 everything above the diagonal outside the prefixes and every pair of blocks in
                 different examples.
  fully_visible  True only where every query of the one block sees every key of the other (both
                 blocks lie in one segment, and the latest key is no later than the earliest
                 query): the pair needs no mask.

From the two, `visit_lists` builds what the streamed TPU kernels prefetch into scalar memory: for
each block a kernel owns, the blocks of the other side it visits, in order and compacted, and a
flag per visit saying whether the mask must be applied. The Triton kernels (GPU) read the
summaries themselves, one scalar at a time (flat_table, blocks_visible_in_kernel).
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


class VisitLists(NamedTuple):
  """For each block a kernel owns (its grid's block axis): the blocks of the other side it visits.

  codes   [batch, owned, steps] int32: 2 * block index + (1 if the pair needs the mask else 0), the
          visible blocks first, in increasing order; the steps past `counts` repeat the last
          visible block, so the pipeline's copy for such a step fetches nothing new.
  counts  [batch, owned] int32: how many steps hold a visible block (at least 1: every query sees
          itself, and every key is seen by its own query).
  """

  codes: jax.Array
  counts: jax.Array


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


def fully_visible(q: BlockTables, k: BlockTables) -> jax.Array:
  """[batch, q_blocks, k_blocks] bool: True only where every query of the one block sees every key of the other."""
  one_segment = ((q.seg_min == q.seg_max)[:, :, None] & (k.seg_min == k.seg_max)[:, None, :]
                 & (q.seg_min[:, :, None] == k.seg_min[:, None, :]))
  every_key_early_enough = k.cpos_max[:, None, :] <= q.cpos_min[:, :, None]
  return one_segment & every_key_early_enough


def visit_lists(seen: jax.Array, full: jax.Array) -> VisitLists:
  """[batch, owned, other] visible and fully_visible (transposed for a kernel that owns key blocks)."""
  steps = seen.shape[-1]
  # A stable sort on "not visible" puts the visible blocks first, each run in increasing order.
  order = jnp.argsort(jnp.logical_not(seen).astype(jnp.int32), axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.sum(seen, axis=-1, dtype=jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
  blocks = jnp.where(jnp.arange(steps, dtype=jnp.int32) < counts[..., None], order, last)
  needs_mask = jnp.logical_not(jnp.take_along_axis(full, blocks, axis=-1))
  return VisitLists(2 * blocks + needs_mask.astype(jnp.int32), counts)


def flash_visits(segment_ids: jax.Array, causal_positions: jax.Array, block_q: int, block_kv: int):
  """(query-side lists, key-side lists): what the forward and dQ kernels (one row per query block)
  and the dK/dV kernel (one row per key block) visit, for a [batch, length] description."""
  q = block_tables(segment_ids, causal_positions, block_q)
  k = block_tables(segment_ids, causal_positions, block_kv)
  seen, full = visible(q, k), fully_visible(q, k)
  return visit_lists(seen, full), visit_lists(jnp.swapaxes(seen, 1, 2), jnp.swapaxes(full, 1, 2))


def flat_table(tables: BlockTables) -> jax.Array:
  """[batch * 4 * num_blocks] int32, the layout the Triton kernels read scalars from (see table_entry)."""
  return jnp.stack(tables, axis=1).reshape(-1).astype(jnp.int32)


def table_entry(ref, row, field: int, block, num_blocks: int):
  """One scalar of a flat_table: field 0..3 = seg_min, seg_max, cpos_min, cpos_max."""
  return ref[(row * 4 + field) * num_blocks + block]


def blocks_visible_in_kernel(q_ref, k_ref, row, qi, kj, num_q_blocks: int, num_k_blocks: int):
  """visible() for one block pair, from the flat tables (scalar reads)."""
  seg_meet = ((table_entry(k_ref, row, 0, kj, num_k_blocks) <= table_entry(q_ref, row, 1, qi, num_q_blocks))
              & (table_entry(k_ref, row, 1, kj, num_k_blocks) >= table_entry(q_ref, row, 0, qi, num_q_blocks)))
  early = table_entry(k_ref, row, 2, kj, num_k_blocks) <= table_entry(q_ref, row, 3, qi, num_q_blocks)
  return seg_meet & early
