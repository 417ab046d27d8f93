"""The analytic half of `midas bench compile`: a train step's activation memory per device, by formula.

Used where no compiler for the target is at hand (GPUs, TPU slices without libtpu) and for the
largest batch that fits. The formula follows the model's tensors, the remat policy, the attention
implementation (the dense path materializes [rows, heads, T, T] scores, flash does not), the loss
chunk (float32 logits for one chunk of the sequence at a time) and gradient accumulation (the
activations are one microbatch's).
"""

from __future__ import annotations

from typing import Dict, Optional

import jax.numpy as jnp

from midas_jax.configs import ModelConfig


def _local(value: int, ways: int) -> int:
  return value // ways if value % ways == 0 else value


def activation_bytes(cfg: ModelConfig, rows: int, seq_len: int, tensor: int = 1,
                     num_layers: Optional[int] = None, attention: str = "dot_product",
                     loss_chunk: int = 0) -> Dict[str, int]:
  """Analytic activation memory of one device's backward pass, by part.

  rows: the rows this device holds in one pass (one microbatch's). `saved` is what the forward
  keeps for the backward pass, per layer, under the remat policy (all layers together); `working`
  is one layer's full set while its gradient is taken (recomputed under remat), with the dense
  path's scores ([rows, heads, T, T]: jax.nn.dot_product_attention's XLA path materializes them)
  or the flash kernels' heads-first copies of q, k, v and the output; `logits` are the float32
  logits of one loss chunk, their softmax and their gradient.
  attention: the resolved implementation, "dot_product", "flash" or "cudnn" (cuDNN's fused kernel
  stores no scores either, but is handed the dense boolean mask, [rows, 1, T, T] bytes, per layer).
  """
  layers = cfg.num_layers if num_layers is None else num_layers
  c = jnp.dtype(cfg.dtype).itemsize
  b, t, d, hd = rows, seq_len, cfg.d_model, cfg.resolved_head_dim
  h, kv = _local(cfg.num_heads, tensor), _local(cfg.kv_heads, tensor)
  f, v = _local(cfg.d_ff, tensor), _local(cfg.vocab_size, tensor)
  mlp = 3 * f if cfg.family == "llama" else 2 * f  # gate, up, their product (llama); fc, gelu (gpt2)
  tokens = b * t
  dense = attention == "dot_product"
  scores = b * h * t * t if dense else 0
  attention_extra = 0 if dense else tokens * (2 * h + 2 * kv) * hd * c + tokens * h * 4  # copies, logsumexp
  if attention == "cudnn":
    attention_extra += b * t * t  # the boolean mask
  everything = tokens * c * (4 * d + (2 * h + 2 * kv) * hd + h * hd + mlp) + scores * c + attention_extra
  matmul_outputs = tokens * c * (3 * d + (h + 2 * kv) * hd + (2 * f if cfg.family == "llama" else f))
  per_layer = {"none": everything,
               "minimal": matmul_outputs,
               "save_dots": matmul_outputs + scores * 4 + tokens * h * hd * c,
               "full": tokens * d * c,
               "offload": 0}[cfg.remat_policy]  # offload: the layer inputs wait in host memory
  chunk = t if loss_chunk <= 0 else min(loss_chunk, t)
  return {"saved": layers * per_layer,
          "working": everything + scores * 4 * 2,  # + float32 scores and their softmax (dense only)
          "logits": 3 * b * chunk * v * 4}


def max_global_batch(analytic: Dict[str, int], rows: int, hbm: Optional[int], batch_shards: int,
                     microbatches: int = 1) -> Optional[int]:
  """The largest global batch whose analytic total fits `hbm` at this many microbatches.

  rows: the rows of one microbatch per device; activations grow with them, the rest is fixed.
  """
  if hbm is None or rows == 0:
    return None
  per_row = analytic["activations"] / rows
  fixed = analytic["total"] - analytic["activations"]
  return max(0, int((hbm - fixed) // per_row)) * batch_shards * microbatches
