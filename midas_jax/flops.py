"""Parameter and FLOP counts from a ModelConfig alone, for MFU and for sizing runs.

Counts follow the config arithmetic, not a built model, so they are cheap and usable before
anything is initialised; tests of the model check that the two agree.
"""

from __future__ import annotations

from typing import Dict, Optional

from midas_jax.configs import ModelConfig
from midas_jax.errors import require


def _vocab(cfg: ModelConfig) -> int:
  require(cfg.vocab_size is not None, "ModelConfig.vocab_size", "is None, so nothing can be counted",
          "call cfg.with_vocab(vocabulary_size) first, or set ModelConfig.vocab_size")
  return cfg.vocab_size


def _attention_matrices(cfg: ModelConfig) -> int:
  """q and o span all query heads; k and v only the kv heads (fewer under GQA)."""
  hd = cfg.resolved_head_dim
  return 2 * cfg.d_model * cfg.num_heads * hd + 2 * cfg.d_model * cfg.kv_heads * hd


def _mlp_matrices(cfg: ModelConfig) -> int:
  n = 3 if cfg.family == "llama" else 2  # SwiGLU: gate, up, down; GELU MLP: up, down
  return n * cfg.d_model * cfg.d_ff


def param_counts(cfg: ModelConfig, num_layers: Optional[int] = None) -> Dict[str, int]:
  """Parameters by part. num_layers overrides cfg.num_layers (depth changes as a model grows).

  llama: RMSNorm scales only, no biases (but q, k, v biases with qkv_bias), untied head unless
  tie_embeddings. gpt2: LayerNorm scale and bias, biases on every projection, learned positions, tied
  head. non_embedding excludes the token and position tables but keeps an untied head (it is a matmul
  like any other layer).
  """
  d, vocab = cfg.d_model, _vocab(cfg)
  layers = cfg.num_layers if num_layers is None else num_layers
  gpt2 = cfg.family == "gpt2"
  attention = _attention_matrices(cfg)
  mlp = _mlp_matrices(cfg)
  if gpt2 or cfg.qkv_bias:
    attention += (cfg.num_heads + 2 * cfg.kv_heads) * cfg.resolved_head_dim  # q, k, v biases
  if gpt2:
    attention += d  # the output projection's bias
    mlp += cfg.d_ff + d
  norm = 2 * d if gpt2 else d  # LayerNorm has scale and bias; RMSNorm a scale
  counts = {
      "embedding": vocab * d,
      "position_embedding": cfg.max_seq_len * d if gpt2 else 0,
      "attention_per_layer": attention,
      "mlp_per_layer": mlp,
      "norms_per_layer": 2 * norm,  # one before attention, one before the MLP
      "final_norm": norm,
      "head": 0 if cfg.tie_embeddings else d * vocab,
  }
  counts["per_layer"] = attention + mlp + counts["norms_per_layer"]
  counts["norms"] = layers * counts["norms_per_layer"] + norm
  counts["total"] = (counts["embedding"] + counts["position_embedding"] + layers * counts["per_layer"]
                     + norm + counts["head"])
  counts["non_embedding"] = counts["total"] - counts["embedding"] - counts["position_embedding"]
  return counts


def matmul_params(cfg: ModelConfig, num_layers: Optional[int] = None) -> int:
  """Weights that take part in a matmul per token: every projection, plus the LM head.

  The head counts even when tied (the output projection multiplies by the table); the embedding
  and position lookups do not (a gather costs no FLOPs). Biases and norms are elementwise.
  """
  layers = cfg.num_layers if num_layers is None else num_layers
  return layers * (_attention_matrices(cfg) + _mlp_matrices(cfg)) + cfg.d_model * _vocab(cfg)


def layer_applications(cfg: ModelConfig, num_layers: Optional[int] = None) -> int:
  """Layers a token passes through: the stored depth plus every extra pass of a looped block.

  num_layers overrides the stored depth cfg.num_layers (a growing run's stage depth); the loop
  (ModelConfig.loop_*) applies its loop_size tied layers loop_repeats times at any depth, so its
  extra passes count whether or not the depth is overridden.
  """
  layers = cfg.num_layers if num_layers is None else num_layers
  return layers + cfg.loop_size * (cfg.loop_repeats - 1)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, num_layers: Optional[int] = None) -> float:
  """Model FLOPs of one training token (forward + backward), the MFU numerator per token.

  The PaLM convention (Chowdhery et al. 2022, appendix B) for the weights, 6 * N for the N matmul
  weights (2 per multiply-add forward, 4 backward), plus attention as the causal mask has it: a
  token's query meets the keys up to its own, seq_len / 2 of them on average, so scores (QK^T) and
  values (AV) cost 6 * 2 * layers * (seq_len / 2) * heads * head_dim. Counting the causal triangle
  once, not the whole square, is MaxText's convention, and the work a kernel that skips masked
  blocks does; the UL2 mixture's bidirectional prefixes are counted as causal too. Recomputation
  under remat is not counted (that would be hardware FLOPs, not model FLOPs). num_layers overrides
  the stored depth, as in layer_applications.
  """
  layers = layer_applications(cfg, num_layers)  # a looped block's repeats cost as much as distinct layers
  attention = 2 * layers * (seq_len / 2) * cfg.num_heads * cfg.resolved_head_dim  # the causal triangle
  return 6.0 * (matmul_params(cfg, layers) + attention)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, num_layers: Optional[int] = None) -> float:
  """One third of train_flops_per_token: the forward pass alone (evaluation, inference)."""
  return train_flops_per_token(cfg, seq_len, num_layers) / 3.0
