"""What a run records: metrics.jsonl, TensorBoard events, a stdout line per log, a progress bar.

metrics.jsonl is the record of truth, one JSON object per write. A write never waits on storage
(fs.Appender): in a local workdir the line is on disk when the write returns; on gs:// it is queued
and a background thread stores it within FLUSH_SECONDS (5 s) while storage answers, as numbered parts
`metrics.jsonl.000000`, ... (GCS takes about one update per second to one object), and close() stores
the rest, on a normal exit and after a preemption's save alike. So a SIGKILLed run on gs:// loses at
most its last 5 s of records. Read them with `read_metrics`, which concatenates the parts.
TensorBoard events are derived from the records: they are written through a local directory mirrored
to the workdir by another background thread (fs.Mirror) and may lag by about 20 s. A resumed run drops
the records after the step it resumes from and rebuilds the events from the records it kept, so both
metrics.jsonl and TensorBoard show each step once. Other trackers (train/trackers/: Weights & Biases)
get each record after it is queued, and a mark at each growth.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import tqdm

from midas_jax import fs
from midas_jax.console import is_tty as _is_tty
from midas_jax.console import say

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
FLUSH_SECONDS = 5.0  # how stale the records on an object store may be while it answers (fs.Appender)
SAVE_FLUSH_SECONDS = 10.0  # how long a save waits for the records before it (a resume from it keeps only those)
CLOSE_SECONDS = 30.0  # how long close() tries to store the last records (on preemption, time is short)
EVENTS_PER_FILE = 20_000  # scalars per TensorBoard event file (~1 MB): bounds what one mirror upload sends
TIME_PREFIX = "time/"  # the goodput breakdown of train/goodput.py
_RESERVED = ("step", "split")
_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def _plain(value: Any) -> Any:
  """A Python number from a Python, NumPy or JAX scalar (json and tensorboardX want plain ones)."""
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, (bool, int)):
    return value
  if isinstance(value, float):
    return value
  try:
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"metric values must be numbers, got {type(value).__name__}: {value!r}") from None


def _with_unit(value: float) -> str:
  for scale, suffix in _UNITS:
    if abs(value) >= scale * 0.9995:  # so 999_990 reads 1.00M, not 1e+03k
      return f"{value / scale:.3g}{suffix}"
  return f"{value:.3g}"


def format_scalar(name: str, value: Any) -> str:
  """A short human reading of one metric.

  Names ending in "mfu" are fractions shown as percentages; counts of 10k and more get k/M/B/T;
  magnitudes below 0.01 (learning rates, small losses) use e-notation; the rest keep 4 digits.
  """
  value = _plain(value)
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if name.lower().endswith("mfu"):
    return f"{100 * value:.1f}%"
  if abs(value) >= 1e4:
    return _with_unit(value)
  if isinstance(value, int):
    return str(value)
  if value == 0:
    return "0"
  if abs(value) < 1e-2:
    return f"{value:.1e}"
  return f"{value:.4g}"


def summary_line(step: int, split: str, scalars: Mapping[str, Any]) -> str:
  """`step N split k=v ...`; the time/* breakdown is shortened to the productive share, `goodput=`."""
  shown = {k: v for k, v in scalars.items() if not k.startswith(TIME_PREFIX)}
  times = [float(v) for k, v in scalars.items() if k.startswith(TIME_PREFIX)]
  if times and sum(times) > 0:
    shown["goodput"] = f"{float(scalars.get(TIME_PREFIX + 'step', 0.0)) / sum(times):.0%}"
  parts = [f"step {step}", split] + [f"{k}={v if isinstance(v, str) else format_scalar(k, v)}"
                                     for k, v in shown.items()]
  return " ".join(parts)


class MetricWriter:
  """Writes each call's scalars to metrics.jsonl, TensorBoard (one run per split) and stdout.

  One writer per run, on process 0 only: other processes should not construct one.
  resume_step: the step a run restarts from; records after it are dropped (the run redoes those
  steps) and the TensorBoard events are rebuilt from the rest. None appends to what is there.
  flush_seconds: on an object store, how often queued records are stored.
  trackers: more places each record goes (train/trackers/); the writer closes them.
  """

  def __init__(self, workdir: str, stdout: bool = True, tensorboard: bool = True,
               resume_step: Optional[int] = None, flush_seconds: float = FLUSH_SECONDS, trackers: Sequence = ()):
    self.workdir = workdir
    self._trackers = list(trackers)
    fs.makedirs(workdir)
    keep = None if resume_step is None else functools.partial(_at_or_before, step=resume_step)
    self._jsonl = fs.Appender(fs.join(workdir, METRICS_FILE), keep=keep, flush_seconds=flush_seconds)
    self._stdout = stdout
    self._tensorboard = tensorboard
    self._tb_writers: Dict[str, Any] = {}
    self._tb_counts: Dict[str, int] = {}  # scalars in each split's current event file
    self._tb_files = 0  # event files opened, so that each new one has a name of its own
    self._tb_mirror = self._summary_writer = None
    if not tensorboard:
      return
    import tensorboardX  # a second to import: paid here at start, not by the first record; only if wanted
    self._summary_writer = tensorboardX.SummaryWriter
    if keep is not None:
      fs.rmtree(fs.join(workdir, TENSORBOARD_DIR))  # events of steps the restart redoes
    self._tb_mirror = fs.Mirror(fs.join(workdir, TENSORBOARD_DIR))
    if keep is not None:
      for record in _records(self._jsonl.kept):
        self._add_events(record["step"], record["split"],
                         {k: v for k, v in record.items() if k not in _RESERVED})

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
    """Queues the record (never waits on storage), adds its events and prints its line."""
    if self._jsonl is None:
      raise RuntimeError("MetricWriter.write after close()")
    clash = [k for k in _RESERVED if k in scalars]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the record's own fields")
    step = int(step)
    values = {k: _plain(v) for k, v in scalars.items()}
    self._jsonl.write(_line({"step": step, "split": split, **values}))
    if self._tensorboard:
      self._add_events(step, split, values)
    for tracker in self._trackers:
      tracker.write(step, split, values)
    if self._stdout:
      say(summary_line(step, split, values))

  def _add_events(self, step: int, split: str, values: Mapping[str, Any]) -> None:
    tb = self._tb_writer(split)
    for name, value in values.items():
      if isinstance(value, (int, float)):
        tb.add_scalar(name, float(value), global_step=step)
    self._tb_counts[split] += len(values)
    if self._tb_counts[split] >= EVENTS_PER_FILE:  # the next events go to a new file; this one is done
      self._tb_writers.pop(split).close()

  def _tb_writer(self, split: str):
    if split not in self._tb_writers:
      # flush_secs bounds what a killed run loses from its curves; the JSONL loses less.
      self._tb_writers[split] = self._summary_writer(
          logdir=fs.join(self._tb_mirror.local, split), flush_secs=10, filename_suffix=f".{self._tb_files:04d}")
      self._tb_files += 1
      self._tb_counts[split] = 0
    return self._tb_writers[split]

  def mark_growth(self, step: int, stage: int, depth: int, provenance: Sequence[int]) -> None:
    """A growth into `stage` at `step` (its record is the "stage" split's): the trackers mark the boundary."""
    for tracker in self._trackers:
      tracker.mark_growth(int(step), int(stage), int(depth), [int(p) for p in provenance])

  def tracker_state(self) -> Dict[str, Any]:
    """What the trackers need to continue their runs after a restart (saved in each checkpoint's metadata)."""
    state: Dict[str, Any] = {}
    for tracker in self._trackers:
      state.update(tracker.resume_state())
    return state

  def flush(self, timeout: float = SAVE_FLUSH_SECONDS) -> bool:
    """Stores the records written so far (waiting up to `timeout` s on an object store); whether they were.
    The TensorBoard events need no flush for a resume: it rebuilds them from the records."""
    return self._jsonl is None or self._jsonl.flush(timeout)

  def close(self, timeout: float = CLOSE_SECONDS) -> None:
    """Stores the last records (tried for up to `timeout` s on an object store), then the last events."""
    if self._jsonl is not None:
      self._jsonl.close(timeout)
      self._jsonl = None
    for tb in self._tb_writers.values():
      tb.close()
    self._tb_writers = {}
    if self._tb_mirror is not None:
      self._tb_mirror.close(timeout)
      self._tb_mirror = None
    for tracker in self._trackers:
      tracker.close()
    self._trackers = []

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _line(record: Mapping[str, Any]) -> str:
  # Non-finite values are written as NaN/Infinity, which Python's json reads back.
  return json.dumps(record) + "\n"


def _at_or_before(line: str, step: int) -> bool:
  """Whether a record's line is of `step` or earlier (what a restart from `step` keeps)."""
  try:
    return json.loads(line)["step"] <= step
  except (json.JSONDecodeError, KeyError, TypeError):
    return False


def _records(lines: Iterable[str]) -> Iterable[Dict[str, Any]]:
  return (json.loads(line) for line in lines)


class NullWriter:
  """The MetricWriter of processes other than 0: logs and files come from process 0 only."""

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
    del step, split, scalars

  def mark_growth(self, step: int, stage: int, depth: int, provenance: Sequence[int]) -> None:
    del step, stage, depth, provenance

  def tracker_state(self) -> Dict[str, Any]:
    return {}

  def flush(self) -> bool:
    return True

  def close(self) -> None:
    pass


def read_metrics(workdir: str, split: Optional[str] = None) -> List[Dict[str, Any]]:
  """The records of <workdir>/metrics.jsonl in file order, optionally of one split only.

  Every reader of a run's records goes through here: on gs:// the file is stored as numbered parts
  (fs.read_appended concatenates them). A run killed mid-write can leave a cut-off last line: it is
  skipped. A bad line elsewhere is a real corruption and raises.
  """
  path = fs.join(workdir, METRICS_FILE)
  lines = fs.read_appended(path).split("\n")
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if i == len(lines) - 1:  # the unterminated tail of an interrupted write
        break
      raise ValueError(f"{path}:{i + 1}: not a JSON object: {line[:80]!r}") from None
    if split is None or record.get("split") == split:
      records.append(record)
  return records


def has_metrics(workdir: str) -> bool:
  """Whether <workdir> holds a run's records (the file, or its parts)."""
  return fs.appended_exists(fs.join(workdir, METRICS_FILE))


class Progress:
  """A tqdm bar on stderr with ETA, driven by absolute step numbers.

  On a terminal it redraws at most twice a second. Asked for into a file or pipe, each redraw is a
  new chunk of log, so it redraws at most once a minute there; enabled=False prints nothing. Lines
  printed through console.say appear above the bar.
  """

  def __init__(self, total_steps: int, initial_step: int = 0, enabled: bool = True):
    stream = sys.stderr
    tty = _is_tty(stream)
    self._bar = tqdm.tqdm(
        total=total_steps, initial=initial_step, file=stream, disable=not enabled,
        unit="step", dynamic_ncols=tty, ascii=not tty, mininterval=0.5 if tty else 60.0,
        smoothing=0.1)

  def update(self, step: int, postfix: Optional[Mapping[str, Any]] = None) -> None:
    if postfix:
      self._bar.set_postfix({k: format_scalar(k, v) for k, v in postfix.items()}, refresh=False)
    self._bar.update(int(step) - self._bar.n)

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
