"""The three export formats, each a directory: hf (transformers), torch (state dict), npz (our tree).

Every directory also gets `midas_jax.json` (where the weights came from: step, stage, depth, the
run's config) and a README.md that says how to load it. Weights are float32 safetensors, no pickle.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping

import numpy as np

from midas_jax.configs import DataConfig, ModelConfig, RunConfig
from midas_jax.convert import hf_config, mapping
from midas_jax.data.vocab import EOS_ID, PAD_ID, make_vocabulary

FORMATS = ("hf", "torch", "npz")
PROVENANCE_FILE = "midas_jax.json"
WEIGHTS_FILE = "model.safetensors"
NPZ_FILE = "params.npz"

CAUSAL_LIMIT = (
    "transformers runs every input causally. The model was trained here on a UL2 mixture in which "
    "prefix-LM and span-corruption examples attend bidirectionally over their inputs (the prefix); "
    "transformers cannot express that mask, so such prompts (mode tokens, sentinels, an input to "
    "condition on) see only earlier tokens, as the causal-LM share of training did. Causal text "
    "continuation and scoring are exact; for prefix-LM and infilling use `midas eval` here.")


def causal_note(data: DataConfig) -> str:
  """What running causally means for a model trained on `data`'s objectives."""
  if data.causal_rate >= 1.0:
    return "The model was trained on causal LM only: transformers computes what it was trained for."
  return CAUSAL_LIMIT


def flatten(tree: Mapping, prefix: str = "") -> Dict[str, np.ndarray]:
  """{'layers/attn/query': array, ...}: our tree with '/' keys."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(flatten(value, f"{prefix}{key}/"))
    else:
      out[f"{prefix}{key}"] = np.asarray(value, dtype=np.float32)
  return out


def unflatten(flat: Mapping[str, np.ndarray]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = np.asarray(value)
  return tree


def _save_safetensors(path: str, state_dict: Dict[str, np.ndarray], extra: Dict[str, str] | None = None) -> None:
  from safetensors.numpy import save_file  # lazy: the convert extra
  # transformers refuses safetensors files whose metadata does not name a framework.
  save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()}, path,
            metadata={"format": "pt", **(extra or {})})


def _write_text(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)


def _header(provenance: Dict[str, Any], cfg: ModelConfig) -> str:
  source = f" from {provenance['source']}" if "source" in provenance else ""
  lines = [f"Exported by midas_jax{source} (step {provenance.get('step')}, stage {provenance.get('stage')}, depth "
           f"{cfg.num_layers}): a {cfg.family}-family decoder, d_model {cfg.d_model}, {cfg.num_heads} heads "
           f"({cfg.kv_heads} kv), vocab {cfg.vocab_size}. Weights are float32."]
  if provenance.get("unrolled_loop"):
    lines.append("The model was looped (a block of layers applied several times); each application is a layer "
                 "of its own here, with the block's weights copied.")
  if cfg.dtype != "float32":
    lines.append(f"midas_jax computed in {cfg.dtype} (weights float32); transformers computes in float32 unless "
                 f"loaded with dtype=torch.{cfg.dtype}.")
  return "\n".join(lines) + "\n"


def write_hf(out_dir: str, params: Mapping, cfg: ModelConfig, run_config: RunConfig,
             provenance: Dict[str, Any]) -> List[str]:
  """A transformers model directory: config.json, model.safetensors, generation and tokenizer files."""
  from transformers import GenerationConfig  # lazy: the convert extra
  from midas_jax.convert import tokenizer as tokenizer_lib
  hf_config.to_hf_config(cfg).save_pretrained(out_dir)
  GenerationConfig(bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
  sd = mapping.to_hf_state_dict(params, cfg)  # tied heads are left out, as transformers writes them
  _save_safetensors(os.path.join(out_dir, WEIGHTS_FILE), sd)
  tokens = tokenizer_lib.write_tokenizer(out_dir, run_config.data)
  real = make_vocabulary(run_config.data).vocab_size
  padding = (f"Ids {real} to {cfg.vocab_size - 1} are padding rows of the embedding (the model's vocabulary is "
             f"rounded up to a multiple of {cfg.vocab_multiple}); no text maps to them.\n"
             if cfg.vocab_size > real else "")
  arch = hf_config.ARCHITECTURES[cfg.family]
  _write_text(os.path.join(out_dir, "README.md"), f"""# {arch} exported from midas_jax

