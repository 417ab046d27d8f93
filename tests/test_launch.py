"""Launchers print the commands they would run (--dry-run), and distributed.plan reads flags and env.

The TPU VM and GKE launchers, their worker-side files and what they install: tests/test_pod_launch.py.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import distributed
from midas_jax.errors import ConfigError

MIDAS = ["train", "--gin_file=gin/experiments/midas_cpu.gin", "--workdir=/runs/x"]


def dry_run(script, *args):
  """The launcher's printed lines, split into (comments, commands as argv lists)."""
  proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "launch", script), *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=60, env=dict(os.environ, PATH=""))
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  return [l for l in lines if l.startswith("#")], [shlex.split(l) for l in lines if not l.startswith("#")]


def test_slurm_writes_one_task_per_gpu_and_submits():
  notes, cmds = dry_run("slurm.py", "--dry-run", "--nodes=4", "--partition=gpu", "--account=lab",
                        "--venv=/opt/venv", "--script=/tmp/job.sbatch", "--", *MIDAS)
  assert cmds == [["sbatch", "/tmp/job.sbatch"]]
  script = [n[len("#   "):] for n in notes if n.startswith("#   ")]
  assert script[0] == "#!/bin/bash"
  for option in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--account=lab"):
    assert f"#SBATCH {option}" in script
  assert "source /opt/venv/bin/activate" in script
  srun = [l for l in script if l.startswith("srun ")]
  assert len(srun) == 1 and srun[0].endswith("python -m midas_jax " + shlex.join(MIDAS) + " &")
  assert script[-1] == 'exit "$status"'  # the job ends with the run's status, after a line that says what it means
  assert "  76) echo 'midas: ended with 76 (preempted, saved): submit this script again (it resumes from the " \
         "workdir)' ;;" in script


GS_MIDAS = ["train", "--gin_file=gin/experiments/midas_cpu.gin", "--workdir=gs://bucket/runs/x"]


def test_slurm_and_local_pass_env():
  notes, _ = dry_run("slurm.py", "--dry-run", "--env=A=1", "--env=B=x y", "--", *GS_MIDAS)
  script = [n[len("#   "):] for n in notes if n.startswith("#   ")]
  assert "export A=1" in script and "export B='x y'" in script
  assert next(l for l in script if l.startswith("srun ")).endswith(shlex.join(GS_MIDAS) + " &")
  _, cmds = dry_run("local.py", "--dry-run", "--num_processes=2", "--env=A=1", "--", *GS_MIDAS)
  assert all(c[0] == "env" and "A=1" in c for c in cmds)
  proc = subprocess.run([sys.executable, "launch/local.py", "--dry-run", "--env=1A=x", "--", *MIDAS],
                        cwd=REPO_ROOT, capture_output=True, text=True)
  assert proc.returncode == 2 and "--env=1A=x" in proc.stderr


def test_slurm_refuses_a_task_count_that_splits_gpus_unevenly():
  proc = subprocess.run([sys.executable, "launch/slurm.py", "--dry-run", "--tasks_per_node=3", "--", *MIDAS],
                        cwd=REPO_ROOT, capture_output=True, text=True)
  assert proc.returncode == 2 and "--tasks_per_node" in proc.stderr


def test_local_gives_each_process_the_coordinator_and_simulated_devices():
  notes, cmds = dry_run("local.py", "--dry-run", "--num_processes=3", "--devices_per_process=2",
                        "--port=4321", "--python=python3", "--", *MIDAS)
  assert notes == ["# 3 processes, coordinator 127.0.0.1:4321"]
  for i, cmd in enumerate(cmds):
    assert cmd[:3] == ["env", "JAX_PLATFORMS=cpu", "XLA_FLAGS=--xla_force_host_platform_device_count=2"]
    assert cmd[3:] == ["python3", "-m", "midas_jax", *MIDAS, "--coordinator_address=127.0.0.1:4321",
                       "--num_processes=3", f"--process_id={i}"]
  assert len(cmds) == 3


