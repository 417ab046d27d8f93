"""Records and events on gs:// without the training thread waiting on storage, through tests/fault_proxy.py.

The appender's parts are checked through an outage and a restart's filter; a run with log_every=1 through
latency and 503s spends under 5% of its wall time writing records; a run SIGKILLed with records past its
newest save, resumed, stopped by SIGTERM and resumed again logs every step once (up to the records of the
last flush interval before the kill, which a kill may take with it).
"""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO_ROOT, tiny_gin, tiny_run
from midas_jax import cli, configs, exit_status, fs
from midas_jax.checkpoint import available_steps
from midas_jax.fs import paths
from midas_jax.fs.background import Periodic
from midas_jax.train.checkpointer import NoCheckpointer
from midas_jax.train.goodput import KEYS
from midas_jax.train import metrics as metrics_lib
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import TrainingRun
from test_metrics import read_tb_scalars


@pytest.fixture
def proxy(gcs):
  """The fault proxy with a seed whose draws answer 503 early and often at a 5% rate (seed 0's first is 36th)."""
  from fault_proxy import FaultProxy  # pylint: disable=import-outside-toplevel
  started = FaultProxy(gcs, seed=1).start()
  yield started
  started.stop()


def lines(first, last):
  return "".join(f"{i:04d}\n" for i in range(first, last + 1))


def test_writes_never_wait_through_an_outage_and_land_in_parts(fault_proxy):
  path = fault_proxy.emulator.new_bucket() + "/run/log.jsonl"
  with fault_proxy.installed():
    fault_proxy.delay_s = 0.02
    log = fs.Appender(path, flush_seconds=1.0, part_chars=50)  # 10 lines a part
    fault_proxy.outage(600)

    def write_all():
      for i in range(1, 41):
        log.write(f"{i:04d}\n")
        time.sleep(0.01)

    writer = threading.Thread(target=write_all)
    writer.start()
    # The writes only queue. One that waited on an upload would wait out gcsfs's own retries of a
    # refused request (about 30 s) at every flush: far past this deadlock guard.
    writer.join(timeout=15)
    assert not writer.is_alive(), "a write waited on storage"
    time.sleep(1.5)  # a flush meets the outage
    assert fault_proxy.injected > 0
    fault_proxy.clear()
    assert log.close(timeout=60)
  assert fs.read_appended(path) == lines(1, 40)
  assert fs.listdir(fs.dirname(path)) == [f"log.jsonl.{n:06d}" for n in range(4)]


def test_the_writer_thread_retries_and_says_once_when_storage_refuses_for_long(capsys):
  """gcsfs retries a request for about 30 s itself; past that the thread's own retries take over."""
  refuse_until, calls = time.monotonic() + 0.6, []

  def upload():
    calls.append(time.monotonic())
    if calls[-1] < refuse_until:
      raise OSError("503 Service Unavailable")

  writer = Periodic(upload, interval=0.05, what="gs://b/log", max_pause=0.1, warn_after=0.3)
  time.sleep(1.0)
  assert writer.close(timeout=5)
  out = capsys.readouterr().out
  assert out.count("gs://b/log: storage has refused writes for") == 1 and "(OSError: 503 Service Unavailable)" in out
  assert out.count("gs://b/log: writing again after") == 1
  assert len(calls) >= 6 and calls[-1] >= refuse_until  # retried, at most max_pause apart, until one succeeded


def test_a_flush_stores_what_was_written_at_once_and_gives_up_in_bounded_time(fault_proxy):
  path = fault_proxy.emulator.new_bucket() + "/run/log.jsonl"
  with fault_proxy.installed():
    log = fs.Appender(path, flush_seconds=600)  # no periodic upload during the test
    log.write(lines(1, 3))
    assert log.flush(timeout=30) and fs.read_appended(path) == lines(1, 3)
    fault_proxy.outage(600)
    log.write(lines(4, 5))
    assert not log.flush(timeout=1.0)  # refused: it stays queued
    fault_proxy.clear()
    assert log.flush(timeout=60) and fs.read_appended(path) == lines(1, 5)
    assert log.close()


def test_a_writer_that_fails_for_another_reason_says_so_at_once(capsys):
  calls = []

  def upload():
    calls.append(1)
    if len(calls) < 3:
      raise ValueError("a bug in the writer")

  writer = Periodic(upload, interval=0.05, what="gs://b/log", max_pause=0.1, warn_after=600)
  assert writer.flush(timeout=10)  # retried until it succeeded
  assert writer.close(timeout=5)
  out = capsys.readouterr().out
  assert out.count("is not a storage error (ValueError: a bug in the writer)") == 1 and "refused writes" not in out


