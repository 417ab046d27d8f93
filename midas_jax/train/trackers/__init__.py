"""Experiment trackers: where a run's records go besides metrics.jsonl (TrainerConfig.trackers).

metrics.jsonl is always written and is the record of truth (train/metrics.py, MetricWriter); the
trackers show the same records elsewhere:
- 'tensorboard': events under <workdir>/tensorboard, written by the MetricWriter itself because they
  are derived from the records it keeps (a resume rebuilds them from those).
- 'wandb': a Weights & Biases run from process 0 (wandb_tracker.py), an optional extra
  (`pip install midas_jax[wandb]`).
A Tracker gets every record the MetricWriter writes and a mark at each growth. It never stops the
run: a tracker whose library fails says so once and turns itself off, and the records go on.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List, Mapping, Protocol, Sequence

from midas_jax.configs import TrainerConfig
from midas_jax.errors import ConfigError
from midas_jax.train.trackers.wandb_tracker import WandbTracker

# The library each optional tracker needs, and the extra that installs it.
_NEEDS = {"wandb": ("wandb", "pip install 'midas_jax[wandb]'")}


class Tracker(Protocol):
  """What the MetricWriter hands a tracker besides metrics.jsonl."""

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None: ...  # one record

  def mark_growth(self, step: int, stage: int, depth: int, provenance: Sequence[int]) -> None: ...

  def resume_state(self) -> Dict[str, Any]: ...  # saved in each checkpoint's metadata (`trackers`) for a restart

  def close(self) -> None: ...


def check_installed(trainer: TrainerConfig) -> None:
  """Refuses, before anything is built or compiled, a tracker whose library is not installed."""
  for name in trainer.trackers:
    if name in _NEEDS:
      module, fix = _NEEDS[name]
      if importlib.util.find_spec(module) is None:
        raise ConfigError("TrainerConfig.trackers", f"{name!r} needs the {module} package, which is not installed",
                          f"{fix}, or drop {name!r} from TrainerConfig.trackers")


def continue_across_restarts(trainer: TrainerConfig) -> bool:
  """Whether a tracker of the config continues its run after a restart from what the save holds (W&B's id)."""
  return "wandb" in trainer.trackers


def open_trackers(trainer: TrainerConfig, workdir: str, config: Mapping[str, Any], saved: Mapping[str, Any],
                  growths: Sequence[Mapping[str, Any]]) -> List[Tracker]:
  """The trackers besides the MetricWriter's own files, for process 0 of a run.

  config: the resolved run config (what the trackers record as the run's config); saved: the `trackers`
  metadata of the checkpoint the run resumes from ({} on a fresh start); growths: those done before it.
  """
  opened: List[Tracker] = []
  if "wandb" in trainer.trackers:
    opened.append(WandbTracker(trainer, workdir, config, saved, growths))
  return opened
