"""One process of a two-process job fails; every process stops within a bound, with the same exit status and
the failing process's reason, and nothing good is set aside.

Each fault is injected into process 1 only: its storage requests go through a fault proxy (tests/fault_proxy.py)
while process 0 talks to the GCS emulator directly, or a sitecustomize module on its path alone poisons its rows
of the batch. Each pair has a hard timeout: a hang fails the test instead of stalling the suite. The first test
is the mechanism alone, in two bare jax.distributed processes: a process blocked in a device collective its
peer never joins is stopped by its watchdog with the peer's status.
"""

import argparse
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO_ROOT
from midas_jax import cli, distributed, exit_status, peers
from midas_jax.checkpoint import available_steps
from midas_jax.errors import ConfigError, HaltedError
from midas_jax.train import attempts
from test_pod import _free_port

BOUND_S = 150  # every process must have exited this long after the pair started (the hard timeout)
GIN = """
include 'gin/experiments/midas_cpu.gin'
ModelConfig.d_model = 32
ModelConfig.num_layers = 4
ModelConfig.num_heads = 4
ModelConfig.num_kv_heads = 2
ModelConfig.d_ff = 64
ModelConfig.dtype = 'float32'
StackingConfig.num_stages = 2
StackingConfig.block_size = 2
StackingConfig.stage_steps = (4, 4)
TrainerConfig.num_steps = 8
TrainerConfig.log_every = 2
TrainerConfig.eval_every = 0
TrainerConfig.progress_bar = False
TrainerConfig.peak_flops_per_device = 1e11
DataConfig.batch_size = 8
DataConfig.seq_len = 32
DataConfig.prefetch = 0
MeshConfig.data = 1
MeshConfig.fsdp = -1
CheckpointConfig.every = 0
"""
GROWTH, LAST = 4, 8  # the saves a run of GIN makes: at the growth and at the end


