"""`midas export` and `midas import`.

  midas export --workdir=DIR --format=hf|torch|npz|params --out=OUT [--step=N] [--dtype=float32|bfloat16]
               [--max_shard_size=5GB]
  midas import --hf=DIR --workdir=OUT
"""

from __future__ import annotations

import json
from typing import List

from midas_jax import fs
from midas_jax.checkpoint import export_run_params
from midas_jax.commands.common import CommandGroup, refuse_bindings
from midas_jax.convert import export, hf_import, shards
from midas_jax.errors import ConfigError

EXPORT_FORMATS = ("hf", "torch", "npz", "params")
DEFAULT_SHARD = shards.DEFAULT_MAX_SHARD_SIZE


def _export(args, bindings: List[str]) -> int:
  refuse_bindings(bindings, "export", "the run's saved config is used; drop them")
  if args.format not in EXPORT_FORMATS:
    raise ConfigError("--format", f"unknown format {args.format!r}", f"use one of {EXPORT_FORMATS}")
  if args.format == "params":
    if args.dtype != "float32" or args.max_shard_size != DEFAULT_SHARD:
      raise ConfigError("--dtype", "a params-only export keeps the run's parameters as they are",
                        "drop --dtype and --max_shard_size for --format=params")
    out = export_run_params(args.workdir, args.out, args.step)
    print(json.dumps({"format": "params", "out": out}))
    return 0
  files = export.export_model(args.workdir, args.out, args.format, args.step, args.dtype, args.max_shard_size)
  provenance = fs.read_json(fs.join(args.out, "midas_jax.json"))
  print(json.dumps({"format": args.format, "out": args.out, "files": files, "step": provenance["step"],
                    "stage": provenance["stage"], "depth": provenance["depth"], "dtype": args.dtype}))
  return 0


def _import(args, bindings: List[str]) -> int:
  refuse_bindings(bindings, "import", "bind settings when you train from the import")
  config, metadata = hf_import.import_hf(args.hf, args.workdir)
  print(json.dumps({"workdir": args.workdir, "family": config.model.family, "depth": metadata["depth"],
                    "vocab_size": config.model.vocab_size, "tokenizer": metadata["tokenizer"],
                    "gin": fs.join(args.workdir, hf_import.GIN_FILE)}))
  return 0


def add_commands(root: CommandGroup) -> None:
  p = root.command("export", _export, help="write a model as a transformers directory, torch state dict, npz or "
                   "params-only export")
  p.add_argument("--workdir", required=True, help="a run's workdir (latest good checkpoint) or a params-only "
                      "export")
  p.add_argument("--format", default="hf", help=f"one of {', '.join(EXPORT_FORMATS)} (default hf)")
  p.add_argument("--out", required=True, help="output directory (new or empty)")
  p.add_argument("--step", type=int, default=None, help="a saved step instead of the latest")
  p.add_argument("--dtype", default="float32", help="weights of hf and torch exports: float32 (default) or "
                      "bfloat16")
  p.add_argument("--max_shard_size", default=DEFAULT_SHARD, help="hf weights larger than this are split into "
                      f"shards with an index (default {DEFAULT_SHARD}, as transformers; 500MB, 2GiB, bytes)")
  imp = root.command("import", _import, help="bring a transformers Llama, Qwen2 or GPT-2 directory in as a "
                     "params-only export, with its tokenizer")
  imp.add_argument("--hf", required=True, help="a transformers model directory (config.json and weights)")
  imp.add_argument("--workdir", required=True, help="output directory (new or empty)")
