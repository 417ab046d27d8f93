"""Flash attention for the UL2 mask as one differentiable function (custom VJP over Pallas kernels).

    flash_attention(q [B, T, H, D], k, v [B, T, KV, D], segment_ids, causal_positions [B, T],
                    block_q=None, block_kv=None, name=None)

Query q sees key k iff segment_ids[q] == segment_ids[k] and causal_positions[k] <= causal_positions[q]
(model/attention.py describes a batch this way). Nothing of size T x T is ever stored: the forward
keeps the output and one logsumexp per query; the backward recomputes the scores block by block.
`name`: what the output and the logsumexp are named for the remat policies (checkpoint_name), so
that a policy saving that name keeps them and its backward pass does not run the forward kernel again.

How the pallas_calls are set up differs per backend, chosen when the program is lowered
(lax.platform_dependent), so that a train step compiled ahead of time for a TPU slice on a CPU host
gets the TPU kernels; so are the block sizes (None or 0: the backend's default, capped by the
padded sequence length):
  tpu          Mosaic, streamed (flash_kernels.py): grid (batch, head, owned block, step), one block of
               each operand in VMEM, the visit lists of block_tables.py prefetched into scalar memory
               and read by the index maps. Blocks of 512 (multiples of 128).
  cuda, rocm   Triton (flash_triton.py): whole-sequence K/V per step, skipping by lax.cond. Blocks of 128.
  otherwise    the Pallas interpreter over the TPU set-up (the CPU tests). Blocks of 128 (multiples of 8).
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from midas_jax.errors import require
from midas_jax.model.kernels import block_tables as tables_lib
from midas_jax.model.kernels import flash_kernels, flash_triton
from midas_jax.padding import round_up

# Default block sizes per backend. On TPU, 512-token blocks keep the MXU busy per step (and the
# per-step overhead small) while one block of each operand stays far below VMEM; smaller blocks
# would skip more of the causal triangle but run 4x the steps.
DEFAULT_BLOCKS = {"tpu": 512, "gpu": 128, "interpret": 128}
# The tile a block's token dimension must fill: 128 lanes on TPU (a block is also a [1, block] row).
BLOCK_MULTIPLE = {"tpu": 128, "gpu": 8, "interpret": 8}
# Above this estimate the TPU kernels ask for more VMEM than the compiler's default scoped limit.
DEFAULT_SCOPED_VMEM = 16 * 1024 ** 2
KERNEL_NAMES = ("ul2_flash_forward", "ul2_flash_dq", "ul2_flash_dkv")


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, causal_positions: jax.Array,
                    block_q: Optional[int] = None, block_kv: Optional[int] = None,
                    name: Optional[str] = None) -> jax.Array:
  """Softmax(q k^T / sqrt(D)) v under the described mask; k and v may have fewer heads (GQA)."""
  h, kv = q.shape[2], k.shape[2]
  if h % kv:
    raise ValueError(f"{h} query heads are not a multiple of {kv} key/value heads")
  for setting, value in (("block_q", block_q), ("block_kv", block_kv)):
    require(not value or value % 8 == 0, f"ModelConfig.flash_{setting}", f"{value} is not a multiple of 8",
            "use a multiple of 128 (the TPU's tile), or 0 for the platform's default")
  return _attention(q, k, v, segment_ids.astype(jnp.int32), causal_positions.astype(jnp.int32),
                    (block_q or 0, block_kv or 0, name))


def block_sizes(backend: str, length: int, block_q: int = 0, block_kv: int = 0) -> Tuple[int, int]:
  """The (query, key) block sizes a backend ("tpu", "gpu", "interpret") uses for `length` tokens:
  the setting (0: DEFAULT_BLOCKS) rounded up to the backend's tile, capped by the padded length."""
  multiple = BLOCK_MULTIPLE[backend]
  cap = round_up(length, multiple)
  return tuple(min(round_up(value or DEFAULT_BLOCKS[backend], multiple), cap) for value in (block_q, block_kv))


def padded_length(length: int, block_q: int, block_kv: int) -> int:
  return round_up(length, math.lcm(block_q, block_kv))


def _pad_length(x, padded: int, axis: int = 1):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, padded - x.shape[axis])
  return jnp.pad(x, widths)


