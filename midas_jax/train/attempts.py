"""A failure that repeats at the same step stops the run for good instead of restarting it forever.

Resume is bitwise: a bug at a growth boundary, or a host that runs out of memory at the same step,
fails again every time the run restarts (restore, compile, train to that step), on a billed slice
and, on GKE, out of the restart budget that preemptions need. So the process that fails with an
unrecognised error (exit status 1) records the step and the cause in WORKDIR/last_failure.json; if
the record, written by an earlier attempt (peers.attempt_id tells attempts apart, so two processes of
one attempt never count as two), already names the same step, it stops with exit status 3 (halted:
never restarted) naming the step and both causes instead. A run that finishes, or stops after a preemption save, removes
the record. Storage outages (75) and bad input (2) are not recorded: an outage that outlasts one
restart is still an outage, and bad input never restarts.
"""

from __future__ import annotations

import datetime
from typing import Optional

import jax

from midas_jax import fs, peers
from midas_jax.errors import HaltedError

RECORD = "last_failure.json"


def failed_at(error: BaseException, step: Optional[int]) -> BaseException:
  """Notes on `error` the step the run was at when it was raised (None: while starting up)."""
  if not hasattr(error, "midas_step"):
    try:
      error.midas_step = step
    except AttributeError:  # an exception type with __slots__: the step stays unknown
      pass
  return error


def _cause(error: BaseException) -> str:
  return f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"


def _where(step: Optional[int]) -> str:
  return "start-up" if step is None else f"step {step}"


def check_repeat(workdir: str, error: BaseException) -> None:
  """Records a failure of status 1; raises HaltedError (from `error`) when the attempt before this one
  failed at the same step. Never hides `error` behind an error of its own: a workdir that cannot be
  read or written here leaves `error` to be reported as it is."""
  step = getattr(error, "midas_step", None)
  path = fs.join(workdir, RECORD)
  attempt = peers.attempt_id()
  try:
    previous = fs.read_json(path) if fs.isfile(path) else None
    if previous is not None and previous.get("attempt") == attempt:
      return  # another process of this attempt failed first and recorded it
    fs.write_json(path, {"step": step, "cause": _cause(error), "process": jax.process_index(), "attempt": attempt,
                         "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
  except Exception:  # pylint: disable=broad-except
    return
  if previous is not None and previous.get("step") == step:
    raise HaltedError(
        f"the run failed at {_where(step)} twice in a row, so it is not restarted again (exit status 3).\n"
        f"  before: {previous.get('cause')} ({previous.get('time')})\n  now:    {_cause(error)}\n"
        f"  fix: find the cause at {_where(step)} (the resume is exact, so a restart repeats it), then run the "
        f"same command again; remove {path} to let a supervisor restart it") from error


def clear(workdir: str) -> None:
  """The run finished or was preempted after saving: a later failure is a first failure again."""
  path = fs.join(workdir, RECORD)
  if jax.process_index() == 0 and fs.isfile(path):
    fs.remove(path)
