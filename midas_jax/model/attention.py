"""The one attention mask every objective uses, described per token, and the attention call itself.

A query may see a key when both belong to the same packed segment and either the key is not later
than the query (causal) or both lie in the segment's bidirectional prefix. Causal LM is the case of
an empty prefix; prefix LM and span corruption put their inputs in the prefix (docs/architecture.md#one-example-format).

The mask is described, not built (docs/architecture.md#the-mask-is-described-not-built):
`describe_mask` turns a batch into two integers per token, a segment id and a causal position
max(position, last prefix position of its segment), and then

    query q sees key k  <=>  segment[q] == segment[k]  and  causal_position[k] <= causal_position[q].

Each padding token is a segment of its own, so it sees only itself (an all-masked softmax row would
otherwise be undefined). Implementations (ModelConfig.attention):
  dot_product  builds the dense [batch, 1, T, T] mask and the whole score matrix (dense_attention,
               XLA): the reference, and the fastest on CPU;
  flash        the fused Pallas kernels of model/kernels/ (TPU: Mosaic, GPU: Triton, CPU: interpreted):
               no [batch, heads, T, T] tensor, fully masked blocks skipped;
  cudnn        NVIDIA GPUs only: cuDNN's fused attention through jax.nn.dot_product_attention
               (model/kernels/cudnn.py), handed the dense boolean mask; bfloat16/float16 only;
  auto         flash on TPU; on an NVIDIA GPU cudnn where it applies, else dot_product (the Triton
               build of the flash kernels has been lowered but never run: ask for flash to try it);
               dot_product on CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from midas_jax.errors import ConfigError
from midas_jax.model.kernels import cudnn, flash_attention
from midas_jax.model.matmul import ATTENTION, PROJECTION, dot, dot_to_float32

# A masked score: exp(MASKED_SCORE - max) is 0 beside any visible score, and finite arithmetic
# never turns it into NaN (every row sees at least its own token).
MASKED_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)


@flax.struct.dataclass
class AttentionMask:
  """The mask of a batch, per token: [batch, length] int32 each (see the module docstring).

  The keys are the queries' own tokens, except where key_segment_ids and key_causal_positions
  describe them apart ([batch, keys]): a decoding step's new token attends over a cache of keys
  (model/kv_cache.py). Then the same rule holds between a query's and a key's description.
  """

  segment_ids: jax.Array
  causal_positions: jax.Array
  key_segment_ids: Optional[jax.Array] = None
  key_causal_positions: Optional[jax.Array] = None

  @property
  def is_self_attention(self) -> bool:
    return self.key_segment_ids is None

  def keys(self) -> Tuple[jax.Array, jax.Array]:
    """(segment ids, causal positions) of the keys."""
    if self.is_self_attention:
      return self.segment_ids, self.causal_positions
    return self.key_segment_ids, self.key_causal_positions


def describe_mask(segment_ids: jax.Array, positions: jax.Array, prefix_mask: jax.Array) -> AttentionMask:
  """A batch's fields -> its AttentionMask.

  Assumes, as every packed row has it, that each example is one contiguous run of its row and that
  its bidirectional tokens are its first ones (BOS and the prefix): then the prefix is exactly the
  tokens whose causal position is the last prefix position.
  """
  length = segment_ids.shape[1]
  segment_ids = segment_ids.astype(jnp.int32)
  positions = positions.astype(jnp.int32)
  causal = jnp.maximum(positions, _last_prefix_positions(segment_ids, positions, prefix_mask.astype(bool)))
  # Padding (segment 0) becomes one segment per token, numbered above every real segment id (<= length)
  # in increasing order, so segment ids stay sorted along a row and the kernels' block test stays tight.
  own_segment = length + 1 + jnp.arange(length, dtype=jnp.int32)[None, :]
  return AttentionMask(segment_ids=jnp.where(segment_ids == 0, own_segment, segment_ids),
                       causal_positions=causal)


def _last_prefix_positions(seg: jax.Array, pos: jax.Array, prefix: jax.Array) -> jax.Array:
  """Per prefix token, the position of its example's last prefix token (-1 elsewhere), [batch, length].

  An example's prefix is one run of its row, so this is the position at the end of each token's run
  of equal (segment, prefix) values: a reverse running minimum of the runs' last indices and one
  gather. No scatter: a TPU offloads a scatter to its SparseCore, a call the compiler's cost model
  cannot price (it counts -1 s for it; analysis/cost_model.py).
  """
  length = seg.shape[1]
  index = jnp.arange(length, dtype=jnp.int32)[None, :]
  run_changes = (seg[:, 1:] != seg[:, :-1]) | (prefix[:, 1:] != prefix[:, :-1])
  run_ends = jnp.concatenate([run_changes, jnp.ones_like(run_changes[:, :1])], axis=1)
  end = jax.lax.cummin(jnp.where(run_ends, index, length), axis=1, reverse=True)
  return jnp.where(prefix, jnp.take_along_axis(pos, end, axis=1), -1)


def dense_mask(mask: AttentionMask) -> jax.Array:
  """The described mask as a boolean [batch, 1, queries, keys] array."""
  seg, cpos = mask.segment_ids, mask.causal_positions
  key_seg, key_cpos = mask.keys()
  visible = (seg[:, :, None] == key_seg[:, None, :]) & (key_cpos[:, None, :] <= cpos[:, :, None])
  return visible[:, None, :, :]


def make_attention_mask(segment_ids: jax.Array, positions: jax.Array,
                        prefix_mask: jax.Array) -> jax.Array:
  """The mask's definition, straight from a batch's fields: boolean [batch, 1, length, length].

  The reference the description is tested against. Padding has segment id 0 and sees only itself.
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


