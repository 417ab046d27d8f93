"""Safetensors weights in shards, as transformers writes and reads them, built one shard at a time.

A model larger than `max_shard_size` is split into
`model-00001-of-0000N.safetensors` files plus `model.safetensors.index.json` (each tensor's file and
the total size); a smaller one is a single `model.safetensors`. Only the tensors of the shard being
written exist in memory (mapping.HFTensor makes each on demand), so an export needs about one shard
above the parameters it reads. Shard sizes count bytes in the written dtype; huggingface_hub's state-dict
splitting, which transformers' own save_pretrained uses, plans the shards (a tensor larger than a shard gets one of
its own).
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence

import ml_dtypes
import numpy as np

from midas_jax import fs
from midas_jax.convert.mapping import HFTensor
from midas_jax.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = WEIGHTS_FILE + ".index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default
DTYPES = ("float32", "bfloat16")
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(size, setting: str = "--max_shard_size") -> int:
  """Bytes of "5GB" (10^9, as transformers counts), "500MiB" (2^20) or a plain integer."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
  unit = match.group(2).upper() if match else None
  if unit not in _UNITS:
    raise ConfigError(setting, f"{size!r} is not a size", "write it like 5GB, 500MB, 2GiB or a number of bytes")
  value = int(float(match.group(1)) * _UNITS[unit])
  if value < 1:
    raise ConfigError(setting, f"{size!r} is not a positive size", "use e.g. 5GB (the default)")
  return value


def numpy_dtype(name: str, setting: str = "--dtype"):
  if name not in DTYPES:
    raise ConfigError(setting, f"unknown dtype {name!r}", f"use one of {DTYPES}")
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(np.float32)


def plan(tensors: Sequence[HFTensor], itemsize: int, max_shard_size: int) -> Dict[str, List[HFTensor]]:
  """File name -> its tensors, as huggingface_hub (and so transformers' save_pretrained) splits a state dict.

  Tensors fill shards in order up to max_shard_size bytes; one larger than that gets a file of its own, placed
  before the shard being filled; one shard is model.safetensors, several are model-0000i-of-0000N.safetensors.
  """
  from huggingface_hub import split_state_dict_into_shards_factory  # lazy: the convert extra (with transformers)
  by_name = {t.name: t for t in tensors}
  split = split_state_dict_into_shards_factory(by_name, get_storage_size=lambda t: t.num_elements * itemsize,
                                               filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
  return {name: [by_name[key] for key in keys] for name, keys in split.filename_to_tensors.items()}


def write_shards(local_dir: str, tensors: Sequence[HFTensor], dtype: str = "float32",
                 max_shard_size: int = parse_size(DEFAULT_MAX_SHARD_SIZE),
                 metadata: Optional[Dict[str, str]] = None) -> List[str]:
  """Writes the tensors into local_dir (a local directory: fs.staged_dir gives one for any URL).

  Returns the file names written. metadata goes into every file's header ("format": "pt" always:
  transformers refuses safetensors files that do not name a framework).
  """
  from safetensors.numpy import save_file  # lazy: the convert extra
  np_dtype = numpy_dtype(dtype)
  shards = plan(tensors, np_dtype.itemsize, max_shard_size)
  header = {"format": "pt", **(metadata or {})}
  names = list(shards)
  weight_map, total = {}, 0
  for name, shard in shards.items():
    arrays = {t.name: t.make().astype(np_dtype, copy=False) for t in shard}
    save_file(arrays, os.path.join(local_dir, name), metadata=header)
    total += sum(a.nbytes for a in arrays.values())
    weight_map.update({t.name: name for t in shard})
    del arrays  # the next shard is built only after this one is on disk
  if len(shards) == 1:
    return names
  fs.write_json(fs.join(local_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
  return names + [INDEX_FILE]
