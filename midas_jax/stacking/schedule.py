"""When depth grows, and what that saves.

Stage i (1-indexed) of k runs T_i steps at depth d_i. Steps are 0-indexed like the train loop's:
stage i covers steps [starts[i-1], starts[i-1] + T_i), and growth into stage i happens just before
step starts[i-1] (the `boundaries`). Prop-alpha (MIDAS paper, 1b) sets T_i proportional to i^alpha.
A schedule built from a StackingConfig also holds the operator's provenance map of every growth, so
a run computes them once, with the schedule (stacking/checks.py's `schedule_for` does, for a run).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from midas_jax import flops
from midas_jax.configs import ModelConfig, StackingConfig
from midas_jax.errors import require
from midas_jax.stacking import operators


def prop_alpha_steps(num_steps: int, num_stages: int, alpha: float = 1.0, start_blocks: int = 1) -> Tuple[int, ...]:
  """Integer T_i proportional to n_i^alpha, summing exactly to num_steps, each >= 1, where stage i has
  n_i = start_blocks + i - 1 blocks (i itself when growth starts from one block).

  Largest-remainder rounding, ties to the later stage; for alpha >= 0 the result is nondecreasing.
  """
  require(isinstance(num_stages, int) and num_stages >= 1, "StackingConfig.num_stages",
          f"must be a positive int, got {num_stages!r}", "use 1 for no growth")
  require(isinstance(num_steps, int) and num_steps >= num_stages, "StackingConfig.num_stages",
          f"{num_stages} stages cannot each get a step out of num_steps={num_steps}",
          "train for at least as many steps as there are stages, or use fewer stages")
  require(math.isfinite(alpha), "StackingConfig.alpha", f"must be finite, got {alpha}", "1.0 is Prop-1")
  weights = [i ** alpha for i in range(start_blocks, start_blocks + num_stages)]
  total = sum(weights)
  ideal = [num_steps * w / total for w in weights]
  steps = [int(math.floor(x)) for x in ideal]
  # Hand the leftover steps to the largest fractional parts; the later stage wins a tie.
  order = sorted(range(num_stages), key=lambda i: (ideal[i] - steps[i], i), reverse=True)
  for i in order[:num_steps - sum(steps)]:
    steps[i] += 1
  # A stage rounded to 0 takes a step from the stage furthest above its ideal share (the earlier on
  # a tie, which keeps the order nondecreasing).
  for i in range(num_stages):
    if steps[i] == 0:
      donor = max((j for j in range(num_stages) if steps[j] > 1), key=lambda j: (steps[j] - ideal[j], -j))
      steps[donor] -= 1
      steps[i] = 1
  return tuple(steps)


def stage_starts(stage_steps: Sequence[int]) -> Tuple[int, ...]:
  """The first step of every stage: (0, T_1, T_1 + T_2, ...)."""
  starts, at = [], 0
  for t in stage_steps:
    starts.append(at)
    at += t
  return tuple(starts)


def stage_at(step: int, starts: Sequence[int]) -> int:
  """The 1-indexed stage that runs `step`; steps past the end stay in the last stage."""
  require(step >= 0, "step", f"must be >= 0, got {step}", "steps count from 0")
  return bisect.bisect_right(starts, step)


@dataclasses.dataclass(frozen=True)
class StageSchedule:
  """Steps and depth of every stage. depths defaults to i * block_size (stage i has i blocks).

  provenances[i]: the provenance map (operators.py) that grows stage i + 1 into stage i + 2, one
  per boundary; empty for a schedule described without its operator (speedup arithmetic).
  """

  stage_steps: Tuple[int, ...]
  block_size: int
  depths: Optional[Tuple[int, ...]] = None
  provenances: Tuple[Tuple[int, ...], ...] = ()
  starts: Tuple[int, ...] = dataclasses.field(init=False)
  num_stages: int = dataclasses.field(init=False)

  def __post_init__(self):
    steps = tuple(int(t) for t in self.stage_steps)
    require(len(steps) > 0 and all(t >= 1 for t in steps), "StackingConfig.stage_steps",
            f"every stage needs at least one step, got {steps}", "give each stage >= 1 step")
    depths = (tuple(i * self.block_size for i in range(1, len(steps) + 1)) if self.depths is None
              else tuple(int(d) for d in self.depths))
    require(len(depths) == len(steps) and all(d >= 1 for d in depths), "StageSchedule.depths",
            f"need one positive depth per stage, got {depths} for {len(steps)} stages",
            "list one depth per stage, or leave depths None for i * block_size")
    provenances = tuple(tuple(int(p) for p in m) for m in self.provenances)
    require(not provenances or [len(m) for m in provenances] == list(depths[1:]), "StageSchedule.provenances",
            f"need one map per growth, of the next stage's depth; got lengths {[len(m) for m in provenances]} "
            f"for depths {depths}", "pass the operator's maps (operators.growth_maps), or none")
    object.__setattr__(self, "stage_steps", steps)
    object.__setattr__(self, "depths", depths)
    object.__setattr__(self, "provenances", provenances)
    object.__setattr__(self, "starts", stage_starts(steps))
    object.__setattr__(self, "num_stages", len(steps))

  @property
  def num_steps(self) -> int:
    return sum(self.stage_steps)

  @property
  def boundaries(self) -> Tuple[int, ...]:
    """The steps before which the model grows (the starts of stages 2..k)."""
    return self.starts[1:]

  def stage_at(self, step: int) -> int:
    return stage_at(step, self.starts)

  def depth_at(self, step: int) -> int:
    return self.depths[self.stage_at(step) - 1]

  def provenance_into(self, stage: int) -> np.ndarray:
    """The provenance map of the growth into `stage` (2..num_stages)."""
    require(len(self.provenances) == self.num_stages - 1 and 2 <= stage <= self.num_stages, "stage",
            f"no growth into stage {stage} is known ({self.num_stages} stages, {len(self.provenances)} maps)",
            "build the schedule with schedule_from_config, which records every growth's map")
    return np.asarray(self.provenances[stage - 2], np.int64)

  def lineage(self, stage: int) -> List[operators.LayerRecord]:
    """The birth record of every layer of `stage`, replayed from stage 1."""
    records = operators.initial_lineage(self.depths[0])
    for s in range(2, stage + 1):
      records = operators.compose_lineage(records, self.provenance_into(s), s)
    return records

  def to_dict(self) -> dict:
    return {"stage_steps": list(self.stage_steps), "starts": list(self.starts),
            "block_size": self.block_size, "num_stages": self.num_stages, "depths": list(self.depths),
            "provenances": [list(m) for m in self.provenances]}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict) -> "StageSchedule":
    return cls(tuple(d["stage_steps"]), d["block_size"], tuple(d["depths"]),
               tuple(tuple(m) for m in d.get("provenances", ())))


def schedule_from_config(stacking: StackingConfig, num_steps: int, num_layers: int) -> StageSchedule:
  """The schedule a StackingConfig asks for (explicit stage_steps, else Prop-alpha)."""
  k = stacking.num_stages
  if k == 1:
    return StageSchedule((num_steps,), num_layers, (num_layers,))
  b = stacking.resolved_block_size(num_layers)
  if stacking.trigger is not None:  # the earliest boundaries; the trigger decides the actual ones in the loop
    first = max(stacking.min_stage_steps, 1)
    require(first * (k - 1) < num_steps, "StackingConfig.min_stage_steps",
            f"{k - 1} stages of at least {first} steps leave no step of TrainerConfig.num_steps={num_steps} "
            "for the last", "lower min_stage_steps or num_stages, or train for more steps")
    steps = (first,) * (k - 1) + (num_steps - first * (k - 1),)
  else:
    steps = stacking.stage_steps or prop_alpha_steps(num_steps, k, stacking.alpha, stacking.start_blocks)
  require(sum(steps) == num_steps, "StackingConfig.stage_steps",
          f"stage_steps {tuple(steps)} sum to {sum(steps)}, not TrainerConfig.num_steps={num_steps}",
          "make the stage steps add up to num_steps, or leave stage_steps None for Prop-alpha")
  # Simulated, not k * b: an operator such as gstack need not add one block per stage.
  maps = operators.growth_maps(stacking.operator, k, b, stacking.start_blocks)
  depths = (stacking.start_blocks * b,) + tuple(len(m) for m in maps)
  require(depths[-1] == num_layers, "StackingConfig.num_stages",
          f"{k} stages of {stacking.operator!r} growth from {stacking.start_blocks} block(s) of {b} layers end "
          f"at depth {depths[-1]} (stage depths {depths}), not ModelConfig.num_layers={num_layers}",
          f"for one block per stage make (num_stages + start_blocks - 1) * block_size = num_layers "
          f"(e.g. num_stages={num_layers // b - stacking.start_blocks + 1})")
  return StageSchedule(tuple(steps), b, depths, tuple(tuple(m.tolist()) for m in maps))


def layer_only_speedup(num_stages: int, alpha: float) -> float:
  """Baseline over stacked layer-steps under Prop-alpha with i blocks in stage i (real-valued T_i):
  k * sum(i^alpha) / sum(i^(alpha + 1)). Ignores embedding, head and everything not per layer."""
  i = range(1, num_stages + 1)
  return num_stages * sum(j ** alpha for j in i) / sum(j ** (alpha + 1) for j in i)


def layer_only_speedup_of(schedule: StageSchedule) -> float:
  """The same ratio for an explicit (integer) schedule: T * final depth / sum(T_i * d_i)."""
  stacked = sum(t * d for t, d in zip(schedule.stage_steps, schedule.depths))
  return schedule.num_steps * schedule.depths[-1] / stacked


def _stage_flops_per_token(model_cfg: ModelConfig, seq_len: int, schedule: StageSchedule):
  require(schedule.depths[-1] == model_cfg.num_layers, "ModelConfig.num_layers",
          f"the schedule ends at depth {schedule.depths[-1]}, the model has {model_cfg.num_layers} layers",
          "build the schedule for this model (schedule_from_config)")
  return [flops.train_flops_per_token(model_cfg, seq_len, d) for d in schedule.depths]


def flop_speedup(model_cfg: ModelConfig, seq_len: int, schedule: StageSchedule) -> float:
  """Training FLOPs of the full-depth baseline over the stacked run, same steps and tokens.

  Lower than the layer-only figure: the LM head costs the same at every depth.
  """
  per_stage = _stage_flops_per_token(model_cfg, seq_len, schedule)
  stacked = sum(t * f for t, f in zip(schedule.stage_steps, per_stage))
  return schedule.num_steps * per_stage[-1] / stacked


def cumulative_flops(model_cfg: ModelConfig, seq_len: int, tokens_per_step: int,
                     schedule: StageSchedule, step: int) -> float:
  """Training FLOPs of steps [0, step): what a run has spent once `step` steps are done.

  cumulative_flops(..., schedule.num_steps) is the stacked total; steps past the end count at the
  final depth, so equal-compute comparisons with longer baselines still line up.
  """
  require(step >= 0, "step", f"must be >= 0, got {step}", "steps count from 0")
  per_stage = _stage_flops_per_token(model_cfg, seq_len, schedule)
  total = 0.0
  for i, (start, t, f) in enumerate(zip(schedule.starts, schedule.stage_steps, per_stage)):
    ran = max(step - start, 0)
    if i < schedule.num_stages - 1:
      ran = min(ran, t)
    total += ran * f
  return float(tokens_per_step) * total
