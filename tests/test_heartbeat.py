"""The run's heartbeat: the record and when it is stale (midas_jax/heartbeat.py), the loop writing it at every
log step and how the run ended (train/heartbeat.py), and `launch/tpu_pod.py watch` reading it from a stand-in
gcloud: a fresh heartbeat, a stale one, none, and a hung run restarted only when asked."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, tiny_run
from midas_jax import configs, heartbeat
from midas_jax.train import heartbeat as writer_lib
from midas_jax.train.checkpointer import NoCheckpointer
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train

NOW = 1_800_000_000.0


def running(step_seconds=None, age=0.0, log_every=50, status=heartbeat.RUNNING):
  return heartbeat.record(step=100, stage=1, loss=3.25, step_seconds=step_seconds, log_every=log_every,
                          attempt="0123456789abcdef", host="w-0", processes=16, now=NOW - age, status=status)


def test_the_record_holds_what_a_watcher_needs_and_no_nan():
  rec = running(step_seconds=0.5)
  assert rec == {"step": 100, "stage": 1, "loss": 3.25, "step_seconds": 0.5, "log_every": 50, "time": NOW,
                 "status": "running", "attempt": "0123456789abcdef", "host": "w-0", "processes": 16}
  assert heartbeat.record(1, 0, float("nan"), None, 1, "a", "h", 1, NOW)["loss"] is None
  assert heartbeat.parse(json.dumps(rec)) == rec
  assert heartbeat.parse("") is None and heartbeat.parse(None) is None
  with pytest.raises(ValueError):
    heartbeat.parse('{"step": 3}')  # no time: not a heartbeat
  assert heartbeat.failed(RuntimeError("disk\n  on fire")) == "failed: RuntimeError: disk on fire"


@pytest.mark.parametrize("rec, limit", [
    (running(step_seconds=10.0), 10 * 10.0 * 50),  # slow steps: 10 log periods of its own speed
    (running(step_seconds=0.1), heartbeat.STALE_FLOOR_S),  # fast steps: the floor
    (running(step_seconds=None), heartbeat.STALE_FLOOR_S),  # a start (restored, compiling): the floor
    (running(status=heartbeat.PREEMPTED, step_seconds=10.0), heartbeat.STALE_FLOOR_S),  # a restart is due
    (running(status="failed: RuntimeError: x", step_seconds=10.0), heartbeat.STALE_FLOOR_S),
])
def test_stale_past_ten_of_its_own_log_periods_and_never_before_the_floor(rec, limit):
  assert heartbeat.limit_s(rec) == limit
  assert not heartbeat.staleness(rec, NOW + limit).stale
  assert heartbeat.staleness(rec, NOW + limit + 1).stale


def test_watch_flags_set_the_intervals_and_the_floor():
  assert heartbeat.limit_s(running(step_seconds=10.0), intervals=2, floor_s=60) == 2 * 10.0 * 50
  assert heartbeat.limit_s(running(step_seconds=0.1), intervals=2, floor_s=60) == 60


def test_a_finished_run_is_never_stale_and_a_clock_ahead_is_age_zero():
  done = running(step_seconds=1.0, status=heartbeat.FINISHED)
  assert heartbeat.limit_s(done) is None and not heartbeat.staleness(done, NOW + 1e9).stale
  assert heartbeat.staleness(running(), NOW - 30).age_s == 0.0


def test_the_watch_line_gives_step_and_age_or_why_it_is_stale():
  assert heartbeat.describe(None, NOW) == "no heartbeat yet"
  fresh = heartbeat.describe(running(step_seconds=1.0, age=42), NOW)
  assert fresh.startswith("step 100 (stage 1, loss 3.25), heartbeat 42 s ago: running") and "STALE" not in fresh
  assert "attempt 01234567, 16 processes" in fresh
  stale = heartbeat.describe(running(step_seconds=1.0, age=5000), NOW)
  assert stale == ("STALE (no heartbeat for 5000 s, limit 1200 s; last step 100 at 2027-01-15 06:36:40 UTC, "
                   "running)")


def test_a_write_that_fails_never_stops_the_caller_and_is_said_once(tmp_path, capsys):
  (tmp_path / heartbeat.FILE).mkdir()  # the object cannot be written: a directory stands on its path
  beats = writer_lib.HeartbeatWriter(str(tmp_path), log_every=2, close_seconds=0.5)
  for step in range(4):
    beats.beat(step, 0, 1.0, 0.1)
  beats.end(4, heartbeat.FINISHED)
  beats.close()
  out = capsys.readouterr().out
  assert out.count("the last heartbeat was not stored") == 1, out


class FailingSave(NoCheckpointer):
  def save(self, state, step, force=False, metadata=None):
    if step == 4:
      raise RuntimeError("the disk is on fire")
    return False


@pytest.fixture
def beats(monkeypatch):
  """The steps the loop beat at, in order."""
  seen = []
  beat = writer_lib.HeartbeatWriter.beat

  def spy(self, step, *args, **kwargs):
    seen.append(step)
    beat(self, step, *args, **kwargs)
  monkeypatch.setattr(writer_lib.HeartbeatWriter, "beat", spy)
  return seen


TRAINER = configs.TrainerConfig(num_steps=4, log_every=2, eval_every=0, progress_bar=False, trackers=(),
                                peak_flops_per_device=1e11)  # metrics.jsonl alone: no TensorBoard to import


def test_a_run_beats_at_its_start_and_every_log_step_and_ends_finished(tmp_path, beats):
  before = time.time()
  train(tiny_run(trainer=TRAINER), str(tmp_path), checkpointer=NoCheckpointer())
  rec = heartbeat.parse((tmp_path / heartbeat.FILE).read_text())
  last = read_metrics(str(tmp_path), "train")[-1]
  assert beats == [0, 2, 4]  # the start (restored, compiling), then each log step
  assert rec["status"] == heartbeat.FINISHED and rec["step"] == last["step"] == 4
  assert rec["loss"] == pytest.approx(last["loss"]) and rec["step_seconds"] == pytest.approx(last["step_seconds"])
  assert rec["log_every"] == 2 and rec["processes"] == 1 and rec["attempt"] and rec["time"] >= before


def test_a_run_that_raises_leaves_failed_and_the_reason(tmp_path, beats):
  with pytest.raises(RuntimeError, match="on fire"):
    train(tiny_run(trainer=TRAINER), str(tmp_path), checkpointer=FailingSave())
  rec = heartbeat.parse((tmp_path / heartbeat.FILE).read_text())
  assert beats == [0, 2]
  assert rec["status"] == "failed: RuntimeError: the disk is on fire" and rec["step"] == 4


FAKE_GCLOUD = """#!/bin/bash
echo "$*" >> "$CALLS"
next() { line=$(head -n 1 "$1"); sed -i 1d "$1"; [ -n "$line" ] && echo "$line"; }
case "$1 $4" in
  "storage "*) next "$BEATS" || exit 1 ;;  # cat: the next heartbeat; an empty line is no object
  *describe) next "$STATES" || exit 1 ;;  # the next state; an empty line is a resource that is not there
