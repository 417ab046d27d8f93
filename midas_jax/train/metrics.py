"""What a run records: metrics.jsonl, TensorBoard events, a stdout line per log, a progress bar.

metrics.jsonl is the record of truth (one JSON object per write, durable when the write returns,
so a killed run keeps every line it logged; on gs:// the object is replaced whole each time,
fs.Appender). TensorBoard events are derived from it: they are written through a local directory
mirrored to the workdir (fs.Mirror) and may lag by a few seconds. A resumed run drops the records
after the step it resumes from and rebuilds the events from the records it kept, so both
metrics.jsonl and TensorBoard show each step once.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Dict, List, Mapping, Optional

import tqdm

from midas_jax import fs
from midas_jax.console import is_tty as _is_tty
from midas_jax.console import say

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
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
  """

  def __init__(self, workdir: str, stdout: bool = True, tensorboard: bool = True,
               resume_step: Optional[int] = None):
    self.workdir = workdir
    fs.makedirs(workdir)
    path = fs.join(workdir, METRICS_FILE)
    kept = None
    if resume_step is not None:
      kept = [r for r in read_metrics(workdir) if r["step"] <= resume_step]
    self._jsonl = fs.Appender(path, initial=None if kept is None else "".join(_line(r) for r in kept))
    self._stdout = stdout
    self._tensorboard = tensorboard
    self._tb_writers: Dict[str, Any] = {}
    self._tb_mirror = None
    if tensorboard and kept is not None:
      fs.rmtree(fs.join(workdir, TENSORBOARD_DIR))  # events of steps the restart redoes
      for record in kept:
        self._add_events(record["step"], record["split"],
                         {k: v for k, v in record.items() if k not in _RESERVED})

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
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
      self._tb_mirror.sync()
    if self._stdout:
      say(summary_line(step, split, values))

  def _add_events(self, step: int, split: str, values: Mapping[str, Any]) -> None:
    tb = self._tb_writer(split)
    for name, value in values.items():
      if isinstance(value, (int, float)):
        tb.add_scalar(name, float(value), global_step=step)

  def _tb_writer(self, split: str):
    if split not in self._tb_writers:
      import tensorboardX  # only runs that want events pay for the import
      if self._tb_mirror is None:
        self._tb_mirror = fs.Mirror(fs.join(self.workdir, TENSORBOARD_DIR))
      # flush_secs bounds what a killed run loses from its curves; the JSONL loses nothing.
      self._tb_writers[split] = tensorboardX.SummaryWriter(
          logdir=fs.join(self._tb_mirror.local, split), flush_secs=10)
    return self._tb_writers[split]

  def close(self) -> None:
    for tb in self._tb_writers.values():
      tb.close()
    self._tb_writers = {}
    if self._tb_mirror is not None:
      self._tb_mirror.close()
      self._tb_mirror = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _line(record: Mapping[str, Any]) -> str:
  # Non-finite values are written as NaN/Infinity, which Python's json reads back.
  return json.dumps(record) + "\n"


class NullWriter:
  """The MetricWriter of processes other than 0: logs and files come from process 0 only."""

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
    del step, split, scalars

  def close(self) -> None:
    pass


def read_metrics(workdir: str, split: Optional[str] = None) -> List[Dict[str, Any]]:
  """The records of <workdir>/metrics.jsonl in file order, optionally of one split only.

  A run killed mid-write can leave a cut-off last line: it is skipped. A bad line elsewhere is a
  real corruption and raises.
  """
  path = fs.join(workdir, METRICS_FILE)
  if not fs.exists(path):
    return []
  lines = fs.read_text(path).split("\n")
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