def test_a_restart_filter_rewrites_the_parts_that_hold_refused_lines(gcs):
  path = gcs.new_bucket() + "/run/log.jsonl"
  log = fs.Appender(path, flush_seconds=1.0, part_chars=50)
  log.write(lines(1, 35))  # one write larger than a part: a part of its own
  log.write(lines(36, 38))
  log.write(lines(39, 46))  # too many for the part holding 36-38: they start the next one
  assert log.close()
  assert fs.listdir(fs.dirname(path)) == [f"log.jsonl.{n:06d}" for n in range(3)]
  log = fs.Appender(path, keep=lambda line: int(line) <= 37, flush_seconds=1.0, part_chars=50)
  assert "".join(log.kept) == lines(1, 37)
  assert fs.read_appended(path) == lines(1, 37)  # part 1 rewritten, part 2 gone, before any write
  log.write(lines(38, 39))
  assert log.close()
  assert fs.read_appended(path) == lines(1, 39)
  assert fs.listdir(fs.dirname(path)) == [f"log.jsonl.{n:06d}" for n in range(2)]  # part 1 was continued


def test_a_long_outage_bounds_memory_and_says_so_once(fault_proxy, capsys):
  path = fault_proxy.emulator.new_bucket() + "/run/log.jsonl"
  with fault_proxy.installed():
    log = fs.Appender(path, flush_seconds=1.0, max_backlog_chars=50)  # 10 lines
    fault_proxy.outage(600)
    log.write(lines(1, 5))
    time.sleep(1.5)  # their upload has met the outage (gcsfs retries it for about 30 s)
    for i in range(6, 31):
      log.write(f"{i:04d}\n")
    assert log.dropped == 20
    fault_proxy.clear()
    assert not log.close(timeout=60)  # stored what it kept, and says that some writes were dropped
  assert fs.read_appended(path) == lines(1, 10)
  out = capsys.readouterr().out
  assert out.count("further writes are dropped") == 1 and "20 writes were dropped" in out


def test_log_every_step_through_latency_and_503s_costs_under_5_percent(proxy):
  """The run's own goodput record says how long its training thread spent writing records (the code before
  background writing spent 45% of this run's wall time there, 58% at 5% 503s: it uploaded the whole file
  on every record)."""
  workdir = proxy.emulator.new_bucket() + "/run"
  config = tiny_run(trainer=configs.TrainerConfig(num_steps=24, log_every=1, eval_every=0, progress_bar=False,
                                                  peak_flops_per_device=1e11, metrics_flush_seconds=1.0))
  with proxy.installed(), contextlib.redirect_stdout(io.StringIO()):
    proxy.delay_s, proxy.error_rate = 0.02, 0.05
    run = TrainingRun(config, workdir, NoCheckpointer())
    try:
      run.run()
    finally:
      start = time.perf_counter()
      run.close()  # stores the last records: a normal exit's flush
      closing = time.perf_counter() - start
    requests, injected = proxy.requests, proxy.injected
  records = read_metrics(workdir, "train")
  assert [r["step"] for r in records] == list(range(1, 25))  # all stored by the exit, each once
  wall = sum(r[k] for r in records for k in KEYS)
  start_up = records[0]["time/logging"]  # the writer's opening (a listing, tensorboardX's import)
  writes = sum(r["time/logging"] for r in records[1:])  # each record's write is timed into the next one
  print(f"\n{len(records)} records through {requests} requests ({injected} answered 503): writes "
        f"{writes:.3f} s of {wall:.2f} s ({writes / wall:.2%}); start-up {start_up:.3f} s; close {closing:.2f} s")
  assert injected > 0 and writes / wall < 0.05
  loss = read_tb_scalars_on_gcs(fs.join(workdir, "tensorboard", "train"))["loss"]
  assert [step for step, _ in loss] == list(range(1, 25))


def test_event_files_are_closed_at_a_bounded_size(tmp_path, monkeypatch):
  """A mirror uploads a changed file whole: so each split's events go to a new file every EVENTS_PER_FILE."""
  monkeypatch.setattr(metrics_lib, "EVENTS_PER_FILE", 4)
  with metrics_lib.MetricWriter(str(tmp_path), stdout=False) as writer:
    for step in range(1, 6):
      writer.write(step, "train", {"loss": float(step), "lr": 0.1})
  assert len(os.listdir(tmp_path / "tensorboard" / "train")) == 3
  assert read_tb_scalars(tmp_path / "tensorboard" / "train")["loss"] == [(s, float(s)) for s in range(1, 6)]


def read_tb_scalars_on_gcs(directory):
  with fs.local_tree(directory) as local:
    return read_tb_scalars(local)


