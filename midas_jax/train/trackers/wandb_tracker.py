"""A Weights & Biases run for a training run, from process 0 (TrainerConfig.trackers = (..., 'wandb')).

The run id is made at the run's first start and kept in two places: <workdir>/wandb_run.json (through
midas_jax.fs, so on gs:// too), written before the W&B run opens, so a run killed before its first save
still continues the same W&B run; and each checkpoint's metadata (`trackers.wandb_run_id`), which travels
with the save. A restart takes the id of the save it resumes from, else the file's, and opens the W&B run
with resume='allow': a resumed or preempted run continues the same W&B run.

What it logs: each record's scalars as `<split>/<name>` at the record's step (`train/loss`,
`eval/loss`, ...), and the resolved run config as the W&B config. Growths show three ways: the
`train/stage` and `train/depth` series step up at each boundary in every chart's x range; each growth's
own record puts `stage/stage`, `stage/depth` and `stage/growth_seconds` at its step (one point per
growth: a marker series); and the summary's `growths` lists every growth so far with its step, stage,
depth and provenance map (which old layer each new one copies). A resume redoes the steps after its
save; a W&B run resumed online knows the last step it holds (`run.step`; W&B's steps only increase),
and the records up to it are not sent again (the values it holds stand). Offline, each start writes a
run directory of its own under WANDB_DIR, all named by the one run id.

wandb hands each call to its own service process, which writes and uploads; a call that raises logs a
warning and turns this tracker off for the rest of the run, which trains on with metrics.jsonl (and
TensorBoard) complete. close() waits for wandb's finish (its upload, when online).
"""

from __future__ import annotations

import secrets
import string
from typing import Any, Callable, Dict, List, Mapping, Sequence

from midas_jax import fs
from midas_jax.configs import TrainerConfig
from midas_jax.console import say

RUN_ID_FILE = "wandb_run.json"
STATE_KEY = "wandb_run_id"  # in a checkpoint's metadata["trackers"]
_ID_CHARS = string.ascii_lowercase + string.digits  # what W&B run ids are made of


def new_run_id() -> str:
  return "".join(secrets.choice(_ID_CHARS) for _ in range(12))


def run_id(workdir: str, saved: Mapping[str, Any]) -> str:
  """The W&B run id of the run in `workdir`: the checkpoint's (`saved`), else the workdir's file, else a new
  one. The file is (re)written with the id chosen before W&B is asked for anything."""
  path = fs.join(workdir, RUN_ID_FILE)
  on_file = None
  if fs.exists(path):
    try:
      on_file = str(fs.read_json(path)["id"])
    except (ValueError, KeyError, TypeError) as e:  # an unreadable file: the checkpoint's id, or a new run
      say(f"wandb: {path} does not hold a run id ({type(e).__name__}: {e}); not using it")
  chosen = saved.get(STATE_KEY) or on_file or new_run_id()
  if chosen != on_file:
    fs.write_json(path, {"id": chosen})
  return chosen


class WandbTracker:
  """One W&B run, continued across restarts; see the module docstring. Process 0 only."""

  def __init__(self, trainer: TrainerConfig, workdir: str, config: Mapping[str, Any], saved: Mapping[str, Any],
               growths: Sequence[Mapping[str, Any]]):
    import wandb  # only runs that track with W&B pay for its import (the `wandb` extra)
    self.run_id = run_id(workdir, saved)
    self._growths: List[Dict[str, Any]] = [
        {"step": g["step"], "stage": g["stage"], "depth": g["to_depth"], "provenance": list(g["provenance"])}
        for g in growths]
    self._run = None
    self._seen_below = 0  # steps the W&B run already holds (a resumed online run): not sent again

    def start():
      run = wandb.init(project=trainer.wandb_project, entity=trainer.wandb_entity,
                       name=trainer.wandb_name or fs.basename(workdir.rstrip("/")), tags=list(trainer.wandb_tags),
                       mode=trainer.wandb_mode, id=self.run_id, resume="allow")
      self._run = run  # before the config: a failure from here on finishes nothing it should not
      # A resume may change operational settings: the config is updated, not refused as a changed value.
      run.config.update(dict(config), allow_val_change=True)
      self._seen_below = int(getattr(run, "step", 0) or 0)
      if self._growths:  # a resumed run's summary lists the growths before its save
        run.summary.update({"growths": list(self._growths)})

    self._call("starting the run", start)

  @property
  def active(self) -> bool:
    return self._run is not None

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
    if self._run is None or step < self._seen_below:
      return
    data = {f"{split}/{name}": value for name, value in scalars.items()}
    self._call("logging", lambda: self._run.log(data, step=step))

  def mark_growth(self, step: int, stage: int, depth: int, provenance: Sequence[int]) -> None:
    self._growths.append({"step": step, "stage": stage, "depth": depth, "provenance": list(provenance)})
    if self._run is None:
      return
    # The history's marker is the growth's own record (split "stage", written just before this).
    self._call("marking the growth", lambda: self._run.summary.update({"growths": list(self._growths)}))

  def resume_state(self) -> Dict[str, Any]:
    return {STATE_KEY: self.run_id}

  def close(self) -> None:
    if self._run is not None:
      self._call("finishing the run", self._run.finish)
      self._run = None

  def _call(self, what: str, call: Callable[[], Any]) -> None:
    """Runs one wandb call; one that raises turns W&B tracking off for the rest of the run, never the run."""
    try:
      call()
    except Exception as e:  # pylint: disable=broad-except  # any wandb failure: the training goes on
      self._run = None
      say(f"wandb: {what} failed ({type(e).__name__}: {e}); W&B tracking is off for the rest of this run "
          f"(metrics.jsonl keeps every record)")
