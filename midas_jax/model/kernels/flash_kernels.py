"""The flash-attention kernel bodies for the UL2 mask: forward, dQ, and dK/dV.

One body per pass serves every backend (Mosaic on TPU, Triton on GPU, the interpreter on CPU):
each grid step owns one block of the output and loops over the blocks of the other side, which
it holds whole ([num_blocks, block, head_dim]: a dynamic index on a leading dimension, which
every backend supports). A block pair the block tables call invisible is skipped: no matmul, no
exponential (model/kernels/block_tables.py). Inside a visited pair the mask is recomputed from
per-token segment ids and causal positions, never read from memory.

Orientation: the forward and dQ passes compute scores [queries, keys]; the dK/dV pass computes
them transposed, [keys, queries], so that every per-query statistic it needs (logsumexp, delta,
segment, position) is a lane-dense row and no pass transposes a matrix it multiplies. Row
statistics the forward produces as columns are stored as rows ([1, block]) by `_as_row`.
Matmuls take the input dtype and accumulate in float32; the softmax runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from midas_jax.model.kernels.block_tables import blocks_visible_in_kernel

# Stands in for -inf in the running maximum: exp(NEG - m) is 0 for any real m and never NaN.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
# Lanes a column is broadcast to before a transpose: the TPU vector width.
LANES = 128


def _nt(a, b):
  """a @ b.T in float32 (contract the last dimension of both)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _as_row(column):
  """[n, 1] -> [1, n] by broadcast, transpose and a sublane reduction (layouts Mosaic supports)."""
  return jnp.max(jnp.broadcast_to(column, (column.shape[0], LANES)).T, axis=0, keepdims=True)


def _as_column(row):
  """[1, n] -> [n, 1], the inverse of _as_row."""
  return jnp.max(jnp.broadcast_to(row, (LANES, row.shape[1])).T, axis=1, keepdims=True)


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
    s = jnp.where(mask, _nt(q, k_ref[kj]) * scale, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    v = v_ref[kj]
    return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
            alpha * acc + _nn(p.astype(v.dtype), v))

  def body(kj, carry):
    seen = blocks_visible_in_kernel(q_tables, k_tables, row, qi, kj, num_q_blocks, num_k_blocks)
    return lax.cond(seen, lambda c: visit(kj, c), lambda c: c, carry)

  init = (jnp.full((bq, 1), NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, d), jnp.float32))
  m, l, acc = lax.fori_loop(0, num_k_blocks, body, init)
  # Every query sees at least itself (padding is a segment of its own), so l > 0.
  o_ref[...] = (acc / l).astype(o_ref.dtype)
  lse_ref[...] = _as_row(m + jnp.log(l))


def dq_kernel(q_tables, k_tables, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
              do_ref, lse_ref, delta_ref, dq_ref, *, scale: float, num_q_blocks: int, num_k_blocks: int):
  """Grid (batch, head, query block): dQ = scale * sum over key blocks of dS @ K."""
  row, qi = pl.program_id(0), pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  qseg, qpos = qseg_ref[...], qpos_ref[...]
  lse, delta = _as_column(lse_ref[...]), _as_column(delta_ref[...])

  def visit(kj, dq):
    k, v = k_ref[kj], v_ref[kj]
    mask = (qseg == kseg_ref[kj]) & (kpos_ref[kj] <= qpos)
    p = jnp.where(mask, jnp.exp(_nt(q, k) * scale - lse), 0.0)
    ds = p * (_nt(do, v) - delta)
    return dq + _nn(ds.astype(k.dtype), k)

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
    p = jnp.where(mask, jnp.exp(_nt(k, q) * scale - lse_ref[h, qi]), 0.0)  # [bk, bq]
    ds = p * (_nt(v, do) - delta_ref[h, qi])
    return dk + _nn(ds.astype(q.dtype), q), dv + _nn(p.astype(do.dtype), do)

  def body(qi, carry):
    seen = blocks_visible_in_kernel(q_tables, k_tables, row, qi, kj, num_q_blocks, num_k_blocks)
    heads = lambda c: lax.fori_loop(0, group, lambda h, cc: visit_head(qi, h, cc), c)
    return lax.cond(seen, heads, lambda c: c, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, num_q_blocks, body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)

