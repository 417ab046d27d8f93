"""The decoder-only transformer: embeddings, a scanned stack of blocks, final norm, LM head.

The blocks are scanned (nn.scan), so every per-layer parameter carries a leading `layers` axis
(docs/architecture.md#stacked-layers): params["layers"]["attn"]["query"] has shape [num_layers, embed, heads, kv].
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from midas_jax.configs import ModelConfig
from midas_jax.model import attention, layer_order, matmul
from midas_jax.model.attention import describe_mask
from midas_jax.model.layers import Block, Norm, dtype_of, operand_dtype, param, weight_init

_policies, _names = jax.checkpoint_policies, jax.checkpoint_policies.save_only_these_names
# A mixed-precision matmul is a custom VJP the dot policies cannot see into; its result is named
# instead (model/matmul.py), and each policy saves the names that stand for the dots it saves.
REMAT_POLICIES = {
    "full": _policies.nothing_saveable,
    "minimal": _policies.save_from_both_policies(_policies.dots_with_no_batch_dims_saveable,
                                                 _names(matmul.PROJECTION)),
    "save_dots": _policies.save_from_both_policies(_policies.checkpoint_dots,
                                                   _names(matmul.PROJECTION, matmul.ATTENTION)),
    # "full", but each layer's input waits for the backward pass in host memory, not on the device.
    "offload": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
        offload_src="device", offload_dst="pinned_host"),
}


def block_class(cfg: ModelConfig):
  """Block under the config's remat policy: what one layer of the scanned stack is."""
  if cfg.remat_policy == "none":
    return Block
  return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)


def scanned_blocks(cfg: ModelConfig, num_layers: int):
  """nn.scan of Block over `num_layers` layers, tagging each param with the `layers` axis."""
  return nn.scan(
      block_class(cfg),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, nn.broadcast),
      length=num_layers,
      unroll=num_layers if cfg.unroll_layers else 1,
      metadata_params={nn.PARTITION_NAME: "layers"},
  )


class Decoder(nn.Module):
  """Maps a batch (docs/architecture.md#one-example-format) to float32 logits [batch, length, vocab].

  platform: where the program runs, which ModelConfig.attention = "auto" is resolved for (None:
  jax's default backend). Set it when compiling for another platform, e.g. a TPU slice from a CPU
  host. The resolution happens here and nowhere else: every layer gets `layer_cfg`.
  """

  cfg: ModelConfig
  platform: Optional[str] = None

  @property
  def attention_implementation(self) -> str:
    """ModelConfig.attention resolved for `platform`: "dot_product", "flash" or "cudnn"."""
    return attention.resolve(self.cfg.attention, self.platform, self.cfg.dtype, self.cfg.resolved_head_dim)

  def setup(self):
    assert self.cfg.vocab_size is not None, "call ModelConfig.with_vocab() before building the model"
    self.layer_cfg = cfg = dataclasses.replace(self.cfg, attention=self.attention_implementation)
    embed_init = weight_init(cfg, fan_in=cfg.d_model)
    self.embedding = param(self, "embedding", embed_init, (cfg.vocab_size, cfg.d_model),
                           ("vocab", "embed"), cfg)
    if cfg.family == "gpt2":
      self.position_embedding = param(self, "position_embedding", embed_init,
                                      (cfg.max_seq_len, cfg.d_model), ("length", "embed"), cfg)
    self.layers = scanned_blocks(cfg, cfg.num_layers)(cfg, name="layers")
    self.final_norm = Norm(cfg, name="final_norm")
    if not cfg.tie_embeddings:
      self.head = param(self, "head", embed_init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg)

  def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    dtype = dtype_of(self.cfg.dtype)
    x = jnp.take(self.embedding, tokens, axis=0).astype(dtype)
    if self.cfg.family == "gpt2":
      x = x + jnp.take(self.position_embedding, positions, axis=0).astype(dtype)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))

  def logits(self, x: jax.Array) -> jax.Array:
    """The last layer's output -> float32 logits (final norm, then the head)."""
    return self.head_logits(self.final_norm(x))

  def head_logits(self, x: jax.Array) -> jax.Array:
    """Normed features [batch, length, d_model] -> float32 logits: the head alone, so a loss can apply it chunk by chunk."""
    operands = operand_dtype(self.layer_cfg)
    if self.cfg.tie_embeddings:
      out = matmul.dot_to_float32("btd,vd->btv", x, self.embedding, x.dtype, operands=operands)
    else:
      out = matmul.dot_to_float32("btd,dv->btv", x, self.head, x.dtype, operands=operands)
    return nn.with_logical_constraint(out, ("batch", "length", "vocab"))

  def __call__(self, batch: Mapping[str, jax.Array]) -> jax.Array:
    return self.head_logits(self.features(batch))

  def features(self, batch: Mapping[str, jax.Array]) -> jax.Array:
    """The final norm's output [batch, length, d_model]: what the head turns into logits."""
    positions = batch["positions"]
    # Described once per batch, read by every layer (docs/architecture.md#the-mask-is-described-not-built).
    mask = describe_mask(batch["segment_ids"], positions, batch["prefix_mask"])
    x = self.embed(batch["inputs"], positions)
    order = layer_order.order_for(self.cfg)
    if order is None or self.is_initializing():  # initializing creates the num_layers unique layers
      x, _ = self.layers(x, positions, mask)
    else:
      x = self._looped_layers(x, positions, mask, order)
    return self.final_norm(x)

  def _looped_layers(self, x, positions, mask, order):
    """The layer stack run in `order` (a block repeated): see model/layer_order.py."""
    cfg = self.layer_cfg
    layer_params = nn.unbox(self.variables["params"]["layers"])

    def block(params, h):
      return Block(cfg, parent=None).apply({"params": params}, h, positions, mask)[0]

    policy = None if cfg.remat_policy == "none" else REMAT_POLICIES[cfg.remat_policy]
    return layer_order.run_in_order(block, layer_params, x, order, policy)

  def cached_layers(self, x, positions, mask, cache):
    """The layers applied in execution order, each with its own entry of `cache` (a kv_cache.LayerCache
    stacked over layer applications), as one scan: (output, updated cache). See model/kv_cache.py."""
    cfg = self.layer_cfg
    order = layer_order.execution_order(cfg)
    layer_params = jax.tree.map(lambda p: p[order], nn.unbox(self.variables["params"]["layers"]))

    def body(h, inputs):
      p, layer_cache = inputs
      return Block(cfg, parent=None).apply({"params": p}, h, positions, mask, layer_cache)

    return jax.lax.scan(body, x, (layer_params, cache))


def dummy_batch(batch_size: int, seq_len: int) -> dict:
  """A shape-only batch for initialization and tracing."""
  ints = jnp.zeros((batch_size, seq_len), jnp.int32)
  return {
      "inputs": ints,
      "targets": ints,
      "positions": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch_size, seq_len)),
      "segment_ids": jnp.ones((batch_size, seq_len), jnp.int32),
      "prefix_mask": jnp.zeros((batch_size, seq_len), jnp.bool_),
      "loss_weights": jnp.ones((batch_size, seq_len), jnp.float32),
      "objective_ids": ints,
  }