esac
exit 0
"""


def watch(tmp_path, states, beats, *flags):
  (tmp_path / "gcloud").write_text(FAKE_GCLOUD)
  (tmp_path / "gcloud").chmod(0o755)
  (tmp_path / "states").write_text("".join(s + "\n" for s in states))
  (tmp_path / "beats").write_text("".join((json.dumps(b) if b else "") + "\n" for b in beats))
  proc = subprocess.run(
      [sys.executable, "launch/tpu_pod.py", "watch", "--name=pod", "--zone=us-east5-a", "--accelerator=v5p-8",
       "--poll_s=0", *flags, "--", "train", "--gin_file=gin/experiments/midas_cpu.gin", "--workdir=gs://b/runs/x"],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
      env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", CALLS=str(tmp_path / "calls"),
               STATES=str(tmp_path / "states"), BEATS=str(tmp_path / "beats"), TMPDIR=str(tmp_path)))
  assert proc.returncode == 1 and "stopped watching" in proc.stderr, proc.stdout + proc.stderr
  lines = [line.split(" heartbeat: ", 1)[1] for line in proc.stdout.splitlines() if " heartbeat: " in line]
  return lines, (tmp_path / "calls").read_text().splitlines()


def beat_at(age, step, status=heartbeat.RUNNING):
  return heartbeat.record(step, 0, 2.5, 1.0, 10, "feedbeef00", "w-0", 2, time.time() - age, status)


def test_watch_reports_no_heartbeat_a_fresh_one_and_a_stale_one_each_poll(tmp_path):
  # queued already; then four polls while ACTIVE; then three looks that find no resource end the watch
  lines, calls = watch(tmp_path, ["ACTIVE"] * 5 + [""] * 3,
                       [None, beat_at(5, 30), beat_at(4000, 40), beat_at(4000, 40, "failed: OSError: x"), None, None])
  assert lines[0] == "no heartbeat yet"
  assert lines[1].startswith("step 30 (stage 0, loss 2.5), heartbeat ") and "STALE" not in lines[1]
  assert re.match(r"STALE \(no heartbeat for 40\d\d s, limit 1200 s; last step 40 at .* UTC, running\)$", lines[2])
  assert lines[3].startswith("STALE (") and lines[3].endswith("failed: OSError: x)")
  assert lines[4:] == ["heartbeat not readable now (gs://b/runs/x/heartbeat.json)"] * 2
  assert calls.count("storage cat gs://b/runs/x/heartbeat.json") == 6
  assert not any("systemctl restart" in c for c in calls)  # reported, never acted on unless asked


def test_watch_restarts_a_hung_run_once_when_asked_and_never_a_failed_one(tmp_path):
  stale = beat_at(4000, 40)
  lines, calls = watch(tmp_path, ["ACTIVE"] * 5 + [""] * 3,
                       [stale, stale, beat_at(4000, 40, "failed: OSError: x"), beat_at(1, 41), None, None],
                       "--restart_stale")
  restarts = [c for c in calls if "systemctl restart midas-midas" in c]
  assert len(restarts) == 1 and "tpu-vm ssh pod --worker=all" in restarts[0]
  assert calls.index(restarts[0]) == 3  # after the first stale look (describe, describe, cat), not the second
  assert lines[3].startswith("step 41")
