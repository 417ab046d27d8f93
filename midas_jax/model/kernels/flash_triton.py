"""The GPU (Pallas on Triton) flash kernels for the UL2 mask: set-up and bodies for forward, dQ and dK/dV.

On a GPU a kernel's refs live in device memory, so each grid step owns one block of its output and
loops over every block of the other side, which it addresses whole ([num_blocks, block, head_dim]:
a dynamic index on a leading dimension). A block pair the block tables call invisible is skipped
by a lax.cond: no matmul, no exponential (model/kernels/block_tables.py). Inside a visited pair the
mask is recomputed from per-token segment ids and causal positions, never read from memory. (The
TPU kernels, flash_kernels.py, stream the blocks through the grid instead.)

Orientation: the forward and dQ passes compute scores [queries, keys]; the dK/dV pass computes
them transposed, [keys, queries], so that every per-query statistic it needs (logsumexp, delta,
segment, position) is a row. Matmuls take the input dtype and accumulate in float32; the softmax
runs in float32. These kernels have been lowered for CUDA, never compiled by Triton or run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from midas_jax.model.kernels import block_tables as tables_lib
from midas_jax.model.kernels.block_tables import blocks_visible_in_kernel
from midas_jax.model.kernels.flash_kernels import NEG, as_column, as_row, nn_dot, nt_dot


def forward_kernel(q_tables, k_tables, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
                   o_ref, lse_ref, *, scale: float, num_q_blocks: int, num_k_blocks: int):
  """Grid (batch, head, query block). q_ref [bq, d]; k_ref, v_ref [nk, bk, d]; qseg/qpos [bq, 1];
  kseg/kpos [nk, 1, bk] -> o_ref [bq, d], lse_ref [1, bq] (natural-log logsumexp per query)."""
  row, qi = pl.program_id(0), pl.program_id(2)
  q = q_ref[...]
  qseg, qpos = qseg_ref[...], qpos_ref[...]
  bq, d = q.shape

  def visit(kj, carry):
    m, l, acc = carry
    mask = (qseg == kseg_ref[kj]) & (kpos_ref[kj] <= qpos)
    s = jnp.where(mask, nt_dot(q, k_ref[kj]) * scale, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    v = v_ref[kj]
    return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
            alpha * acc + nn_dot(p.astype(v.dtype), v))

  def body(kj, carry):
    seen = blocks_visible_in_kernel(q_tables, k_tables, row, qi, kj, num_q_blocks, num_k_blocks)
    return lax.cond(seen, lambda c: visit(kj, c), lambda c: c, carry)

  init = (jnp.full((bq, 1), NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, d), jnp.float32))
  m, l, acc = lax.fori_loop(0, num_k_blocks, body, init)
  # Every query sees at least itself (padding is a segment of its own), so l > 0.
  o_ref[...] = (acc / l).astype(o_ref.dtype)
  lse_ref[...] = as_row(m + jnp.log(l))


def dq_kernel(q_tables, k_tables, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
              do_ref, lse_ref, delta_ref, dq_ref, *, scale: float, num_q_blocks: int, num_k_blocks: int):
  """Grid (batch, head, query block): dQ = scale * sum over key blocks of dS @ K."""
  row, qi = pl.program_id(0), pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  qseg, qpos = qseg_ref[...], qpos_ref[...]
  lse, delta = as_column(lse_ref[...]), as_column(delta_ref[...])

  def visit(kj, dq):
    k, v = k_ref[kj], v_ref[kj]
    mask = (qseg == kseg_ref[kj]) & (kpos_ref[kj] <= qpos)
    p = jnp.where(mask, jnp.exp(nt_dot(q, k) * scale - lse), 0.0)
    ds = p * (nt_dot(do, v) - delta)
    return dq + nn_dot(ds.astype(k.dtype), k)

  def body(kj, dq):
    seen = blocks_visible_in_kernel(q_tables, k_tables, row, qi, kj, num_q_blocks, num_k_blocks)
    return lax.cond(seen, lambda acc: visit(kj, acc), lambda acc: acc, dq)

  dq = lax.fori_loop(0, num_k_blocks, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def dkv_kernel(q_tables, k_tables, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, kseg_ref, kpos_ref,
               qseg_ref, qpos_ref, dk_ref, dv_ref, *, scale: float, group: int, num_q_blocks: int,
               num_k_blocks: int):
  """Grid (batch, kv head, key block). k_ref, v_ref [bk, d]; q_ref, do_ref [group, nq, bq, d];
  lse_ref, delta_ref [group, nq, 1, bq]; kseg/kpos [bk, 1]; qseg/qpos [nq, 1, bq].

  Scores are transposed here ([keys, queries]); the `group` query heads sharing this kv head
  (grouped-query attention) all add into the same dK and dV.
  """
  row, kj = pl.program_id(0), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kseg, kpos = kseg_ref[...], kpos_ref[...]

  def visit_head(qi, h, carry):
    dk, dv = carry
    q, do = q_ref[h, qi], do_ref[h, qi]
    mask = (kseg == qseg_ref[qi]) & (kpos <= qpos_ref[qi])
    p = jnp.where(mask, jnp.exp(nt_dot(k, q) * scale - lse_ref[h, qi]), 0.0)  # [bk, bq]
    ds = p * (nt_dot(v, do) - delta_ref[h, qi])
    return dk + nn_dot(ds.astype(q.dtype), q), dv + nn_dot(p.astype(do.dtype), do)

  def body(qi, carry):
    seen = blocks_visible_in_kernel(q_tables, k_tables, row, qi, kj, num_q_blocks, num_k_blocks)
    heads = lambda c: lax.fori_loop(0, group, lambda h, cc: visit_head(qi, h, cc), c)
    return lax.cond(seen, heads, lambda c: c, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, num_q_blocks, body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)



def _specs(bq: int, bk: int, nq: int, nk: int, d: int, group: int):
  """BlockSpecs of the query-side passes (grid: batch, head, query block): their own block of queries,
  the whole sequence of their kv head's keys and values, and the per-token description."""
  q_block = pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0))
  whole_kv = pl.BlockSpec((None, None, nk, bk, d), lambda b, h, i: (b, lax.div(h, group), 0, 0, 0))
  column = pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0))
  rows = pl.BlockSpec((None, nk, 1, bk), lambda b, h, i: (b, 0, 0, 0))
  stat = pl.BlockSpec((None, None, None, 1, bq), lambda b, h, i: (b, h, i, 0, 0))
  return q_block, whole_kv, column, rows, stat


