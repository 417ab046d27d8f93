"""The streamed flash-attention kernel bodies for the UL2 mask (TPU, and the interpreter on CPU):
forward, dQ and dK/dV.

Each kernel's grid is (batch, heads, owned block, step): a step visits one block of the other side,
so only one block of each operand is resident in VMEM, whatever the sequence length. The step axis
runs in order ("arbitrary"), carrying the running statistics in VMEM scratch from the first step,
which initialises them, to the last, which writes the owned block's output. Which block a step
visits comes from the visit lists (block_tables.visit_lists), prefetched into scalar memory and
read by the BlockSpec index maps: a kernel walks only the visible blocks of its owned block, and
the steps past their count repeat the last block (the pipeline then copies nothing) and run no body.
A visited pair the tables call fully visible runs the body without a mask; a partly visible one
recomputes the mask from per-token segment ids and causal positions, never reading it from memory.

  forward  grid (batch, head, query block, key step): scratch m, l [bq, 1], acc [bq, d] (the online softmax);
  dQ       grid (batch, head, query block, key step): scratch dq [bq, d];
  dK/dV    grid (batch, kv head, key block, query step): scratch dk, dv [bk, d]; the `group` query heads
           sharing the kv head (grouped-query attention) are a loop inside the step, all adding into
           the same dK and dV.

Orientation: the forward and dQ passes compute scores [queries, keys]; the dK/dV pass computes them
transposed, [keys, queries], so that every per-query statistic it needs (logsumexp, delta, segment,
position) is a lane-dense row and no pass transposes a matrix it multiplies. Matmuls take the input
dtype and accumulate in float32; the softmax runs in float32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Stands in for -inf in the running maximum: exp(NEG - m) is 0 for any real m and never NaN.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
# Lanes a column is broadcast to before a transpose: the TPU vector width.
LANES = 128


def nt_dot(a, b):
  """a @ b.T in float32 (contract the last dimension of both)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def nn_dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def as_row(column):
  """[n, 1] -> [1, n] by broadcast, transpose and a sublane reduction (layouts Mosaic supports)."""
  return jnp.max(jnp.broadcast_to(column, (column.shape[0], LANES)).T, axis=0, keepdims=True)


def as_column(row):
  """[1, n] -> [n, 1], the inverse of as_row."""
  return jnp.max(jnp.broadcast_to(row, (LANES, row.shape[1])).T, axis=1, keepdims=True)


def _visit(codes_ref, counts_ref, rows: int, steps: int, body):
  """Runs body(masked) for this grid step's pair if the step holds a visible block: with the mask
  for a partly visible pair, without it for a fully visible one. Grid axes 0, 2, 3 = batch, owned
  block, step."""
  b, owned, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  live = step < counts_ref[b * rows + owned]
  masked = lax.rem(codes_ref[(b * rows + owned) * steps + step], 2) == 1
  pl.when(live & masked)(lambda: body(True))
  pl.when(live & jnp.logical_not(masked))(lambda: body(False))


def forward_kernel(codes_ref, counts_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
                   o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale: float, rows: int, steps: int):
  """q_ref [bq, d]; k_ref, v_ref [bk, d] (this step's key block); qseg/qpos [bq, 1]; kseg/kpos [1, bk]
  -> o_ref [bq, d], lse_ref [1, bq] (natural-log logsumexp per query), written at the last step."""
  step = pl.program_id(3)

  @pl.when(step == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def body(masked: bool):
    s = nt_dot(q_ref[...], k_ref[...]) * scale
    if masked:
      mask = (qseg_ref[...] == kseg_ref[...]) & (kpos_ref[...] <= qpos_ref[...])
      s = jnp.where(mask, s, NEG)
    m = m_ref[...]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    if masked:  # a row with nothing visible yet has m_new = NEG, where exp(s - m_new) = 1
      p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp(m - m_new)
    v = v_ref[...]
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + nn_dot(p.astype(v.dtype), v)
    m_ref[...] = m_new

  _visit(codes_ref, counts_ref, rows, steps, body)

  @pl.when(step == steps - 1)
  def _write():
    l = l_ref[...]  # > 0: every query sees at least itself (padding is a segment of its own)
    o_ref[...] = (acc_ref[...] / l).astype(o_ref.dtype)
    lse_ref[...] = as_row(m_ref[...] + jnp.log(l))


def dq_kernel(codes_ref, counts_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
              do_ref, lse_ref, delta_ref, dq_ref, acc_ref, lse_col_ref, delta_col_ref, *, scale: float, rows: int,
              steps: int):
  """dQ = scale * sum over visited key blocks of dS @ K. lse_ref, delta_ref [1, bq] rows, turned into
  columns once (first step) in scratch."""
  step = pl.program_id(3)

  @pl.when(step == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    lse_col_ref[...] = as_column(lse_ref[...])
    delta_col_ref[...] = as_column(delta_ref[...])

  def body(masked: bool):
    k, v = k_ref[...], v_ref[...]
    p = jnp.exp(nt_dot(q_ref[...], k) * scale - lse_col_ref[...])
    if masked:
      p = jnp.where((qseg_ref[...] == kseg_ref[...]) & (kpos_ref[...] <= qpos_ref[...]), p, 0.0)
    ds = p * (nt_dot(do_ref[...], v) - delta_col_ref[...])
    acc_ref[...] += nn_dot(ds.astype(k.dtype), k)

  _visit(codes_ref, counts_ref, rows, steps, body)

  @pl.when(step == steps - 1)
  def _write():
    dq_ref[...] = (acc_ref[...] * scale).astype(dq_ref.dtype)


def dkv_kernel(codes_ref, counts_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, kseg_ref, kpos_ref,
               qseg_ref, qpos_ref, dk_ref, dv_ref, dk_acc_ref, dv_acc_ref, *, scale: float, group: int, rows: int,
               steps: int):
  """k_ref, v_ref [bk, d]; this step's query block of the kv head's group: q_ref, do_ref [group, bq, d],
  lse_ref, delta_ref [group, 1, bq]; kseg/kpos [bk, 1]; qseg/qpos [1, bq]. Scores are [keys, queries]."""
  step = pl.program_id(3)

  @pl.when(step == 0)
  def _init():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  def body(masked: bool):
    k, v = k_ref[...], v_ref[...]
    if masked:
      mask = (kseg_ref[...] == qseg_ref[...]) & (kpos_ref[...] <= qpos_ref[...])

    def head(h, carry):
      dk, dv = carry
      q, do = q_ref[h], do_ref[h]
      p = jnp.exp(nt_dot(k, q) * scale - lse_ref[h])  # [bk, bq]
      if masked:
        p = jnp.where(mask, p, 0.0)
      ds = p * (nt_dot(v, do) - delta_ref[h])
      return dk + nn_dot(ds.astype(q.dtype), q), dv + nn_dot(p.astype(do.dtype), do)

    dk, dv = lax.fori_loop(0, group, head, (dk_acc_ref[...], dv_acc_ref[...]))
    dk_acc_ref[...] = dk
    dv_acc_ref[...] = dv

  _visit(codes_ref, counts_ref, rows, steps, body)

  @pl.when(step == steps - 1)
  def _write():
    dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)
