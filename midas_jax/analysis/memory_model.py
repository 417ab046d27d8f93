"""The analytic half of `midas bench compile`: a train step's activation memory per device, by formula.

Used where no compiler for the target is at hand (GPUs, TPU slices without libtpu) and for the
largest batch that fits. The formula follows the model's tensors, the remat policy, the attention
implementation (the dense path materializes [rows, heads, T, T] scores, flash does not), the loss
chunk (float32 logits for one chunk of the sequence at a time) and gradient accumulation (the
activations are one microbatch's).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from midas_jax.configs import ModelConfig


# The share of a GPU's memory a train step may plan to fill: "fits" on a GPU means total <= 90% of it.
# The other 10% is what the count does not see: the CUDA context and cuDNN/cuBLAS workspaces (cuDNN's
# attention backward asks for its own scratch buffer), NCCL's buffers, and the fragmentation of XLA's
# BFC allocator (a free total is not one free block). A run must also let XLA take that much: jax
# preallocates XLA_CLIENT_MEM_FRACTION of the memory, 0.75 by default, which is below this, so a
# GPU job sets the fraction above 0.9 (launch/slurm.py: 0.92, the rest for NCCL). A TPU's compiled peak
# is the compiler's own static plan, checked against its HBM exactly (it refuses a larger program), so
# TPUs get no headroom.
GPU_USABLE_FRACTION = 0.90


def usable_bytes(hbm: int, platform: str) -> int:
  """What a step may plan to fill of a device with `hbm` bytes (GPU_USABLE_FRACTION on GPUs)."""
  return int(hbm * GPU_USABLE_FRACTION) if platform == "gpu" else hbm


def fits(total: int, hbm: Optional[int], platform: str) -> Optional[bool]:
  """Whether a step of `total` bytes per device fits, with the GPU headroom; None where hbm is unknown."""
  return None if hbm is None else total <= usable_bytes(hbm, platform)


# The last jax whose cuDNN attention writes a bias gradient for a boolean mask: jax's main branch stopped
# on 2026-07-30 (commit 46e1d9b6de, jax issue #34685), after 0.11.0 was tagged.
CUDNN_MASK_DBIAS_UNTIL = (0, 11, 0)


def _release(version: str) -> Tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def cudnn_mask_bytes(rows: int, seq_len: int, itemsize: int, jax_version: str = jax.__version__) -> Dict[str, int]:
  """What the mask costs one layer of cuDNN attention (jax/_src/cudnn/fused_attention_stablehlo.py).

  jax.nn.dot_product_attention(implementation='cudnn') does not hand cuDNN the boolean mask:
  combine_bias_and_mask turns it into an additive bias in the inputs' dtype (0 or a large negative
  number), shaped as the mask, [rows, 1, T, T]; the custom VJP keeps that bias for the backward pass.
  Up to jax 0.11.0 should_export_dbias is always true, so the backward kernel also writes a bias
  gradient of the same shape and dtype (unused here, but a custom call's output is allocated all the
  same); later releases skip it for a boolean mask. The boolean mask (1 byte) is live while the bias is
  made from it. jax_version: the jax that runs the step (default: this one).
  """
  elements = rows * seq_len * seq_len
  dbias = _release(jax_version) <= CUDNN_MASK_DBIAS_UNTIL
  return {"mask": elements, "bias": elements * itemsize, "dbias": elements * itemsize if dbias else 0}


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
  stores no scores either, but is handed the dense mask: `cudnn_mask_bytes`).
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
  cudnn_mask = cudnn_mask_bytes(b, t, c) if attention == "cudnn" else {"mask": 0, "bias": 0, "dbias": 0}
  attention_extra += cudnn_mask["mask"] + cudnn_mask["bias"]  # the forward's; dbias is the backward's
  everything = tokens * c * (4 * d + (2 * h + 2 * kv) * hd + h * hd + mlp) + scores * c + attention_extra
  matmul_outputs = tokens * c * (3 * d + (h + 2 * kv) * hd + (2 * f if cfg.family == "llama" else f))
  per_layer = {"none": everything,
               "minimal": matmul_outputs,
               "save_dots": matmul_outputs + scores * 4 + tokens * h * hd * c,
               "full": tokens * d * c,
               "offload": 0}[cfg.remat_policy]  # offload: the layer inputs wait in host memory
  chunk = t if loss_chunk <= 0 else min(loss_chunk, t)
  return {"saved": layers * per_layer,
          # + float32 scores and their softmax (dense only), + cuDNN's bias gradient (cudnn only)
          "working": everything + scores * 4 * 2 + cudnn_mask["dbias"],
          "logits": 3 * b * chunk * v * 4}


def max_global_batch(analytic: Dict[str, int], rows: int, hbm: Optional[int], batch_shards: int,
                     microbatches: int = 1, platform: str = "tpu") -> Optional[int]:
  """The largest global batch whose analytic total fits `hbm` at this many microbatches.

  rows: the rows of one microbatch per device; activations grow with them, the rest is fixed.
  platform: "gpu" counts against `usable_bytes` (the headroom), others against all of `hbm`.
  """
  if hbm is None or rows == 0:
    return None
  hbm = usable_bytes(hbm, platform)
  per_row = analytic["activations"] / rows
  fixed = analytic["total"] - analytic["activations"]
  return max(0, int((hbm - fixed) // per_row)) * batch_shards * microbatches