# 4 layers grown in 2 stages at step 4; saves at the growth, at the end and on SIGTERM only. 40 steps, so that the
# killed and the stopped run are still training when the test acts (the last run trains the rest in a second).
GIN = tiny_gin("""
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 2
TrainerConfig.num_steps = 40
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 20
TrainerConfig.eval_batches = 1
TrainerConfig.metrics_flush_seconds = 1.0
StackingConfig.num_stages = 2
StackingConfig.stage_steps = (4, 36)
StackingConfig.alpha = 1.0
CheckpointConfig.every = 0
CheckpointConfig.keep = 3
""", num_layers=4)
NUM_STEPS, BOUNDARY = 40, 4


class Run:
  """`midas train` in a subprocess, its output read on a thread so that the test can watch the bucket."""

  def __init__(self, args, env):
    self.proc = subprocess.Popen([sys.executable, "-u", "-m", "midas_jax", *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
    self.lines = []
    self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
    self._reader.start()

  @property
  def output(self) -> str:
    return "".join(self.lines)

  def wait_for(self, condition, what, timeout=120.0):
    deadline = time.time() + timeout
    while not condition():
      assert self.proc.poll() is None, f"the run ended before {what}:\n{self.output[-3000:]}"
      assert time.time() < deadline, f"no {what} in {timeout} s:\n{self.output[-3000:]}"
      time.sleep(0.1)

  def end(self, sig=None):
    if sig is not None:
      self.proc.send_signal(sig)
    self.proc.wait(timeout=120)
    self._reader.join(timeout=10)
    return self.proc.returncode


def steps_of(workdir, split="train"):
  return [r["step"] for r in read_metrics(workdir, split)]


def test_every_record_once_after_a_sigkill_a_sigterm_and_resumes(gcs, tmp_path):
  workdir = gcs.new_bucket() + "/run"
  gin_file = tmp_path / "run.gin"
  gin_file.write_text(GIN)
  args = ["train", f"--gin_file={gin_file}", f"--workdir={workdir}"]
  env = dict(os.environ, **gcs.environment(), JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=8")

  # 1. SIGKILL once the bucket holds records past the newest save: the restart must drop them.
  seen = {}

  def records_past_a_save():
    paths.refresh(workdir)  # this process lists the bucket again and again
    saves = available_steps(workdir)
    steps = steps_of(workdir)
    seen.update(save=saves[-1] if saves else 0, steps=steps)
    return saves and steps and steps[-1] > saves[-1]

  first = Run(args, env)
  first.wait_for(records_past_a_save, "records stored past a save")
  assert first.end(signal.SIGKILL) == -signal.SIGKILL

  # 2. The restart, stopped by SIGTERM: it saves, stores its last records and exits cleanly.
  second = Run(args, env)
  second.wait_for(lambda: re.search(r"resuming from the checkpoint of step (\d+)", second.output)
                  and re.search(r"step \d+ train", second.output.split("resuming")[-1]), "a step after the resume")
  resumed = int(re.search(r"resuming from the checkpoint of step (\d+)", second.output).group(1))
  assert resumed >= seen["save"] and seen["steps"][-1] > seen["save"]
  assert second.end(signal.SIGTERM) == exit_status.PREEMPTED.status, second.output[-3000:]  # saved: restart it
  stopped = int(re.search(r"stopped at step (\d+)", second.output).group(1))
  # The records up to a save are stored as it starts (the run waits for them, up to 10 s), so a resume
  # from it finds them all. Only a save whose async commit beat that upload, and a kill between the two,
  # could take some with it: steps after the last ones seen, up to the save resumed from. None is twice.
  got = steps_of(workdir)
  lost = set(range(1, stopped + 1)) - set(got)
  assert got == sorted(set(got)) and set(got) <= set(range(1, stopped + 1)), (seen, resumed, stopped, got)
  assert lost <= set(range(seen["steps"][-1] + 1, resumed + 1)), (seen, resumed, stopped, got)

  # 3. The second restart runs to the end, in this process.
  paths.refresh(workdir)  # what this process listed of the bucket is out of date
  with contextlib.redirect_stdout(io.StringIO()) as out:
    assert cli.main(args) == 0
  assert f"resuming from the checkpoint of step {stopped}" in out.getvalue()
  assert steps_of(workdir) == [s for s in range(1, NUM_STEPS + 1) if s not in lost]
  assert steps_of(workdir, "eval") == [20, 40] and steps_of(workdir, "stage") == [BOUNDARY]
  print(f"\nkilled with records to step {seen['steps'][-1]} past the save of step {seen['save']}, resumed from "
        f"{resumed}, stopped at {stopped}; steps lost to the kill: {sorted(lost)}")
