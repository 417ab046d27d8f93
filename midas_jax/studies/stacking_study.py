"""The multi-seed stacking study: how much compute growth saves to reach the baseline's loss.

One run config (model, data, optimizer, and the stacked schedule in StackingConfig) gives every arm
(studies/study_arms.py); a StackingStudyConfig (studies/stacking_config.py) says which lengths, arms,
rates and seeds. The study runs in four parts, each resumable from DIR/cells.jsonl:

  rates    at the shortest length every arm trains at every rate of the grid (on the grid's seeds),
           ranked by final loss on the validation shard; a best rate on the grid's edge extends the grid
           (studies/rate_choice.py)
  arms     at every length every arm trains at its rate, on every seed
  ladder   the baseline also trains at ladder_steps: with its runs at the lengths, the ladder of
           complete runs the effective speedup is read on (studies/effective_speedup.py)
  recheck  at the longest length each arm also trains at its best rate's neighbours (the first seed)

Each (length, arm, rate, seed) is a cell: a `midas train` run (TrainerConfig.seed and DataConfig.seed set
to the seed: the initialization and the training rows; the held-out batches come from the study's
eval_seed, the same for every cell), then measured on the validation half:
  eval_curve     the validation loss at every eval step, with the FLOPs spent by then
  growths        the validation loss just before each growth (the eval at the boundary, which the
                 eval cadence hits), just after it (the grown state's checkpoint), and at the next eval
  growth_steps   growth_window steps either side of each growth, one by one (train/growth_probe.py)
Every compared run's final checkpoint is then measured on test_batches batches of the test half, with its
standard error over batches (the reported loss, DIR/tests.jsonl), and with StackingStudyConfig.score scored
(primitives and memorization, DIR/scores.jsonl). Both read only the kept checkpoints, so changing how many
test batches or questions re-measures without training again. The summary (stacking_study_summary.py) is
written as DIR/results.json (provenance, tables, cells) and rendered into DIR/study.md
(stacking_study_page.py); DIR/results_tables.json is its small part (provenance and tables), the one to
commit beside docs that quote its tables.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from midas_jax import flops, fs, hardware, results
from midas_jax.checkpoint import load_model
from midas_jax.checkpoint.metadata import config_to_dict
from midas_jax.configs import RunConfig
from midas_jax.data.factory import load_data
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import NonFiniteLossError, require
from midas_jax.evals import memorization_scores, primitive_scores
from midas_jax.stacking.checks import schedule_for
from midas_jax.studies import rate_choice
from midas_jax.studies import stacking_study_page as page
from midas_jax.studies import stacking_study_summary as summary_lib
from midas_jax.studies.stacking_config import STACKED, StackingStudyConfig
from midas_jax.studies.study_arms import arm_config, length_run, on_test_shard, parse_arm
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
  require(run.data.source != "prepared", "DataConfig.source",
          "is 'prepared', but the study cuts the held-out split into validation and test halves, which a store "
          "does not support", "run the study on an in-memory source (builtin, text, seqio)")
  require(study is None or not study.ladder_steps or bool(study.steps), "StackingStudyConfig.ladder_steps",
          "are set, but steps is empty (the run config's own length is not a ladder rung)",
          "list the lengths in StackingStudyConfig.steps too")
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


# ---------------------------------------------------------------------------------------------
# Measuring one run


def held_out_loss(config: RunConfig, params, depth: int, data) -> float:
  """The loss of `params` (a model of `depth` layers) on the batches the train loop evaluates."""
  return held_out_batches(config, params, depth, data)["loss"]


def held_out_batches(config: RunConfig, params, depth: int, data) -> Dict[str, Any]:
  """The loss of `params` on the config's eval_batches held-out batches, and its standard error: the
  batches are independent draws, so the sd of their losses over sqrt(batches)."""
  build = build_stage(config, data=data, num_layers=depth)
  sums, tokens = [], []
  with build.context():
    params = jax.device_put(params, build.layout.shardings.params)
    eval_step = build.jit_eval_step()
    for i in range(config.trainer.eval_batches):
      aux = jax.device_get(eval_step(params, build.device_batch(i, "validation")))
      sums.append(float(np.sum(aux["objective_loss_sum"])))
      tokens.append(float(aux["tokens"]))
  per_batch = [s / max(t, 1e-9) for s, t in zip(sums, tokens)]
  se = float(np.std(per_batch, ddof=1) / math.sqrt(len(per_batch))) if len(per_batch) > 1 else None
  return {"loss": sum(sums) / max(sum(tokens), 1e-9), "se": se, "batches": len(per_batch), "tokens": sum(tokens)}


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


def device_kind() -> str:
  """What measured a cell: the accelerator's kind, or the CPU's model (losses differ between CPU models)."""
  device = jax.devices()[0]
  return hardware.cpu_model() if device.platform == "cpu" else device.device_kind


def train_cell(run: RunConfig, study: StackingStudyConfig, arm: str, seed: int, workdir: str,
               operative_config: str = "", learning_rate: Optional[float] = None) -> Dict[str, Any]:
  """Trains one cell (resuming a run its workdir holds) of a length's run config and measures it.
  A run whose loss turns non-finite (a rate too high) is a cell with `diverged` set and no losses."""
  vocab_size = make_vocabulary(run.data).vocab_size
  config = arm_config(run, arm, seed, vocab_size, learning_rate, eval_seed=study.eval_seed)
  data = load_data(config)
  cell = {"arm": arm, "seed": seed, "steps": config.trainer.num_steps, "learning_rate": config.optimizer.learning_rate,
          "length": run.trainer.num_steps, "warmup_steps": config.optimizer.warmup_steps,
          "eval_every": config.trainer.eval_every, "workdir": workdir, "diverged": False, "device": device_kind()}
  start = time.time()
  try:
    result = train(config, workdir, operative_config=operative_config, growth_window=study.growth_window)
  except NonFiniteLossError as e:
    return dict(cell, diverged=True, error=str(e), final_eval_loss=None, total_flops=None, eval_curve=[],
                growths=[], growth_steps=[], train_seconds=None, wall_seconds=round(time.time() - start, 1))
  trained = time.time() - start
  evals = [{"step": r["step"], "loss": r["loss"], "flops": r["cumulative_flops"]}
           for r in read_metrics(workdir, "eval")]
  train_rows = read_metrics(workdir, "train")
  start = time.time()
  growths = _growth_losses(config, workdir, result.growths, evals, data)
  return dict(cell, total_flops=train_rows[-1]["cumulative_flops"], final_eval_loss=evals[-1]["loss"],
              final_train_loss=result.final_loss, eval_curve=evals, growths=growths,
              growth_steps=[{k: v for k, v in r.items() if k != "split"} for r in read_metrics(workdir, "growth")],
              train_seconds=round(result.train_seconds, 1), wall_seconds=round(trained + time.time() - start, 1))


def measure_test_loss(study: StackingStudyConfig, cell: Dict[str, Any]) -> Dict[str, Any]:
  """A finished cell's final checkpoint on test_batches batches of the test half (loss, standard error, and
  the device that measured it, which may not be the one that trained it)."""
  final = load_model(cell["workdir"])
  test = on_test_shard(final.config, study.test_batches)
  return dict(held_out_batches(test, final.params, final.model_config.num_layers, load_data(test)),
              device=device_kind())


def score_checkpoint(study: StackingStudyConfig, loaded) -> Dict[str, Any]:
  """The primitives' and memorization's scores of a loaded checkpoint: {suite: {task: {score: value}}}."""
  options = {"k_shot": study.k_shot, "score_examples": study.score_examples, "seed": 0,
             "tasks": list(study.tasks) if study.tasks else None, "batch_size": study.eval_batch_size}
  context_len = min(loaded.config.data.seq_len, loaded.model_config.max_seq_len)
  reasoning = primitive_scores.evaluate(loaded.params, loaded.model_config, loaded.vocab, context_len, options)
  out = {"primitives": {name: {k: v["value"] for k, v in t["scores"].items()}
                        for name, t in reasoning["tasks"].items()},
         "memorization": {}}
  if loaded.config.data.source == "builtin":  # the facts of the built-in corpus's world
    memory = memorization_scores.evaluate(loaded.params, loaded.model_config, loaded.vocab, context_len,
                                          dict(options, score_examples=study.memory_questions),
                                          corpus_seed=loaded.config.data.corpus_seed)
    out["memorization"] = {name: {k: v["value"] for k, v in c["scores"].items()}
                           for name, c in memory["conditions"].items()}
  return out


# ---------------------------------------------------------------------------------------------
# Cells on disk: a re-run with the same settings resumes


def _settings(run: RunConfig, study: StackingStudyConfig) -> Dict[str, Any]:
  """What a cell's result depends on besides its key: a re-run reuses cells only if equal.

  In JSON form (tuples as lists), as cells.jsonl stores it, so that equal settings compare equal.
  The grids (seeds, arms, lengths, rates) pick cells, and the test set and scoring read finished
  checkpoints: none of them is a setting of a cell.
  """
  d = dataclasses.asdict(study)
  for grid in ("seeds", "arms", "steps", "ladder_steps", "learning_rates", "rate_seeds", "max_rate_extensions",
               "recheck_rates", "longer_rate", "matched_arms", "score", "k_shot", "score_examples",
               "memory_questions", "tasks", "eval_batch_size", "test_batches"):
    d.pop(grid)
  return json.loads(json.dumps({"run": config_to_dict(run), "study": d}))


def _test_settings(study: StackingStudyConfig) -> Dict[str, Any]:
  return {"test_batches": study.test_batches, "eval_seed": study.eval_seed}


def _score_settings(study: StackingStudyConfig) -> Dict[str, Any]:
  return json.loads(json.dumps({k: getattr(study, k) for k in ("k_shot", "score_examples", "memory_questions",
                                                                  "tasks")}))


def _key(row: Dict[str, Any]) -> Key:
  return (row["length"], row["arm"], float(row["learning_rate"]), row["seed"])


def _read_rows(path: str, settings: Dict[str, Any]) -> Dict[Key, Dict[str, Any]]:
  rows = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      row = json.loads(line) if line.strip() else None
      if row and _comparable(row.get("settings")) == settings:
        rows[_key(row)] = row
  return rows


def _comparable(settings: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
  """Stored settings as this version compares them: cells written when the test set was measured inside a
  cell still carry its batch count, which no longer bears on training."""
  if not settings or "study" not in settings or "test_batches" not in settings["study"]:
    return settings
  return dict(settings, study={k: v for k, v in settings["study"].items() if k != "test_batches"})


def _write_rows(path: str, rows: Dict[Key, Dict[str, Any]], settings: Dict[str, Any]) -> None:
  fs.write_text(path, "".join(json.dumps(dict(c, settings=settings)) + "\n" for c in rows.values()))


def _cell_dir(workdir: str, study: StackingStudyConfig, steps: int, arm: str, rate: float, seed: int) -> str:
  parts = ([f"steps{steps}"] if study.steps else []) + [arm]
  parts += [f"lr{rate:g}"] if study.learning_rates else []
  return fs.join(workdir, *parts, f"seed{seed}")


# ---------------------------------------------------------------------------------------------
# The study


class _Cells:
  """The study's cells: trained on first use, kept in DIR/cells.jsonl (whole-file writes: a kill loses no
  finished cell)."""

  def __init__(self, run: RunConfig, study: StackingStudyConfig, workdir: str, operative_config: str,
               log: Callable[[str], None]):
    self.run, self.study, self.workdir, self.operative, self.log = run, study, workdir, operative_config, log
    self.settings = _settings(run, study)
    self.path = fs.join(workdir, "cells.jsonl")
    self.done = _read_rows(self.path, self.settings)
    self.visited: List[Key] = []

  def get(self, steps: Optional[int], arm: str, rate: float, seed: int) -> Dict[str, Any]:
    length = length_run(self.run, steps, self.study.evals_per_run)
    key = (length.trainer.num_steps, arm, float(rate), seed)
    if key not in self.visited:
      self.visited.append(key)
    if key not in self.done:
      n = key[0]
      self.log(f"training {arm} seed {seed}" + (f" at {n} steps" if self.study.steps else "")
               + (f", peak rate {rate:g}" if self.study.learning_rates else ""))
      cell = train_cell(length, self.study, arm, seed, _cell_dir(self.workdir, self.study, n, arm, rate, seed),
                        self.operative, learning_rate=rate)
      self.done[key] = cell
      _write_rows(self.path, self.done, self.settings)
      self.log(f"{arm} seed {seed}: " + ("diverged" if cell["diverged"] else
                                         f"validation loss {cell['final_eval_loss']:.4f}")
               + f" after {cell['steps']} steps, {cell['total_flops'] or 0:.3e} FLOPs ({cell['wall_seconds']}s)")
    return self.done[key]


def choose_rates(cells: _Cells, study: StackingStudyConfig, shortest: Optional[int], config_rate: float,
                 log: Callable[[str], None]) -> Dict[str, Dict[str, Any]]:
  """Per arm: the grid it trained at the shortest length (each rate's validation losses over the grid's
  seeds), extended past an edge-best rate up to the cap; its best rate, and whether it is bracketed."""
  seeds = study.seeds[:study.rate_seeds] if study.rate_seeds else study.seeds
  out = {}
  for arm in study.arms:
    rates = list(study.learning_rates or (config_rate,))
    grid: Dict[float, List[Optional[float]]] = {}
    extensions = 0
    while True:
      for rate in rates:
        if rate not in grid:
          grid[rate] = [cells.get(shortest, arm, rate, s)["final_eval_loss"] for s in seeds]
      nxt = rate_choice.extension(grid)
      if nxt is None or extensions >= study.max_rate_extensions:
        break
      log(f"{arm}: best rate {rate_choice.best_rate(grid):g} is on the grid's edge; extending to {nxt:g}")
      rates.append(nxt)
      extensions += 1
    out[arm] = {"grid": {str(r): grid[r] for r in sorted(grid)}, "best": rate_choice.best_rate(grid),
                "bracketed": rate_choice.bracketed(grid) if len(grid) > 1 else None, "extensions": extensions,
                "seeds": list(seeds)}
  return out


def compared_plan(study: StackingStudyConfig, lengths: Sequence[Optional[int]], best: Dict[str, float],
                  config_rate: float) -> List[Tuple[Optional[int], str, float, int, str]]:
  """(length, arm, rate, seed, role) of every run the study compares, in training order: every arm at every
  length (role "arm"), at its best rate at the first and, with longer_rate "best", at every length; then the
  baseline at the ladder's extra lengths (role "ladder"), at the rate it trains at beyond the first length."""
  def rate(arm: str, first: bool) -> float:
    return float(best[arm] if first or study.longer_rate == "best" else config_rate)

  plan = [(steps, arm, rate(arm, i == 0), seed, "arm")
          for i, steps in enumerate(lengths) for seed in study.seeds for arm in study.arms]
  if "baseline" in study.arms:
    plan += [(steps, "baseline", rate("baseline", False), seed, "ladder")
             for steps in sorted(study.ladder_steps) for seed in study.seeds]
  return plan