def test_launchers_need_a_midas_command():
  for script in ("local.py", "slurm.py"):
    proc = subprocess.run([sys.executable, f"launch/{script}", "--dry-run"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no midas command" in proc.stderr


def _flags(**kw):
  parser = argparse.ArgumentParser()
  distributed.add_flags(parser)
  return parser.parse_args([f"--{k}={v}" for k, v in kw.items()])


SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_NTASKS": "32", "SLURM_PROCID": "9",
         "SLURM_LOCALID": "1"}


def test_plan_single_process_by_default():
  assert distributed.plan(_flags(), environ={}, on_tpu_vm=False) == distributed.Plan("single")


def test_plan_explicit_flags_then_env_fallback():
  plan = distributed.plan(_flags(coordinator_address="10.0.0.2:8476", num_processes=4, process_id=3),
                          environ=SLURM, on_tpu_vm=True)  # explicit flags win over everything
  assert plan == distributed.Plan("explicit", "10.0.0.2:8476", 4, 3)
  env = {"MIDAS_COORDINATOR_ADDRESS": "h:1", "MIDAS_NUM_PROCESSES": "2", "MIDAS_PROCESS_ID": "1"}
  assert distributed.plan(_flags(process_id=0), environ=env, on_tpu_vm=False).process_id == 0  # flag over env
  assert distributed.plan(_flags(), environ=env, on_tpu_vm=False) == distributed.Plan("explicit", "h:1", 2, 1)


@pytest.mark.parametrize("flags,setting", [
    (dict(coordinator_address="h:1", num_processes=2), "--process_id"),
    (dict(coordinator_address="nohostport", num_processes=2, process_id=0), "--coordinator_address"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), "--process_id"),
])
def test_plan_refuses_incomplete_or_bad_coordinator_settings(flags, setting):
  with pytest.raises(ConfigError, match=setting):
    distributed.plan(_flags(**flags), environ={}, on_tpu_vm=False)


def test_plan_detects_slurm_and_tpu_vms():
  assert distributed.plan(None, environ=SLURM, on_tpu_vm=False) == distributed.Plan("slurm", None, 32, 9)
  one_task_per_node = dict(SLURM, SLURM_NTASKS="4", SLURM_PROCID="2", SLURM_NTASKS_PER_NODE="1",
                           SLURM_GPUS_ON_NODE="8")
  assert distributed.plan(None, environ=one_task_per_node, on_tpu_vm=False).local_device_ids == tuple(range(8))
  assert distributed.plan(None, environ=dict(SLURM, SLURM_NTASKS="1"), on_tpu_vm=False).mode == "single"
  assert distributed.plan(None, environ={}, on_tpu_vm=True) == distributed.Plan("tpu_vm")


def test_tpu_chips_are_told_from_google_nics_by_pci_device_id(tmp_path):
  def device(name, vendor, device_id):
    (tmp_path / name).mkdir()
    (tmp_path / name / "vendor").write_text(vendor + "\n")
    (tmp_path / name / "device").write_text(device_id + "\n")
  device("0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC
  assert not distributed.tpu_chips_present(str(tmp_path))
  device("0000:00:05.0", "0x1ae0", "0x0062")  # v5p
  assert distributed.tpu_chips_present(str(tmp_path))


def test_initialize_does_nothing_for_a_single_process():
  assert distributed.initialize(_flags()).mode == "single"


def test_local_follows_every_process_and_returns_the_first_failure(tmp_path):
  proc = subprocess.run([sys.executable, "launch/local.py", "--num_processes=2", "--", "train",
                         f"--gin_file={tmp_path}/missing.gin", f"--workdir={tmp_path}/run"],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=REPO_ROOT))
  assert proc.returncode == 2  # midas's status for bad input, from whichever process ended first
  # Each line comes prefixed with its process; the later one may be stopped before it says anything.
  assert re.search(r"^\[[01]\] midas: error: --gin_file: no gin file", proc.stdout, re.M), proc.stdout
