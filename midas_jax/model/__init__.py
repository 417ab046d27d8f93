"""The decoder-only transformer (llama and gpt2 families)."""

from midas_jax.model.attention import AttentionMask, describe_mask, make_attention_mask
from midas_jax.model.transformer import Decoder, dummy_batch

__all__ = ["AttentionMask", "Decoder", "describe_mask", "dummy_batch", "make_attention_mask"]
