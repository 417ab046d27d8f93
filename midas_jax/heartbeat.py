"""A run's heartbeat: WORKDIR/heartbeat.json, what it holds and when it is stale (docs/pods.md#the-heartbeat).

A slice whose queued resource is ACTIVE may still train nothing: a worker stuck in its boot, a host
blocked in a collective its peers never join, a run restarting again and again. Process 0 of a run
rewrites one small object at every log step (train/heartbeat.py writes it), and `launch/tpu_pod.py
watch` reads it each poll and says how old it is. This module is the record and the rule, in the
standard library only, because the launchers import it without the package's dependencies (as they
do exit_status.py).

Stale, from the record itself: a running run is expected to write again about every
`log_every * step_seconds` seconds (its own recent speed). Evaluations, saves and growths fall between
two log steps, so the limit is `intervals` such periods (10 by default), and never less than
`floor_s` (20 minutes by default), which covers what a log step's speed does not foretell: the
compile after a start or a growth, a restore, a blocking save. A record whose status says the attempt
ended ("preempted", "failed: ...") is stale once `floor_s` passes without a new attempt writing one
(a restart is expected within a boot, a restore and a compile). A finished run is never stale. The
age is the watcher's clock less the writer's (worker clocks are NTP-synchronised: seconds, against
limits of minutes).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from typing import Any, Dict, Optional

FILE = "heartbeat.json"
RUNNING, FINISHED, PREEMPTED = "running", "finished", "preempted"
FAILED_PREFIX = "failed: "
STALE_INTERVALS = 10.0  # log periods (at the record's own speed) without a write before it is stale
STALE_FLOOR_S = 1200.0  # never stale sooner: a compile, a restore or a save can take minutes


def record(step: int, stage: int, loss: Optional[float], step_seconds: Optional[float], log_every: int,
           attempt: str, host: str, processes: int, now: float, status: str = RUNNING) -> Dict[str, Any]:
  """The heartbeat's JSON object. loss and step_seconds are None until known (a start, a window that
  only compiled); a loss that is not finite is None too (JSON has no NaN)."""
  def number(value):
    return float(value) if value is not None and math.isfinite(float(value)) else None
  return {"step": int(step), "stage": int(stage), "loss": number(loss), "step_seconds": number(step_seconds),
          "log_every": int(log_every), "time": float(now), "status": status, "attempt": attempt, "host": host,
          "processes": int(processes)}


def failed(error: BaseException, limit: int = 300) -> str:
  """The status of a run that raised `error`: "failed: <type>: <first words of the message>"."""
  text = " ".join(f"{type(error).__name__}: {error}".split())
  return FAILED_PREFIX + (text if len(text) <= limit else text[:limit - 3] + "...")


def parse(text: Optional[str]) -> Optional[Dict[str, Any]]:
  """The record from the object's text; None when there is none (no text). Raises ValueError when the
  text is not a heartbeat record."""
  if not text or not text.strip():
    return None
  found = json.loads(text)  # json.JSONDecodeError is a ValueError
  if not isinstance(found, dict) or not isinstance(found.get("time"), (int, float)) or "step" not in found:
    raise ValueError(f"not a heartbeat record: {text[:80]!r}")
  return found


@dataclasses.dataclass(frozen=True)
class Verdict:
  age_s: float  # seconds since the record was written (never negative)
  limit_s: Optional[float]  # the age past which it is stale; None: a finished run, nothing more expected

  @property
  def stale(self) -> bool:
    return self.limit_s is not None and self.age_s > self.limit_s


def limit_s(rec: Dict[str, Any], intervals: float = STALE_INTERVALS, floor_s: float = STALE_FLOOR_S) -> Optional[float]:
  """The age past which `rec` is stale (see the module's docstring); None for a finished run."""
  if rec.get("status") == FINISHED:
    return None
  step_seconds = rec.get("step_seconds")
  if rec.get("status") != RUNNING or not step_seconds:
    return floor_s
  return max(intervals * float(step_seconds) * int(rec.get("log_every") or 1), floor_s)


def staleness(rec: Dict[str, Any], now: float, intervals: float = STALE_INTERVALS,
              floor_s: float = STALE_FLOOR_S) -> Verdict:
  return Verdict(age_s=max(now - float(rec["time"]), 0.0), limit_s=limit_s(rec, intervals, floor_s))


def _utc(unix: float) -> str:
  return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe(rec: Optional[Dict[str, Any]], now: float, intervals: float = STALE_INTERVALS,
             floor_s: float = STALE_FLOOR_S) -> str:
  """watch's line for one look at the heartbeat: its step and age, and STALE (with why) when it is."""
  if rec is None:
    return "no heartbeat yet"
  verdict = staleness(rec, now, intervals, floor_s)
  status, step = rec.get("status", "?"), rec["step"]
  if verdict.stale:
    return (f"STALE (no heartbeat for {verdict.age_s:.0f} s, limit {verdict.limit_s:.0f} s; last step {step} at "
            f"{_utc(float(rec['time']))}, {status})")
  loss = f", loss {rec['loss']:.4g}" if rec.get("loss") is not None else ""
  return (f"step {step} (stage {rec.get('stage', '?')}{loss}), heartbeat {verdict.age_s:.0f} s ago: {status} "
          f"(attempt {str(rec.get('attempt', '?'))[:8]}, {rec.get('processes', '?')} processes)")
