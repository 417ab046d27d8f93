"""The decoder's shape, initialisation, precision and attention implementation."""

from __future__ import annotations

import dataclasses
from typing import Optional

from midas_jax.errors import require


FAMILIES = ("llama", "gpt2")
INIT_SCHEMES = ("gpt2", "gamma")
REMAT_POLICIES = ("none", "full", "minimal", "save_dots", "offload")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLEMENTATIONS = ("auto", "dot_product", "flash", "cudnn")
MATMUL_OPERANDS = ("auto", "compute", "float32")
RESIDUAL_INIT_DEPTHS = ("stage", "final")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer.

  family: "llama" (RMSNorm, rotary positions, SwiGLU, no biases, optional GQA) or
    "gpt2" (LayerNorm, learned positions, GELU MLP, biases, tied embeddings).
  vocab_size: None takes the data vocabulary's size rounded up to `vocab_multiple`.
  num_kv_heads: None means multi-head attention (= num_heads); fewer gives grouped-query attention.
  init: "gpt2" (the default: N(0, init_std) for every weight matrix and embedding table, with the two
    residual output projections scaled by 1/sqrt(2 * num_layers)), or "gamma": every weight matrix
    and embedding table drawn from N(0, (fan_in ** -init_gamma) ** 2), fan_in being the matrix's input
    dimension (d_model for embedding and position tables, heads * head_dim for the attention output,
    d_ff for the MLP output). Norm scales start at 1 and biases at 0 under both schemes.
  dtype: the compute dtype; param_dtype: the dtype parameters are stored (and updated) in.
  matmul_operands: what the matmuls multiply when dtype is bfloat16 (they accumulate in float32 either
    way): "compute" (bfloat16 operands), "float32" (the same bfloat16 values as float32 operands: the
    same products, at float32 speed) or "auto" (compute, except in a program the CPU cannot run with
    them, found by running it once on zeros before it trains: model/dot_support.py).
  loop_start, loop_size, loop_repeats: a looped model: layers [loop_start, loop_start + loop_size)
    share their weights across loop_repeats consecutive applications (1: no looping). Set in training
    for a looped model, or at evaluation to loop a grown model's middle block (model/layer_order.py).
  qkv_bias: llama family only: biases on the query, key and value projections (Qwen2's layout).
  unroll_layers: unroll the loop over layers in the compiled program (the parameters stay stacked): a longer
    compile, the same values. XLA's cost model prices a loop's body once, so `midas bench compile` prices
    the step from unrolled programs (analysis/cost_model.py).
  residual_init_depth: the L of init "gpt2"'s residual scale 1/sqrt(2L): "stage" (the depth of the model being
    initialized, a stacked run's first stage included) or "final" (the depth a stacked run grows to, which
    train/build.py's build_stage writes into residual_init_layers for every stage; for an unstacked model the
    two agree). residual_init_layers: that final depth (None: num_layers); set by build_stage, not by hand.
  attention: "dot_product" (XLA, with a dense [batch, 1, T, T] mask), "flash" (the fused Pallas
    kernels of model/kernels/: nothing of size T x T stored, fully masked blocks skipped), "cudnn"
    (NVIDIA GPUs: cuDNN's fused kernel, bfloat16 or float16, head_dim a multiple of 8 up to 128) or
    "auto" (flash on TPU; cudnn on an NVIDIA GPU where it applies, else dot_product, until the Triton
    kernels have run on one; dot_product on CPU). See model/attention.py.
  flash_block_q, flash_block_kv: the flash kernels' query and key/value block sizes, in tokens (None or
    0: the platform's default, 512 on TPU and 128 elsewhere, capped by the padded sequence length).
    Multiples of 128, the TPU's tile (model/kernels/flash.py).
  """

  family: str = "llama"
  vocab_size: Optional[int] = None
  vocab_multiple: int = 128
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  d_ff: int = 1024
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  norm_eps: float = 1e-5
  init: str = "gpt2"
  init_std: float = 0.02
  init_gamma: float = 0.5
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat_policy: str = "none"
  loop_start: int = 0
  loop_size: int = 0
  loop_repeats: int = 1
  attention: str = "auto"
  qkv_bias: bool = False
  matmul_operands: str = "auto"
  unroll_layers: bool = False
  residual_init_depth: str = "stage"
  residual_init_layers: Optional[int] = None
  flash_block_q: Optional[int] = None
  flash_block_kv: Optional[int] = None

  def __post_init__(self):
    s = "ModelConfig."
    require(self.attention in ATTENTION_IMPLEMENTATIONS, s + "attention",
            f"unknown attention implementation {self.attention!r}",
            f"use one of {ATTENTION_IMPLEMENTATIONS}")
    require(self.matmul_operands in MATMUL_OPERANDS, s + "matmul_operands",
            f"unknown choice {self.matmul_operands!r}", f"use one of {MATMUL_OPERANDS}")
    for name in ("flash_block_q", "flash_block_kv"):
      value = getattr(self, name)
      require(value is None or (isinstance(value, int) and value >= 0 and value % 128 == 0), s + name,
              f"must be a multiple of 128 tokens (the TPU's tile), got {value!r}",
              f"set {s}{name} to 128, 256, 512, ..., or None for the platform's default")
    if self.loop_repeats != 1:
      require(self.loop_repeats >= 1 and self.loop_size >= 1 and self.loop_start >= 0
              and self.loop_start + self.loop_size <= self.num_layers, s + "loop_repeats",
              f"loop block [{self.loop_start}, {self.loop_start + self.loop_size}) x {self.loop_repeats} does not "
              f"fit {self.num_layers} layers", "set loop_start, loop_size >= 1 within num_layers and loop_repeats >= 1")
    require(self.family in FAMILIES, s + "family", f"unknown family {self.family!r}",
            f"use one of {FAMILIES}")
    for name in ("d_model", "num_layers", "num_heads", "d_ff", "max_seq_len", "vocab_multiple"):
      value = getattr(self, name)
      require(isinstance(value, int) and value > 0, s + name, f"must be a positive int, got {value!r}",
              f"set {s}{name} to a positive integer")
    if self.head_dim is None:
      require(self.d_model % self.num_heads == 0, s + "num_heads",
              f"num_heads={self.num_heads} does not divide d_model={self.d_model}",
              "pick num_heads that divides d_model, or set ModelConfig.head_dim explicitly")
    kv = self.kv_heads
    require(kv > 0 and self.num_heads % kv == 0, s + "num_kv_heads",
            f"num_kv_heads={kv} does not divide num_heads={self.num_heads}",
            "grouped-query attention needs num_heads to be a multiple of num_kv_heads")
    require(self.family == "llama" or kv == self.num_heads, s + "num_kv_heads",
            "grouped-query attention is a llama-family option", "leave num_kv_heads unset for gpt2")
    require(self.family == "llama" or not self.qkv_bias, s + "qkv_bias",
            "gpt2-family models always have biases on every projection", "leave ModelConfig.qkv_bias False for gpt2")
    require(self.family == "llama" or self.tie_embeddings, s + "tie_embeddings",
            "gpt2-family models tie their embeddings", "set ModelConfig.tie_embeddings = True")
    require(self.family != "llama" or self.resolved_head_dim % 2 == 0, s + "head_dim",
            f"rotary positions need an even head_dim, got {self.resolved_head_dim}",
            "choose d_model / num_heads (or head_dim) even")
    require(self.init in INIT_SCHEMES, s + "init", f"unknown init scheme {self.init!r}",
            f"use one of {INIT_SCHEMES}")
    require(self.residual_init_depth in RESIDUAL_INIT_DEPTHS, s + "residual_init_depth",
            f"unknown choice {self.residual_init_depth!r}", f"use one of {RESIDUAL_INIT_DEPTHS}")
    require(self.residual_init_layers is None or (isinstance(self.residual_init_layers, int)
                                                  and self.residual_init_layers >= 1),
            s + "residual_init_layers", f"must be None or a positive int, got {self.residual_init_layers!r}",
            "leave it None: build_stage sets it from the final depth")
    require(self.init_gamma > 0, s + "init_gamma", "must be > 0", "typical values are 0.3 to 1.0")
    require(self.remat_policy in REMAT_POLICIES, s + "remat_policy",
            f"unknown remat policy {self.remat_policy!r}", f"use one of {REMAT_POLICIES}")
    for name in ("dtype", "param_dtype"):
      require(getattr(self, name) in DTYPES, s + name, f"unsupported dtype {getattr(self, name)!r}",
              f"use one of {DTYPES}")
    if self.vocab_size is not None:
      require(self.vocab_size > 0, s + "vocab_size", "must be positive",
              "set it to at least the vocabulary size, or leave it None to take the vocabulary's")

  @property
  def residual_depth(self) -> int:
    """The L of the residual projections' init std init_std / sqrt(2L) (ModelConfig.residual_init_depth)."""
    if self.residual_init_depth == "final" and self.residual_init_layers is not None:
      return self.residual_init_layers
    return self.num_layers

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  def with_vocab(self, vocab_size: int) -> "ModelConfig":
    """Fills vocab_size from the data vocabulary (padded), or checks that a set one is big enough."""
    if self.vocab_size is None:
      padded = -(-vocab_size // self.vocab_multiple) * self.vocab_multiple  # round up (configs import only errors)
      return dataclasses.replace(self, vocab_size=padded)
    require(self.vocab_size >= vocab_size, "ModelConfig.vocab_size",
            f"{self.vocab_size} is smaller than the data vocabulary ({vocab_size} ids)",
            f"set ModelConfig.vocab_size >= {vocab_size}, or leave it None")
    return self
