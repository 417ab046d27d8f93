"""Fused attention kernels for the one UL2 mask (docs/architecture.md#the-mask-is-described-not-built).

block_tables.py  per-block summaries of the mask description and which blocks can be skipped
flash_kernels.py the Pallas kernel bodies: forward, dQ and dK/dV, one body for every backend
flash.py         the kernels as one differentiable function: layout, padding, backend choice
"""

from midas_jax.model.kernels.flash import flash_attention

__all__ = ["flash_attention"]
