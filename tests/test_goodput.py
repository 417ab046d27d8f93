"""Goodput: the time breakdown of each log line (train/goodput.py) and its table and bar in `midas report`."""

import pytest

from midas_jax import fs
from midas_jax.evals import report
from midas_jax.train.goodput import ACTIVITIES, KEYS, Goodput, summarize
from midas_jax.train.metrics import MetricWriter, summary_line


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_breakdown_adds_up_to_the_wall_time_and_restarts():
  clock = Clock()
  goodput = Goodput(clock)
  with goodput.timing("compile"):
    clock.now += 3.0
  clock.now += 1.5  # steps
  with goodput.timing("checkpoint"):
    with goodput.timing("eval"):  # nested: counted once, for the outer activity
      clock.now += 0.5
  goodput.add("data", 0.25)
  clock.now += 0.25
  first = goodput.take()
  assert set(first) == set(KEYS) and sum(first.values()) == pytest.approx(5.25)
  assert first["time/compile"] == 3.0 and first["time/checkpoint"] == 0.5 and first["time/eval"] == 0.0
  assert first["time/step"] == pytest.approx(1.5)
  clock.now += 2.0
  assert goodput.take() == dict({"time/step": 2.0}, **{f"time/{a}": 0.0 for a in ACTIVITIES})
  with pytest.raises(ValueError, match="unknown activity"):
    with goodput.timing("lunch"):
      pass


def test_stdout_shows_the_productive_share_only():
  line = summary_line(5, "train", {"loss": 2.0, "time/step": 3.0, "time/compile": 1.0})
  assert line == "step 5 train loss=2 goodput=75%"


def test_report_has_the_goodput_table_and_stacked_bar(tmp_path):
  run = str(tmp_path / "run")
  with MetricWriter(run, stdout=False, tensorboard=False) as w:
    w.write(1, "train", {"loss": 3.0, "time/step": 1.0, "time/compile": 7.0, "time/data": 0.0,
                         "time/checkpoint": 1.0, "time/growth": 0.0, "time/eval": 0.0, "time/logging": 0.0})
    w.write(2, "train", {"loss": 2.5, "time/step": 8.0, "time/compile": 0.0, "time/data": 0.5,
                         "time/checkpoint": 0.0, "time/growth": 1.5, "time/eval": 1.0, "time/logging": 0.0})
  totals = summarize([r for r in report.load_run("run", run)["time"]])
  assert totals == {"step": 9.0, "compile": 7.0, "data": 0.5, "checkpoint": 1.0, "growth": 1.5, "eval": 1.0,
                    "logging": 0.0}
  page = fs.read_text(report.write_report(run))
  table = page[page.index("## Where the time went"):]
  assert "| run | wall seconds | step | compile |" in table and "| run | 20.000 | 9.0 s (45%) | 7.0 s (35%) |" in table
  assert fs.read_bytes(str(tmp_path / "run" / "report" / "goodput.png"))[:4] == b"\x89PNG"