def _call(kernel, name, grid, in_specs, out_specs, out_shape, q_tables, k_tables, *operands):
  """pallas_call on Triton; the two flat block tables come first in every kernel's signature."""
  table_spec = lambda t: pl.BlockSpec(t.shape, lambda *_: (0,))
  return pl.pallas_call(kernel, out_shape=out_shape, grid=grid,
                        in_specs=[table_spec(q_tables), table_spec(k_tables)] + in_specs, out_specs=out_specs,
                        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2), name=name)(
                            q_tables, k_tables, *operands)


def _described(seg, cpos, bq: int, bk: int):
  b, t = seg.shape
  q_tables = tables_lib.flat_table(tables_lib.block_tables(seg, cpos, bq))
  k_tables = tables_lib.flat_table(tables_lib.block_tables(seg, cpos, bk))
  columns = (seg[:, :, None], cpos[:, :, None])
  rows = lambda x, block: x.reshape(b, t // block, 1, block)
  return q_tables, k_tables, columns, (rows(seg, bk), rows(cpos, bk)), (rows(seg, bq), rows(cpos, bq))


def forward(q, k, v, seg, cpos, bq: int, bk: int):
  """q [B, H, T, D], k, v [B, KV, T, D] (T a multiple of both blocks) -> out [B, H, T, D], lse [B, H, T]."""
  b, h, t, d = q.shape
  group, nq, nk = h // k.shape[1], t // bq, t // bk
  q_tables, k_tables, columns, key_rows, _ = _described(seg, cpos, bq, bk)
  q_block, whole_kv, column, rows, stat = _specs(bq, bk, nq, nk, d, group)
  blocked = lambda x: x.reshape(b, x.shape[1], nk, bk, d)
  kernel = functools.partial(forward_kernel, scale=d ** -0.5, num_q_blocks=nq, num_k_blocks=nk)
  out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, nq, 1, bq), jnp.float32))
  out, lse = _call(kernel, "ul2_flash_forward", (b, h, nq),
                   [q_block, whole_kv, whole_kv, column, column, rows, rows], (q_block, stat), out_shape,
                   q_tables, k_tables, q, blocked(k), blocked(v), *columns, *key_rows)
  return out, lse.reshape(b, h, t)


def backward(q, k, v, seg, cpos, d_out, lse, delta, bq: int, bk: int):
  """The gradients (dq, dk, dv) given the forward's lse and delta = rowsum(d_out * out), [B, H, T] each."""
  b, h, t, d = q.shape
  kv = k.shape[1]
  group, nq, nk = h // kv, t // bq, t // bk
  q_tables, k_tables, columns, key_rows, query_rows = _described(seg, cpos, bq, bk)
  q_block, whole_kv, column, rows, stat = _specs(bq, bk, nq, nk, d, group)
  stats = lambda x: x.reshape(b, h, nq, 1, bq)
  scale = d ** -0.5
  dq_kernel_ = functools.partial(dq_kernel, scale=scale, num_q_blocks=nq, num_k_blocks=nk)
  blocked = lambda x, n, block: x.reshape(b, x.shape[1], n, block, d)
  dq = _call(dq_kernel_, "ul2_flash_dq", (b, h, nq),
             [q_block, whole_kv, whole_kv, column, column, rows, rows, q_block, stat, stat], q_block,
             jax.ShapeDtypeStruct(q.shape, q.dtype), q_tables, k_tables,
             q, blocked(k, nk, bk), blocked(v, nk, bk), *columns, *key_rows, d_out, stats(lse), stats(delta))
  # dK/dV: grid (batch, kv head, key block); each step holds its kv head's query group whole.
  k_block = pl.BlockSpec((None, None, bk, d), lambda b, j, i: (b, j, i, 0))
  whole_group = pl.BlockSpec((None, group, nq, bq, d), lambda b, j, i: (b, j, 0, 0, 0))
  group_stats = pl.BlockSpec((None, group, nq, 1, bq), lambda b, j, i: (b, j, 0, 0, 0))
  key_column = pl.BlockSpec((None, bk, 1), lambda b, j, i: (b, i, 0))
  query_rows_spec = pl.BlockSpec((None, nq, 1, bq), lambda b, j, i: (b, 0, 0, 0))
  dkv_kernel_ = functools.partial(dkv_kernel, scale=scale, group=group, num_q_blocks=nq, num_k_blocks=nk)
  dk, dv = _call(dkv_kernel_, "ul2_flash_dkv", (b, kv, nk),
                 [k_block, k_block, whole_group, whole_group, group_stats, group_stats, key_column, key_column,
                  query_rows_spec, query_rows_spec], (k_block, k_block),
                 (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)), q_tables, k_tables,
                 k, v, blocked(q, nq, bq), blocked(d_out, nq, bq), stats(lse), stats(delta), *columns, *query_rows)
  return dq, dk, dv