{_header(provenance, cfg)}
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{provenance.get('exported_to', out_dir)}")  # {arch}, float32
tok = AutoTokenizer.from_pretrained("{provenance.get('exported_to', out_dir)}")
ids = tok("The capital of France is", return_tensors="pt").input_ids
out = model.generate(ids, do_sample=False, max_new_tokens=32)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
```

## Tokens
The {tokens}.
`tok(text).input_ids` equals midas_jax's `vocab.encode(text)`: no BOS and no EOS are added (the
model never saw a BOS; documents end with eos id {EOS_ID}). Literal strings such as `</s>` or
`<extra_id_0>` in a text become those special ids here and plain text in midas_jax.
{padding}
## Limits
{causal_note(run_config.data)}
""")
  return sorted(os.listdir(out_dir))


def write_torch(out_dir: str, params: Mapping, cfg: ModelConfig, data: DataConfig,
                provenance: Dict[str, Any]) -> List[str]:
  """model.safetensors: exactly `model.state_dict()` of the transformers model (tied head included)."""
  sd = mapping.to_hf_state_dict(params, cfg)
  head_name = "lm_head.weight"
  if head_name not in sd:
    sd[head_name] = sd["model.embed_tokens.weight" if cfg.family == "llama" else "transformer.wte.weight"]
  _save_safetensors(os.path.join(out_dir, WEIGHTS_FILE), sd,
                    {"midas_jax.model_config": json.dumps(dataclasses.asdict(cfg))})
  _write_text(os.path.join(out_dir, "README.md"), f"""# {hf_config.ARCHITECTURES[cfg.family]} state dict

{_header(provenance, cfg)}
`model.safetensors` holds the transformers state dict (float32), the tied head included, so
`model.load_state_dict(safetensors.torch.load_file("model.safetensors"))` fits a
{hf_config.ARCHITECTURES[cfg.family]} built with the matching config (the ModelConfig is in the file's
metadata under "midas_jax.model_config" and in {PROVENANCE_FILE}).

{causal_note(data)}
""")
  return sorted(os.listdir(out_dir))


def write_npz(out_dir: str, params: Mapping, cfg: ModelConfig, provenance: Dict[str, Any]) -> List[str]:
  """params.npz (our tree, '/' keys, float32) and model_config.json (the ModelConfig fields)."""
  np.savez(os.path.join(out_dir, NPZ_FILE), **flatten(params))
  _write_json(os.path.join(out_dir, "model_config.json"), dataclasses.asdict(cfg))
  _write_text(os.path.join(out_dir, "README.md"), f"""# midas_jax parameters as NumPy arrays

{_header(provenance, cfg)}
`params.npz` holds the parameter tree of `midas_jax.model.Decoder` with '/' keys (e.g.
`layers/attn/query`, shape [layers, d_model, heads, head_dim]: every per-layer tensor has a leading
layers axis); `model_config.json` has the ModelConfig fields. Load with `numpy.load("params.npz")`.
""")
  return sorted(os.listdir(out_dir))


def read_npz(path: str) -> dict:
  """The tree write_npz wrote (path: the directory or the .npz file)."""
  if os.path.isdir(path):
    path = os.path.join(path, NPZ_FILE)
  with np.load(path) as data:
    return unflatten({k: data[k] for k in data.files})


def write_provenance(out_dir: str, provenance: Dict[str, Any]) -> None:
  _write_json(os.path.join(out_dir, PROVENANCE_FILE), provenance)
