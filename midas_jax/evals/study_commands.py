"""`midas study anchor` and `midas study stacking`: the small-initialization and the stacking studies.

  midas study anchor --gin_file=gin/experiments/anchor_gamma_cpu.gin [--gin.AnchorStudyConfig.K=V ...] --workdir=DIR
  midas study stacking --gin_file=gin/experiments/study_stacking_cpu.gin [--gin.K=V ...] --workdir=DIR

anchor writes DIR/cells.jsonl (one line per trained cell; a re-run resumes), DIR/anchor_study.json,
DIR/phase_diagram.png and DIR/operative_config.gin, and prints the grid. stacking writes one run
per (arm, seed) under DIR/<arm>/seed<seed>/, DIR/cells.jsonl (a re-run resumes), DIR/study.json,
DIR/study.md with its figures under DIR/study/, and prints the page's tables. Imports nothing
heavy until the command runs.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Dict

from midas_jax import fs
from midas_jax.errors import ConfigError


def register(sub, bench_sub) -> Dict[str, object]:
  del bench_sub
  study = sub.add_parser("study", help="studies: the anchor-function phase diagram, the multi-seed stacking study")
  study_sub = study.add_subparsers(dest="study", required=True)
  anchor = study_sub.add_parser("anchor", help="train the gamma x depth (x arm) grid of the anchor-function task")
  anchor.add_argument("--gin_file", action="append", default=[],
                      help="gin file binding AnchorStudyConfig; repeatable, later files override earlier ones")
  anchor.add_argument("--workdir", required=True, help="output: cells.jsonl, anchor_study.json, phase_diagram.png")
  stacking = study_sub.add_parser("stacking", help="baseline, equal-FLOPs baseline, MIDAS and GradStack over seeds")
  stacking.add_argument("--gin_file", action="append", default=[],
                        help="gin file binding the run config and StackingStudyConfig; repeatable")
  stacking.add_argument("--workdir", required=True, help="output: one run per arm and seed, study.json, study.md")
  return {"study": _study}


_registered = set()


def _parse(gin_files, bindings, config_class, example: str) -> None:
  """Registers `config_class` with gin (module "midas", once), then parses gin files and bindings; an
  unknown setting of `config_class` names its valid settings."""
  import gin  # pylint: disable=import-outside-toplevel
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  if config_class not in _registered:
    gin.configurable(config_class, module="midas")
    _registered.add(config_class)
  if not gin_files:
    raise ConfigError("--gin_file", "no gin file given", f"pass e.g. --gin_file={example}")
  name = config_class.__name__
  settings = [f.name for f in dataclasses.fields(config_class)]
  try:
    gin_config.parse(gin_files, bindings)
  except ConfigError as e:
    if e.setting.startswith(f"{name}."):  # gin_config knows only the run configs' settings
      close = difflib.get_close_matches(e.setting.split(".")[-1], settings, n=2)
      hint = f"did you mean {', '.join(close)}? " if close else ""
      raise ConfigError(e.setting, e.problem, f"{hint}valid settings: {', '.join(settings)}") from None
    raise


def _build(config_class):
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  try:
    return config_class()
  except Exception as e:  # pylint: disable=broad-except
    gin_config._unwrap_config_error(e)  # pylint: disable=protected-access
    raise


def study_config_from_gin(gin_files, bindings):
  """Parses the gin files and bindings and builds the AnchorStudyConfig they bind."""
  import gin  # pylint: disable=import-outside-toplevel
  from midas_jax.evals import anchor  # pylint: disable=import-outside-toplevel
  _parse(gin_files, bindings, anchor.AnchorStudyConfig, "gin/experiments/anchor_gamma_cpu.gin")
  return _build(anchor.AnchorStudyConfig), gin.operative_config_str()


def stacking_study_from_gin(gin_files, bindings):
  """(RunConfig, StackingStudyConfig, operative gin config) from the gin files and bindings."""
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  from midas_jax.evals import stacking_study  # pylint: disable=import-outside-toplevel
  _parse(gin_files, bindings, stacking_study.StackingStudyConfig, "gin/experiments/study_stacking_cpu.gin")
  study = _build(stacking_study.StackingStudyConfig)
  run = gin_config.run_config_from_gin()
  stacking_study.check_run_config(run)
  return run, study, gin_config.operative_config()


def _study(args, bindings) -> int:
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  from midas_jax.cli import enable_compilation_cache  # pylint: disable=import-outside-toplevel
  from midas_jax.train.loop import prepare_workdir  # pylint: disable=import-outside-toplevel
  if args.study == "stacking":
    return _stacking(args, bindings)
  from midas_jax.evals import anchor_train  # pylint: disable=import-outside-toplevel
  config, operative = study_config_from_gin(args.gin_file, bindings)
  workdir = prepare_workdir(args.workdir)
  enable_compilation_cache()
  fs.write_text(fs.join(workdir, "operative_config.gin"), operative)
  print(f"anchor study: {config.num_cells} cells ({len(config.arms)} arms x {len(config.gammas)} gammas x "
        f"{len(config.depths)} depths x {len(config.seeds)} seeds) into {workdir}", flush=True)
  result = anchor_train.run_study(config, workdir, log=lambda line: print(line, flush=True))
  print(anchor_train.format_grid(config, result["grid"]))
  print(f"phase diagram: {result['phase_diagram']}")
  return 0


def _stacking(args, bindings) -> int:
  import time  # pylint: disable=import-outside-toplevel
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  from midas_jax.cli import enable_compilation_cache  # pylint: disable=import-outside-toplevel
  from midas_jax.evals import stacking_study, stacking_study_page  # pylint: disable=import-outside-toplevel
  from midas_jax.train.loop import prepare_workdir  # pylint: disable=import-outside-toplevel
  run, study, operative = stacking_study_from_gin(args.gin_file, bindings)
  workdir = prepare_workdir(args.workdir)
  enable_compilation_cache()
  fs.write_text(fs.join(workdir, "operative_config.gin"), operative)
  print(f"stacking study: {len(study.arms)} arms x {len(study.seeds)} seeds into {workdir}", flush=True)
  start = time.time()
  result = stacking_study.run_study(run, study, workdir, operative, log=lambda line: print(line, flush=True))
  print(stacking_study_page.printable(result, run))
  print(f"page: {fs.join(workdir, 'study.md')} ({time.time() - start:.0f} s)")
  return 0
