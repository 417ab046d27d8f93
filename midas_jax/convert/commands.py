"""`midas export` and `midas import` (registered through cli.COMMAND_MODULES).

  midas export --workdir=DIR --format=hf|torch|npz|params --out=OUT [--step=N]
  midas import --hf=DIR --workdir=OUT
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Dict, List

EXPORT_FORMATS = ("hf", "torch", "npz", "params")


def _export(args, bindings: List[str]) -> int:
  from midas_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  if bindings:
    raise ConfigError("--gin.*", "export takes no gin bindings", "the run's saved config is used; drop them")
  if args.format not in EXPORT_FORMATS:
    raise ConfigError("--format", f"unknown format {args.format!r}", f"use one of {EXPORT_FORMATS}")
  if args.format == "params":
    from midas_jax.checkpoint import export_params  # pylint: disable=import-outside-toplevel
    out = export_params(args.workdir, args.out, args.step)
    print(json.dumps({"format": "params", "out": out}))
    return 0
  from midas_jax.convert import export  # pylint: disable=import-outside-toplevel
  files = export.export_model(args.workdir, args.out, args.format, args.step)
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  provenance = fs.read_json(fs.join(args.out, "midas_jax.json"))
  print(json.dumps({"format": args.format, "out": args.out, "files": files, "step": provenance["step"],
                    "stage": provenance["stage"], "depth": provenance["depth"]}))
  return 0


def _import(args, bindings: List[str]) -> int:
  from midas_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  if bindings:
    raise ConfigError("--gin.*", "import takes no gin bindings", "bind settings when you train from the import")
  from midas_jax.convert import hf_import  # pylint: disable=import-outside-toplevel
  config, metadata = hf_import.import_hf(args.hf, args.workdir)
  print(json.dumps({"workdir": args.workdir, "family": config.model.family, "depth": metadata["depth"],
                    "tokenizer": metadata["tokenizer"], "gin": hf_import.gin_path(args.workdir)}))
  return 0


def register(sub, bench_sub) -> Dict[str, Callable[[argparse.Namespace, List[str]], int]]:
  del bench_sub
  export = sub.add_parser("export", help="write a model as a transformers directory, torch state dict, npz or "
                          "params-only export")
  export.add_argument("--workdir", required=True, help="a run's workdir (latest good checkpoint) or a params-only "
                      "export")
  export.add_argument("--format", default="hf", help=f"one of {', '.join(EXPORT_FORMATS)} (default hf)")
  export.add_argument("--out", required=True, help="output directory (new or empty)")
  export.add_argument("--step", type=int, default=None, help="a saved step instead of the latest")
  imp = sub.add_parser("import", help="bring a transformers Llama or GPT-2 directory in as a params-only export")
  imp.add_argument("--hf", required=True, help="a transformers model directory (config.json and weights)")
  imp.add_argument("--workdir", required=True, help="output directory (new or empty)")
  return {"export": _export, "import": _import}
