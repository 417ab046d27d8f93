"""The stacking study's arms and the run config of each cell (length, arm, learning rate, seed).

An arm is a name:

  baseline              full depth throughout, the length's steps
  baseline_equal_flops  full depth, as many steps as spend the stacked schedule's FLOPs at that length
                        (rounded), its learning-rate schedule over its own, shorter run
  <operator>[_zero_moments][_rewarm]
                        grown by the operator ("midas", "gradstack") on the config's stages, by
                        default with copied optimizer moments and one global learning-rate schedule;
                        `_zero_moments` zeroes the moments of the copied layers at growth
                        (StackingConfig.new_moments), `_rewarm` warms the rate up again after each
                        growth (StackingConfig.lr_schedule). E.g. midas_zero_moments, gradstack_rewarm.

A length is a number of steps. At each length every arm's schedule is built for that length: the
stacked arms' stage steps by the config's Prop-alpha of it, the warm-up cut to fit inside the first
stage, the periodic eval on a cadence that hits every stage boundary. A study of one length (no
StackingStudyConfig.steps) keeps the run config's own steps, warm-up and eval_every, as before.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from midas_jax.configs import CheckpointConfig, RunConfig, StackingConfig
from midas_jax.errors import require
from midas_jax.stacking.schedule import cumulative_flops, schedule_from_config

BASELINES = ("baseline", "baseline_equal_flops")
OPERATORS = ("midas", "gradstack")
SUFFIXES = ("_zero_moments", "_rewarm")


@dataclasses.dataclass(frozen=True)
class Arm:
  """What an arm name means: operator None for the baselines."""

  name: str
  operator: Optional[str] = None
  new_moments: str = "copy"
  lr_schedule: str = "global"

  @property
  def stacked(self) -> bool:
    return self.operator is not None


def parse_arm(name: str) -> Arm:
  """The Arm an arm name describes; ConfigError naming StackingStudyConfig.arms for anything else."""
  if name in BASELINES:
    return Arm(name)
  operator = next((op for op in OPERATORS if name == op or name.startswith(op + "_")), None)
  rest = name[len(operator):] if operator else name
  flags = []
  for suffix in SUFFIXES:  # in this order, each at most once
    if rest.startswith(suffix):
      flags.append(suffix)
      rest = rest[len(suffix):]
  require(operator is not None and rest == "", "StackingStudyConfig.arms", f"{name!r} is not an arm",
          f"use {BASELINES[0]}, {BASELINES[1]}, or an operator of {OPERATORS} with optional suffixes "
          f"{SUFFIXES} in that order (e.g. midas_zero_moments, gradstack_rewarm, midas_zero_moments_rewarm)")
  return Arm(name, operator, "zero" if "_zero_moments" in flags else "copy",
             "rewarm" if "_rewarm" in flags else "global")


def eval_every_for(run: RunConfig, steps: int, evals: int) -> int:
  """The eval cadence at a length: the largest divisor of every stage boundary and of `steps` that
  still gives at least `evals` evals (else the greatest common divisor itself, which gives more)."""
  stacked = schedule_from_config(dataclasses.replace(run.stacking, operator="midas", stage_steps=None), steps,
                                 run.model.num_layers)
  g = steps
  for b in stacked.boundaries:
    g = math.gcd(g, b)
  fits = [d for d in range(1, g + 1) if g % d == 0 and steps // d >= evals]
  return max(fits) if fits else g


def length_run(run: RunConfig, steps: Optional[int], evals: int) -> RunConfig:
  """The run config at a length: `steps` steps, Prop-alpha stages of them (explicit stage_steps dropped),
  the warm-up at most the first stage, the eval cadence of eval_every_for (and a log cadence dividing
  it). None: the run config as it is."""
  if steps is None:
    return run
  stacking = dataclasses.replace(run.stacking, stage_steps=None)
  stacked = schedule_from_config(dataclasses.replace(stacking, operator="midas"), steps, run.model.num_layers)
  warmup = min(run.optimizer.warmup_steps, stacked.stage_steps[0])
  eval_every = eval_every_for(run, steps, evals)
  # The loop evaluates at its records only (train/run.py), so records fall on every eval.
  trainer = dataclasses.replace(run.trainer, num_steps=steps, eval_every=eval_every,
                                log_every=math.gcd(run.trainer.log_every, eval_every))
  return dataclasses.replace(run, trainer=trainer, stacking=stacking,
                             optimizer=dataclasses.replace(run.optimizer, warmup_steps=warmup))


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


VALIDATION_SHARD, TEST_SHARD = (0, 2), (1, 2)  # the held-out split's two halves (DataConfig.heldout_shard)


def arm_config(run: RunConfig, arm: str, seed: int, vocab_size: int, learning_rate: Optional[float] = None,
               eval_seed: Optional[int] = None) -> RunConfig:
  """The run config of one (arm, seed) of a length's run config (length_run): checkpoints at stage
  boundaries and the end, all kept. The seed sets the initialization and the training rows; with
  eval_seed the periodic eval reads the validation half of the held-out split, drawn from eval_seed,
  the same batches for every arm and seed. learning_rate None keeps OptimizerConfig.learning_rate."""
  spec = parse_arm(arm)
  trainer = dataclasses.replace(run.trainer, seed=seed)
  stacking = StackingConfig()
  if arm == "baseline_equal_flops":
    trainer = dataclasses.replace(trainer, num_steps=equal_flops_steps(run, vocab_size))
  elif spec.stacked:
    stacking = dataclasses.replace(run.stacking, operator=spec.operator, new_moments=spec.new_moments,
                                   lr_schedule=spec.lr_schedule)
  checkpoint = CheckpointConfig(every=0, keep=run.stacking.num_stages + 1, async_save=False)
  optimizer = run.optimizer if learning_rate is None else dataclasses.replace(run.optimizer,
                                                                              learning_rate=learning_rate)
  data = dataclasses.replace(run.data, seed=seed)
  if eval_seed is not None:
    data = dataclasses.replace(data, eval_seed=eval_seed, heldout_shard=VALIDATION_SHARD)
  return dataclasses.replace(run, trainer=trainer, stacking=stacking, optimizer=optimizer, data=data,
                             checkpoint=checkpoint)


def on_test_shard(config: RunConfig, batches: int) -> RunConfig:
  """A cell's config read on the test half of the held-out split: `batches` batches of the same eval seed."""
  return dataclasses.replace(config, data=dataclasses.replace(config.data, heldout_shard=TEST_SHARD),
                             trainer=dataclasses.replace(config.trainer, eval_batches=batches))