def _pad_description(seg, cpos, padded: int):
  """Padded slots become segments of their own, numbered above every real one (order is kept)."""
  pad = padded - seg.shape[1]
  if pad == 0:
    return seg, cpos
  fresh = jnp.max(seg, axis=1, keepdims=True) + 1 + jnp.arange(pad, dtype=jnp.int32)[None]
  return jnp.concatenate([seg, fresh], axis=1), jnp.pad(cpos, [(0, 0), (0, pad)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, seg, cpos, settings):
  return _forward(q, k, v, seg, cpos, settings)[0]


def _attention_fwd(q, k, v, seg, cpos, settings):
  out, lse = _forward(q, k, v, seg, cpos, settings)
  name = settings[2]
  if name is not None:  # what the remat policies may keep instead of running this kernel again
    out, lse = checkpoint_name(out, name), checkpoint_name(lse, name)
  return out, (q, k, v, seg, cpos, out, lse)


def _attention_bwd(settings, residuals, d_out):
  q, k, v, seg, cpos, out, lse = residuals
  delta = jnp.swapaxes(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2)  # [B, H, T]
  dq, dk, dv = _backward(q, k, v, seg, cpos, d_out, lse, delta, settings)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _by_platform(fn, *args):
  return lax.platform_dependent(*args, tpu=functools.partial(fn, "tpu"), cuda=functools.partial(fn, "gpu"),
                                rocm=functools.partial(fn, "gpu"), default=functools.partial(fn, "interpret"))


def _prepared(backend, q, seg, cpos, settings):
  """Block sizes, padded length and padded description for one backend."""
  t = q.shape[1]
  bq, bk = block_sizes(backend, t, settings[0], settings[1])
  padded = padded_length(t, bq, bk)
  return bq, bk, padded, _pad_description(seg, cpos, padded)


def _heads_first(x, padded: int):
  return jnp.swapaxes(_pad_length(x, padded), 1, 2)  # [B, T, heads, D] -> [B, heads, padded T, D]


def _forward(q, k, v, seg, cpos, settings):
  return _by_platform(functools.partial(_forward_on, settings=settings), q, k, v, seg, cpos)


def _backward(q, k, v, seg, cpos, d_out, lse, delta, settings):
  return _by_platform(functools.partial(_backward_on, settings=settings), q, k, v, seg, cpos, d_out, lse, delta)


def _forward_on(backend, q, k, v, seg, cpos, *, settings):
  """-> out [B, T, H, D], lse [B, H, T] float32."""
  t = q.shape[1]
  bq, bk, padded, (seg, cpos) = _prepared(backend, q, seg, cpos, settings)
  args = (_heads_first(q, padded), _heads_first(k, padded), _heads_first(v, padded), seg, cpos, bq, bk)
  out, lse = flash_triton.forward(*args) if backend == "gpu" else _tpu_forward(backend == "interpret", *args)
  return jnp.swapaxes(out, 1, 2)[:, :t], lse[:, :, :t]


def _backward_on(backend, q, k, v, seg, cpos, d_out, lse, delta, *, settings):
  t = q.shape[1]
  bq, bk, padded, (seg, cpos) = _prepared(backend, q, seg, cpos, settings)
  # Padded queries get lse = delta = 0 and a zero d_out: each sees only its own zero key (score 0), so
  # every term it adds is 0.
  stat = lambda x: _pad_length(x, padded, axis=2)
  args = (_heads_first(q, padded), _heads_first(k, padded), _heads_first(v, padded), seg, cpos,
          _heads_first(d_out, padded), stat(lse), stat(delta), bq, bk)
  grads = flash_triton.backward(*args) if backend == "gpu" else _tpu_backward(backend == "interpret", *args)
  return tuple(jnp.swapaxes(g, 1, 2)[:, :t] for g in grads)


# --- the streamed TPU set-up (also what the interpreter runs) ----------------------------------------------


def vmem_estimates(block_q: int, block_kv: int, head_dim: int, group: int, itemsize: int) -> Dict[str, int]:
  """VMEM bytes each streamed kernel needs, by the block sizes alone (not the sequence length): the
  double-buffered blocks of its operands and outputs, its scratch, and its [bq, bk] float32
  temporaries. Columns ([n, 1]) occupy 128 lanes and rows ([1, n]) 8 sublanes."""
  bq, bk, d = block_q, block_kv, head_dim
  column, row, f32 = 128 * 4, 8 * 4, 4
  forward = (2 * (2 * bq * d * itemsize + 2 * bk * d * itemsize + 2 * bq * column + 2 * bk * row + bq * row)
             + 2 * bq * column + bq * d * f32 + 3 * bq * bk * f32)
  dq = (2 * (3 * bq * d * itemsize + 2 * bk * d * itemsize + 2 * bq * column + 2 * bk * row + 2 * bq * row)
        + bq * d * f32 + 2 * bq * column + 4 * bq * bk * f32)
  dkv = (2 * (4 * bk * d * itemsize + 2 * group * bq * d * itemsize + 2 * group * bq * row + 2 * bk * column
              + 2 * bq * row) + 2 * bk * d * f32 + 4 * bk * bq * f32)
  return {"forward": forward, "dq": dq, "dkv": dkv}


# Matmul FLOPs per visited (query block, key block) pair and head, in units of bq * bk * head_dim: the
# forward kernel's scores and values (2 + 2); dQ's scores, dP and dQ (2 + 2 + 2); dK/dV's scores, dP,
# dV and dK (4 x 2). The backward kernels each recompute the scores rather than store them.
MATMUL_FLOPS = {"forward": 4, "dq": 6, "dkv": 8}


def causal_block_pairs(length: int, block_q: int, block_kv: int) -> int:
  """The (query block, key block) pairs a causal mask over one `length` sequence leaves partly visible."""
  return sum(min(length // block_kv, ((i + 1) * block_q - 1) // block_kv + 1) for i in range(length // block_q))


def cost_estimate(kernel: str, batch: int, heads: int, kv_heads: int, length: int, head_dim: int, block_q: int,
                  block_kv: int, itemsize: int) -> pl.CostEstimate:
  """What one kernel costs XLA's cost model, which otherwise prices a custom call at nothing: the FLOPs,
  exponentials and HBM bytes of the blocks a causal mask visits. A causal mask is the most UL2 rows
  need (prefixes see within the causal triangle's blocks; packed segments skip more), so this is the
  upper bound of the data-dependent count (analysis/cost_model.py prices steps with it)."""
  pairs = batch * heads * causal_block_pairs(length, block_q, block_kv)
  per_pair = block_q * block_kv
  streamed_block = {"forward": 2 * block_kv, "dq": 2 * block_kv, "dkv": 2 * block_q}[kernel]  # re-read per pair
  owned = {"forward": 2 * heads, "dq": 3 * heads, "dkv": 4 * kv_heads}[kernel] * batch * length  # read or written once
  stats = batch * heads * length * 4 * (1 if kernel == "forward" else 2)
  return pl.CostEstimate(flops=MATMUL_FLOPS[kernel] * per_pair * head_dim * pairs,
                         transcendentals=per_pair * pairs,
                         bytes_accessed=(pairs * streamed_block + owned) * head_dim * itemsize + stats)


def _tpu_call(interpret: bool, kernel, name: str, grid, in_specs, out_specs, out_shape, scratch,
              visits: tables_lib.VisitLists, operands, vmem_bytes: int, cost: pl.CostEstimate):
  """pallas_call with the visit lists (flat, for scalar memory) prefetched ahead of the operands: every
  index map gets them after the grid indices, every kernel before its operand refs."""
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
                                           out_specs=out_specs, scratch_shapes=scratch)
  params = pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=int(vmem_bytes * 1.25) + (4 << 20) if vmem_bytes > DEFAULT_SCOPED_VMEM else None)
  return pl.pallas_call(kernel, out_shape=out_shape, grid_spec=grid_spec, compiler_params=params,
                        interpret=interpret, name=name, cost_estimate=cost)(
                            visits.codes.reshape(-1), visits.counts.reshape(-1), *operands)


def _visited(rows: int, steps: int):
  """The block a step visits, from the flat visit codes (grid axes 0, 2, 3: batch, owned block, step)."""
  return lambda b, owned, step, codes: lax.div(codes[(b * rows + owned) * steps + step], 2)


def _query_side(q, k, seg, cpos, bq: int, bk: int):
  """What the forward and dQ kernels share (grid: batch, head, query block, key step)."""
  b, h, t, d = q.shape
  group, nq, nk = h // k.shape[1], t // bq, t // bk
  key = _visited(nq, nk)
  specs = dict(
      q=pl.BlockSpec((None, None, bq, d), lambda b, h, i, s, codes, counts: (b, h, i, 0)),
      kv=pl.BlockSpec((None, None, bk, d), lambda b, h, i, s, codes, counts: (b, lax.div(h, group),
                                                                              key(b, i, s, codes), 0)),
      column=pl.BlockSpec((None, bq, 1), lambda b, h, i, s, codes, counts: (b, i, 0)),
      row=pl.BlockSpec((None, None, 1, bk), lambda b, h, i, s, codes, counts: (b, key(b, i, s, codes), 0, 0)),
      stat=pl.BlockSpec((None, None, None, 1, bq), lambda b, h, i, s, codes, counts: (b, h, i, 0, 0)))
  description = (seg[:, :, None], cpos[:, :, None], seg.reshape(b, nk, 1, bk), cpos.reshape(b, nk, 1, bk))
  return specs, description, (b, h, nq, nk), dict(rows=nq, steps=nk)


def _tpu_forward(interpret, q, k, v, seg, cpos, bq: int, bk: int):
  b, h, t, d = q.shape
  query_lists, _ = tables_lib.flash_visits(seg, cpos, bq, bk)
  sp, description, grid, shape = _query_side(q, k, seg, cpos, bq, bk)
  kernel = functools.partial(flash_kernels.forward_kernel, scale=d ** -0.5, **shape)
  out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t // bq, 1, bq), jnp.float32))
  scratch = [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, d), jnp.float32)]
  vmem = vmem_estimates(bq, bk, d, h // k.shape[1], q.dtype.itemsize)["forward"]
  out, lse = _tpu_call(interpret, kernel, KERNEL_NAMES[0], grid,
                       [sp["q"], sp["kv"], sp["kv"], sp["column"], sp["column"], sp["row"], sp["row"]],
                       (sp["q"], sp["stat"]), out_shape, scratch, query_lists, (q, k, v) + description, vmem,
                       cost_estimate("forward", b, h, k.shape[1], t, d, bq, bk, q.dtype.itemsize))
  return out, lse.reshape(b, h, t)


def _tpu_backward(interpret, q, k, v, seg, cpos, d_out, lse, delta, bq: int, bk: int):
  b, h, t, d = q.shape
  kv = k.shape[1]
  group, nq, nk = h // kv, t // bq, t // bk
  scale = d ** -0.5
  query_lists, key_lists = tables_lib.flash_visits(seg, cpos, bq, bk)
  vmem = vmem_estimates(bq, bk, d, group, q.dtype.itemsize)
  cost = functools.partial(cost_estimate, batch=b, heads=h, kv_heads=kv, length=t, head_dim=d, block_q=bq,
                           block_kv=bk, itemsize=q.dtype.itemsize)
  stats = lambda x: x.reshape(b, h, nq, 1, bq)

  sp, description, grid, shape = _query_side(q, k, seg, cpos, bq, bk)
  dq_kernel = functools.partial(flash_kernels.dq_kernel, scale=scale, **shape)
  scratch = [pltpu.VMEM((bq, d), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32)]
  dq = _tpu_call(interpret, dq_kernel, KERNEL_NAMES[1], grid,
                 [sp["q"], sp["kv"], sp["kv"], sp["column"], sp["column"], sp["row"], sp["row"], sp["q"], sp["stat"],
                  sp["stat"]], sp["q"], jax.ShapeDtypeStruct(q.shape, q.dtype), scratch, query_lists,
                 (q, k, v) + description + (d_out, stats(lse), stats(delta)), vmem["dq"], cost("dq"))

  # dK/dV: grid (batch, kv head, key block, query step); a step holds one query block of the whole group.
  query = _visited(nk, nq)
  k_block = pl.BlockSpec((None, None, bk, d), lambda b, j, i, s, codes, counts: (b, j, i, 0))
  q_group = pl.BlockSpec((None, group, bq, d), lambda b, j, i, s, codes, counts: (b, j, query(b, i, s, codes), 0))
  stat_group = pl.BlockSpec((None, group, None, 1, bq),
                            lambda b, j, i, s, codes, counts: (b, j, query(b, i, s, codes), 0, 0))
  column = pl.BlockSpec((None, bk, 1), lambda b, j, i, s, codes, counts: (b, i, 0))
  row = pl.BlockSpec((None, None, 1, bq), lambda b, j, i, s, codes, counts: (b, query(b, i, s, codes), 0, 0))
  dkv_kernel = functools.partial(flash_kernels.dkv_kernel, scale=scale, group=group, rows=nk, steps=nq)
  dk, dv = _tpu_call(interpret, dkv_kernel, KERNEL_NAMES[2], (b, kv, nk, nq),
                     [k_block, k_block, q_group, q_group, stat_group, stat_group, column, column, row, row],
                     (k_block, k_block),
                     (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                     [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)], key_lists,
                     (k, v, q, d_out, stats(lse), stats(delta), seg[:, :, None], cpos[:, :, None],
                      seg.reshape(b, nq, 1, bq), cpos.reshape(b, nq, 1, bq)), vmem["dkv"], cost("dkv"))
  return dq, dk, dv
