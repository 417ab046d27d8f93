"""`midas study anchor`: the small-initialization (gamma x depth) anchor-function study.

  midas study anchor --gin_file=gin/experiments/anchor_gamma_cpu.gin [--gin.AnchorStudyConfig.K=V ...] --workdir=DIR

Writes DIR/cells.jsonl (one line per trained cell; a re-run resumes), DIR/anchor_study.json,
DIR/phase_diagram.png and DIR/operative_config.gin, and prints the grid. Imports nothing heavy
until the command runs.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Dict

from midas_jax import fs
from midas_jax.errors import ConfigError


def register(sub, bench_sub) -> Dict[str, object]:
  del bench_sub
  study = sub.add_parser("study", help="small-initialization studies (the anchor-function phase diagram)")
  study_sub = study.add_subparsers(dest="study", required=True)
  anchor = study_sub.add_parser("anchor", help="train the gamma x depth grid of the anchor-function task")
  anchor.add_argument("--gin_file", action="append", default=[],
                      help="gin file binding AnchorStudyConfig; repeatable, later files override earlier ones")
  anchor.add_argument("--workdir", required=True, help="output: cells.jsonl, anchor_study.json, phase_diagram.png")
  return {"study": _study}


def study_config_from_gin(gin_files, bindings):
  """Parses the gin files and bindings and builds the AnchorStudyConfig they bind."""
  import gin  # pylint: disable=import-outside-toplevel
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  from midas_jax.evals import anchor  # pylint: disable=import-outside-toplevel
  if not gin_files:
    raise ConfigError("--gin_file", "no gin file given",
                      "pass e.g. --gin_file=gin/experiments/anchor_gamma_cpu.gin")
  anchor.register_gin()
  settings = [f.name for f in dataclasses.fields(anchor.AnchorStudyConfig)]
  try:
    gin_config.parse(gin_files, bindings)
  except ConfigError as e:
    if e.setting.startswith("AnchorStudyConfig."):  # gin_config knows only the run configs' settings
      close = difflib.get_close_matches(e.setting.split(".")[-1], settings, n=2)
      hint = f"did you mean {', '.join(close)}? " if close else ""
      raise ConfigError(e.setting, e.problem, f"{hint}valid settings: {', '.join(settings)}") from None
    raise
  try:
    config = anchor.AnchorStudyConfig()
  except Exception as e:  # pylint: disable=broad-except
    gin_config._unwrap_config_error(e)  # pylint: disable=protected-access
    raise
  return config, gin.operative_config_str()


def _study(args, bindings) -> int:
  from midas_jax.cli import enable_compilation_cache  # pylint: disable=import-outside-toplevel
  from midas_jax.evals import anchor_train  # pylint: disable=import-outside-toplevel
  from midas_jax.train.loop import prepare_workdir  # pylint: disable=import-outside-toplevel
  config, operative = study_config_from_gin(args.gin_file, bindings)
  workdir = prepare_workdir(args.workdir)
  enable_compilation_cache()
  fs.write_text(fs.join(workdir, "operative_config.gin"), operative)
  print(f"anchor study: {config.num_cells} cells ({len(config.gammas)} gammas x {len(config.depths)} depths x "
        f"{len(config.seeds)} seeds) into {workdir}", flush=True)
  result = anchor_train.run_study(config, workdir, log=lambda line: print(line, flush=True))
  print(anchor_train.format_grid(config, result["grid"]))
  print(f"phase diagram: {result['phase_diagram']}")
  return 0
