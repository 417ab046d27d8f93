"""Two processes (4 simulated CPU devices each, joined by jax.distributed on 127.0.0.1) on a gs://
workdir: a SIGTERM to one of them stops both at the same step, and a resume agrees across them.

The run grows at step 4 and logs every 4 steps. When process 0 has logged step 4 it is paused
(SIGSTOP) and what it printed is read: the last step it logged is the step the signal comes at.
Process 1 gets SIGTERM, process 0 is resumed, and both must stop at the same step just after that
one (jax's preemption service agrees on the step after the furthest either has reached), which falls
between log steps, after one committed save, with exit status 76 (preempted, saved). Then that save is damaged and the pair is started again:
process 0 alone moves it aside (once), both restore the growth's save at step 4, and they train to
the end, logging the same loss at the step the first attempt stopped at.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT
from midas_jax import exit_status, fs
from midas_jax.checkpoint import available_steps, checkpoint_dir
from midas_jax.train.metrics import read_metrics
import test_kill_resume as kill_resume

GIN = kill_resume.GIN + """
TrainerConfig.num_steps = 16
TrainerConfig.log_every = 4
TrainerConfig.eval_every = 0
StackingConfig.stage_steps = (4, 12)
CheckpointConfig.every = 0
DataConfig.prefetch = 0
MeshConfig.data = 1
MeshConfig.fsdp = -1
"""
BOUNDARY, LOG_EVERY, NUM_STEPS = 4, 4, 16


def start_pair(gin_file, workdir, env, *extra):
  port = _free_port()
  return [subprocess.Popen([sys.executable, "-u", "-m", "midas_jax", "train", f"--gin_file={gin_file}", *extra,
                            f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}",
                            "--num_processes=2", f"--process_id={i}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
          for i in range(2)]


def _free_port():
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def read_until(proc, pattern):
  """proc's output up to a line matching pattern, read from the pipe itself (so nothing is read ahead)."""
  out = b""
  while not re.search(pattern, out.decode(errors="replace"), re.M):
    chunk = os.read(proc.stdout.fileno(), 1 << 16)
    assert chunk, out.decode(errors="replace")[-3000:]  # it ended first
    out += chunk
  return out


def pause(proc):
  """SIGSTOPs proc, waits until every thread of it has stopped, and returns what it printed until then."""
  os.kill(proc.pid, signal.SIGSTOP)
  for _ in range(3000):
    states = []
    for task in os.listdir(f"/proc/{proc.pid}/task"):
      try:
        with open(f"/proc/{proc.pid}/task/{task}/stat") as f:
          states.append(f.read().rsplit(")", 1)[1].split()[0])
      except FileNotFoundError:  # the thread ended meanwhile
        pass
    if all(state in "tT" for state in states):
      break
    time.sleep(0.01)
  else:
    raise AssertionError(f"process {proc.pid} did not stop: {states}")
  fd, out = proc.stdout.fileno(), b""
  os.set_blocking(fd, False)
  try:
    while chunk := os.read(fd, 1 << 16):
      out += chunk
  except BlockingIOError:  # all of it read
    pass
  finally:
    os.set_blocking(fd, True)
  return out


def finish(procs, timeout=300):
  outputs = []
  for proc in procs:
    out, _ = proc.communicate(timeout=timeout)
    outputs.append(out)
  return outputs


@pytest.fixture(scope="module")
def pod(gcs, tmp_path_factory):
  root = tmp_path_factory.mktemp("pod")
  gin_file = root / "run.gin"
  gin_file.write_text(GIN)
  env = dict(os.environ, **gcs.environment(), JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  return gin_file, gcs.new_bucket() + "/pod", env


def test_sigterm_to_one_process_stops_both_at_the_same_step_and_resume_agrees(pod):
  gin_file, workdir, env = pod
  procs = start_pair(gin_file, workdir, env)
  head = read_until(procs[0], rf"^step {BOUNDARY} train")
  head = (head + pause(procs[0])).decode()
  signalled = max(int(n) for n in re.findall(r"^step (\d+) train", head, re.M))  # the last step logged
  procs[1].send_signal(signal.SIGTERM)
  os.kill(procs[0].pid, signal.SIGCONT)
  outputs = finish(procs)
  outputs[0] = head + outputs[0]
  assert [p.returncode for p in procs] == [exit_status.PREEMPTED.status] * 2, "\n".join(o[-3000:] for o in outputs)
  stops = [int(re.search(r"stopped at step (\d+) after saving", out).group(1)) for out in outputs]
  # Paused after logging step `signalled`, process 0 had reached at most the next step, and process 1 (which
  # waits for process 0's part of every step it logs) the one after: the agreed stop is at most one further.
  # Asking only now and then, or stopping at the end, would land later.
  assert stops[0] == stops[1] and signalled < stops[0] <= signalled + 3, (signalled, stops)
  assert stops[0] % LOG_EVERY, stops  # between log steps: every process saved there, not at its next log step
  stop = stops[0]
  assert available_steps(workdir) == [BOUNDARY, stop]  # the growth's save and the one preemption save
  first = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}

  # Damage the preemption save: the pair must agree to set it aside and both restore step 4.
  params = fs.join(checkpoint_dir(workdir), str(stop), "params")
  for path in fs.glob(fs.join(params, "**", "*")):
    if fs.isfile(path) and not path.endswith("commit_success.txt"):
      fs.remove(path)
  outputs = finish(start_pair(gin_file, workdir, env, "--gin.TrainerConfig.log_every=1"))
  assert all("resuming from" not in o or f"checkpoint of step {BOUNDARY}" in o for o in outputs)
  assert f"resuming from the checkpoint of step {BOUNDARY}" in outputs[0], outputs[0][-3000:]
  assert sum(o.count(f"step {stop} is damaged") for o in outputs) == 1  # reported (and set aside) once
  moved = [n for n in fs.listdir(checkpoint_dir(workdir)) if n.startswith(f"corrupt-{stop}-")]
  assert len(moved) == 1
  again = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}
  assert sorted(again) == list(range(BOUNDARY, NUM_STEPS + 1))  # each step once: those after step 4 redone
  assert again[stop] == pytest.approx(first[stop], rel=1e-6)
