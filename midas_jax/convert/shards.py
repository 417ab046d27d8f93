"""Safetensors weights in shards, as transformers writes and reads them, built one shard at a time.

A model larger than `max_shard_size` is split, in checkpoint order, into
`model-00001-of-0000N.safetensors` files plus `model.safetensors.index.json` (each tensor's file and
the total size); a smaller one is a single `model.safetensors`. Only the tensors of the shard being
written exist in memory (mapping.HFTensor makes each on demand), so an export needs about one shard
above the parameters it reads. Shard sizes count bytes in the written dtype; a tensor larger than a
shard gets a shard of its own, as in transformers.
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


def plan(tensors: Sequence[HFTensor], itemsize: int, max_shard_size: int) -> List[List[HFTensor]]:
  """Tensors in order, cut into shards of at most max_shard_size bytes (an oversized tensor alone)."""
  shards: List[List[HFTensor]] = [[]]
  used = 0
  for t in tensors:
    size = t.num_elements * itemsize
    if shards[-1] and used + size > max_shard_size:
      shards.append([])
      used = 0
    shards[-1].append(t)
    used += size
  return shards


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
  names = ([WEIGHTS_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map, total = {}, 0
  for name, shard in zip(names, shards):
    arrays = {t.name: t.make().astype(np_dtype, copy=False) for t in shard}
    save_file(arrays, os.path.join(local_dir, name), metadata=header)
    total += sum(a.nbytes for a in arrays.values())
    weight_map.update({t.name: name for t in shard})
    del arrays  # the next shard is built only after this one is on disk
  if len(shards) == 1:
    return names
  fs.write_json(fs.join(local_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
  return names + [INDEX_FILE]
