"""Our parameter tree <-> a Hugging Face transformers state dict, as pure numpy maps.

Ours keeps kernels as [in, heads, head_dim] einsum operands with a leading `layers` axis; HF keeps
one tensor per layer. Llama uses torch Linear weights ([out, in], so a transpose) and GPT-2 uses
Conv1D weights ([in, out], no transpose) with query, key and value fused into one `c_attn`. Head
order is the same on both sides (query head h reads kv head h // group in both), and the rotary
half-rotation layout is HF's `rotate_half`, so no permutation of the query/key rows is needed.
Every map is a transpose, reshape or concatenation: export then import returns the exact bits.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping

import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.errors import ConfigError

StateDict = Dict[str, np.ndarray]

# Non-persistent buffers that older transformers versions wrote into checkpoints; they hold no weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _np(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float32)


def _per_layer(stacked: np.ndarray, template: str, fn: Callable[[np.ndarray], np.ndarray]) -> StateDict:
  return {template.format(i): np.ascontiguousarray(fn(layer)) for i, layer in enumerate(stacked)}


# ---- llama -------------------------------------------------------------------------------------

def _llama_to_hf(params: Mapping, cfg: ModelConfig) -> StateDict:
  d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
  attn, mlp, layers = params["layers"]["attn"], params["layers"]["mlp"], params["layers"]
  pre = "model.layers.{}."
  sd: StateDict = {"model.embed_tokens.weight": _np(params["embedding"]),
                   "model.norm.weight": _np(params["final_norm"]["scale"])}
  sd.update(_per_layer(_np(attn["query"]), pre + "self_attn.q_proj.weight", lambda w: w.reshape(d, h * hd).T))
  sd.update(_per_layer(_np(attn["key"]), pre + "self_attn.k_proj.weight", lambda w: w.reshape(d, kv * hd).T))
  sd.update(_per_layer(_np(attn["value"]), pre + "self_attn.v_proj.weight", lambda w: w.reshape(d, kv * hd).T))
  sd.update(_per_layer(_np(attn["out"]), pre + "self_attn.o_proj.weight", lambda w: w.reshape(h * hd, d).T))
  for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
    sd.update(_per_layer(_np(mlp[ours]), pre + f"mlp.{theirs}.weight", lambda w: w.T))
  sd.update(_per_layer(_np(layers["attn_norm"]["scale"]), pre + "input_layernorm.weight", lambda w: w))
  sd.update(_per_layer(_np(layers["mlp_norm"]["scale"]), pre + "post_attention_layernorm.weight", lambda w: w))
  if not cfg.tie_embeddings:
    sd["lm_head.weight"] = np.ascontiguousarray(_np(params["head"]).T)
  return sd


def _llama_from_hf(sd: "_Reader", cfg: ModelConfig) -> dict:
  d, h, kv, hd, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.d_ff
  pre = "model.layers.{}."
  params = {
      "embedding": sd.take("model.embed_tokens.weight", (cfg.vocab_size, d)),
      "final_norm": {"scale": sd.take("model.norm.weight", (d,))},
      "layers": {
          "attn": {
              "query": sd.stack(pre + "self_attn.q_proj.weight", (h * hd, d), lambda w: w.T.reshape(d, h, hd)),
              "key": sd.stack(pre + "self_attn.k_proj.weight", (kv * hd, d), lambda w: w.T.reshape(d, kv, hd)),
              "value": sd.stack(pre + "self_attn.v_proj.weight", (kv * hd, d), lambda w: w.T.reshape(d, kv, hd)),
              "out": sd.stack(pre + "self_attn.o_proj.weight", (d, h * hd), lambda w: w.T.reshape(h, hd, d)),
          },
          "mlp": {
              "gate": sd.stack(pre + "mlp.gate_proj.weight", (f, d), lambda w: w.T),
              "up": sd.stack(pre + "mlp.up_proj.weight", (f, d), lambda w: w.T),
              "down": sd.stack(pre + "mlp.down_proj.weight", (d, f), lambda w: w.T),
          },
          "attn_norm": {"scale": sd.stack(pre + "input_layernorm.weight", (d,), lambda w: w)},
          "mlp_norm": {"scale": sd.stack(pre + "post_attention_layernorm.weight", (d,), lambda w: w)},
      },
  }
  if cfg.tie_embeddings:
    sd.drop("lm_head.weight")  # some writers store the tied copy as well
  else:
    params["head"] = sd.take("lm_head.weight", (cfg.vocab_size, d)).T
  return params


# ---- gpt2 --------------------------------------------------------------------------------------

def _gpt2_to_hf(params: Mapping, cfg: ModelConfig) -> StateDict:
  d = cfg.d_model
  attn, mlp, layers = params["layers"]["attn"], params["layers"]["mlp"], params["layers"]
  pre = "transformer.h.{}."
  sd: StateDict = {"transformer.wte.weight": _np(params["embedding"]),
                   "transformer.wpe.weight": _np(params["position_embedding"]),
                   "transformer.ln_f.weight": _np(params["final_norm"]["scale"]),
                   "transformer.ln_f.bias": _np(params["final_norm"]["bias"])}
  qkv = np.concatenate([_np(attn[n]).reshape(cfg.num_layers, d, d) for n in ("query", "key", "value")], axis=-1)
  qkv_bias = np.concatenate([_np(attn[n]).reshape(cfg.num_layers, d)
                             for n in ("query_bias", "key_bias", "value_bias")], axis=-1)
  sd.update(_per_layer(qkv, pre + "attn.c_attn.weight", lambda w: w))
  sd.update(_per_layer(qkv_bias, pre + "attn.c_attn.bias", lambda w: w))
  sd.update(_per_layer(_np(attn["out"]), pre + "attn.c_proj.weight", lambda w: w.reshape(d, d)))
  sd.update(_per_layer(_np(attn["out_bias"]), pre + "attn.c_proj.bias", lambda w: w))
  for ours, theirs in (("fc", "c_fc"), ("proj", "c_proj")):
    sd.update(_per_layer(_np(mlp[ours]), pre + f"mlp.{theirs}.weight", lambda w: w))
    sd.update(_per_layer(_np(mlp[ours + "_bias"]), pre + f"mlp.{theirs}.bias", lambda w: w))
  for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
    sd.update(_per_layer(_np(layers[ours]["scale"]), pre + f"{theirs}.weight", lambda w: w))
    sd.update(_per_layer(_np(layers[ours]["bias"]), pre + f"{theirs}.bias", lambda w: w))
  return sd


def _gpt2_from_hf(sd: "_Reader", cfg: ModelConfig) -> dict:
  d, h, hd, f = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.d_ff
  pre = "transformer.h.{}."
  qkv = sd.stack(pre + "attn.c_attn.weight", (d, 3 * d), lambda w: w)
  qkv_bias = sd.stack(pre + "attn.c_attn.bias", (3 * d,), lambda w: w)
  q, k, v = np.split(qkv, 3, axis=-1)
  qb, kb, vb = np.split(qkv_bias, 3, axis=-1)
  n = cfg.num_layers
  norm = lambda name: {"scale": sd.stack(pre + name + ".weight", (d,), lambda w: w),  # noqa: E731
                       "bias": sd.stack(pre + name + ".bias", (d,), lambda w: w)}
  sd.drop("lm_head.weight")  # GPT-2 ties its head to wte
  return {
      "embedding": sd.take("transformer.wte.weight", (cfg.vocab_size, d)),
      "position_embedding": sd.take("transformer.wpe.weight", (cfg.max_seq_len, d)),
      "final_norm": {"scale": sd.take("transformer.ln_f.weight", (d,)),
                     "bias": sd.take("transformer.ln_f.bias", (d,))},
      "layers": {
          "attn": {
              "query": q.reshape(n, d, h, hd), "key": k.reshape(n, d, h, hd), "value": v.reshape(n, d, h, hd),
              "query_bias": qb.reshape(n, h, hd), "key_bias": kb.reshape(n, h, hd),
              "value_bias": vb.reshape(n, h, hd),
              "out": sd.stack(pre + "attn.c_proj.weight", (d, d), lambda w: w.reshape(h, hd, d)),
              "out_bias": sd.stack(pre + "attn.c_proj.bias", (d,), lambda w: w),
          },
          "mlp": {
              "fc": sd.stack(pre + "mlp.c_fc.weight", (d, f), lambda w: w),
              "fc_bias": sd.stack(pre + "mlp.c_fc.bias", (f,), lambda w: w),
              "proj": sd.stack(pre + "mlp.c_proj.weight", (f, d), lambda w: w),
              "proj_bias": sd.stack(pre + "mlp.c_proj.bias", (d,), lambda w: w),
          },
          "attn_norm": norm("ln_1"),
          "mlp_norm": norm("ln_2"),
      },
  }


# ---- the reader that checks names and shapes ---------------------------------------------------

class _Reader:
  """Hands out state-dict tensors by name, checking shapes, and remembers which were used."""

  def __init__(self, state_dict: Mapping[str, np.ndarray], cfg: ModelConfig, source: str):
    self._sd = dict(state_dict)
    self._cfg = cfg
    self._source = source
    self._unused = {k for k in self._sd if not k.endswith(_IGNORED_SUFFIXES)}

  def take(self, name: str, shape) -> np.ndarray:
    if name not in self._sd:
      raise ConfigError(self._source, f"the weights have no tensor {name!r}",
                        f"pass a complete {self._cfg.family} checkpoint whose config.json matches its weights")
    value = np.asarray(self._sd[name], dtype=np.float32)
    if value.shape != tuple(shape):
      raise ConfigError(self._source, f"{name!r} has shape {value.shape}, config.json implies {tuple(shape)}",
                        "pass weights and a config.json from the same model")
    self._unused.discard(name)
    return value

  def stack(self, template: str, shape, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    return np.stack([fn(self.take(template.format(i), shape)) for i in range(self._cfg.num_layers)])

  def drop(self, name: str) -> None:
    self._unused.discard(name)

  def check_all_used(self) -> None:
    if self._unused:
      names = sorted(self._unused)
      raise ConfigError(self._source, f"{len(names)} tensors have no place in a {self._cfg.family} model: "
                        f"{names[:5]}{' ...' if len(names) > 5 else ''}",
                        "pass a plain LlamaForCausalLM or GPT2LMHeadModel checkpoint (no adapters or extra heads)")


_TO_HF = {"llama": _llama_to_hf, "gpt2": _gpt2_to_hf}
_FROM_HF = {"llama": _llama_from_hf, "gpt2": _gpt2_from_hf}


def to_hf_state_dict(params: Mapping, cfg: ModelConfig) -> StateDict:
  """Our unboxed params (numpy or jax arrays) -> the HF CausalLM state dict, float32 numpy."""
  return _TO_HF[cfg.family](params, cfg)


def _canonical_gpt2_names(state_dict: Mapping[str, np.ndarray]) -> StateDict:
  """GPT2Model checkpoints (the original OpenAI ones among them) name tensors without `transformer.`."""
  return {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
          for k, v in state_dict.items()}


def from_hf_state_dict(state_dict: Mapping[str, np.ndarray], cfg: ModelConfig, source: str = "--hf") -> dict:
  """The HF state dict -> our params tree (float32 numpy). Missing, misshapen or extra tensors raise."""
  if cfg.family == "gpt2":
    state_dict = _canonical_gpt2_names(state_dict)
  reader = _Reader(state_dict, cfg, source)
  params = _FROM_HF[cfg.family](reader, cfg)
  reader.check_all_used()
  return params
