"""Fused attention kernels for the one UL2 mask (docs/architecture.md#the-mask-is-described-not-built).

block_tables.py  per-block summaries of the mask description: which block pairs to visit, which need the mask
flash_kernels.py the streamed kernel bodies (TPU, and the interpreter on CPU): forward, dQ and dK/dV
flash_triton.py  the GPU kernels (Pallas on Triton): their set-up and in-kernel-loop bodies
flash.py         the kernels as one differentiable function: block sizes, padding, backend choice, the TPU set-up
cudnn.py         cuDNN's fused kernel on NVIDIA GPUs (jax's own), handed the dense mask, and where it applies
"""

from midas_jax.model.kernels.cudnn import cudnn_attention
from midas_jax.model.kernels.flash import flash_attention

__all__ = ["cudnn_attention", "flash_attention"]
