"""Flash attention for the UL2 mask as one differentiable function (custom VJP over Pallas kernels).

    flash_attention(q [B, T, H, D], k, v [B, T, KV, D], segment_ids, causal_positions [B, T])

Query q sees key k iff segment_ids[q] == segment_ids[k] and causal_positions[k] <= causal_positions[q]
(model/attention.py describes a batch this way). Nothing of size T x T is ever stored: the forward
keeps the output and one logsumexp per query; the backward recomputes the scores block by block.

The kernel bodies (flash_kernels.py) are shared; what differs per backend is how the pallas_call is
set up, chosen when the program is lowered (lax.platform_dependent), so that a train step compiled
ahead of time for a TPU slice on a CPU host gets the TPU kernel:
  tpu          Mosaic; the block tables go to SMEM by scalar prefetch;
  cuda, rocm   Triton; the block tables are read from device memory;
  otherwise    the Pallas interpreter over the TPU set-up (CPU tests).
"""

from __future__ import annotations

import functools
import math
from typing import Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from midas_jax.model.kernels import block_tables as tables_lib
from midas_jax.model.kernels import flash_kernels

DEFAULT_BLOCK = 128
# Above this estimate the TPU kernels ask for more VMEM than the compiler's default scoped limit.
DEFAULT_SCOPED_VMEM = 16 * 1024 ** 2


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                    causal_positions: jax.Array, block: int = DEFAULT_BLOCK) -> jax.Array:
  """Softmax(q k^T / sqrt(D)) v under the described mask; k and v may have fewer heads (GQA)."""
  b, t, h, d = q.shape
  kv = k.shape[2]
  if h % kv:
    raise ValueError(f"{h} query heads are not a multiple of {kv} key/value heads")
  block = min(block, _round_up(t, 8))
  padded = _round_up(t, block)
  seg, cpos = _pad_description(segment_ids.astype(jnp.int32), causal_positions.astype(jnp.int32), padded)
  heads_first = lambda x: jnp.swapaxes(_pad_length(x, padded), 1, 2)  # [B, heads, T, D]
  out = _attention(heads_first(q), heads_first(k), heads_first(v), seg, cpos, block)
  return jnp.swapaxes(out, 1, 2)[:, :t]


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _pad_length(x, padded: int):
  return jnp.pad(x, [(0, 0), (0, padded - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _pad_description(seg, cpos, padded: int):
  """Padded slots become segments of their own, numbered above every real one (order is kept)."""
  pad = padded - seg.shape[1]
  if pad == 0:
    return seg, cpos
  fresh = jnp.max(seg, axis=1, keepdims=True) + 1 + jnp.arange(pad, dtype=jnp.int32)[None]
  return jnp.concatenate([seg, fresh], axis=1), jnp.pad(cpos, [(0, 0), (0, pad)])


class _Layout:
  """Shapes and the per-token description in the layouts the kernels read."""

  def __init__(self, q, k, seg, cpos, block: int):
    self.batch, self.heads, self.length, self.head_dim = q.shape
    self.kv_heads = k.shape[1]
    self.group = self.heads // self.kv_heads
    self.block = block
    self.num_blocks = self.length // block
    self.scale = 1.0 / math.sqrt(self.head_dim)
    self.tables = tables_lib.flat_table(tables_lib.block_tables(seg, cpos, block))
    self.columns = (seg[:, :, None], cpos[:, :, None])  # [B, T, 1]: one token per sublane
    rows = lambda x: x.reshape(self.batch, self.num_blocks, 1, block)  # [B, nb, 1, block]: lane-dense
    self.rows = (rows(seg), rows(cpos))

  def blocked(self, x):
    """[B, heads, T, D] -> [B, heads, nb, block, D] (a leading block index the kernels loop over)."""
    return x.reshape(x.shape[0], x.shape[1], self.num_blocks, self.block, x.shape[-1])

  def stats(self, x):
    """[B, H, T] per-query statistics -> [B, H, nb, 1, block]."""
    return x.reshape(self.batch, self.heads, self.num_blocks, 1, self.block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, seg, cpos, block):
  return _forward(q, k, v, seg, cpos, block)[0]


def _attention_fwd(q, k, v, seg, cpos, block):
  out, lse = _forward(q, k, v, seg, cpos, block)
  return out, (q, k, v, seg, cpos, out, lse)


def _attention_bwd(block, residuals, d_out):
  q, k, v, seg, cpos, out, lse = residuals
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, H, T]
  dq, dk, dv = _backward(q, k, v, seg, cpos, d_out, lse, delta, block)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _by_platform(fn, *args):
  return lax.platform_dependent(*args, tpu=functools.partial(fn, "tpu"), cuda=functools.partial(fn, "gpu"),
                                rocm=functools.partial(fn, "gpu"), default=functools.partial(fn, "interpret"))


def _forward(q, k, v, seg, cpos, block):
  return _by_platform(functools.partial(_forward_call, block=block), q, k, v, seg, cpos)


def _backward(q, k, v, seg, cpos, d_out, lse, delta, block):
  return _by_platform(functools.partial(_backward_call, block=block), q, k, v, seg, cpos, d_out, lse, delta)


def _spec(shape, index):
  return pl.BlockSpec(shape, index)


def _call(backend: str, kernel, grid, in_specs, out_specs, out_shape, operands, tables, vmem_bytes: int):
  """pallas_call for one backend. The two flat block tables come first in every kernel's signature."""
  if backend == "gpu":
    table_spec = pl.BlockSpec(tables.shape, lambda *_: (0,))
    params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=[table_spec, table_spec] + in_specs,
                          out_specs=out_specs, compiler_params=params)(tables, tables, *operands)
  # Scalar prefetch hands the tables to every index map too; ours ignore them.
  with_tables = lambda spec: pl.BlockSpec(spec.block_shape, lambda *idx: spec.index_map(*idx[:len(grid)]))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=grid, in_specs=[with_tables(s) for s in in_specs],
      out_specs=jax.tree.map(with_tables, out_specs, is_leaf=lambda s: isinstance(s, pl.BlockSpec)))
  params = pltpu.CompilerParams(
      dimension_semantics=("parallel",) * len(grid),
      vmem_limit_bytes=int(vmem_bytes * 1.25) + (4 << 20) if vmem_bytes > DEFAULT_SCOPED_VMEM else None)
  return pl.pallas_call(kernel, out_shape=out_shape, grid_spec=grid_spec, compiler_params=params,
                        interpret=backend == "interpret")(tables, tables, *operands)


