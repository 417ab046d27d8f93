"""The multi-seed stacking study: lengths x arms x learning rates x seeds, and what each cell measured.

One run config (model, data, optimizer, and the stacked schedule in StackingConfig) gives every
arm (studies/study_arms.py); a StackingStudyConfig (studies/stacking_config.py) says which lengths, arms,
rates and seeds:

  steps           the training lengths (empty: the run config's TrainerConfig.num_steps alone, with
                  its own warm-up and eval_every); at each, every arm's schedule is built for it
  learning_rates  peak rates swept for every arm at the shortest length (empty: the config's);
                  longer lengths train each arm at its own best rate there (longer_rate "best") or at
                  the config's ("config")
  arms            baseline, baseline_equal_flops, and stacked arms such as midas, gradstack,
                  midas_zero_moments, midas_rewarm (study_arms.py)

Each (length, arm, rate, seed) is a cell: a `midas train` run (TrainerConfig.seed and DataConfig.seed
both set to the seed, so a seed changes the initialization and the data order; the arms of one seed
see the same data), then measured:
  eval_curve     the held-out loss at every eval step, with the FLOPs spent by then
  growths        the held-out loss just before each growth (the eval at the boundary, which the
                 eval cadence hits) and just after it (the grown state's checkpoint, evaluated on the
                 same batches), then at the next eval
  growth_steps   growth_window steps either side of each growth, one by one: loss, gradient norm and
                 the update norm of the copied block (train/growth_probe.py)
  primitives     primitive_scores.py's four scores per primitive on the final checkpoint
Then, with matched_arms, the baseline (which keeps a checkpoint at every eval) is read at each such
arm's final held-out loss: its primitive scores interpolated between the two bracketing saves
(matched_loss.py), into DIR/matched.jsonl.
Cells are written to DIR/cells.jsonl as they finish; a re-run with the same settings resumes (adding
a length, seed or rate trains only the new cells). The summary (stacking_study_page.py) is
DIR/study.json, DIR/study.md and its figures.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax

from midas_jax import flops, fs
from midas_jax.checkpoint import load_model
from midas_jax.checkpoint.metadata import config_to_dict
from midas_jax.configs import RunConfig
from midas_jax.data.factory import load_data
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import NonFiniteLossError, require
from midas_jax.evals import primitive_scores
from midas_jax.stacking.checks import schedule_for
from midas_jax.studies import matched_loss
from midas_jax.studies import stacking_study_page as page
from midas_jax.studies.stacking_config import STACKED, StackingStudyConfig
from midas_jax.studies.study_arms import arm_config, length_run, parse_arm
from midas_jax.train.build import build_stage
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train

Key = Tuple[int, str, float, int]  # (steps, arm, peak learning rate, seed)


def check_run_config(run: RunConfig, study: Optional[StackingStudyConfig] = None) -> None:
  """The study needs a stacked schedule whose boundaries the periodic eval hits (loss before growth),
  at every length. Checked here, before any arm trains (the stacked arms grow on the same schedule)."""
  st = run.stacking
  require(st.num_stages > 1, "StackingConfig.num_stages", "is 1: the study compares stacked arms with a baseline",
          "set the stacked schedule (e.g. num_stages = 4, block_size = 2)")
  for name, default in (("new_moments", "copy"), ("lr_schedule", "global")):
    require(getattr(st, name) == default, f"StackingConfig.{name}",
            f"is {getattr(st, name)!r}, but in the study each arm's name sets it (midas: {default!r})",
            f"leave StackingConfig.{name} at {default!r} and list an ablation arm, e.g. midas_zero_moments or "
            "midas_rewarm")
  lengths = study.lengths(run) if study else (None,)
  for steps in lengths:
    if steps is not None:
      require(steps >= 10 * st.num_stages, "StackingStudyConfig.steps",
              f"{steps} steps leave {st.num_stages} stages under 10 steps each on average",
              f"list lengths of at least {10 * st.num_stages} steps")
    length = length_run(run, steps, study.evals_per_run if study else 10)
    trainer = length.trainer
    stacked = [a for a in (study.arms if study else STACKED) if parse_arm(a).stacked]
    for arm in stacked:  # every stacked arm's schedule and settings (a rewarm longer than a stage, ...)
      spec = parse_arm(arm)
      schedule = schedule_for(dataclasses.replace(length, stacking=dataclasses.replace(
          st, stage_steps=length.stacking.stage_steps, operator=spec.operator, new_moments=spec.new_moments,
          lr_schedule=spec.lr_schedule)))
      missed = [b for b in schedule.boundaries if not trainer.eval_every or b % trainer.eval_every]
      require(not missed, "TrainerConfig.eval_every",
              f"{trainer.eval_every} does not divide the stage boundaries {missed} (stage steps "
              f"{schedule.stage_steps}), so the loss just before a growth would not be measured",
              "pick an eval_every that divides every boundary, or set StackingConfig.stage_steps to multiples of it")


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


def arm_run(run: RunConfig, arm: str, seed: int, learning_rate: Optional[float] = None,
            keep_every_eval: bool = False):
  """(the cell's run config, its (vocabulary, pipeline)): the data of the arm's own DataConfig.seed,
  whose held-out batches are the ones the train loop evaluates on."""
  config = arm_config(run, arm, seed, make_vocabulary(run.data).vocab_size, learning_rate, keep_every_eval)
  return config, load_data(config)


def score_primitives(study: StackingStudyConfig, loaded) -> Dict[str, Any]:
  """primitive_scores.py's scores per task of a loaded checkpoint."""
  options = {"k_shot": study.k_shot, "score_examples": study.score_examples, "seed": 0,
             "tasks": list(study.tasks) if study.tasks else None, "batch_size": study.eval_batch_size}
  context_len = min(loaded.config.data.seq_len, loaded.model_config.max_seq_len)
  scores = primitive_scores.evaluate(loaded.params, loaded.model_config, loaded.vocab, context_len, options)["tasks"]
  return {name: t["scores"] for name, t in scores.items()}


def train_cell(run: RunConfig, study: StackingStudyConfig, arm: str, seed: int, workdir: str,
               operative_config: str = "", learning_rate: Optional[float] = None,
               keep_every_eval: bool = False) -> Dict[str, Any]:
  """Trains one cell (resuming a run its workdir holds) of a length's run config and measures it.

  `final_eval_loss_remeasured` is the final checkpoint's loss measured as the loss after each
  growth is (held_out_loss); it equals the loop's last eval when both read the same batches. A run
  whose loss turns non-finite (a rate too high) is a cell with `diverged` set and no scores.
  """
  config, data = arm_run(run, arm, seed, learning_rate, keep_every_eval)
  rate = config.optimizer.learning_rate
  cell = {"arm": arm, "seed": seed, "steps": config.trainer.num_steps, "learning_rate": rate,
          "length": run.trainer.num_steps, "warmup_steps": config.optimizer.warmup_steps,
          "eval_every": config.trainer.eval_every, "workdir": workdir, "diverged": False}
  start = time.time()
  try:
    result = train(config, workdir, operative_config=operative_config, growth_window=study.growth_window)
  except NonFiniteLossError as e:
    return dict(cell, diverged=True, error=str(e), final_eval_loss=None, total_flops=None, eval_curve=[],
                growths=[], growth_steps=[], primitives={}, train_seconds=None,
                wall_seconds=round(time.time() - start, 1))
  trained = time.time() - start
  evals = [{"step": r["step"], "loss": r["loss"], "flops": r["cumulative_flops"]}
           for r in read_metrics(workdir, "eval")]
  train_rows = read_metrics(workdir, "train")
  start = time.time()
  growths = _growth_losses(config, workdir, result.growths, evals, data)
  final = load_model(workdir)
  remeasured = held_out_loss(config, final.params, final.model_config.num_layers, data)
  return dict(cell, total_flops=train_rows[-1]["cumulative_flops"], final_eval_loss=evals[-1]["loss"],
              final_eval_loss_remeasured=remeasured, final_train_loss=result.final_loss, eval_curve=evals,
              growths=growths, growth_steps=[{k: v for k, v in r.items() if k != "split"}
                                             for r in read_metrics(workdir, "growth")],
              primitives=score_primitives(study, final), train_seconds=round(result.train_seconds, 1),
              wall_seconds=round(trained + time.time() - start, 1))


def _settings(run: RunConfig, study: StackingStudyConfig) -> Dict[str, Any]:
  """What a cell's result depends on besides its key: a re-run reuses cells only if equal.

  In JSON form (tuples as lists), as cells.jsonl stores it, so that equal settings compare equal.
  The grids (seeds, arms, lengths, rates) pick cells; they are not settings.
  """
  d = dataclasses.asdict(study)
  for grid in ("seeds", "arms", "steps", "learning_rates", "longer_rate", "matched_arms"):
    d.pop(grid)
  return json.loads(json.dumps({"run": config_to_dict(run), "study": d}))


def _key(row: Dict[str, Any]) -> Key:
  return (row["length"], row["arm"], float(row["learning_rate"]), row["seed"])


def _read_rows(path: str, settings: Dict[str, Any]) -> Dict[Key, Dict[str, Any]]:
  rows = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      row = json.loads(line) if line.strip() else None
      if row and row.get("settings") == settings:
        rows[_key(row)] = row
  return rows


def _write_rows(path: str, rows: Dict[Key, Dict[str, Any]], settings: Dict[str, Any]) -> None:
  fs.write_text(path, "".join(json.dumps(dict(c, settings=settings)) + "\n" for c in rows.values()))


_read_cells, _write_cells = _read_rows, _write_rows


def best_rates(cells: List[Dict[str, Any]], arms, rates) -> Dict[str, float]:
  """Per arm, the rate of lowest mean final held-out loss over its seeds; a rate at which a seed diverged
  ranks after every rate at which none did (then by the mean of the seeds that did not)."""
  best = {}
  for arm in arms:
    def rank(rate):
      mine = [c for c in cells if c["arm"] == arm and c["learning_rate"] == rate]
      losses = [c["final_eval_loss"] for c in mine if not c.get("diverged")]
      diverged = len(losses) < len(mine) or not losses
      return (diverged, sum(losses) / len(losses) if losses else float("inf"))
    best[arm] = min(rates, key=rank)
  return best


def length_cells(study: StackingStudyConfig, steps: int, first: bool, config_rate: float,
                 best: Dict[str, float]) -> List[Key]:
  """The cells of one length, in training order: at the first (shortest) length every arm at every swept
  rate; at a longer one each arm at its best rate there (longer_rate "best") or at the config's."""
  sweep = study.learning_rates or (config_rate,)
  keys = []
  for seed in study.seeds:
    for arm in study.arms:
      rates = sweep if first else ((best[arm],) if study.longer_rate == "best" else (config_rate,))
      keys += [(steps, arm, float(r), seed) for r in rates]
  return keys


def compared_rate(study: StackingStudyConfig, arm: str, first: bool, config_rate: float,
                  best: Dict[str, float]) -> float:
  """The rate an arm is compared at: its best at the first length (and at every length with longer_rate
  "best"), else the config's."""
  return float(best[arm] if first or study.longer_rate == "best" else config_rate)


def _cell_dir(workdir: str, study: StackingStudyConfig, steps: int, arm: str, rate: float, seed: int) -> str:
  parts = ([f"steps{steps}"] if study.steps else []) + [arm]
  parts += [f"lr{rate:g}"] if study.learning_rates else []
  return fs.join(workdir, *parts, f"seed{seed}")


def _checkpoint_scores(study: StackingStudyConfig, baseline: Dict[str, Any], step: int) -> Dict[str, Any]:
  """The primitive scores of the baseline's checkpoint at `step`, cached beside it (several arms share)."""
  path = fs.join(baseline["workdir"], "primitive_scores.json")
  cache = json.loads(fs.read_text(path)) if fs.isfile(path) else {}
  if str(step) not in cache:
    cache[str(step)] = score_primitives(study, load_model(baseline["workdir"], step))
    fs.write_json(path, cache)
  return cache[str(step)]


def matched_row(study: StackingStudyConfig, cell: Dict[str, Any], baseline: Dict[str, Any]) -> Dict[str, Any]:
  """The baseline read at the cell's final held-out loss: the bracketing evals and the interpolated scores."""
  target = cell["final_eval_loss"]
  row = {"arm": cell["arm"], "seed": cell["seed"], "length": cell["length"], "learning_rate": cell["learning_rate"],
         "baseline_learning_rate": baseline["learning_rate"], "target_loss": target, "bracket": None,
         "baseline_step": None, "scores": None, "arm_scores": cell["primitives"]}
  found = None if target is None or baseline.get("diverged") else matched_loss.bracket(baseline["eval_curve"], target)
  if found is None:
    return row
  a, b, w = found
  scores = matched_loss.interpolate({t: {k: v["value"] for k, v in s.items()}
                                     for t, s in _checkpoint_scores(study, baseline, a).items()},
                                    {t: {k: v["value"] for k, v in s.items()}
                                     for t, s in _checkpoint_scores(study, baseline, b).items()}, w)
  return dict(row, bracket=[a, b, w], baseline_step=a + w * (b - a), scores=scores)


def _model_params(run: RunConfig) -> int:
  return flops.param_counts(run.model.with_vocab(make_vocabulary(run.data).vocab_size))["total"]


def run_study(run: RunConfig, study: StackingStudyConfig, workdir: str, operative_config: str = "",
              log: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains and measures every missing cell, length by length (the shortest first: its rate sweep picks
  the longer lengths' rates), reads the baseline at matched loss, then writes study.json, study.md and
  the figures."""
  check_run_config(run, study)
  fs.makedirs(workdir)
  settings = _settings(run, study)
  cells_path, matched_path = fs.join(workdir, "cells.jsonl"), fs.join(workdir, "matched.jsonl")
  done, matched_done = _read_rows(cells_path, settings), _read_rows(matched_path, settings)
  started = time.time()
  config_rate = run.optimizer.learning_rate
  sweep = study.learning_rates or (config_rate,)
  lengths = study.lengths(run)
  best: Dict[str, float] = {}
  visited: List[Key] = []
  chosen: List[Dict[str, Any]] = []  # each arm's cells at its length's rate
  matched: List[Dict[str, Any]] = []
  for i, steps in enumerate(lengths):
    length = length_run(run, steps, study.evals_per_run)
    n = length.trainer.num_steps

    def rate_of(arm: str) -> float:  # the rate an arm is compared at, at this length
      return compared_rate(study, arm, i == 0, config_rate, best)

    keys = length_cells(study, n, i == 0, config_rate, best)
    for key in keys:
      _, arm, rate, seed = key
      visited.append(key)
      if key in done:
        continue
      log(f"training {arm} seed {seed}" + (f" at {n} steps" if study.steps else "")
          + (f", peak rate {rate:g}" if study.learning_rates else ""))
      done[key] = cell = train_cell(length, study, arm, seed, _cell_dir(workdir, study, n, arm, rate, seed),
                                    operative_config, learning_rate=rate,
                                    keep_every_eval=bool(study.matched_arms) and arm == "baseline")
      _write_rows(cells_path, done, settings)  # whole-file atomic: a kill loses no finished cell
      log(f"{arm} seed {seed}: " + ("diverged" if cell["diverged"] else f"eval loss {cell['final_eval_loss']:.4f}")
          + f" after {cell['steps']} steps, {cell['total_flops'] or 0:.3e} FLOPs ({cell['wall_seconds']}s)")
    if i == 0:
      best = best_rates([done[k] for k in keys], study.arms, [float(r) for r in sweep])
    chosen += [done[(n, arm, rate_of(arm), seed)] for arm in study.arms for seed in study.seeds]
    for arm in study.matched_arms:
      for seed in study.seeds:
        cell, base = done[(n, arm, rate_of(arm), seed)], done[(n, "baseline", rate_of("baseline"), seed)]
        row = matched_done.get(_key(cell))
        if row is None or row["baseline_learning_rate"] != base["learning_rate"]:
          log(f"reading the baseline at {arm}'s final loss, seed {seed}" + (f", {n} steps" if study.steps else ""))
          matched_done[_key(cell)] = row = matched_row(study, cell, base)
          _write_rows(matched_path, matched_done, settings)
        matched.append(row)
  cells = [done[k] for k in visited]
  summary = page.summarize_study(cells, chosen, matched, study, best,
                                 tokens_per_step=run.data.batch_size * run.data.seq_len, params=_model_params(run))
  summary["wall_seconds_this_call"] = round(time.time() - started, 1)
  summary["cell_wall_seconds"] = round(sum(c["wall_seconds"] for c in cells), 1)
  result = {"study": dataclasses.asdict(study), "summary": summary,
            "cells": [{k: v for k, v in c.items() if k != "settings"} for c in cells],
            "matched": [{k: v for k, v in m.items() if k != "settings"} for m in matched]}
  result["figures"] = page.plot_all(chosen, workdir, summary)
  fs.write_json(fs.join(workdir, "study.json"), result)
  fs.write_text(fs.join(workdir, "study.md"), page.markdown(result, run))
  return result
