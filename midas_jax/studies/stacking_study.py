"""The multi-seed stacking study: a baseline, the baseline cut to MIDAS's FLOPs, MIDAS and GradStack.

One run config (model, data, steps, optimizer, and the stacked schedule in StackingConfig) gives
every arm; a StackingStudyConfig says which arms and seeds:

  baseline              full depth throughout, TrainerConfig.num_steps steps
  baseline_equal_flops  full depth, as many steps as spend the stacked schedule's total FLOPs
                        (rounded; its learning-rate schedule runs over its own, shorter length)
  midas, gradstack      grown by that operator on the config's stage schedule

Each (arm, seed) is a cell: a `midas train` run under DIR/<arm>/seed<seed>/ (TrainerConfig.seed
and DataConfig.seed both set to the seed, so a seed changes the initialization and the data order;
the arms of one seed see the same data), then measured:
  eval_curve   the held-out loss at every eval step, with the FLOPs spent by then
  growths      the held-out loss just before each growth (the eval at the boundary, which the
               study's eval_every hits) and just after it (the grown state's checkpoint, evaluated on
               the same batches), then at the next eval
  primitives   likelihood.py's four scores per primitive on the final checkpoint
Cells are written to DIR/cells.jsonl as they finish; a re-run with the same settings resumes. The
summary (stacking_study_page.py) is DIR/study.json, DIR/study.md and its figures.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax

from midas_jax import fs
from midas_jax.checkpoint import load_model
from midas_jax.checkpoint.metadata import config_to_dict
from midas_jax.configs import CheckpointConfig, RunConfig, StackingConfig
from midas_jax.data.factory import load_data
from midas_jax.data.vocabularies import make_vocabulary
from midas_jax.errors import require
from midas_jax.evals import likelihood
from midas_jax.stacking.checks import schedule_for
from midas_jax.stacking.schedule import cumulative_flops, schedule_from_config
from midas_jax.studies import stacking_study_page as page
from midas_jax.train.build import build_stage
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train

ARMS = ("baseline", "baseline_equal_flops", "midas", "gradstack")
STACKED = ("midas", "gradstack")


@dataclasses.dataclass(frozen=True)
class StackingStudyConfig:
  """Which arms and seeds `midas study stacking` trains, and how the primitives are scored.

  The primitives are scored on `score_examples` held-out questions per task, `k_shot` solved
  examples before each; `tasks` None scores every task of evals/primitives.py.
  """

  seeds: Tuple[int, ...] = (0, 1)
  arms: Tuple[str, ...] = ARMS
  k_shot: int = 5
  score_examples: int = 500
  tasks: Optional[Tuple[str, ...]] = None
  eval_batch_size: int = 32

  def __post_init__(self):
    s = "StackingStudyConfig."
    for name in ("seeds", "arms"):
      object.__setattr__(self, name, tuple(getattr(self, name)))  # gin hands over lists
    if self.tasks is not None:
      object.__setattr__(self, "tasks", tuple(self.tasks))
    require(len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds)
            and all(isinstance(x, int) and x >= 0 for x in self.seeds), s + "seeds",
            f"must be distinct non-negative ints, got {self.seeds}", "e.g. seeds = [0, 1] (two or more show a spread)")
    require(len(self.arms) >= 1 and all(a in ARMS for a in self.arms) and len(set(self.arms)) == len(self.arms),
            s + "arms", f"{self.arms} are not distinct names of {ARMS}", f"list some of {ARMS}")
    require("baseline_equal_flops" not in self.arms or any(a in STACKED for a in self.arms), s + "arms",
            "baseline_equal_flops is cut to a stacked arm's FLOPs, but no stacked arm is listed",
            f"add one of {STACKED}")
    for name in ("k_shot",):
      require(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, s + name, "must be an int >= 0",
              "5 is the paper's setting")
    for name in ("score_examples", "eval_batch_size"):
      require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, s + name,
              "must be a positive int", f"set {s}{name} >= 1 (500 questions give intervals of about +-0.04)")


def check_run_config(run: RunConfig) -> None:
  """The study needs a stacked schedule whose boundaries the periodic eval hits (loss before growth).
  Checked here, before any arm trains (MIDAS and GradStack grow on the same schedule)."""
  st, trainer = run.stacking, run.trainer
  require(st.num_stages > 1, "StackingConfig.num_stages", "is 1: the study compares stacked arms with a baseline",
          "set the stacked schedule (e.g. num_stages = 4, block_size = 2)")
  schedule = schedule_for(dataclasses.replace(run, stacking=dataclasses.replace(st, operator="midas")))
  missed = [b for b in schedule.boundaries if not trainer.eval_every or b % trainer.eval_every]
  require(not missed, "TrainerConfig.eval_every",
          f"{trainer.eval_every} does not divide the stage boundaries {missed} (stage steps {schedule.stage_steps}), "
          "so the loss just before a growth would not be measured",
          "pick an eval_every that divides every boundary, or set StackingConfig.stage_steps to multiples of it")


def equal_flops_steps(run: RunConfig, vocab_size: int) -> int:
  """Full-depth steps whose FLOPs come closest to the stacked schedule's total (MIDAS and GradStack
  grow one block per stage, so they spend the same)."""
  model = run.model.with_vocab(vocab_size)
  data = run.data
  stacked = schedule_from_config(dataclasses.replace(run.stacking, operator="midas"), run.trainer.num_steps,
                                 model.num_layers)
  full = schedule_from_config(StackingConfig(), run.trainer.num_steps, model.num_layers)
  tokens = data.batch_size * data.seq_len
  ratio = (cumulative_flops(model, data.seq_len, tokens, stacked, stacked.num_steps)
           / cumulative_flops(model, data.seq_len, tokens, full, full.num_steps))
  return max(1, int(round(run.trainer.num_steps * ratio)))


def arm_config(run: RunConfig, arm: str, seed: int, vocab_size: int) -> RunConfig:
  """The run config of one (arm, seed): checkpoints only at stage boundaries and the end, all kept."""
  trainer = dataclasses.replace(run.trainer, seed=seed)
  stacking = StackingConfig()
  if arm == "baseline_equal_flops":
    trainer = dataclasses.replace(trainer, num_steps=equal_flops_steps(run, vocab_size))
  elif arm in STACKED:
    stacking = dataclasses.replace(run.stacking, operator=arm)
  keep = run.stacking.num_stages + 1
  return dataclasses.replace(run, trainer=trainer, stacking=stacking, data=dataclasses.replace(run.data, seed=seed),
                             checkpoint=CheckpointConfig(every=0, keep=keep, async_save=False))


def held_out_loss(config: RunConfig, params, depth: int, data) -> float:
  """The held-out loss of `params` (a model of `depth` layers) on the batches the train loop evaluates."""
  build = build_stage(config, data=data, num_layers=depth)
  with build.context():
    params = jax.device_put(params, build.layout.shardings.params)
    return build.evaluate(build.jit_eval_step(), params)["loss"]


def _growth_losses(config: RunConfig, workdir: str, growths: List[dict], evals: List[dict], data) -> List[dict]:
  by_step = {r["step"]: r["loss"] for r in evals}
  out = []
  for g in growths:
    grown = load_model(workdir, g["step"])
    later = [r for r in evals if r["step"] > g["step"]]
    out.append({"step": g["step"], "from_depth": g["from_depth"], "to_depth": g["to_depth"],
                "loss_before": by_step.get(g["step"]),
                "loss_after": held_out_loss(config, grown.params, g["to_depth"], data),
                "loss_next_eval": later[0]["loss"] if later else None,
                "next_eval_step": later[0]["step"] if later else None})
  return out


def arm_run(run: RunConfig, arm: str, seed: int):
  """(the arm's run config, its (vocabulary, pipeline)): the data of the arm's own DataConfig.seed,
  whose held-out batches are the ones the train loop evaluates on."""
  config = arm_config(run, arm, seed, make_vocabulary(run.data).vocab_size)
  return config, load_data(config)


def train_cell(run: RunConfig, study: StackingStudyConfig, arm: str, seed: int, workdir: str,
               operative_config: str = "") -> Dict[str, Any]:
  """Trains one (arm, seed) (resuming a run its workdir holds) and measures it.

  `final_eval_loss_remeasured` is the final checkpoint's loss measured as the loss after each
  growth is (held_out_loss); it equals the loop's last eval when both read the same batches.
  """
  config, data = arm_run(run, arm, seed)
  start = time.time()
  result = train(config, workdir, operative_config=operative_config)
  trained = time.time() - start
  evals = [{"step": r["step"], "loss": r["loss"], "flops": r["cumulative_flops"]}
           for r in read_metrics(workdir, "eval")]
  train_rows = read_metrics(workdir, "train")
  start = time.time()
  growths = _growth_losses(config, workdir, result.growths, evals, data)
  final = load_model(workdir)
  remeasured = held_out_loss(config, final.params, final.model_config.num_layers, data)
  options = {"k_shot": study.k_shot, "score_examples": study.score_examples, "seed": 0,
             "tasks": list(study.tasks) if study.tasks else None, "batch_size": study.eval_batch_size}
  context_len = min(final.config.data.seq_len, final.model_config.max_seq_len)
  scores = likelihood.evaluate(final.params, final.model_config, final.vocab, context_len, options)["tasks"]
  primitives = {name: t["scores"] for name, t in scores.items()}
  return {"arm": arm, "seed": seed, "steps": config.trainer.num_steps,
          "total_flops": train_rows[-1]["cumulative_flops"], "final_eval_loss": evals[-1]["loss"],
          "final_eval_loss_remeasured": remeasured, "final_train_loss": result.final_loss, "eval_curve": evals,
          "growths": growths, "primitives": primitives, "train_seconds": round(result.train_seconds, 1),
          "wall_seconds": round(trained + time.time() - start, 1), "workdir": workdir}


def _settings(run: RunConfig, study: StackingStudyConfig) -> Dict[str, Any]:
  """What a cell's result depends on besides its (arm, seed): a re-run reuses cells only if equal.

  In JSON form (tuples as lists), as cells.jsonl stores it, so that equal settings compare equal.
  """
  d = dataclasses.asdict(study)
  for grid in ("seeds", "arms"):
    d.pop(grid)
  return json.loads(json.dumps({"run": config_to_dict(run), "study": d}))


def _read_cells(path: str, settings: Dict[str, Any]) -> Dict[Tuple[str, int], Dict[str, Any]]:
  cells = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      row = json.loads(line) if line.strip() else None
      if row and row.get("settings") == settings:
        cells[(row["arm"], row["seed"])] = row
  return cells


def _write_cells(path: str, cells: Dict[Tuple[str, int], Dict[str, Any]], settings: Dict[str, Any]) -> None:
  fs.write_text(path, "".join(json.dumps(dict(c, settings=settings)) + "\n" for c in cells.values()))


def run_study(run: RunConfig, study: StackingStudyConfig, workdir: str, operative_config: str = "",
              log: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains and measures every missing cell, then writes study.json, study.md and the figures."""
  check_run_config(run)
  fs.makedirs(workdir)
  settings = _settings(run, study)
  cells_path = fs.join(workdir, "cells.jsonl")
  done = _read_cells(cells_path, settings)
  started = time.time()
  for seed in study.seeds:
    for arm in study.arms:
      if (arm, seed) in done:
        continue
      log(f"training {arm} seed {seed}")
      cell = train_cell(run, study, arm, seed, fs.join(workdir, arm, f"seed{seed}"), operative_config)
      done[(arm, seed)] = cell
      _write_cells(cells_path, done, settings)  # whole-file atomic: a kill loses no finished cell
      log(f"{arm} seed {seed}: eval loss {cell['final_eval_loss']:.4f} after {cell['steps']} steps, "
          f"{cell['total_flops']:.3e} FLOPs ({cell['wall_seconds']}s)")
  cells = [done[(arm, seed)] for arm in study.arms for seed in study.seeds]
  summary = page.summarize(cells, study)
  summary["wall_seconds_this_call"] = round(time.time() - started, 1)
  summary["cell_wall_seconds"] = round(sum(c["wall_seconds"] for c in cells), 1)
  result = {"study": dataclasses.asdict(study), "summary": summary,
            "cells": [{k: v for k, v in c.items() if k != "settings"} for c in cells]}
  result["figures"] = page.plot_all(cells, workdir)
  fs.write_json(fs.join(workdir, "study.json"), result)
  fs.write_text(fs.join(workdir, "study.md"), page.markdown(result, run))
  return result