def _query_side_specs(lay: _Layout):
  """Specs shared by the forward and dQ passes (grid: batch, head, query block)."""
  bq, d, nb, g = lay.block, lay.head_dim, lay.num_blocks, lay.group
  whole_kv = _spec((None, None, nb, bq, d), lambda b, h, i: (b, lax.div(h, g), 0, 0, 0))
  column = _spec((None, bq, 1), lambda b, h, i: (b, i, 0))
  rows = _spec((None, nb, 1, bq), lambda b, h, i: (b, 0, 0, 0))
  q_block = _spec((None, None, bq, d), lambda b, h, i: (b, h, i, 0))
  stat = _spec((None, None, None, 1, bq), lambda b, h, i: (b, h, i, 0, 0))
  return q_block, whole_kv, column, rows, stat


def _vmem_estimate(lay: _Layout, itemsize: int, whole_heads: int) -> int:
  """Double-buffered VMEM of the largest operands: `whole_heads` whole-sequence [T, D] arrays."""
  whole = whole_heads * lay.length * lay.head_dim * itemsize
  per_token_rows = 4 * lay.length * 8 * 4  # seg / cpos rows and the stat rows, padded to 8 sublanes
  return 2 * (whole + per_token_rows)


def _forward_call(backend, q, k, v, seg, cpos, *, block) -> Tuple[jax.Array, jax.Array]:
  lay = _Layout(q, k, seg, cpos, block)
  q_block, whole_kv, column, rows, stat = _query_side_specs(lay)
  kernel = functools.partial(flash_kernels.forward_kernel, scale=lay.scale, num_q_blocks=lay.num_blocks,
                             num_k_blocks=lay.num_blocks)
  out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((lay.batch, lay.heads, lay.num_blocks, 1, lay.block), jnp.float32))
  out, lse = _call(backend, kernel, (lay.batch, lay.heads, lay.num_blocks),
                   [q_block, whole_kv, whole_kv, column, column, rows, rows], (q_block, stat), out_shape,
                   (q, lay.blocked(k), lay.blocked(v)) + lay.columns + lay.rows, lay.tables,
                   _vmem_estimate(lay, q.dtype.itemsize, 2))
  return out, lse.reshape(lay.batch, lay.heads, lay.length)


def _backward_call(backend, q, k, v, seg, cpos, d_out, lse, delta, *, block):
  lay = _Layout(q, k, seg, cpos, block)
  bq, d, nb, g = lay.block, lay.head_dim, lay.num_blocks, lay.group
  q_block, whole_kv, column, rows, stat = _query_side_specs(lay)
  dq_kernel = functools.partial(flash_kernels.dq_kernel, scale=lay.scale, num_q_blocks=nb, num_k_blocks=nb)
  dq = _call(backend, dq_kernel, (lay.batch, lay.heads, nb),
             [q_block, whole_kv, whole_kv, column, column, rows, rows, q_block, stat, stat], q_block,
             jax.ShapeDtypeStruct(q.shape, q.dtype),
             (q, lay.blocked(k), lay.blocked(v)) + lay.columns + lay.rows + (d_out, lay.stats(lse), lay.stats(delta)),
             lay.tables, _vmem_estimate(lay, q.dtype.itemsize, 2))

  # dK/dV: grid (batch, kv head, key block); each step holds its kv head's query group whole.
  k_block = _spec((None, None, bq, d), lambda b, j, i: (b, j, i, 0))
  whole_group = _spec((None, g, nb, bq, d), lambda b, j, i: (b, j, 0, 0, 0))
  group_stats = _spec((None, g, nb, 1, bq), lambda b, j, i: (b, j, 0, 0, 0))
  column = _spec((None, bq, 1), lambda b, j, i: (b, i, 0))
  rows = _spec((None, nb, 1, bq), lambda b, j, i: (b, 0, 0, 0))
  dkv_kernel = functools.partial(flash_kernels.dkv_kernel, scale=lay.scale, group=g, num_q_blocks=nb,
                                 num_k_blocks=nb)
  dk, dv = _call(backend, dkv_kernel, (lay.batch, lay.kv_heads, nb),
                 [k_block, k_block, whole_group, whole_group, group_stats, group_stats, column, column, rows, rows],
                 (k_block, k_block), (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                 (k, v, lay.blocked(q), lay.blocked(d_out), lay.stats(lse), lay.stats(delta)) + lay.columns + lay.rows,
                 lay.tables, _vmem_estimate(lay, q.dtype.itemsize, 2 * g))
  return dq, dk, dv
