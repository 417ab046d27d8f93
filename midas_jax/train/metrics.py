"""What a run records: metrics.jsonl, TensorBoard events, a stdout line per log, a progress bar.

metrics.jsonl is the record of truth (one JSON object per write, flushed at once, so a killed run
keeps every line it logged); TensorBoard events are for looking at curves and may lag by a few
seconds. A resumed run first drops the records after the step it resumes from (truncate_after),
then appends: metrics.jsonl holds each step once. TensorBoard may show the dropped stretch twice.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List, Mapping, Optional

import tqdm

from midas_jax.console import is_tty as _is_tty, say

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
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
  parts = [f"step {step}", split] + [f"{k}={format_scalar(k, v)}" for k, v in scalars.items()]
  return " ".join(parts)


class MetricWriter:
  """Writes each call's scalars to metrics.jsonl, TensorBoard (one run per split) and stdout.

  One writer per run, on process 0 only: other processes should not construct one.
  """

  def __init__(self, workdir: str, stdout: bool = True, tensorboard: bool = True):
    self.workdir = workdir
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a", encoding="utf-8")
    self._stdout = stdout
    self._tensorboard = tensorboard
    self._tb_writers: Dict[str, Any] = {}

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
    if self._jsonl is None:
      raise RuntimeError("MetricWriter.write after close()")
    clash = [k for k in _RESERVED if k in scalars]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the record's own fields")
    step = int(step)
    values = {k: _plain(v) for k, v in scalars.items()}
    # Non-finite values are written as NaN/Infinity, which Python's json reads back.
    self._jsonl.write(json.dumps({"step": step, "split": split, **values}) + "\n")
    self._jsonl.flush()
    if self._tensorboard:
      tb = self._tb_writer(split)
      for name, value in values.items():
        tb.add_scalar(name, float(value), global_step=step)
    if self._stdout:
      say(summary_line(step, split, values))

  def _tb_writer(self, split: str):
    if split not in self._tb_writers:
      import tensorboardX  # only runs that want events pay for the import
      logdir = os.path.join(self.workdir, TENSORBOARD_DIR, split)
      # flush_secs bounds what a killed run loses from its curves; the JSONL loses nothing.
      self._tb_writers[split] = tensorboardX.SummaryWriter(logdir=logdir, flush_secs=10)
    return self._tb_writers[split]

  def close(self) -> None:
    for tb in self._tb_writers.values():
      tb.close()
    self._tb_writers = {}
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class NullWriter:
  """The MetricWriter of processes other than 0: logs and files come from process 0 only."""

  def write(self, step: int, split: str, scalars: Mapping[str, Any]) -> None:
    del step, split, scalars

  def close(self) -> None:
    pass


def truncate_after(workdir: str, step: int) -> int:
  """Drops records of steps after `step` (a resumed run redoes them); returns how many were dropped."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return 0
  records = read_metrics(workdir)
  keep = [r for r in records if r["step"] <= step]
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in keep)
  os.replace(tmp, path)
  return len(records) - len(keep)


def read_metrics(workdir: str, split: Optional[str] = None) -> List[Dict[str, Any]]:
  """The records of <workdir>/metrics.jsonl in file order, optionally of one split only.

  A run killed mid-write can leave a cut-off last line: it is skipped. A bad line elsewhere is a
  real corruption and raises.
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
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
