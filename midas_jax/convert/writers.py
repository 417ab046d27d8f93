"""The three export formats, each a directory: hf (transformers), torch (state dict), npz (our tree).

Every directory also gets `midas_jax.json` (where the weights came from: step, stage, depth, the
run's config) and a README.md that says how to load it. Weights are safetensors (float32 unless
asked for bfloat16), no pickle; hf weights are sharded above `max_shard_size` (shards.py). Each is
written through a local staging directory (fs.staged_dir), so `out_dir` may be a gs:// URL.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping

import numpy as np

from midas_jax import fs
from midas_jax.configs import ModelConfig, ObjectivesConfig, RunConfig
from midas_jax.convert import hf_config, mapping, shards
from midas_jax.convert import tokenizer as tokenizer_lib
from midas_jax.data.ul2 import objectives
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError

FORMATS = ("hf", "torch", "npz")
PROVENANCE_FILE = "midas_jax.json"
WEIGHTS_FILE = shards.WEIGHTS_FILE
NPZ_FILE = "params.npz"
SPECIAL_TOKENS_KEY = "midas_jax_special_tokens"  # in config.json: what every special id means

CAUSAL_LIMIT = (
    "transformers runs every input causally. The model was trained here on a UL2 mixture in which "
    "prefix-LM and span-corruption examples attend bidirectionally over their inputs (the prefix); "
    "transformers cannot express that mask, so such prompts (mode tokens, sentinels, an input to "
    "condition on) see only earlier tokens, as the causal-LM share of training did. Causal text "
    "continuation and scoring are exact; for prefix-LM and infilling use `midas eval` here.")


def causal_note(mix: ObjectivesConfig) -> str:
  """What running causally means for a model trained on the UL2 mixture `mix`."""
  if mix.causal_rate >= 1.0:
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


def _header(provenance: Dict[str, Any], cfg: ModelConfig, dtype: str = "float32") -> str:
  source = f" from {provenance['source']}" if "source" in provenance else ""
  arch = hf_config.ARCHITECTURES[hf_config.model_type(cfg)]
  lines = [f"Exported by midas_jax{source} (step {provenance.get('step')}, stage {provenance.get('stage')}, depth "
           f"{cfg.num_layers}): a {arch} decoder, d_model {cfg.d_model}, {cfg.num_heads} heads "
           f"({cfg.kv_heads} kv), vocab {cfg.vocab_size}. Weights are {dtype}."]
  if provenance.get("unrolled_loop"):
    lines.append("The model was looped (a block of layers applied several times); each application is a layer "
                 "of its own here, with the block's weights copied.")
  if cfg.dtype != dtype:
    lines.append(f"midas_jax computed in {cfg.dtype} (weights {cfg.param_dtype}); transformers computes in the "
                 f"weights' dtype unless loaded with dtype=torch.{cfg.dtype}.")
  return "\n".join(lines) + "\n"


def special_tokens_record(run_config: RunConfig, vocab) -> Dict[str, Any]:
  """The vocabulary's special ids and the objectives' sentinels and mode tokens, for config.json."""
  record = dict(vocab.special_ids())
  try:
    record.update(objectives.vocabulary_special_tokens(vocab, run_config.objectives.num_sentinels).to_json())
  except ConfigError:  # too few extra ids for sentinels: the run trained causal LM alone
    pass
  return record


def write_hf(out_dir: str, params: Mapping, cfg: ModelConfig, run_config: RunConfig, provenance: Dict[str, Any],
             dtype: str = "float32", max_shard_size: int = shards.parse_size(shards.DEFAULT_MAX_SHARD_SIZE)) -> List[str]:
  """A transformers model directory: config.json, safetensors weights (sharded above max_shard_size),
  generation config, the run's tokenizer, README.md."""
  from transformers import GenerationConfig  # lazy: the convert extra
  vocab = make_vocabulary(run_config.data)
  ids = {"bos": vocab.bos_id, "eos": vocab.eos_id, "pad": vocab.pad_id}
  with fs.staged_dir(out_dir) as local:
    config = hf_config.to_hf_config(cfg, ids, dtype)
    setattr(config, SPECIAL_TOKENS_KEY, special_tokens_record(run_config, vocab))
    config.save_pretrained(local)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(local)
    # tied heads are left out, as transformers writes them
    shards.write_shards(local, mapping.hf_tensors(params, cfg), dtype, max_shard_size)
    tokens = tokenizer_lib.write_tokenizer(local, run_config.data, vocab)
    real = vocab.vocab_size
    padding = (f"Ids {real} to {cfg.vocab_size - 1} are padding rows of the embedding (the model's vocabulary is "
               f"larger than the tokenizer's); no text maps to them.\n" if cfg.vocab_size > real else "")
    arch = hf_config.ARCHITECTURES[hf_config.model_type(cfg)]
    fs.write_text(fs.join(local, "README.md"), f"""# {arch} exported from midas_jax

{_header(provenance, cfg, dtype)}
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{out_dir}")  # {arch}
tok = AutoTokenizer.from_pretrained("{out_dir}")
ids = tok("The capital of France is", return_tensors="pt").input_ids
out = model.generate(ids, do_sample=False, max_new_tokens=32)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
```

## Tokens
{tokens}
config.json records every special id under "{SPECIAL_TOKENS_KEY}".
{padding}
## Limits
{causal_note(run_config.objectives)}
""")
  return fs.listdir(out_dir)


