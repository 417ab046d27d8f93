"""Two processes (4 simulated CPU devices each, joined by jax.distributed on 127.0.0.1) on a gs://
workdir: a SIGTERM to one of them stops both at the same step, and a resume agrees across them.

The run grows at step 4 and logs every 4 steps. Process 1 gets SIGTERM right after process 0 logs
step 4, so the stop falls between log steps: both processes must stop at the same step before
step 8 (where a check at log steps only would first see it), after one committed save, with exit
status 0. Then that save is damaged and the pair is started again: process 0 alone moves it aside
(once), both restore the growth's save at step 4, and they train to the end, logging the same loss
at the step the first attempt stopped at.
"""

import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import fs
from midas_jax.checkpoint import available_steps, checkpoint_dir
from midas_jax.train.metrics import read_metrics
import test_kill_resume as kill_resume

GIN = kill_resume.GIN + """
TrainerConfig.num_steps = 10
TrainerConfig.log_every = 4
TrainerConfig.eval_every = 0
StackingConfig.stage_steps = (4, 6)
CheckpointConfig.every = 0
DataConfig.prefetch = 0
MeshConfig.data = 1
MeshConfig.fsdp = -1
"""
BOUNDARY, LOG_EVERY, NUM_STEPS = 4, 4, 10


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
  head = []
  for line in procs[0].stdout:
    head.append(line)
    if re.match(rf"step {LOG_EVERY} train", line):
      procs[1].send_signal(signal.SIGTERM)
      break
  outputs = finish(procs)
  outputs[0] = "".join(head) + outputs[0]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
  stops = [int(re.search(r"stopped at step (\d+) after saving", out).group(1)) for out in outputs]
  assert stops[0] == stops[1] and LOG_EVERY < stops[0] < 2 * LOG_EVERY, stops
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
  assert sum(o.count(f"step {stop} is unusable") for o in outputs) == 1  # reported (and moved) once
  moved = [n for n in fs.listdir(checkpoint_dir(workdir)) if n.startswith(f"corrupt-{stop}-")]
  assert len(moved) == 1
  again = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}
  assert sorted(again) == list(range(BOUNDARY, NUM_STEPS + 1))
  assert again[stop] == pytest.approx(first[stop], rel=1e-6)
