"""The training loop: steps, growth at stage boundaries, metrics, periodic eval, saves, the non-finite guard.

`train()` builds a TrainingRun and runs it. The run owns none of the steps' parts itself: the stage
controller (train/stages.py) has each stage's compiled step and grows the state, the prefetcher
builds the batches, the checkpointer (train/checkpointer.py) saves, the metric writer records. The
TrainState is passed from method to method; the run holds only what changes at a stage boundary
(the current stage) and the records of the steps since the last log line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax

from midas_jax import flops, fs, heartbeat, hosts, sharding
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.checkpoint.emergency import checkpointer_for
from midas_jax.configs import RunConfig
from midas_jax.console import bar_wanted, say
from midas_jax.data.factory import load_data
from midas_jax.data.prefetch import Prefetcher
from midas_jax.device_peak import peak_flops_per_device
from midas_jax.errors import NonFiniteLossError
from midas_jax.stacking.checks import schedule_for
from midas_jax.stacking.trigger import PLATEAU, GrowthTrigger
from midas_jax.train import resume, trackers
from midas_jax.train.checkpointer import Checkpointer
from midas_jax.train.goodput import Goodput
from midas_jax.train.growth_probe import GrowthProbe
from midas_jax.train.heartbeat import HeartbeatWriter
from midas_jax.train.metrics import MetricWriter, NullWriter, Progress
from midas_jax.train import attempts
from midas_jax.train.preemption import PreemptionGuard
from midas_jax.train.profiler import StepProfiler
from midas_jax.train.shared_paths import check_shared_paths
from midas_jax.train.stages import StageController
from midas_jax.train.step import per_objective_losses
from midas_jax.train.workdir import prepare_workdir
from midas_jax.train_state import TrainState


@dataclasses.dataclass
class TrainResult:
  steps: int  # the step the run ended at (less than num_steps if preempted)
  final_loss: float
  final_eval_loss: Optional[float]
  wall_seconds: float
  train_seconds: float  # wall time less evaluation: what growth and recompiles are compared against
  workdir: str
  growths: list
  start_step: int = 0  # > 0 when the run resumed from a checkpoint
  preempted: bool = False  # stopped by SIGTERM/SIGINT after saving
  save_seconds: List[float] = dataclasses.field(default_factory=list)  # time each save blocked training


def _first_non_finite(losses, first_step: int) -> Optional[int]:
  for i, loss in enumerate(losses):
    if not math.isfinite(float(loss)):
      return first_step + i
  return None


class _Window:
  """Metrics of the steps since the last log line, and the wall time of those after any compile."""

  def __init__(self, step: int):
    self.restart(step, timed=False)

  def restart(self, step: int, timed: bool = True):
    self.metrics, self.first_step = [], step  # metrics[i] is from step first_step + i (0-indexed)
    self.start_timer(step) if timed else self.stop_timer()

  def start_timer(self, step: int):
    self.start, self.timed_from, self.data_wait = time.time(), step, 0.0

  def stop_timer(self):
    self.start, self.timed_from, self.data_wait = None, None, 0.0

  @property
  def compiling(self) -> bool:
    """The next step is the stage's first: it compiles (or loads its program from the cache)."""
    return self.start is None


