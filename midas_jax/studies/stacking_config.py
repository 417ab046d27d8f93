"""The settings of the multi-seed stacking study (studies/stacking_study.py trains them; studies/study_arms.py
says what each arm name means)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from midas_jax import gin_config
from midas_jax.configs import RunConfig
from midas_jax.errors import require
from midas_jax.studies.study_arms import parse_arm

ARMS = ("baseline", "baseline_equal_flops", "midas", "gradstack")
STACKED = ("midas", "gradstack")
ABLATIONS = ("midas_zero_moments", "midas_rewarm", "gradstack_zero_moments", "gradstack_rewarm")
LONGER_RATES = ("best", "config")


@dataclasses.dataclass(frozen=True)
class StackingStudyConfig:
  """Which lengths, arms, rates and seeds `midas study stacking` trains, and how the cells are scored.

  steps: training lengths at which every arm trains, each with its own full schedule (each >= 10 * the
    stage count); empty: TrainerConfig.num_steps alone. ladder_steps: more lengths the baseline alone
    trains at; the baseline's runs at steps + ladder_steps are the ladder the effective speedup is read
    on (studies/effective_speedup.py), so it should reach past the stacked arms' losses both ways.
  eval_seed: the seed of the held-out batches, the same for every arm and training seed (a training
    seed then varies only the initialization and the training rows). The held-out split is cut in two
    (DataConfig.heldout_shard): the periodic eval, the growth losses and the rate choice read shard 0
    (validation), the reported loss is measured once per finished run on test_batches batches of shard
    1 (test), with its standard error.
  learning_rates: the rate grid every arm trains at the shortest length (empty: OptimizerConfig's),
    on the first rate_seeds seeds (0: all); a best rate on the grid's edge extends the grid one step
    past it, at most max_rate_extensions times (studies/rate_choice.py). longer_rate: what the other
    lengths train each arm at, its "best" rate or the "config"'s. recheck_rates: at the longest length,
    each arm also trains at its best rate's grid neighbours (the first seed), to show whether the
    choice holds there.
  evals_per_run: at a listed length, the eval cadence is the largest divisor of every stage boundary
    giving at least this many evals.
  matched_arms: stacked arms whose final test loss the ladder is read at (scores interpolated between
    the two rungs that bracket it); () turns it off. score: primitives and memorization on every
    compared run's final checkpoint (off: losses only, as on a GPU whose time is short).
  growth_window: steps either side of every growth recorded one by one (0: none).
  The primitives are scored on `score_examples` held-out questions per task, `k_shot` solved examples
  before each; `tasks` None scores every task of evals/primitives.py. Memorization (closed book, open
  book, counterfactual: evals/memorization_scores.py) on memory_questions of the world's facts.
  """

  seeds: Tuple[int, ...] = (0, 1, 2)
  arms: Tuple[str, ...] = ARMS
  k_shot: int = 5
  score_examples: int = 500
  memory_questions: int = 150
  tasks: Optional[Tuple[str, ...]] = None
  eval_batch_size: int = 32
  steps: Tuple[int, ...] = ()
  ladder_steps: Tuple[int, ...] = ()
  eval_seed: int = 1234
  test_batches: int = 128
  evals_per_run: int = 10
  learning_rates: Tuple[float, ...] = ()
  rate_seeds: int = 0
  max_rate_extensions: int = 2
  recheck_rates: bool = False
  longer_rate: str = "best"
  matched_arms: Tuple[str, ...] = ()
  score: bool = True
  growth_window: int = 0

  def __post_init__(self):
    s = "StackingStudyConfig."
    for name in ("seeds", "arms", "steps", "ladder_steps", "learning_rates", "matched_arms"):
      object.__setattr__(self, name, tuple(getattr(self, name)))  # gin hands over lists
    if self.tasks is not None:
      object.__setattr__(self, "tasks", tuple(self.tasks))
    object.__setattr__(self, "learning_rates", tuple(float(r) for r in self.learning_rates))
    require(len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds)
            and all(isinstance(x, int) and x >= 0 for x in self.seeds), s + "seeds",
            f"must be distinct non-negative ints, got {self.seeds}",
            "e.g. seeds = [0, 1, 2] (three or more give an interval)")
    require(len(self.arms) >= 1 and len(set(self.arms)) == len(self.arms), s + "arms",
            f"{self.arms} are not distinct arm names", f"list some of {ARMS + ABLATIONS}")
    specs = [parse_arm(a) for a in self.arms]
    require("baseline_equal_flops" not in self.arms or any(a.stacked for a in specs), s + "arms",
            "baseline_equal_flops is cut to a stacked arm's FLOPs, but no stacked arm is listed",
            f"add one of {STACKED}")
    for name in ("k_shot", "growth_window", "eval_seed", "rate_seeds", "max_rate_extensions"):
      require(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, s + name, "must be an int >= 0",
              "k_shot 5 is the paper's setting; growth_window 0 records no steps around growth; rate_seeds 0 "
              "trains the grid on every seed")
    for name in ("score_examples", "memory_questions", "eval_batch_size", "evals_per_run", "test_batches"):
      require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, s + name,
              "must be a positive int", f"set {s}{name} >= 1 (500 questions give intervals of about +-0.04)")
    require(len(set(self.steps)) == len(self.steps) and all(isinstance(t, int) and t >= 1 for t in self.steps),
            s + "steps", f"must be distinct positive ints, got {self.steps}", "e.g. steps = [200, 800, 1600]")
    require(len(set(self.ladder_steps)) == len(self.ladder_steps) and not set(self.ladder_steps) & set(self.steps)
            and all(isinstance(t, int) and t >= 1 for t in self.ladder_steps), s + "ladder_steps",
            f"must be distinct positive ints not in steps {self.steps}, got {self.ladder_steps}",
            "e.g. steps = [400, 800, 1600] and ladder_steps = [200, 2400]")
    require(not self.ladder_steps or "baseline" in self.arms, s + "ladder_steps",
            "the ladder is the baseline's runs, but arms does not list 'baseline'", "add 'baseline' to arms")
    require(len(set(self.learning_rates)) == len(self.learning_rates) and all(r > 0 for r in self.learning_rates),
            s + "learning_rates", f"must be distinct positive rates, got {self.learning_rates}",
            "e.g. learning_rates = [1e-3, 3e-3, 1e-2], or [] for OptimizerConfig.learning_rate")
    require(self.longer_rate in LONGER_RATES, s + "longer_rate", f"unknown choice {self.longer_rate!r}",
            f"use one of {LONGER_RATES}")
    require(all(a in self.arms and parse_arm(a).stacked for a in self.matched_arms), s + "matched_arms",
            f"{self.matched_arms} must be stacked arms of arms={self.arms}", "e.g. matched_arms = ['midas'], or []")
    require(not self.matched_arms or "baseline" in self.arms, s + "matched_arms",
            "the matched-loss readout reads the baseline, which arms does not list", "add 'baseline' to arms")

  def lengths(self, run: RunConfig) -> Tuple[Optional[int], ...]:
    """The lengths in order, shortest first; (None,) for the run config's own."""
    return tuple(sorted(self.steps)) if self.steps else (None,)


gin_config.register(StackingStudyConfig)  # `StackingStudyConfig.arms = [...]` in gin files and --gin flags
