"""`midas study anchor` and `midas study stacking`: the small-initialization and the stacking studies.

  midas study anchor --gin_file=gin/experiments/anchor_gamma_cpu.gin [--gin.AnchorStudyConfig.K=V ...] --workdir=DIR
  midas study stacking --gin_file=gin/experiments/study_stacking_cpu.gin [--gin.K=V ...] --workdir=DIR
  midas study stacking --gin_file=gin/experiments/study_long_cpu.gin --workdir=DIR   (10 tokens per parameter)

anchor writes DIR/cells.jsonl (one line per trained cell; a re-run resumes), DIR/anchor_study.json,
DIR/phase_diagram.png and DIR/operative_config.gin, and prints the grid and its arms' contrasts. stacking writes one run
per cell under DIR/[steps<N>/]<arm>/[lr<rate>/]seed<seed>/, DIR/cells.jsonl, DIR/tests.jsonl and DIR/scores.jsonl
(a re-run resumes), DIR/results.json (provenance, tables, every cell) and its small part DIR/results_tables.json,
DIR/study.md rendered from it with its figures under DIR/study/, and prints the page.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from typing import Sequence, Tuple

from midas_jax import fs, gin_config
from midas_jax.commands.common import CommandGroup, add_gin_flags, enable_compilation_cache, parse_gin
from midas_jax.configs import RunConfig
from midas_jax.errors import ConfigError
from midas_jax.studies import anchor_study, stacking_study, stacking_study_page
from midas_jax.studies.anchor_config import AnchorStudyConfig
from midas_jax.studies.stacking_config import StackingStudyConfig
from midas_jax.train.workdir import prepare_workdir


def add_commands(root: CommandGroup) -> None:
  study = root.group("study", help="studies: the anchor-function phase diagram, the multi-seed stacking study")
  anchor = study.command("anchor", _anchor, help="train the gamma x depth (x arm) grid of the anchor-function task")
  add_gin_flags(anchor, "gin file binding AnchorStudyConfig")
  anchor.add_argument("--workdir", required=True, help="output: cells.jsonl, anchor_study.json, phase_diagram.png")
  stacking = study.command("stacking", _stacking,
                           help="effective speedup of MIDAS and GradStack on a baseline ladder, over seeds")
  add_gin_flags(stacking, "gin file binding the run config and StackingStudyConfig")
  stacking.add_argument("--workdir", required=True, help="output: one run per cell, results.json, study.md")


def _parse(gin_files: Sequence[str], bindings: Sequence[str], config_class: type, example: str) -> None:
  """Parses the gin files and bindings; an unknown setting of `config_class` names its valid settings,
  or the composed config (a field's type, e.g. the anchor study's ModelConfig) that has it."""
  name = config_class.__name__
  fields = dataclasses.fields(config_class)
  settings = [f.name for f in fields]
  try:
    parse_gin(gin_files, bindings, example)
  except ConfigError as e:
    if not e.setting.startswith(f"{name}."):
      raise
    setting = e.setting.split(".")[-1]
    owner = next((f for f in fields if dataclasses.is_dataclass(f.default) and
                  setting in {g.name for g in dataclasses.fields(f.default)}), None)
    if owner is not None:
      kind = type(owner.default).__name__
      raise ConfigError(e.setting, f"is a setting of the study's {owner.name}, a {kind}",
                        f"bind {kind}.{setting} (with {name}.{owner.name} = @{kind}())") from None
    close = difflib.get_close_matches(setting, settings, n=2)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(e.setting, e.problem, f"{hint}valid settings: {', '.join(settings)}") from None


def study_config_from_gin(gin_files: Sequence[str], bindings: Sequence[str]) -> Tuple[AnchorStudyConfig, str]:
  """The AnchorStudyConfig the gin files and bindings describe, and the operative gin config."""
  _parse(gin_files, bindings, AnchorStudyConfig, "gin/experiments/anchor_gamma_cpu.gin")
  return gin_config.build(AnchorStudyConfig), gin_config.operative_config()


def stacking_study_from_gin(gin_files: Sequence[str],
                            bindings: Sequence[str]) -> Tuple[RunConfig, StackingStudyConfig, str]:
  """(RunConfig, StackingStudyConfig, operative gin config) from the gin files and bindings."""
  _parse(gin_files, bindings, StackingStudyConfig, "gin/experiments/study_stacking_cpu.gin")
  study = gin_config.build(StackingStudyConfig)
  run = gin_config.run_config_from_gin()
  stacking_study.check_run_config(run, study)
  return run, study, gin_config.operative_config()


def _anchor(args, bindings) -> int:
  config, operative = study_config_from_gin(args.gin_file, bindings)
  workdir = prepare_workdir(args.workdir)
  enable_compilation_cache()
  fs.write_text(fs.join(workdir, "operative_config.gin"), operative)
  print(f"anchor study: {config.num_cells} cells ({len(config.arms)} arms x {len(config.gammas)} gammas x "
        f"{len(config.rates)} learning rates x {len(config.depths)} depths x {len(config.seeds)} seeds) "
        f"into {workdir}", flush=True)
  result = anchor_study.run_study(config, workdir, log=lambda line: print(line, flush=True))
  print(anchor_study.format_grid(config, result["grid"]))
  print(anchor_study.format_contrasts(config, result["contrasts"], result["verdicts"]))
  print(f"phase diagram: {result['phase_diagram']}")
  return 0


def _stacking(args, bindings) -> int:
  run, study, operative = stacking_study_from_gin(args.gin_file, bindings)
  workdir = prepare_workdir(args.workdir)
  enable_compilation_cache()
  fs.write_text(fs.join(workdir, "operative_config.gin"), operative)
  lengths = list(study.steps) or [run.trainer.num_steps]
  rates = f" (x {len(study.learning_rates)} peak rates at {min(lengths)} steps)" if study.learning_rates else ""
  ladder = f", the baseline also at {sorted(study.ladder_steps)} steps" if study.ladder_steps else ""
  print(f"stacking study: {len(study.arms)} arms{rates} x {len(study.seeds)} seeds x lengths {lengths} steps{ladder} "
        f"into {workdir}", flush=True)
  start = time.time()
  result = stacking_study.run_study(run, study, workdir, operative, log=lambda line: print(line, flush=True))
  print(stacking_study_page.printable(result))
  print(f"page: {fs.join(workdir, 'study.md')}, results: {fs.join(workdir, 'results.json')} "
        f"({time.time() - start:.0f} s)")
  return 0