class TrainingRun:
  """A run from its first (or resumed) step to its last: call `run()` once, then `close()`.

  Built from the config alone: the stage schedule (every growth's provenance map included) is
  computed once here and passed down, as are the data and the final model config. growth_window > 0
  records that many steps either side of every growth, step by step (train/growth_probe.py).
  """

  def __init__(self, config: RunConfig, workdir: str, checkpointer: Optional[Checkpointer] = None,
               operative_config: str = "", devices=None, allow_config_changes: Sequence[str] = (),
               growth_window: int = 0):
    check_shared_paths(config, workdir, hosts.machine_count())
    trackers.check_installed(config.trainer)  # before anything is built or compiled
    self.workdir = prepare_workdir(workdir)
    self.config = config
    self.operative_config = operative_config
    self.primary = jax.process_index() == 0
    self.schedule = schedule_for(config)
    self.probe = GrowthProbe(self.schedule, growth_window)
    vocab_and_pipeline = load_data(config, stage_starts=self.schedule.starts)  # a mixture's weights switch there
    self._open = contextlib.ExitStack()  # what close() closes, last opened first
    try:
      self._start(checkpointer, vocab_and_pipeline, devices, allow_config_changes)
    except BaseException:
      self._open.close()
      raise

  def _start(self, checkpointer, vocab_and_pipeline, devices, allow_config_changes) -> None:
    """Opens every part of the run, and finds the step it starts from."""
    config = self.config
    self.controller = self._open.enter_context(contextlib.closing(
        StageController(config, self.schedule, vocab_and_pipeline, devices)))
    self.pipeline = vocab_and_pipeline[1]
    self.checkpointer = self._open.enter_context(contextlib.closing(
        checkpointer or checkpointer_for(self.workdir, config.checkpoint)))
    self.resolved = metadata_lib.config_to_dict(dataclasses.replace(config, model=self.controller.model_config))
    # From here the run's wall time is accounted for: the restore (or a fresh start's init) first.
    self.goodput = Goodput()
    restore_start = time.perf_counter()
    begin = resume.start(self.controller, self.checkpointer, self.resolved, allow_config_changes)
    restore_seconds = time.perf_counter() - restore_start
    self.start_step, self.start_state, self.stage = begin.step, begin.state, begin.stage
    self.trigger = self._open_trigger()
    self.controller.prepare(self.stage.index + 1)  # compiles the next stage's step while this one trains
    self._write_start_files(begin.accepted_changes)
    trainer, data = config.trainer, config.data
    self.peak = peak_flops_per_device(trainer.peak_flops_per_device, dtype=config.model.dtype) * jax.device_count()
    self.tokens_per_step = data.batch_size * data.seq_len
    self.batches = self._open.enter_context(contextlib.closing(
        Prefetcher(self.stage.build.host_batch, self.start_step, trainer.num_steps, data.prefetch)))
    # A restart redoes the steps after its checkpoint (or all of them): their records are dropped.
    with self.goodput.timing("logging"):  # a resume rebuilds the events of the records it keeps
      self.writer = self._open.enter_context(contextlib.closing(self._open_writer()))
    self.progress = self._open.enter_context(contextlib.closing(Progress(
        trainer.num_steps, initial_step=self.start_step, enabled=bar_wanted(trainer.progress_bar) and self.primary)))
    self.profiler = self._open.enter_context(contextlib.closing(
        StepProfiler(self.workdir, trainer.profile_steps, self.start_step)))
    self.goodput.add("checkpoint" if self.start_step else "compile", restore_seconds)  # a fresh start compiles its init
    self.heartbeat = self._open.enter_context(contextlib.closing(HeartbeatWriter(self.workdir, trainer.log_every)))
    self.window = _Window(self.start_step)
    self.last_loss, self.eval_loss, self.eval_seconds = float("nan"), None, 0.0

  def _open_trigger(self) -> Optional[GrowthTrigger]:
    """StackingConfig.trigger's state, continued from the save a resume starts from (its metadata holds it)."""
    stacking = self.config.stacking
    if stacking.trigger is None or self.schedule.num_stages == 1:
      return None
    trigger = GrowthTrigger(stacking, self.schedule.num_stages)
    if self.start_step:
      growths = self.controller.growths
      trigger.restore(self.checkpointer.metadata(self.start_step).get(
          "growth_trigger", {"stage_start": growths[-1]["step"] if growths else 0}))
    return trigger

  def _growth_due(self, step: int) -> Optional[str]:
    """Why the model grows just before `step` (None: it does not): the fixed schedule's boundary, or the trigger."""
    if self.trigger is None:
      return "schedule" if self.schedule.stage_at(step) > self.stage.index else None
    return self.trigger.due(step, self.stage.index)

  def _open_writer(self):
    """metrics.jsonl and the trackers of TrainerConfig.trackers, on process 0; nothing on the others."""
    trainer = self.config.trainer
    # Every process reads the save's metadata (as a restore does), though only process 0 tracks.
    saved = (self.checkpointer.metadata(self.start_step).get("trackers", {})
             if self.start_step and trackers.continue_across_restarts(trainer) else {})
    if not self.primary:
      return NullWriter()
    extra = trackers.open_trackers(trainer, self.workdir, self.resolved, saved, self.controller.growths)
    try:
      return MetricWriter(self.workdir, tensorboard="tensorboard" in trainer.trackers, resume_step=self.start_step,
                          flush_seconds=trainer.metrics_flush_seconds, trackers=extra)
    except BaseException:
      for tracker in extra:
        tracker.close()
      raise

  def _write_start_files(self, accepted_changes: Tuple[str, ...]) -> None:
    if not self.primary:
      return
    fs.write_json(fs.join(self.workdir, "config.json"), dict(self.resolved, data_mixture=self.pipeline.describe()))
    if self.operative_config:
      fs.write_text(fs.join(self.workdir, "operative_config.gin"), self.operative_config)
    if self.start_step:
      say(f"resuming from the checkpoint of step {self.start_step} (stage {self.stage.index}, depth "
          f"{self.stage.depth})" + (f"; accepted config changes: {'; '.join(accepted_changes)}"
                                    if accepted_changes else ""))

  def run(self) -> TrainResult:
    """Trains from the start step to TrainerConfig.num_steps, or until a preemption signal."""
    t_start, trainer = time.time(), self.config.trainer
    state, done, preempted = self.start_state, self.start_step, False
    self.start_state = None  # the loop owns the state now (its buffers are donated step by step)
    with PreemptionGuard() as guard:
      self.heartbeat.beat(self.start_step, self.stage.index, None)  # this attempt is alive: restored, compiling
      try:
        for step in range(self.start_step, trainer.num_steps):
          reason = self._growth_due(step)  # a boundary (or resumed just before one), or the trigger's growth
          if reason:
            state = self.grow(state, step, reason)
          state = self.step(state, step)
          done = step + 1
          preempted = guard.stop_after(done)  # every step, on every process the same answer
          if self._record_due(done, preempted):
            self.log_and_save(state, done, preempted)
          if preempted:
            say(f"stopped at step {done} after saving; run the same command to resume")
            break
      except Exception as e:
        attempts.failed_at(e, done)  # for the rule that a failure repeated at one step is not restarted
        self.heartbeat.end(done, heartbeat.failed(e))
        raise
    if not preempted:
      self._save(state, trainer.num_steps, force=True)  # a no-op unless the loop had no step left to run
      self._write_stages(trainer.num_steps)
    self.heartbeat.end(done, heartbeat.PREEMPTED if preempted else heartbeat.FINISHED)
    wall = time.time() - t_start
    return TrainResult(steps=done, final_loss=self.last_loss, final_eval_loss=self.eval_loss,
                       wall_seconds=wall, train_seconds=wall - self.eval_seconds, workdir=self.workdir,
                       growths=list(self.controller.growths), start_step=self.start_step, preempted=preempted,
                       save_seconds=list(self.checkpointer.save_seconds))

  def grow(self, state: TrainState, step: int, reason: str = "schedule") -> TrainState:
    """At a stage boundary: logs the steps before it, grows the state into the next stage, saves it."""
    if self.window.metrics:
      self._log(step, self._checked_window())
    with self.goodput.timing("growth"):
      state, self.stage = self.controller.grow(state, self.stage, step)
      self.controller.prepare(self.stage.index + 1)
    growth = self.controller.growths[-1]
    record = {"stage": self.stage.index, "depth": self.stage.depth, "growth_seconds": growth["seconds"]}
    if self.trigger is not None:  # the growths taken go into the records and every later save's metadata
      self.trigger.grown(step)
      growth["reason"] = reason  # records hold numbers: 1 grew on a plateau, 0 at max_stage_steps
      record["plateau"] = int(reason == PLATEAU)
    self._record(step, "stage", record)
    with self.goodput.timing("logging"):
      self.writer.mark_growth(step, self.stage.index, self.stage.depth, growth["provenance"])
    if self._save(state, step, force=True):
      self._store_records()
    self._write_stages(step)
    self.window.restart(step, timed=False)
    return state

  def step(self, state: TrainState, step: int) -> TrainState:
    """One train step; its metrics join the window (read on the host only when the window is logged)."""
    compiling = self.window.compiling
    build = self.stage.build
    with build.context():
      with self.goodput.timing("data"):
        wait_start = time.time()
        host = self.batches.get(step)
        self.window.data_wait += time.time() - wait_start
      snapshot = self.probe.before(state.params, build.layout.logical.params, step)
      with self.goodput.timing("compile") if compiling else contextlib.nullcontext():
        state, metrics = self.stage.train_step(state, sharding.shard_batch(host, build.mesh))
        if compiling:
          jax.block_until_ready(metrics["loss"])
      if snapshot is not None:
        self._record(step + 1, "growth", self.probe.after(snapshot, state.params, metrics, step))
    self.window.metrics.append(metrics)
    if compiling:  # time the window from the end of the compiled step
      self.window.start_timer(step + 1)
    self.profiler.after_step(step + 1, block_on=metrics["loss"])
    return state

  def _record_due(self, done: int, preempted: bool) -> bool:
    trainer = self.config.trainer
    return (done % trainer.log_every == 0 or done == trainer.num_steps or preempted
            or self.checkpointer.due(done))

  def log_and_save(self, state: TrainState, done: int, preempted: bool) -> None:
    """Checks the window's losses, evaluates if due, saves if due, then writes the window's record."""
    trainer = self.config.trainer
    last_step = done == trainer.num_steps
    checked = self._checked_window()  # before anything of this state is saved
    if trainer.eval_every and (done % trainer.eval_every == 0 or last_step):
      self._evaluate(state, done)
    # At a boundary the grown state is saved instead, by the next step's growth.
    saved = False
    boundary = (done in self.schedule.boundaries if self.trigger is None
                else self.trigger.due(done, self.stage.index) is not None)
    if preempted or last_step or not boundary:
      saved = self._save(state, done, force=preempted or last_step)
    if preempted or last_step:
      with self.goodput.timing("checkpoint"):
        self.checkpointer.wait()  # the last save lands before the last line, which counts the wait
    self._log(done, checked)
    if saved:
      self._store_records()
    self.window.restart(done)

  def _evaluate(self, state: TrainState, done: int) -> None:
    eval_start = time.time()
    with self.goodput.timing("eval"), self.stage.build.context():
      metrics = self.stage.build.evaluate(self.stage.eval_step, state.params)
      for name, source in getattr(self.pipeline, "sources", {}).items():  # a mixture: each source on its own batches
        only = dataclasses.replace(self.stage.build, pipeline=source)
        metrics[f"loss/{name}"] = only.evaluate(self.stage.eval_step, state.params)["loss"]
    self.eval_loss = metrics["loss"]
    if self.trigger is not None:  # process 0's decision on every process, though eval losses are global already
      decision = self.trigger.observe(done, self.eval_loss, self.stage.index)
      self.trigger.pending = hosts.exchange(f"growth_trigger/{done}", decision)[0]
    self._record(done, "eval", dict(metrics, stage=self.stage.index, depth=self.stage.depth,
                                    cumulative_flops=self.controller.cumulative_flops(done)))
    self.eval_seconds += time.time() - eval_start

  def _checked_window(self) -> Tuple[List[dict], Dict[str, float]]:
    """The window's metrics on the host, after checking that every step's loss was finite, and its
    throughput (timed here, before this step's evaluation or save)."""
    window = self.window
    fetched = jax.device_get(window.metrics)
    bad = _first_non_finite([m["loss"] for m in fetched], window.first_step + 1)
    if bad is not None:
      raise NonFiniteLossError(
          f"the loss became non-finite at step {bad}; training stopped before that state could be "
          "saved. Lower OptimizerConfig.learning_rate, set OptimizerConfig.grad_clip_norm, or "
          "check the data.")
    speed = {}
    if window.start is not None and window.first_step + len(fetched) > window.timed_from:
      elapsed = time.time() - window.start
      step_time = elapsed / (window.first_step + len(fetched) - window.timed_from)
      step_flops = flops.train_flops_per_token(self.controller.model_config, self.config.data.seq_len,
                                               num_layers=self.stage.depth) * self.tokens_per_step
      speed = dict(tokens_per_second=self.tokens_per_step / step_time, step_seconds=step_time,
                   mfu=step_flops / step_time / self.peak, data_wait_fraction=window.data_wait / elapsed)
    return fetched, speed

  def _log(self, done: int, checked: Tuple[List[dict], Dict[str, float]]) -> None:
    """Writes the window's train record: the last step's metrics and the window's time breakdown."""
    fetched, speed = checked
    last = fetched[-1]
    self.last_loss = float(last["loss"])
    scalars = {"loss": self.last_loss, "grad_norm": float(last["grad_norm"]),
               "learning_rate": float(last["learning_rate"]), "stage": self.stage.index, "depth": self.stage.depth,
               "cumulative_flops": self.controller.cumulative_flops(done), **self.pipeline.progress(done)}
    scalars.update(per_objective_losses(last["objective_loss_sum"], last["objective_weight_sum"]))
    if last["z_loss"]:
      scalars["z_loss"] = float(last["z_loss"])
    scalars.update(speed)
    scalars.update(self.goodput.take())
    self._record(done, "train", scalars)
    self.heartbeat.beat(done, self.stage.index, self.last_loss, speed.get("step_seconds"))
    self.progress.update(done, {"loss": f"{self.last_loss:.3f}", "depth": self.stage.depth})

  def _record(self, step: int, split: str, scalars: dict) -> None:
    with self.goodput.timing("logging"):
      self.writer.write(step, split, scalars)

  def _store_records(self) -> None:
    """After a save: the records up to it are stored now (bounded wait), not at the next flush interval. A
    resume from that save keeps the records up to it and redoes the rest, so a SIGKILL after it loses none."""
    with self.goodput.timing("logging"):
      self.writer.flush()

  def _save(self, state: TrainState, step: int, force: bool = False) -> bool:
    with self.goodput.timing("checkpoint"):
      return self.checkpointer.save(state, step, force=force, metadata=self._checkpoint_metadata(step))

  def _checkpoint_metadata(self, step: int) -> dict:
    stage, data = self.stage, self.config.data
    return {"step": step, "stage": stage.index, "depth": stage.depth, "block_size": self.schedule.block_size,
            "operator": self.config.stacking.operator,
            "lineage": [r.to_dict() for r in self.schedule.lineage(stage.index)],
            "growths": self.controller.growths, "config": self.resolved, "operative_config": self.operative_config,
            "data": {"seed": data.seed, "step": step, "mixture": self.pipeline.describe()},
            "versions": metadata_lib.package_versions(), "format": metadata_lib.FORMAT_VERSION,
            "trackers": self.writer.tracker_state(),
            **({"growth_trigger": self.trigger.to_dict()} if self.trigger is not None else {})}

  def _write_stages(self, step: int) -> None:
    if self.primary:
      fs.write_json(fs.join(self.workdir, "stages.json"), self.controller.describe(step))

  def close(self) -> None:
    """Stops the trace and the threads, flushes the records and waits for the last save."""
    self._open.close()


def train(config: RunConfig, workdir: str, checkpointer: Optional[Checkpointer] = None,
          operative_config: str = "", devices=None, allow_config_changes: Sequence[str] = (),
          growth_window: int = 0) -> TrainResult:
  """Trains a run, or resumes it from the workdir's latest good checkpoint, growing at stage boundaries.

  workdir: a local directory or a gs:// URL; every output goes there through midas_jax.fs.
  checkpointer: None saves orbax checkpoints under <workdir>/checkpoints (config.checkpoint says
  when); pass train.checkpointer.NoCheckpointer() to save nothing. allow_config_changes: settings
  that may differ from the checkpoint's config on resume (checkpoint/metadata.py check_resumable).
  growth_window: steps recorded one by one either side of every growth (train/growth_probe.py).
  """
  run = TrainingRun(config, workdir, checkpointer, operative_config, devices, allow_config_changes, growth_window)
  try:
    return run.run()
  finally:
    run.close()
