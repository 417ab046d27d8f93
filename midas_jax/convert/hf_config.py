"""ModelConfig <-> transformers LlamaConfig / Qwen2Config / GPT2Config.

A setting without an exact transformers equivalent is refused with a ConfigError naming it, never
approximated: an exported model must compute what ours computes. transformers is imported lazily.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from midas_jax.configs import ModelConfig
from midas_jax.data.vocab.vocabulary import EOS_ID, PAD_ID
from midas_jax.errors import ConfigError, require

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}
IMPORTABLE = tuple(ARCHITECTURES)  # transformers model_type values
# transformers activations equal to jax.nn.gelu(approximate=True) (the tanh form GPT-2 used).
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def model_type(cfg: ModelConfig) -> str:
  """The transformers model_type that computes what cfg does: Qwen2 is Llama with q/k/v biases."""
  return "qwen2" if cfg.family == "llama" and cfg.qkv_bias else cfg.family


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


def to_hf_config(cfg: ModelConfig, token_ids: Optional[dict] = None, dtype: str = "float32"):
  """The transformers config object (LlamaConfig, Qwen2Config or GPT2Config) of a ModelConfig.

  token_ids: {"bos", "eos", "pad"} ids of the vocabulary (default seqio's layout: no bos, eos 1,
  pad 0); dtype: the dtype the weights are written in.
  """
  check_exportable(cfg)
  import transformers  # lazy: only conversion needs it
  ids = token_ids or {"bos": None, "eos": EOS_ID, "pad": PAD_ID}
  kind = model_type(cfg)
  common = dict(vocab_size=cfg.vocab_size, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                pad_token_id=ids["pad"], tie_word_embeddings=cfg.tie_embeddings, architectures=[ARCHITECTURES[kind]],
                dtype=dtype)
  if cfg.family == "llama":
    fields = dict(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.resolved_head_dim,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)}, **common)
    if kind == "qwen2":  # biases on q, k, v, never on the output projection
      return transformers.Qwen2Config(use_sliding_window=False, **fields)
    return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **fields)
  return transformers.GPT2Config(
      n_embd=cfg.d_model, n_inner=cfg.d_ff, n_layer=cfg.num_layers, n_head=cfg.num_heads,
      n_positions=cfg.max_seq_len, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
      scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, **common)


def _get(hf: Any, name: str, default: Any = None) -> Any:
  return getattr(hf, name, default)


def _refuse_unless(condition: bool, key: str, problem: str) -> None:
  require(condition, f"--hf config.json {key}", problem,
          "only plain Llama and Qwen2 (SwiGLU, RMSNorm, default rotary, full attention) and GPT-2 checkpoints "
          "can be imported exactly")


def model_config_from_hf(hf: Any, base: Optional[ModelConfig] = None) -> ModelConfig:
  """The ModelConfig that computes what a transformers Llama, Qwen2 or GPT-2 config describes.

  base: where settings transformers does not record come from (compute dtype, init scheme, ...);
  the ModelConfig defaults otherwise. vocab_size is the HF one, kept as is (vocab_multiple 1 unless
  base has that vocab_size already).
  """
  kind = _get(hf, "model_type")
  require(kind in IMPORTABLE, "--hf config.json model_type", f"{kind!r} cannot be imported",
          f"import one of {IMPORTABLE}")
  base = base or ModelConfig()
  vocab_size = int(hf.vocab_size)
  common = dict(family="gpt2" if kind == "gpt2" else "llama", vocab_size=vocab_size, qkv_bias=kind == "qwen2",
                vocab_multiple=base.vocab_multiple if base.vocab_size == vocab_size else 1,
                tie_embeddings=bool(_get(hf, "tie_word_embeddings", kind == "gpt2")), loop_start=0, loop_size=0,
                loop_repeats=1)
  if kind in ("llama", "qwen2"):
    _refuse_unless(_get(hf, "hidden_act", "silu") == "silu", "hidden_act", f"{hf.hidden_act!r} is not silu")
    _refuse_unless(not _get(hf, "attention_bias", False), "attention_bias",
                   "Llama attention biases include one on the output projection, which is not supported "
                   "(Qwen2's biases on q, k, v alone are)")
    _refuse_unless(not _get(hf, "mlp_bias", False), "mlp_bias", "MLP biases are not supported")
    _refuse_unless(not _get(hf, "use_sliding_window", False), "use_sliding_window",
                   "sliding-window attention is not supported")
    layer_types = set(_get(hf, "layer_types", None) or ["full_attention"])
    _refuse_unless(layer_types == {"full_attention"}, "layer_types", f"{sorted(layer_types)} are not all full "
                   "attention")
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
