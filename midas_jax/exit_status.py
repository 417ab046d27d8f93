"""What a run's exit status tells its supervisor (systemd on a TPU VM, GKE's JobSet, SLURM, a shell loop).

One table, used by the CLI that exits with these statuses and by every launcher that restarts a run
(docs/pods.md#exit-statuses renders the same classes in prose). Each status is one class of ending with
one restart rule, so a supervisor needs no more than the number to act right.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class ExitClass:
  status: int
  name: str
  meaning: str
  restart: str  # "never", "now" or "after a delay"


FINISHED = ExitClass(0, "finished", "the run reached TrainerConfig.num_steps (or the command did its work)", "never")
FAILED = ExitClass(1, "failed", "an error nobody recognised; the workdir is as the last good save left it",
                   "after a delay; a failure at the same step as the attempt before it stops with status 3")
BAD_INPUT = ExitClass(2, "bad input", "a config, flag, path, data file or checkpoint the run refused; the message "
                      "names the setting and the fix", "never: the same command fails the same way")
HALTED = ExitClass(3, "halted", "a loss that is not finite, or a failure at the same step as the attempt before "
                   "(the message names the step and both causes): running again repeats it", "never")
STORAGE_UNAVAILABLE = ExitClass(75, "storage unavailable", "the storage did not answer after the retries; nothing "
                                "stored was judged by it (EX_TEMPFAIL)", "after a delay")
PREEMPTED = ExitClass(76, "preempted, saved", "a SIGTERM (preemption, maintenance, a stop) was agreed by every "
                      "process and the state saved; or a damaged save was set aside and the run must start over "
                      "from the one before", "now")

ALL: Tuple[ExitClass, ...] = (FINISHED, FAILED, BAD_INPUT, HALTED, STORAGE_UNAVAILABLE, PREEMPTED)
NEVER_RESTART: Tuple[int, ...] = tuple(c.status for c in ALL if c.restart.startswith("never"))


def describe(status: int) -> str:
  """'76 (preempted, saved)' for a known status, the number alone otherwise (a signal's 128 + N, say)."""
  for c in ALL:
    if c.status == status:
      return f"{status} ({c.name})"
  return str(status)
