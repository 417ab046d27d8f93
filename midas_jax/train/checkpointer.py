"""The seam a checkpoint manager plugs into (checkpoint/manager.py has the orbax one), and a null one."""

from __future__ import annotations

from typing import List, Optional, Protocol, Tuple

from midas_jax.train_state import StateLayout, TrainState


class Checkpointer(Protocol):
  """What the train loop asks of its checkpoints.

  It only ever sees states whose loss was finite. `save` decides itself whether a non-forced step
  is due; the loop makes sure it has checked the losses of every step it hands over.
  """

  save_seconds: List[float]  # how long each save blocked the loop

  def steps(self) -> List[int]: ...  # committed saves, newest first

  def metadata(self, step: int) -> dict: ...

  def restore(self, layout: StateLayout, step: int) -> TrainState: ...  # in layout's shardings

  # Sets a damaged save aside (never deletes it); alone: without waiting for the other processes.
  def quarantine(self, step: int, reason: str, alone: bool = False) -> None: ...

  def set_aside_saves(self) -> List[Tuple[str, str]]: ...  # (name, why) of the saves set aside so far

  def due(self, step: int) -> bool: ...

  def save(self, state: TrainState, step: int, force: bool = False, metadata: Optional[dict] = None) -> bool: ...

  def wait(self) -> None: ...  # until every started save is committed

  def close(self) -> None: ...


class NoCheckpointer:
  """Saves nothing: benchmarks and tests that do not need checkpoints."""

  def __init__(self):
    self.save_seconds: List[float] = []

  def steps(self) -> List[int]:
    return []

  def metadata(self, step: int) -> dict:
    raise AssertionError("NoCheckpointer has no metadata")

  def restore(self, layout: StateLayout, step: int) -> TrainState:
    raise AssertionError("NoCheckpointer has nothing to restore")

  def quarantine(self, step: int, reason: str, alone: bool = False) -> None:
    raise AssertionError("NoCheckpointer has nothing to quarantine")

  def set_aside_saves(self) -> List[Tuple[str, str]]:
    return []

  def due(self, step: int) -> bool:
    return False

  def save(self, state: TrainState, step: int, force: bool = False, metadata: Optional[dict] = None) -> bool:
    return False

  def wait(self) -> None:
    pass

  def close(self) -> None:
    pass
