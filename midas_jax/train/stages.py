"""The stage controller: which model (depth) trains at each step, and growing the state between stages.

A stage is a StageBuild at that stage's depth (its own model, shardings and jitted steps); all
stages share the vocabulary and the step-addressed data pipeline. The run's StageSchedule (computed
once, with every growth's provenance map: stacking/checks.py) says when each growth happens and
what it copies; at a boundary the controller builds the deeper stage and grows the TrainState with
one jitted gather whose out_shardings are the new model's (stacking/grow.py). The layer lineage,
which layer each current layer was born as, follows from the schedule's maps, so a resumed run
recomputes it rather than storing it.

Recompiling at every boundary would stall training once per stage. Instead, as soon as a stage
starts, the next stage's train step is compiled ahead of time in a background thread (`prepare`),
from shapes alone; by the boundary it is usually ready, so growth costs the gather and little else.
On an accelerator the host is idle during steps and the compile is free; on a CPU it shares the
cores with training.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax

from midas_jax.configs import ModelConfig, RunConfig
from midas_jax.data.factory import AnyPipeline
from midas_jax.data.vocab.vocabulary import Vocabulary
from midas_jax.stacking.grow import make_grower
from midas_jax.stacking.schedule import StageSchedule, cumulative_flops, flop_speedup, layer_only_speedup_of
from midas_jax.train.build import StageBuild, build_stage
from midas_jax.train_state import TrainState


@dataclasses.dataclass
class Stage:
  """One stage's build and its jitted steps."""

  index: int  # 1-indexed
  build: StageBuild
  train_step: Callable
  eval_step: Callable

  @property
  def depth(self) -> int:
    return self.build.model_config.num_layers


class StageController:
  """Builds a run's stages on its schedule and moves a TrainState from one stage to the next.

  schedule: the run's (stacking.checks.schedule_for(config)); data: its (vocabulary, pipeline).
  """

  def __init__(self, config: RunConfig, schedule: StageSchedule, data: Tuple[Vocabulary, AnyPipeline],
               devices=None):
    self.config = config
    self.schedule = schedule
    self.data = data
    self.devices = devices
    self.model_config: ModelConfig = config.model.with_vocab(data[0].vocab_size)  # the final depth's
    self.growths: List[Dict[str, Any]] = []
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="precompile")
    self._prepared: Dict[int, concurrent.futures.Future] = {}

  @property
  def block_size(self) -> int:
    return self.schedule.block_size

  def _build(self, index: int, compile_ahead: bool) -> Stage:
    build = build_stage(self.config, self.devices, data=self.data, num_layers=self.schedule.depths[index - 1],
                        growth_steps=self.schedule.boundaries, model_config=self.model_config)
    if build.checked is not None:  # compiled already, by build_stage's check that its matmuls run
      return Stage(index, build, *build.checked)
    with build.context():
      train_step = build.jit_train_step()
      if compile_ahead:
        train_step = train_step.lower(*build.abstract_args()).compile()
      return Stage(index, build, train_step, build.jit_eval_step())

  def stage(self, index: int) -> Stage:
    """Stage `index` (1-indexed) with its steps: compiled ahead if prepared, else when first called."""
    future = self._prepared.pop(index, None)
    if future is not None:
      return future.result()
    return self._build(index, compile_ahead=False)

  def prepare(self, index: int) -> None:
    """Starts compiling stage `index`'s train step in the background (no-op past the last stage)."""
    if index <= self.schedule.num_stages and index not in self._prepared:
      self._prepared[index] = self._pool.submit(self._build, index, True)

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)

  def grow(self, state: TrainState, current: Stage, step: int) -> Tuple[TrainState, Stage]:
    """(grown state, next stage). Fresh layers (provenance -1) take the new model's initial values."""
    start = time.time()
    nxt = self.stage(current.index + 1)
    prov = self.schedule.provenance_into(nxt.index)
    grower = make_grower(current.build.layout, nxt.build.layout, prov, self.config.stacking.new_moments,
                         stacking=self.config.stacking)  # the operator's own transform (e.g. midas_zero's)
    fresh = nxt.build.init_state() if (prov < 0).any() else None
    with nxt.build.context():
      state = grower(state, fresh)
    jax.block_until_ready(state.params)
    self.growths.append({"step": step, "stage": nxt.index, "from_depth": current.depth, "to_depth": nxt.depth,
                         "provenance": prov.tolist(), "seconds": round(time.time() - start, 3)})
    return state, nxt

  def cumulative_flops(self, step: int) -> float:
    """Training FLOPs of steps [0, step): compare runs at equal compute with this."""
    data = self.config.data
    return cumulative_flops(self.model_config, data.seq_len, data.batch_size * data.seq_len, self.schedule, step)

  def describe(self, step: Optional[int] = None) -> Dict[str, Any]:
    """What `midas inspect` prints: the schedule, speedups, growths so far and each layer's birth."""
    step = self.config.trainer.num_steps if step is None else step
    if self.config.stacking.trigger is None:
      stage = self.schedule.stage_at(min(step, self.config.trainer.num_steps - 1))
    else:  # the trigger's growths, not the schedule's (its earliest) boundaries
      stage = 1 + sum(g["step"] <= step for g in self.growths)
    return {
        "step": step,
        "stage": stage,
        "num_stages": self.schedule.num_stages,
        "depth": self.schedule.depths[stage - 1],
        "block_size": self.block_size,
        "operator": self.config.stacking.operator,
        "schedule": self.schedule.to_dict(),
        "speedup": {"layer_only": layer_only_speedup_of(self.schedule),
                    "flops": flop_speedup(self.model_config, self.config.data.seq_len, self.schedule)},
        "growths": self.growths,
        "layers": [dict(r.to_dict(), layer=i) for i, r in enumerate(self.schedule.lineage(stage))],
    }
