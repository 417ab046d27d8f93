"""Growing depth in stages: how many, how long each, and how a stage is grown."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from midas_jax.errors import require


GROWTH_MOMENTS = ("copy", "zero")
ZEROED_MOMENTS = ("zero", "copy")
LR_SCHEDULES = ("global", "rewarm")


@dataclasses.dataclass(frozen=True)
class StackingConfig:
  """Growing depth in stages (MIDAS, GradStack, or a registered operator).

  num_stages: k, the number of stages; 1 (the default) trains at full depth throughout: the baseline.
    Stage i has i blocks (start_blocks + i - 1 in general), so the last has num_stages * block_size =
    ModelConfig.num_layers layers.
  block_size: b, layers per block; None means num_layers // (num_stages + start_blocks - 1).
  operator: how a stage is grown from the previous one: "midas" (copy the middle block, ceil(n/2),
    right after itself), "gradstack" (copy the top block onto the top), or any name registered with
    midas_jax.stacking.operators.register_operator (e.g. the examples "fresh_block", "gstack").
  alpha: the Prop-alpha exponent: stage i gets steps proportional to i^alpha (1 = Prop-1, 2 = Prop-2,
    0 = Equal). Ignored when stage_steps is given.
  stage_steps: explicit steps per stage (one per stage, each >= 1, summing to TrainerConfig.num_steps).
  new_moments: what optimizer moments a copied layer starts with: "copy" (its source's) or "zero".
  zeroed_moments: with a function-preserving operator ("midas_zero", "gradstack_zero"), the optimizer
    moments of the residual output projections it zeroes: "zero" (default) or "copy" (keep the
    source's, which needs new_moments="copy"). Other operators ignore it.
  lr_schedule: "global" (one schedule over all steps, growth does not touch it) or "rewarm" (after
    each growth the learning rate warms up again, linearly over rewarm_steps, to the global value).
  rewarm_steps: the re-warmup length; 0 means OptimizerConfig.warmup_steps.
  start_blocks: blocks of the first stage (1: growth starts from one block). A run that starts from a
    model at some depth, e.g. an imported pretrained one (CheckpointConfig.init_from), sets it to that
    depth / block_size: stage i then has start_blocks + i - 1 blocks, and Prop-alpha gives it steps
    proportional to that count to the alpha.
  stage_mixtures: with DataConfig.mixture, the sources' weights in each stage (one tuple per stage,
    one weight per source, in the mixture's order; relative, each stage's summing to > 0): the rows of
    a stage's first step already follow its weights (data/mixture.py). None: the sources' own weights.
  trigger: None (fixed boundaries, as above) or "plateau": a stage ends once it has run min_stage_steps
    and the held-out loss improved by less than plateau_fraction (relative) over its last plateau_window
    evaluations (TrainerConfig.eval_every > 0), or once it has run max_stage_steps (None: no maximum). The
    last stage runs to num_steps, the cap; a run whose stages do not all fit ends at the depth it reached
    (docs/stacking.md#growth-on-a-trigger).
  """

  num_stages: int = 1
  block_size: Optional[int] = None
  operator: str = "midas"
  alpha: float = 1.0
  stage_steps: Optional[Tuple[int, ...]] = None
  new_moments: str = "copy"
  zeroed_moments: str = "zero"
  lr_schedule: str = "global"
  rewarm_steps: int = 0
  start_blocks: int = 1
  stage_mixtures: Optional[Tuple[Tuple[float, ...], ...]] = None
  trigger: Optional[str] = None
  plateau_fraction: float = 0.01
  plateau_window: int = 2
  min_stage_steps: int = 0
  max_stage_steps: Optional[int] = None

  def __post_init__(self):
    s = "StackingConfig."
    require(isinstance(self.num_stages, int) and self.num_stages >= 1, s + "num_stages",
            f"must be a positive int, got {self.num_stages!r}", "use 1 for no growth (the baseline)")
    require(self.block_size is None or (isinstance(self.block_size, int) and self.block_size >= 1),
            s + "block_size", f"must be a positive int or None, got {self.block_size!r}",
            "leave it None for num_layers // num_stages")
    require(isinstance(self.alpha, (int, float)) and -float("inf") < self.alpha < float("inf"), s + "alpha",
            f"must be a finite number, got {self.alpha!r}", "1.0 is Prop-1, 2.0 Prop-2, 0.0 Equal")
    if self.stage_steps is not None:
      steps = tuple(self.stage_steps)  # gin hands over lists
      object.__setattr__(self, "stage_steps", steps)
      require(len(steps) == self.num_stages, s + "stage_steps",
              f"{len(steps)} entries for num_stages={self.num_stages}", "list one step count per stage")
      require(all(isinstance(t, int) and t >= 1 for t in steps), s + "stage_steps",
              f"every stage needs a whole number of steps >= 1, got {steps}",
              "give each stage at least one step, or drop the stage")
    require(self.new_moments in GROWTH_MOMENTS, s + "new_moments",
            f"unknown choice {self.new_moments!r}", f"use one of {GROWTH_MOMENTS}")
    require(self.zeroed_moments in ZEROED_MOMENTS, s + "zeroed_moments",
            f"unknown choice {self.zeroed_moments!r}", f"use one of {ZEROED_MOMENTS}")
    require(not (self.zeroed_moments == "copy" and self.new_moments == "zero"), s + "zeroed_moments",
            "'copy' keeps the source's moments, but new_moments='zero' already zeroed them",
            "set new_moments='copy', or zeroed_moments='zero'")
    require(self.lr_schedule in LR_SCHEDULES, s + "lr_schedule",
            f"unknown choice {self.lr_schedule!r}", f"use one of {LR_SCHEDULES}")
    require(isinstance(self.rewarm_steps, int) and self.rewarm_steps >= 0, s + "rewarm_steps",
            f"must be an int >= 0, got {self.rewarm_steps!r}", "0 reuses OptimizerConfig.warmup_steps")
    require(isinstance(self.operator, str) and bool(self.operator), s + "operator",
            f"must be an operator name, got {self.operator!r}", "use 'midas' or 'gradstack'")
    require(isinstance(self.start_blocks, int) and self.start_blocks >= 1, s + "start_blocks",
            f"must be a positive int, got {self.start_blocks!r}",
            "use 1 to grow from one block, or the starting model's depth / block_size")
    if self.stage_mixtures is not None:
      mixes = tuple(tuple(m) for m in self.stage_mixtures)  # gin hands over lists
      object.__setattr__(self, "stage_mixtures", mixes)
      require(len(mixes) == self.num_stages, s + "stage_mixtures",
              f"{len(mixes)} weight tuples for num_stages={self.num_stages}", "list one weight tuple per stage")
      require(all(len(m) == len(mixes[0]) for m in mixes), s + "stage_mixtures",
              f"stages list different numbers of weights: {mixes}", "give every stage one weight per source")
      require(all(isinstance(w, (int, float)) and 0 <= w < float("inf") for m in mixes for w in m)
              and all(sum(m) > 0 for m in mixes), s + "stage_mixtures",
              f"weights must be finite and >= 0 with a positive sum per stage, got {mixes}",
              "e.g. [(1.0, 0.0), (0.7, 0.3)]: stage 1 on the first source alone, then 70/30")

    self._check_trigger()

  def _check_trigger(self):
    s = "StackingConfig."
    require(self.trigger in (None, "plateau"), s + "trigger", f"unknown choice {self.trigger!r}",
            "use None for fixed stage boundaries or 'plateau' to grow when the eval loss stops improving")
    require(isinstance(self.plateau_fraction, (int, float)) and 0 <= self.plateau_fraction < float("inf"),
            s + "plateau_fraction", f"must be a finite number >= 0, got {self.plateau_fraction!r}",
            "e.g. 0.01: grow when the loss improved by less than 1%")
    require(isinstance(self.plateau_window, int) and self.plateau_window >= 1, s + "plateau_window",
            f"must be an int >= 1, got {self.plateau_window!r}", "the evaluations the improvement is measured over")
    require(isinstance(self.min_stage_steps, int) and self.min_stage_steps >= 0, s + "min_stage_steps",
            f"must be an int >= 0, got {self.min_stage_steps!r}", "0 lets a stage end at its first plateau")
    require(self.max_stage_steps is None or (isinstance(self.max_stage_steps, int)
                                             and self.max_stage_steps >= max(self.min_stage_steps, 1)),
            s + "max_stage_steps", f"must be None or an int >= max(min_stage_steps, 1), got {self.max_stage_steps!r}",
            "leave it None for no maximum, or raise it to at least min_stage_steps")
    if self.trigger is not None:
      for name, fixed in (("stage_steps", self.stage_steps is not None), ("lr_schedule", self.lr_schedule == "rewarm"),
                          ("stage_mixtures", self.stage_mixtures is not None)):
        require(not fixed, s + name, f"needs fixed stage boundaries, which trigger={self.trigger!r} does not give",
                f"leave StackingConfig.{name} at its default, or set StackingConfig.trigger = None")

  def resolved_block_size(self, num_layers: int) -> int:
    blocks = self.num_stages + self.start_blocks - 1  # of the last stage, when each stage adds one
    return self.block_size if self.block_size is not None else num_layers // blocks

  def resolved_rewarm_steps(self, warmup_steps: int) -> int:
    return self.rewarm_steps or warmup_steps
