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

  steps: training lengths (each >= 10 * the stage count); empty: TrainerConfig.num_steps alone.
  evals_per_run: at a listed length, the eval cadence is the largest divisor of every stage boundary
    giving at least this many evals (the baseline keeps a checkpoint at each, for matched_arms).
  learning_rates: peak rates every arm trains at the shortest length (empty: OptimizerConfig's);
    longer_rate: what longer lengths train each arm at, its own "best" rate at the shortest length (the
    lowest mean final held-out loss over the seeds) or the "config"'s.
  matched_arms: stacked arms whose final held-out loss the baseline is read at (its primitive scores
    interpolated between the two bracketing eval checkpoints); () turns it off.
  growth_window: steps either side of every growth recorded one by one (0: none).
  The primitives are scored on `score_examples` held-out questions per task, `k_shot` solved examples
  before each; `tasks` None scores every task of evals/primitives.py.
  """

  seeds: Tuple[int, ...] = (0, 1)
  arms: Tuple[str, ...] = ARMS
  k_shot: int = 5
  score_examples: int = 500
  tasks: Optional[Tuple[str, ...]] = None
  eval_batch_size: int = 32
  steps: Tuple[int, ...] = ()
  evals_per_run: int = 10
  learning_rates: Tuple[float, ...] = ()
  longer_rate: str = "best"
  matched_arms: Tuple[str, ...] = ()
  growth_window: int = 0

  def __post_init__(self):
    s = "StackingStudyConfig."
    for name in ("seeds", "arms", "steps", "learning_rates", "matched_arms"):
      object.__setattr__(self, name, tuple(getattr(self, name)))  # gin hands over lists
    if self.tasks is not None:
      object.__setattr__(self, "tasks", tuple(self.tasks))
    object.__setattr__(self, "learning_rates", tuple(float(r) for r in self.learning_rates))
    require(len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds)
            and all(isinstance(x, int) and x >= 0 for x in self.seeds), s + "seeds",
            f"must be distinct non-negative ints, got {self.seeds}", "e.g. seeds = [0, 1] (two or more show a spread)")
    require(len(self.arms) >= 1 and len(set(self.arms)) == len(self.arms), s + "arms",
            f"{self.arms} are not distinct arm names", f"list some of {ARMS + ABLATIONS}")
    specs = [parse_arm(a) for a in self.arms]
    require("baseline_equal_flops" not in self.arms or any(a.stacked for a in specs), s + "arms",
            "baseline_equal_flops is cut to a stacked arm's FLOPs, but no stacked arm is listed",
            f"add one of {STACKED}")
    for name in ("k_shot", "growth_window"):
      require(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, s + name, "must be an int >= 0",
              "k_shot 5 is the paper's setting; growth_window 0 records no steps around growth")
    for name in ("score_examples", "eval_batch_size", "evals_per_run"):
      require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, s + name,
              "must be a positive int", f"set {s}{name} >= 1 (500 questions give intervals of about +-0.04)")
    require(len(set(self.steps)) == len(self.steps) and all(isinstance(t, int) and t >= 1 for t in self.steps),
            s + "steps", f"must be distinct positive ints, got {self.steps}", "e.g. steps = [200, 800, 1600]")
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