@pytest.fixture(scope="module")
def setup(gcs, tmp_path_factory):
  root = tmp_path_factory.mktemp("peers")
  gin_file = root / "run.gin"
  gin_file.write_text(GIN)
  env = dict(os.environ, **gcs.environment(), JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  return gin_file, gcs.new_bucket(), env, root


def run_pair(gin_file, workdir, envs, *extra):
  """Starts `midas train` as processes 0 and 1 (envs[i] each) and returns (exit statuses, outputs, seconds)."""
  port, start = _free_port(), time.monotonic()
  procs = [subprocess.Popen([sys.executable, "-u", "-m", "midas_jax", "train", f"--gin_file={gin_file}",
                             f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                             f"--process_id={i}", "--peer_timeout_s=60", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
           for i, env in enumerate(envs)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=max(BOUND_S - (time.monotonic() - start), 1))[0])
  except subprocess.TimeoutExpired:
    for proc in procs:
      proc.kill()
    raise AssertionError(f"the pair did not stop within {BOUND_S} s: "
                         + "\n".join((p.communicate()[0] or "")[-2000:] for p in procs))
  return [p.returncode for p in procs], outputs, time.monotonic() - start


def test_a_process_blocked_in_a_collective_stops_with_its_peers_status(tmp_path):
  script = tmp_path / "pair.py"
  script.write_text(textwrap.dedent("""
      import sys
      from midas_jax import cli, distributed, peers
      from jax.experimental import multihost_utils
      import argparse
      args = argparse.Namespace(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]),
                                initialization_timeout_s=60, peer_timeout_s=30)
      distributed.initialize(args)
      multihost_utils.sync_global_devices("both here")
      if args.process_id == 1:
        sys.exit(cli._stop(75, "midas: stopped: injected: the storage did not answer"))
      multihost_utils.sync_global_devices("process 1 never comes")  # blocks: only the watchdog ends it
      print("passed a collective its peer never joined")
  """))
  address = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  procs = [subprocess.Popen([sys.executable, str(script), address, str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
  outputs = [p.communicate(timeout=60)[0] for p in procs]
  assert [p.returncode for p in procs] == [75, 75], outputs
  assert "process 1 failed, so this process (process 0) stops too, with the same exit status 75" in outputs[0]
  assert "injected: the storage did not answer" in outputs[0] and "passed" not in outputs[0]


@pytest.fixture(scope="module")
def failed_save(setup, gcs):
  """A pair whose process 1 may not write the last save (403 on its paths): (statuses, outputs, workdir)."""
  from fault_proxy import FaultProxy  # pylint: disable=import-outside-toplevel
  gin_file, bucket, env, _ = setup
  workdir = f"{bucket}/save"
  proxy = FaultProxy(gcs).start()
  try:
    proxy.only, proxy.status = rf"/save/checkpoints/{LAST}/", 403
    proxy.outage(BOUND_S)
    codes, outputs, _ = run_pair(gin_file, workdir, [env, dict(env, **proxy.environment())])
  finally:
    proxy.stop()
  return codes, outputs, workdir


def test_a_save_that_fails_on_one_process_stops_both_naming_the_step_and_the_save_that_stands(failed_save):
  codes, outputs, workdir = failed_save
  assert codes == [exit_status.BAD_INPUT.status] * 2, "\n".join(o[-3000:] for o in outputs)  # a 403: not by waiting
  message = f"writing the save of step {LAST} to {workdir}/checkpoints/{LAST}: "
  assert message in outputs[1] and f"the save of step {GROWTH} stands" in outputs[1], outputs[1][-3000:]
  assert outputs[1].count("midas: error:") == 1  # said once, not again on the way out
  assert "Traceback" not in outputs[1]  # orbax's log of its commit thread's storage error is not printed too
  assert "process 1 failed" in outputs[0] and message in outputs[0]
  assert available_steps(workdir) == [GROWTH]  # the failed save was never committed; the one before stands
  assert f"saving step {LAST}" in outputs[0]  # it trained to the end and started the last save


def test_a_restore_read_that_fails_on_one_process_stops_both_as_unavailable_and_sets_nothing_aside(
    setup, failed_save, fault_proxy):
  gin_file, _, env, _ = setup
  workdir = failed_save[2]  # its save of step 4 stands
  fault_proxy.only = rf"/save/checkpoints/{GROWTH}/(metadata|params|state)/"  # process 1's reads of it: 503
  fault_proxy.outage(BOUND_S)
  codes, outputs, _ = run_pair(gin_file, workdir, [env, dict(env, **fault_proxy.environment())])
  assert codes == [75, 75], "\n".join(o[-3000:] for o in outputs)
  assert f"reading the metadata of {workdir}/checkpoints/{GROWTH}: the storage is unavailable: HTTP 503" in outputs[1]
  assert "stops every process with exit status 75" in outputs[1] and "Traceback" not in outputs[1]
  assert outputs[1].count("midas: stopped:") == 1
  assert "process 1 failed, so this process (process 0) stops too, with the same exit status 75" in outputs[0]
  assert "the storage is unavailable: HTTP 503" in outputs[0]  # the failing host's reason, in the other's log
  assert available_steps(workdir) == [GROWTH]  # nothing set aside, nothing trained
  assert "set aside" not in "".join(outputs) and not any(re.search(r"^step \d+ train", o, re.M) for o in outputs)


def test_a_loss_poisoned_on_one_process_halts_both_and_saves_nothing_after_it(setup):
  gin_file, bucket, env, root = setup
  poison = root / "poison"
  poison.mkdir(exist_ok=True)
  (poison / "sitecustomize.py").write_text(textwrap.dedent("""
      # Process 1's rows of every batch from step 5 on carry NaN loss weights: the global loss is not finite.
      import numpy as np
      from midas_jax.train import build
      _rows = build.StageBuild.host_batch
      def host_batch(self, step, split="train"):
        batch = _rows(self, step, split)
        if split == "train" and step >= 5:
          batch = dict(batch, loss_weights=np.full_like(batch["loss_weights"], np.nan))
        return batch
      build.StageBuild.host_batch = host_batch
  """))
  workdir = f"{bucket}/nan"
  codes, outputs, _ = run_pair(gin_file, workdir, [env, dict(env, PYTHONPATH=f"{poison}:{REPO_ROOT}")])
  assert codes == [exit_status.HALTED.status] * 2, "\n".join(o[-3000:] for o in outputs)
  for out in outputs:
    assert "training stopped: the loss became non-finite at step 6" in out and "exit status 3" in out, out[-3000:]
  assert available_steps(workdir) == [GROWTH]  # the growth's save; no state after the poisoned step


def test_a_failure_at_the_same_step_twice_halts_naming_both_causes(tmp_path, monkeypatch):
  workdir = str(tmp_path)

  def attempt(name, cause, step):
    monkeypatch.setattr(peers, "_attempt", name)  # each start of the job has its own id
    attempts.check_repeat(workdir, attempts.failed_at(RuntimeError(cause), step))

  attempt("first", "XlaRuntimeError: RESOURCE_EXHAUSTED at the growth", 12)  # recorded: may be a fluke
  attempt("second", "a different bug", 13)  # another step: restarted again
  attempt("second", "the same bug, seen by another process of the same attempt", 13)  # not a second attempt
  with pytest.raises(HaltedError) as halted:
    attempt("third", "XlaRuntimeError: RESOURCE_EXHAUSTED once more", 13)
  text = str(halted.value)
  assert "failed at step 13 twice in a row" in text and "a different bug" in text and "once more" in text
  assert halted.value.exit_status == exit_status.HALTED.status
  attempts.clear(workdir)  # a finished or preempted run: the next failure is a first one again
  attempt("fourth", "x", 13)


def test_every_exit_class_has_one_status_and_the_cli_uses_them():
  statuses = [c.status for c in exit_status.ALL]
  assert len(set(statuses)) == len(statuses)
  assert set(exit_status.NEVER_RESTART) == {0, 2, 3}
  assert cli.main(["train", "--gin_file=/nonexistent.gin", "--workdir=/tmp/x"]) == exit_status.BAD_INPUT.status


def test_the_waits_are_settings_checked_before_anything_starts():
  parser = argparse.ArgumentParser()
  distributed.add_flags(parser)
  explicit = ["--coordinator_address=10.0.0.2:8476", "--num_processes=4", "--process_id=1"]
  plan = distributed.plan(parser.parse_args(explicit), environ={"MIDAS_PEER_TIMEOUT_S": "30"}, on_tpu_vm=False)
  assert (plan.peer_timeout_s, plan.initialization_timeout_s) == (30, 600)
  plan = distributed.plan(parser.parse_args(explicit + ["--initialization_timeout_s=1800"]), environ={},
                          on_tpu_vm=False)
  assert (plan.peer_timeout_s, plan.initialization_timeout_s) == (120, 1800)
  with pytest.raises(ConfigError, match="--peer_timeout_s: must be at least 1 second"):
    distributed.plan(parser.parse_args(explicit + ["--peer_timeout_s=0"]), environ={}, on_tpu_vm=False)