def recheck_plan(study: StackingStudyConfig, lengths: Sequence[Optional[int]], best: Dict[str, float],
                 config_rate: float, grids: Dict[str, Dict[str, Any]]) -> List[Tuple[Optional[int], str, float, int]]:
  """(length, arm, rate, seed): at the longest length, each arm at its rate there and at the grid's rates either
  side of its best, on the first seed (none without recheck_rates, a grid, or a second length)."""
  if not (study.recheck_rates and study.learning_rates and len(lengths) > 1):
    return []
  plan = []
  for arm in study.arms:
    chosen = float(best[arm] if study.longer_rate == "best" else config_rate)
    for rate in [chosen] + list(rate_choice.neighbours([float(r) for r in grids[arm]], best[arm])):
      plan.append((lengths[-1], arm, rate, study.seeds[0]))
  return plan


def run_study(run: RunConfig, study: StackingStudyConfig, workdir: str, operative_config: str = "",
              log: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains and measures every missing cell (rates, arms, ladder, recheck), scores the compared runs,
  then writes results.json and study.md."""
  check_run_config(run, study)
  fs.makedirs(workdir)
  started = time.time()
  cells = _Cells(run, study, workdir, operative_config, log)
  config_rate = run.optimizer.learning_rate
  lengths = study.lengths(run)
  rates = choose_rates(cells, study, lengths[0], config_rate, log)
  best = {arm: r["best"] for arm, r in rates.items()}
  compared = [dict(cells.get(steps, arm, rate, seed), role=role)
              for steps, arm, rate, seed, role in compared_plan(study, lengths, best, config_rate)]
  recheck = [cells.get(*key) for key in recheck_plan(study, lengths, best, config_rate,
                                                     {arm: r["grid"] for arm, r in rates.items()})]
  finished = [c for c in compared if not c["diverged"]]
  tests = _measured(workdir, "tests.jsonl", "test", _test_settings(study), finished,
                    lambda cell: measure_test_loss(study, cell), log)
  compared = [dict(c, test=tests.get(_key(c))) for c in compared]
  for key, test in tests.items():
    cells.done[key] = dict(cells.done[key], test=test)  # the results file's cells carry their test loss
  scores = (_measured(workdir, "scores.jsonl", "scores", _score_settings(study), finished,
                      lambda cell: score_checkpoint(study, load_model(cell["workdir"])), log) if study.score else {})
  summary = summary_lib.summarize(compared, rates, recheck, scores, study, tokens_per_step=run.data.batch_size
                                  * run.data.seq_len, params=_model_params(run), corpus_tokens=_corpus_tokens(run))
  every = [cells.done[k] for k in cells.visited]
  summary["wall_seconds_this_call"] = round(time.time() - started, 1)
  summary["cell_wall_seconds"] = round(sum(c["wall_seconds"] for c in every), 1)
  result = page.results_file(summary, every, run, study, operative_config)
  result["figures"] = page.plot_all(compared, workdir, summary)
  fs.write_text(fs.join(workdir, "results.json"), results.dumps(result) + "\n")
  fs.write_text(fs.join(workdir, "results_tables.json"), results.dumps(page.tables_file(result)) + "\n")
  fs.write_text(fs.join(workdir, "study.md"), page.markdown(result))
  return result


def _measured(workdir: str, file_name: str, what: str, settings: Dict[str, Any],
              cells: Sequence[Dict[str, Any]],
              measure: Callable[[Dict[str, Any]], Dict[str, Any]],
              log: Callable[[str], None]) -> Dict[Key, Dict[str, Any]]:
  """measure(cell) of each finished cell's final checkpoint, kept as `what` in DIR/<file_name> under
  `settings`: a re-run with other settings measures again, training nothing."""
  path = fs.join(workdir, file_name)
  done = _read_rows(path, settings)
  for cell in cells:
    key = _key(cell)
    if key not in done:
      log(f"{what}: {cell['arm']} seed {cell['seed']} at {cell['length']} steps")
      done[key] = {"length": cell["length"], "arm": cell["arm"], "learning_rate": cell["learning_rate"],
                   "seed": cell["seed"], what: measure(cell)}
      _write_rows(path, done, settings)
  return {k: v[what] for k, v in done.items()}


def _model_params(run: RunConfig) -> int:
  return flops.param_counts(run.model.with_vocab(make_vocabulary(run.data).vocab_size))["total"]


def _corpus_tokens(run: RunConfig) -> Optional[int]:
  """The training split's tokens, for passes over the corpus (None where the source has no fixed corpus)."""
  if run.data.source not in ("builtin", "text"):
    return None
  vocab, pipeline = load_data(run)
  return int(sum(len(d) for d in pipeline.documents["train"])) if hasattr(pipeline, "documents") else None