def resolve(implementation: str, platform: Optional[str] = None, dtype: str = "bfloat16",
            head_dim: int = 64) -> str:
  """ModelConfig.attention for `platform`: 'auto' -> 'flash' on TPU, 'cudnn' on an NVIDIA GPU where
  cuDNN takes the model (dtype, head_dim: model/kernels/cudnn.py), else 'dot_product'.

  On GPU the flash kernels (Pallas on Triton) have been lowered but never compiled by Triton or run,
  so 'auto' takes paths that have run there: cuDNN's kernel, or XLA's dense ops. 'cudnn' where it
  cannot run is a ConfigError before anything compiles.

  platform: where the program will run (a mesh's devices know it); None takes jax's default backend,
  which is wrong when compiling ahead of time for another platform (bench compile passes it).
  """
  platform = platform or jax.default_backend()
  cannot = (f"cuDNN runs on an NVIDIA GPU, and this program is for {platform!r}" if platform not in ("gpu", "cuda")
            else cudnn.unsupported_reason(dtype, head_dim))
  if implementation == "cudnn" and cannot:
    raise ConfigError("ModelConfig.attention", f"'cudnn' cannot run here: {cannot}",
                      "use 'auto' (it takes cuDNN where it applies), 'dot_product' or 'flash'")
  if implementation != "auto":
    return implementation
  if platform == "tpu":
    return "flash"
  return "dot_product" if cannot else "cudnn"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, implementation: str,
           operands=None, flash_blocks: Tuple[Optional[int], Optional[int]] = (None, None)) -> jax.Array:
  """Scaled dot-product attention under `mask`; k and v may have fewer heads than q (grouped-query attention).

  q [batch, queries, heads, head_dim]; k, v [batch, keys, kv_heads, head_dim]. implementation:
  "dot_product", "flash" or "cudnn" ("auto" is resolved by the Decoder, for its platform). The fused
  kernels are for self-attention over one sequence; a decoding step (a few queries over a cache of keys,
  described apart) is attended densely whatever the implementation: its scores are one row per query.
  operands: what the dense path's matmuls multiply (model/matmul.py; None: q's dtype).
  flash_blocks: the flash kernels' (query, key) block sizes (ModelConfig.flash_block_q, flash_block_kv;
  None: the platform's default).
  """
  fused = implementation in ("flash", "cudnn") and mask.is_self_attention
  if implementation == "dot_product" or not fused or (implementation == "cudnn" and q.shape[1] % 2):
    return dense_attention(q, k, v, mask, operands)  # cuDNN takes a mask only at an even length
  if implementation == "flash":
    return _sharded_flash(q, k, v, mask, flash_blocks)
  if implementation == "cudnn":
    return cudnn.cudnn_attention(q, k, v, dense_mask(mask))
  raise ConfigError("ModelConfig.attention", f"unknown attention implementation {implementation!r}",
                    "use 'auto', 'dot_product', 'flash' or 'cudnn' ('auto' is resolved by model.Decoder)")


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, operands=None) -> jax.Array:
  """Attention through the whole [batch, heads, queries, keys] score matrix (XLA fuses what it can).

  The scores are a float32 result of compute-dtype operands, the softmax runs in float32 and the
  probabilities meet the values in the compute dtype (docs/model.md#which-ops-run-in-which-dtype).
  In float32 it computes what jax.nn.dot_product_attention's XLA path does, operation for operation.
  """
  batch, queries, heads, head_dim = q.shape
  kv_heads, dtype = k.shape[2], q.dtype
  visible = dense_mask(mask)  # [b, 1, t, s]
  scale = jnp.float32(1.0 / math.sqrt(head_dim))

  def one_group(q_group):  # the query heads that share the kv heads' index: [b, t, kv, d]
    scores = dot_to_float32("btnd,bsnd->bnts", q_group, k, dtype, name=ATTENTION, operands=operands) * scale
    probs = jax.nn.softmax(jnp.where(visible, scores, jnp.float32(MASKED_SCORE)), axis=-1).astype(dtype)
    return dot("bnts,bsnd->btnd", probs, v, dtype, name=ATTENTION, operands=operands)

  grouped = q.reshape(batch, queries, kv_heads, heads // kv_heads, head_dim)
  return jax.vmap(one_group, in_axes=3, out_axes=3)(grouped).reshape(batch, queries, heads, head_dim)


def _sharded_flash(q, k, v, mask: AttentionMask, blocks):
  """The flash kernels on each device's rows and heads (a kernel is opaque to XLA's partitioner).

  The kernels' output and logsumexp are named PROJECTION: the remat policies that keep projections
  ('minimal', 'save_dots') keep them too, [T, heads * head_dim] like a projection's output, where the
  backward pass would otherwise run the whole forward kernel again to get them back."""
  mesh = jax.sharding.get_abstract_mesh()
  args = (q, k, v, mask.segment_ids, mask.causal_positions)
  flash = functools.partial(flash_attention, block_q=blocks[0], block_kv=blocks[1], name=PROJECTION)
  if mesh.empty:
    return flash(*args)
  batch, length, heads, head_dim = nn.logical_to_mesh_axes(("batch", "length", "heads", "kv"))
  if length is not None or head_dim is not None:
    raise ConfigError("MeshConfig.rules", "flash attention needs whole sequences and whole heads on each device, "
                      f"but 'length' maps to {length!r} and 'kv' to {head_dim!r}",
                      "map 'length' and 'kv' to None, or set ModelConfig.attention = 'dot_product'")
  # A dimension its mesh axes do not divide (a batch of one while decoding) is left whole on every device.
  batch = batch if q.shape[0] % _axes_size(mesh, batch) == 0 else None
  heads = heads if k.shape[2] % _axes_size(mesh, heads) == 0 else None
  per_head, per_token = P(batch, None, heads, None), P(batch, None)
  return jax.shard_map(flash, mesh=mesh, in_specs=(per_head,) * 3 + (per_token,) * 2,
                       out_specs=per_head, check_vma=False)(*args)


def _axes_size(mesh, axes) -> int:
  if axes is None:
    return 1
  names = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[name] for name in names)
