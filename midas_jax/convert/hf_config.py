"""ModelConfig <-> transformers LlamaConfig / GPT2Config.

A setting without an exact transformers equivalent is refused with a ConfigError naming it, never
approximated: an exported model must compute what ours computes. transformers is imported lazily.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from midas_jax.configs import ModelConfig
from midas_jax.data.vocab import EOS_ID, PAD_ID
from midas_jax.errors import ConfigError, require

ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
# transformers activations equal to jax.nn.gelu(approximate=True) (the tanh form GPT-2 used).
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def check_exportable(cfg: ModelConfig) -> None:
  """Refuses ModelConfig settings that transformers cannot express exactly."""
  require(cfg.loop_repeats == 1, "ModelConfig.loop_repeats",
          "a looped model has no transformers equivalent", "unroll it first with convert.unroll_loop")
  require(cfg.vocab_size is not None, "ModelConfig.vocab_size", "is not set",
          "export a config with the vocabulary filled in (ModelConfig.with_vocab)")
  require(cfg.d_model % cfg.num_heads == 0, "ModelConfig.num_heads",
          f"transformers requires num_heads to divide d_model ({cfg.num_heads} vs {cfg.d_model}), even with an "
          "explicit head_dim", "train with num_heads dividing d_model")
  if cfg.family == "gpt2":
    require(cfg.resolved_head_dim * cfg.num_heads == cfg.d_model, "ModelConfig.head_dim",
            f"GPT-2 in transformers has head_dim = d_model / num_heads, this model has {cfg.resolved_head_dim}",
            "leave ModelConfig.head_dim unset for gpt2 models you want to export")


def to_hf_config(cfg: ModelConfig):
  """The transformers config object (LlamaConfig or GPT2Config) of a ModelConfig, float32 weights."""
  check_exportable(cfg)
  import transformers  # lazy: only conversion needs it
  common = dict(vocab_size=cfg.vocab_size, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                tie_word_embeddings=cfg.tie_embeddings, architectures=[ARCHITECTURES[cfg.family]],
                dtype="float32")
  if cfg.family == "llama":
    return transformers.LlamaConfig(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.resolved_head_dim,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False, mlp_bias=False, **common)
  return transformers.GPT2Config(
      n_embd=cfg.d_model, n_inner=cfg.d_ff, n_layer=cfg.num_layers, n_head=cfg.num_heads,
      n_positions=cfg.max_seq_len, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
      scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, **common)


def _get(hf: Any, name: str, default: Any = None) -> Any:
  return getattr(hf, name, default)


def _refuse_unless(condition: bool, key: str, problem: str) -> None:
  require(condition, f"--hf config.json {key}", problem,
          "only plain Llama (SwiGLU, RMSNorm, default rotary) and GPT-2 checkpoints can be imported exactly")


def model_config_from_hf(hf: Any, base: Optional[ModelConfig] = None) -> ModelConfig:
  """The ModelConfig that computes what a transformers Llama or GPT-2 config describes.

  base: where settings transformers does not record come from (compute dtype, init scheme, ...);
  the ModelConfig defaults otherwise. vocab_size is the HF one, kept as is (vocab_multiple 1 unless
  base has that vocab_size already).
  """
  kind = _get(hf, "model_type")
  require(kind in ARCHITECTURES, "--hf config.json model_type", f"{kind!r} cannot be imported",
          f"import one of {tuple(ARCHITECTURES)}")
  base = base or ModelConfig()
  vocab_size = int(hf.vocab_size)
  common = dict(family=kind, vocab_size=vocab_size,
                vocab_multiple=base.vocab_multiple if base.vocab_size == vocab_size else 1,
                tie_embeddings=bool(_get(hf, "tie_word_embeddings", kind == "gpt2")), loop_start=0, loop_size=0,
                loop_repeats=1)
  if kind == "llama":
    _refuse_unless(_get(hf, "hidden_act", "silu") == "silu", "hidden_act", f"{hf.hidden_act!r} is not silu")
    _refuse_unless(not _get(hf, "attention_bias", False), "attention_bias", "attention biases are not supported")
    _refuse_unless(not _get(hf, "mlp_bias", False), "mlp_bias", "MLP biases are not supported")
    rope = dict(_get(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _refuse_unless(rope_type == "default", "rope_parameters", f"rotary scaling {rope_type!r} is not supported")
    heads = int(hf.num_attention_heads)
    kv = int(_get(hf, "num_key_value_heads", None) or heads)
    head_dim = int(_get(hf, "head_dim", None) or hf.hidden_size // heads)
    fields = dict(d_model=int(hf.hidden_size), num_layers=int(hf.num_hidden_layers), num_heads=heads,
                  num_kv_heads=None if kv == heads else kv,
                  head_dim=None if head_dim * heads == hf.hidden_size else head_dim,
                  d_ff=int(hf.intermediate_size), max_seq_len=int(hf.max_position_embeddings),
                  rope_theta=float(rope.get("rope_theta", _get(hf, "rope_theta", 10000.0))),
                  norm_eps=float(hf.rms_norm_eps))
  else:
    act = _get(hf, "activation_function", "gelu_new")
    _refuse_unless(act in _TANH_GELUS, "activation_function", f"{act!r} is not the tanh GELU")
    _refuse_unless(_get(hf, "scale_attn_weights", True), "scale_attn_weights", "unscaled attention")
    _refuse_unless(not _get(hf, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx",
                   "per-layer attention scaling")
    _refuse_unless(not _get(hf, "add_cross_attention", False), "add_cross_attention", "cross-attention")
    _refuse_unless(common["tie_embeddings"], "tie_word_embeddings", "gpt2 models here tie their head")
    d = int(hf.n_embd)
    fields = dict(d_model=d, num_layers=int(hf.n_layer), num_heads=int(hf.n_head), num_kv_heads=None,
                  head_dim=None, d_ff=int(_get(hf, "n_inner", None) or 4 * d), max_seq_len=int(hf.n_positions),
                  norm_eps=float(hf.layer_norm_epsilon))
  try:
    return dataclasses.replace(base, **common, **fields)
  except ConfigError as e:
    raise ConfigError(f"--hf config.json ({e.setting})", e.problem, e.fix) from None
