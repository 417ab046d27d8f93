"""Our parameter tree <-> a Hugging Face transformers state dict, as pure numpy maps.

Ours keeps kernels as [in, heads, head_dim] einsum operands with a leading `layers` axis; HF keeps
one tensor per layer. Llama uses torch Linear weights ([out, in], so a transpose) and GPT-2 uses
Conv1D weights ([in, out], no transpose) with query, key and value fused into one `c_attn`. Head
order is the same on both sides (query head h reads kv head h // group in both), and the rotary
half-rotation layout is HF's `rotate_half`, so no permutation of the query/key rows is needed.
Every map is a transpose, reshape or concatenation: export then import returns the exact bits.
Qwen2 is Llama with biases on the query, key and value projections (ModelConfig.qkv_bias). Export
makes each tensor only when it is written (`hf_tensors`), so no second copy of the model is built.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.errors import ConfigError

StateDict = Dict[str, np.ndarray]

# Non-persistent buffers that older transformers versions wrote into checkpoints; they hold no weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class HFTensor(NamedTuple):
  """One tensor of the HF state dict, made on demand: a sharded export holds one shard at a time."""

  name: str
  shape: Tuple[int, ...]
  make: Callable[[], np.ndarray]  # -> float32, C-contiguous

  @property
  def num_elements(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


def _np(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float32)


def _tensor(name: str, shape, source, fn: Callable[[np.ndarray], np.ndarray] = lambda w: w,
            layer: Optional[int] = None) -> HFTensor:
  """The tensor fn(source[layer]) (fn(source) without a layer), computed and copied only when made."""
  def make():
    return np.ascontiguousarray(fn(_np(source if layer is None else source[layer])))
  return HFTensor(name, tuple(int(n) for n in shape), make)


# ---- llama (and Qwen2: llama with biases on q, k, v) --------------------------------------------

def _llama_to_hf(params: Mapping, cfg: ModelConfig) -> List[HFTensor]:
  d, h, kv, hd, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.d_ff
  attn, mlp, layers = params["layers"]["attn"], params["layers"]["mlp"], params["layers"]
  out = [_tensor("model.embed_tokens.weight", (cfg.vocab_size, d), params["embedding"])]
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    for p, ours, n in (("q", "query", h), ("k", "key", kv), ("v", "value", kv)):
      out.append(_tensor(pre + f"self_attn.{p}_proj.weight", (n * hd, d), attn[ours], lambda w: w.reshape(d, -1).T, i))
      if cfg.qkv_bias:
        out.append(_tensor(pre + f"self_attn.{p}_proj.bias", (n * hd,), attn[ours + "_bias"], np.ravel, i))
    out += [
        _tensor(pre + "self_attn.o_proj.weight", (d, h * hd), attn["out"], lambda w: w.reshape(-1, d).T, i),
        _tensor(pre + "mlp.gate_proj.weight", (f, d), mlp["gate"], np.transpose, i),
        _tensor(pre + "mlp.up_proj.weight", (f, d), mlp["up"], np.transpose, i),
        _tensor(pre + "mlp.down_proj.weight", (d, f), mlp["down"], np.transpose, i),
        _tensor(pre + "input_layernorm.weight", (d,), layers["attn_norm"]["scale"], layer=i),
        _tensor(pre + "post_attention_layernorm.weight", (d,), layers["mlp_norm"]["scale"], layer=i),
    ]
  out.append(_tensor("model.norm.weight", (d,), params["final_norm"]["scale"]))
  if not cfg.tie_embeddings:
    out.append(_tensor("lm_head.weight", (cfg.vocab_size, d), params["head"], np.transpose))
  return out


def _llama_from_hf(sd: "_Reader", cfg: ModelConfig) -> dict:
  d, h, kv, hd, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.d_ff
  pre = "model.layers.{}."
  attn = {
      "query": sd.stack(pre + "self_attn.q_proj.weight", (h * hd, d), lambda w: w.T.reshape(d, h, hd)),
      "key": sd.stack(pre + "self_attn.k_proj.weight", (kv * hd, d), lambda w: w.T.reshape(d, kv, hd)),
      "value": sd.stack(pre + "self_attn.v_proj.weight", (kv * hd, d), lambda w: w.T.reshape(d, kv, hd)),
      "out": sd.stack(pre + "self_attn.o_proj.weight", (d, h * hd), lambda w: w.T.reshape(h, hd, d)),
  }
  if cfg.qkv_bias:
    for p, ours, n in (("q", "query", h), ("k", "key", kv), ("v", "value", kv)):
      attn[f"{ours}_bias"] = sd.stack(pre + f"self_attn.{p}_proj.bias", (n * hd,), lambda w, n=n: w.reshape(n, hd))
  params = {
      "embedding": sd.take("model.embed_tokens.weight", (cfg.vocab_size, d)),
      "final_norm": {"scale": sd.take("model.norm.weight", (d,))},
      "layers": {
          "attn": attn,
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

def _gpt2_to_hf(params: Mapping, cfg: ModelConfig) -> List[HFTensor]:
  d, f = cfg.d_model, cfg.d_ff
  attn, mlp, layers = params["layers"]["attn"], params["layers"]["mlp"], params["layers"]

  def fused(name: str, shape, parts, i: int) -> HFTensor:
    """c_attn of layer i: query, key and value side by side (GPT-2's Conv1D keeps [in, out])."""
    def make():
      arrays = [_np(attn[p][i]) for p in parts]  # kernels [d, h, hd], biases [h, hd]
      return np.ascontiguousarray(np.concatenate([a.reshape(*a.shape[:-2], -1) for a in arrays], axis=-1))
    return HFTensor(name, shape, make)

  out = [_tensor("transformer.wte.weight", (cfg.vocab_size, d), params["embedding"]),
         _tensor("transformer.wpe.weight", (cfg.max_seq_len, d), params["position_embedding"])]
  for i in range(cfg.num_layers):
    pre = f"transformer.h.{i}."
    out += [
        fused(pre + "attn.c_attn.weight", (d, 3 * d), ("query", "key", "value"), i),
        fused(pre + "attn.c_attn.bias", (3 * d,), ("query_bias", "key_bias", "value_bias"), i),
        _tensor(pre + "attn.c_proj.weight", (d, d), attn["out"], lambda w: w.reshape(d, d), i),
        _tensor(pre + "attn.c_proj.bias", (d,), attn["out_bias"], layer=i),
    ]
    for ours, theirs, shape in (("fc", "c_fc", (d, f)), ("proj", "c_proj", (f, d))):
      out += [_tensor(pre + f"mlp.{theirs}.weight", shape, mlp[ours], layer=i),
              _tensor(pre + f"mlp.{theirs}.bias", shape[1:], mlp[ours + "_bias"], layer=i)]
    for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      out += [_tensor(pre + f"{theirs}.weight", (d,), layers[ours]["scale"], layer=i),
              _tensor(pre + f"{theirs}.bias", (d,), layers[ours]["bias"], layer=i)]
  out += [_tensor("transformer.ln_f.weight", (d,), params["final_norm"]["scale"]),
          _tensor("transformer.ln_f.bias", (d,), params["final_norm"]["bias"])]
  return out


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


def hf_tensors(params: Mapping, cfg: ModelConfig) -> List[HFTensor]:
  """The HF CausalLM state dict of our unboxed params (numpy or jax arrays), tensor by tensor, in
  checkpoint order (embeddings, layer by layer, final norm, head); a tied head is left out."""
  return _TO_HF[cfg.family](params, cfg)


def to_hf_state_dict(params: Mapping, cfg: ModelConfig) -> StateDict:
  """Our unboxed params (numpy or jax arrays) -> the HF CausalLM state dict, float32 numpy."""
  return {t.name: t.make() for t in hf_tensors(params, cfg)}


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