def write_torch(out_dir: str, params: Mapping, cfg: ModelConfig, mix: ObjectivesConfig,
                provenance: Dict[str, Any], dtype: str = "float32") -> List[str]:
  """model.safetensors: exactly `model.state_dict()` of the transformers model (tied head included)."""
  tensors = mapping.hf_tensors(params, cfg)
  if not any(t.name == "lm_head.weight" for t in tensors):  # tied: state_dict() holds the table twice
    table = tensors[0]
    tensors.append(mapping.HFTensor("lm_head.weight", table.shape, table.make))
  arch = hf_config.ARCHITECTURES[hf_config.model_type(cfg)]
  with fs.staged_dir(out_dir) as local:
    shards.write_shards(local, tensors, dtype, max_shard_size=1 << 62,
                        metadata={"midas_jax.model_config": json.dumps(dataclasses.asdict(cfg))})
    fs.write_text(fs.join(local, "README.md"), f"""# {arch} state dict

{_header(provenance, cfg, dtype)}
`model.safetensors` holds the transformers state dict ({dtype}), the tied head included, so
`model.load_state_dict(safetensors.torch.load_file("model.safetensors"))` fits a
{arch} built with the matching config (the ModelConfig is in the file's
metadata under "midas_jax.model_config" and in {PROVENANCE_FILE}).

{causal_note(mix)}
""")
  return fs.listdir(out_dir)


def write_npz(out_dir: str, params: Mapping, cfg: ModelConfig, provenance: Dict[str, Any]) -> List[str]:
  """params.npz (our tree, '/' keys, float32) and model_config.json (the ModelConfig fields)."""
  with fs.staged_dir(out_dir) as local:
    np.savez(fs.join(local, NPZ_FILE), **flatten(params))
    fs.write_json(fs.join(local, "model_config.json"), dataclasses.asdict(cfg))
    fs.write_text(fs.join(local, "README.md"), f"""# midas_jax parameters as NumPy arrays

{_header(provenance, cfg)}
`params.npz` holds the parameter tree of `midas_jax.model.Decoder` with '/' keys (e.g.
`layers/attn/query`, shape [layers, d_model, heads, head_dim]: every per-layer tensor has a leading
layers axis); `model_config.json` has the ModelConfig fields. Load with `numpy.load("params.npz")`.
""")
  return fs.listdir(out_dir)


def read_npz(path: str) -> dict:
  """The tree write_npz wrote (path: the directory or the .npz file)."""
  if fs.isdir(path):
    path = fs.join(path, NPZ_FILE)
  with fs.open_file(path, "rb") as f, np.load(f) as data:
    return unflatten({k: data[k] for k in data.files})


def write_provenance(out_dir: str, provenance: Dict[str, Any]) -> None:
  fs.write_json(fs.join(out_dir, PROVENANCE_FILE), provenance)
