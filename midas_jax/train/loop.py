"""The training loop: steps, metrics, periodic eval, the non-finite guard, and the checkpoint seam."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import List, Optional, Protocol, Sequence

import jax
import numpy as np

from midas_jax import flops, fs, sharding
from midas_jax.device_peak import peak_flops_per_device
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.checkpoint.manager import OrbaxCheckpointer
from midas_jax.configs import RunConfig
from midas_jax.data.prefetch import Prefetcher
from midas_jax.errors import ConfigError, NonFiniteLossError
from midas_jax.stacking.controller import StageController
from midas_jax.train.experiment import Experiment
from midas_jax.train import resume
from midas_jax.console import bar_wanted, say
from midas_jax.train.goodput import Goodput
from midas_jax.train.metrics import MetricWriter, NullWriter, Progress
from midas_jax.train.preemption import PreemptionGuard
from midas_jax.train.profiler import StepProfiler
from midas_jax.train.state import TrainState
from midas_jax.train.step import per_objective_losses


class Checkpointer(Protocol):
  """The seam a checkpoint manager plugs into (checkpoint/manager.py has the orbax one).

  It only ever sees states whose loss was finite. `save` decides itself whether a non-forced step
  is due; the loop makes sure it has checked the losses of every step it hands over.
  """

  def steps(self) -> List[int]: ...  # committed saves, newest first

  def metadata(self, step: int) -> dict: ...

  def restore(self, experiment: Experiment, step: int) -> TrainState: ...

  def quarantine(self, step: int, reason: str) -> None: ...

  def due(self, step: int) -> bool: ...

  def save(self, state: TrainState, step: int, force: bool = False, metadata: Optional[dict] = None) -> bool: ...

  def wait(self) -> None: ...  # until every started save is committed

  def close(self) -> None: ...


class NoCheckpointer:
  """Saves nothing: benchmarks and tests that do not need checkpoints."""

  save_seconds: List[float] = []

  def steps(self):
    return []

  def metadata(self, step):
    raise AssertionError("NoCheckpointer has no metadata")

  def restore(self, experiment, step):
    raise AssertionError("NoCheckpointer has nothing to restore")

  def quarantine(self, step, reason):
    raise AssertionError("NoCheckpointer has nothing to quarantine")

  def due(self, step):
    return False

  def save(self, state, step, force=False, metadata=None):
    return False

  def wait(self):
    pass

  def close(self):
    pass


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


def prepare_workdir(workdir: str) -> str:
  """Creates the workdir and checks it is writable, before any data is read or anything compiled.

  A local path is made absolute; a URL (gs://...) is kept as it is, checked by writing a probe.
  """
  if not workdir:
    raise ConfigError("--workdir", "no workdir given", "pass --workdir=DIR or gs://BUCKET/DIR (created if missing)")
  workdir = fs.absolute(workdir, "--workdir")
  try:
    fs.makedirs(workdir)
    # one probe per process: hosts may share a workdir
    probe = fs.join(workdir, f".write_test.{jax.process_index()}.{os.getpid()}")
    fs.write_text(probe, "ok")
    fs.remove(probe)
  except Exception as e:  # pylint: disable=broad-except  # gcsfs and google-auth raise their own types
    reason = getattr(e, "strerror", None) or f"{type(e).__name__}: {e}"
    raise ConfigError("--workdir", f"cannot write to {workdir} ({reason})",
                      "choose a directory (or a bucket and credentials) you can write to") from None
  return workdir


def evaluate(experiment: Experiment, eval_step, params) -> dict:
  """Loss on the first `eval_batches` batches of the held-out split (the same batches every time)."""
  totals = None
  for i in range(experiment.config.trainer.eval_batches):
    aux = jax.device_get(eval_step(params, experiment.device_batch(i, "validation")))
    totals = aux if totals is None else jax.tree.map(np.add, totals, aux)
  out = {"loss": float(totals["objective_loss_sum"].sum() / max(totals["tokens"], 1e-9))}
  out.update(per_objective_losses(totals["objective_loss_sum"], totals["objective_weight_sum"]))
  return out


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


def _checkpoint_metadata(controller: StageController, stage, step: int, resolved: dict,
                         operative_config: str) -> dict:
  data = controller.config.data
  return {"step": step, "stage": stage.index, "depth": stage.depth, "block_size": controller.block_size,
          "operator": controller.config.stacking.operator,
          "lineage": [r.to_dict() for r in controller.lineage(stage.index)], "growths": controller.growths,
          "config": resolved, "operative_config": operative_config,
          "data": {"seed": data.seed, "step": step, "mixture": controller.data[1].describe()},
          "versions": metadata_lib.package_versions(), "format": metadata_lib.FORMAT_VERSION}


def train(config: RunConfig, workdir: str, checkpointer: Optional[Checkpointer] = None,
          operative_config: str = "", devices=None, allow_config_changes: Sequence[str] = ()) -> TrainResult:
  """Trains a run, or resumes it from the workdir's latest good checkpoint, growing at stage boundaries.

  workdir: a local directory or a gs:// URL; every output goes there through midas_jax.fs.
  checkpointer: None saves orbax checkpoints under <workdir>/checkpoints (config.checkpoint says
  when); pass NoCheckpointer() to save nothing. allow_config_changes: settings that may differ from
  the checkpoint's config on resume (metadata.check_resumable).
  """
  workdir = prepare_workdir(workdir)
  primary = jax.process_index() == 0
  controller = StageController(config, devices)
  trainer, data = config.trainer, config.data
  if checkpointer is None:
    checkpointer = OrbaxCheckpointer(workdir, config.checkpoint)
  vocab, pipeline = controller.data
  resolved = metadata_lib.config_to_dict(dataclasses.replace(config, model=controller.model_config))
  restore_start = time.perf_counter()
  begin = resume.start(controller, checkpointer, resolved, allow_config_changes)
  restore_seconds = time.perf_counter() - restore_start
  start_step, state, stage = begin.step, begin.state, begin.stage
  controller.prepare(stage.index + 1)  # compiles the next stage's step while this one trains
  if primary:
    fs.write_json(fs.join(workdir, "config.json"), dict(resolved, data_mixture=pipeline.describe()))
    if operative_config:
      fs.write_text(fs.join(workdir, "operative_config.gin"), operative_config)
    if start_step:
      say(f"resuming from the checkpoint of step {start_step} (stage {stage.index}, depth {stage.depth})"
          + (f"; accepted config changes: {'; '.join(begin.accepted_changes)}" if begin.accepted_changes else ""))
  peak = peak_flops_per_device(trainer.peak_flops_per_device, dtype=config.model.dtype) * jax.device_count()
  tokens_per_step = data.batch_size * data.seq_len

  def flops_per_step(depth):
    return flops.train_flops_per_token(controller.model_config, data.seq_len, num_layers=depth) * tokens_per_step

  def write_stages(step):
    if primary:
      fs.write_json(fs.join(workdir, "stages.json"), controller.describe(step))

  def save(step, force=False):
    with goodput.timing("checkpoint"):
      return checkpointer.save(state, step, force=force,
                               metadata=_checkpoint_metadata(controller, stage, step, resolved, operative_config))

  def record(step, split, scalars):
    with goodput.timing("logging"):
      writer.write(step, split, scalars)

  batches = Prefetcher(stage.experiment.host_batch, start_step, trainer.num_steps, data.prefetch)
  # A restart redoes the steps after its checkpoint (or all of them): their records are dropped.
  writer = MetricWriter(workdir, resume_step=start_step) if primary else NullWriter()
  progress = Progress(trainer.num_steps, initial_step=start_step, enabled=bar_wanted(trainer.progress_bar) and primary)
  profiler = StepProfiler(workdir, trainer.profile_steps, start_step)
  goodput = Goodput()
  goodput.add("checkpoint" if start_step else "compile", restore_seconds)  # a fresh start compiles its init
  t_start, eval_seconds = time.time(), 0.0
  last_loss, eval_loss, preempted, done = float("nan"), None, False, start_step
  window = _Window(start_step)

  def checked_window():
    """The window's metrics on the host, after checking that every step's loss was finite, and its
    throughput (timed here, before this step's evaluation or save)."""
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
      speed = dict(tokens_per_second=tokens_per_step / step_time, step_seconds=step_time,
                   mfu=flops_per_step(stage.depth) / step_time / peak, data_wait_fraction=window.data_wait / elapsed)
    return fetched, speed

  def log(done: int, checked) -> None:
    """Writes the window's train record: the last step's metrics and the window's time breakdown."""
    nonlocal last_loss
    fetched, speed = checked
    last = fetched[-1]
    last_loss = float(last["loss"])
    scalars = {"loss": last_loss, "grad_norm": float(last["grad_norm"]),
               "learning_rate": float(last["learning_rate"]), "stage": stage.index, "depth": stage.depth,
               "cumulative_flops": controller.cumulative_flops(done), "epoch": pipeline.epoch(done)}
    scalars.update(per_objective_losses(last["objective_loss_sum"], last["objective_weight_sum"]))
    if last["z_loss"]:
      scalars["z_loss"] = float(last["z_loss"])
    scalars.update(speed)
    scalars.update(goodput.take())
    record(done, "train", scalars)
    progress.update(done, {"loss": f"{last_loss:.3f}", "depth": stage.depth})

  try:
    with PreemptionGuard() as guard:
      for step in range(start_step, trainer.num_steps):
        if controller.schedule.stage_at(step) > stage.index:  # a boundary (or resumed just before one)
          if window.metrics:
            log(step, checked_window())
          with goodput.timing("growth"):
            state, stage = controller.grow(state, stage, step)
            controller.prepare(stage.index + 1)
          growth = controller.growths[-1]
          record(step, "stage", {"stage": stage.index, "depth": stage.depth, "growth_seconds": growth["seconds"]})
          save(step, force=True)
          write_stages(step)
          window.restart(step, timed=False)
        compiling = window.start is None  # the stage's first step compiles (or loads it from the cache)
        with stage.experiment.context():
          with goodput.timing("data"):
            wait_start = time.time()
            host = batches.get(step)
            window.data_wait += time.time() - wait_start
          with goodput.timing("compile") if compiling else contextlib.nullcontext():
            state, metrics = stage.train_step(state, sharding.shard_batch(host, stage.experiment.mesh))
            if compiling:
              jax.block_until_ready(metrics["loss"])
        window.metrics.append(metrics)
        done = step + 1
        if compiling:  # time the window from the end of the compiled step
          window.start_timer(done)
        profiler.after_step(done, block_on=metrics["loss"])
        preempted = guard.stop_after(done)  # every step, on every process the same answer
        last_step = done == trainer.num_steps
        log_step = done % trainer.log_every == 0 or last_step
        if not (log_step or preempted or checkpointer.due(done)):
          continue
        checked = checked_window()  # before anything of this state is saved
        if trainer.eval_every and (done % trainer.eval_every == 0 or last_step):
          eval_start = time.time()
          with goodput.timing("eval"), stage.experiment.context():
            eval_metrics = evaluate(stage.experiment, stage.eval_step, state.params)
          eval_loss = eval_metrics["loss"]
          record(done, "eval", dict(eval_metrics, stage=stage.index, depth=stage.depth,
                                    cumulative_flops=controller.cumulative_flops(done)))
          eval_seconds += time.time() - eval_start
        # At a boundary the grown state is saved instead, at the start of the next iteration.
        if preempted or last_step or done not in controller.schedule.boundaries:
          save(done, force=preempted or last_step)
        if preempted or last_step:
          with goodput.timing("checkpoint"):
            checkpointer.wait()  # the last save lands before the last line, which counts the wait
        log(done, checked)
        window.restart(done)
        if preempted:
          say(f"stopped at step {done} after saving; run the same command to resume")
          break
    if not preempted:
      save(trainer.num_steps, force=True)  # a no-op unless the loop had no step left to run
      write_stages(trainer.num_steps)
  finally:
    profiler.close()
    controller.close()
    batches.close()
    progress.close()
    writer.close()
    checkpointer.close()
  wall = time.time() - t_start
  return TrainResult(steps=done, final_loss=last_loss, final_eval_loss=eval_loss,
                     wall_seconds=wall, train_seconds=wall - eval_seconds, workdir=workdir,
                     growths=list(controller.growths), start_step=start_step, preempted=preempted,
                     save_seconds=list(checkpointer.save_seconds))
