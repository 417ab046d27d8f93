"""The training loop: steps, metrics, periodic eval, the non-finite guard, and the checkpoint seam."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Optional, Protocol

import jax
import numpy as np

from midas_jax import flops, sharding
from midas_jax.bench.peak import peak_flops_per_device
from midas_jax.configs import RunConfig
from midas_jax.data.prefetch import Prefetcher
from midas_jax.errors import ConfigError, NonFiniteLossError
from midas_jax.train.experiment import Experiment, build_experiment
from midas_jax.train.metrics import MetricWriter, Progress
from midas_jax.train.state import TrainState
from midas_jax.train.step import per_objective_losses


class Checkpointer(Protocol):
  """The seam a checkpoint manager plugs into. It only ever sees states whose loss was finite."""

  def restore(self, experiment: Experiment) -> Optional[TrainState]: ...

  def save(self, state: TrainState, step: int, force: bool = False) -> None: ...

  def close(self) -> None: ...


class NoCheckpointer:
  def restore(self, experiment):
    return None

  def save(self, state, step, force=False):
    pass

  def close(self):
    pass


@dataclasses.dataclass
class TrainResult:
  steps: int
  final_loss: float
  final_eval_loss: Optional[float]
  wall_seconds: float
  workdir: str


def prepare_workdir(workdir: str) -> str:
  """Creates the workdir and checks it is writable, before any data is read or anything compiled."""
  if not workdir:
    raise ConfigError("--workdir", "no workdir given", "pass --workdir=DIR (created if missing)")
  workdir = os.path.abspath(os.path.expanduser(workdir))
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ConfigError("--workdir", f"cannot write to {workdir} ({e.strerror})",
                      "choose a directory you can write to") from None
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


def train(config: RunConfig, workdir: str, checkpointer: Optional[Checkpointer] = None,
          operative_config: str = "") -> TrainResult:
  workdir = prepare_workdir(workdir)
  experiment = build_experiment(config)
  trainer = config.trainer
  checkpointer = checkpointer or NoCheckpointer()
  with open(os.path.join(workdir, "config.json"), "w") as f:
    resolved = dataclasses.asdict(dataclasses.replace(config, model=experiment.model_config))
    json.dump(dict(resolved, data_mixture=experiment.pipeline.describe()), f, indent=2)
  if operative_config:
    with open(os.path.join(workdir, "operative_config.gin"), "w") as f:
      f.write(operative_config)

  flops_per_step = (flops.train_flops_per_token(experiment.model_config, config.data.seq_len)
                    * config.data.batch_size * config.data.seq_len)
  peak = peak_flops_per_device(trainer.peak_flops_per_device, dtype=experiment.model_config.dtype)
  peak_total = peak * jax.device_count()
  tokens_per_step = config.data.batch_size * config.data.seq_len

  state = checkpointer.restore(experiment) or experiment.init_state()
  start_step = int(jax.device_get(state.step))
  with experiment.context():
    train_step = experiment.jit_train_step()
    eval_step = experiment.jit_eval_step()

  batches = Prefetcher(experiment.host_batch, start_step, trainer.num_steps, config.data.prefetch)
  writer = MetricWriter(workdir)
  progress = Progress(trainer.num_steps, initial_step=start_step, enabled=trainer.progress_bar)
  t_start = time.time()
  last_loss, eval_loss = float("nan"), None
  pending, window_start, window_step, data_wait = [], None, start_step, 0.0
  try:
    with experiment.context():
      for step in range(start_step, trainer.num_steps):
        wait_start = time.time()
        host = batches.get(step)
        data_wait += time.time() - wait_start
        state, metrics = train_step(state, sharding.shard_batch(host, experiment.mesh))
        pending.append(metrics)
        done = step + 1
        if window_start is None:  # the first step includes compilation: time from its end
          jax.block_until_ready(metrics["loss"])
          window_start, window_step, data_wait = time.time(), done, 0.0
        if done % trainer.log_every and done != trainer.num_steps:
          continue
        fetched = jax.device_get(pending)
        bad = _first_non_finite([m["loss"] for m in fetched], done - len(fetched) + 1)
        if bad is not None:
          raise NonFiniteLossError(
              f"the loss became non-finite at step {bad}; training stopped before that state could be "
              "saved. Lower OptimizerConfig.learning_rate, set OptimizerConfig.grad_clip_norm, or "
              "check the data.")
        now = time.time()
        last = fetched[-1]
        last_loss = float(last["loss"])
        scalars = {"loss": last_loss, "grad_norm": float(last["grad_norm"]),
                   "learning_rate": float(last["learning_rate"])}
        scalars.update(per_objective_losses(last["objective_loss_sum"], last["objective_weight_sum"]))
        if last["z_loss"]:
          scalars["z_loss"] = float(last["z_loss"])
        if done > window_step:
          step_time = (now - window_start) / (done - window_step)
          scalars["tokens_per_second"] = tokens_per_step / step_time
          scalars["mfu"] = flops_per_step / step_time / peak_total
          scalars["step_seconds"] = step_time
          scalars["data_wait_fraction"] = data_wait / (now - window_start)
        writer.write(done, "train", scalars)
        progress.update(done, {"loss": f"{last_loss:.3f}"})
        checkpointer.save(state, done)
        pending, window_start, window_step, data_wait = [], time.time(), done, 0.0
        if trainer.eval_every and (done % trainer.eval_every == 0 or done == trainer.num_steps):
          eval_metrics = evaluate(experiment, eval_step, state.params)
          eval_loss = eval_metrics["loss"]
          writer.write(done, "eval", eval_metrics)
          window_start = time.time()  # eval time is not training time
    checkpointer.save(state, trainer.num_steps, force=True)
  finally:
    batches.close()
    progress.close()
    writer.close()
    checkpointer.close()
  return TrainResult(steps=trainer.num_steps, final_loss=last_loss, final_eval_loss=eval_loss,
                     wall_seconds=time.time() - t_start, workdir=workdir)
