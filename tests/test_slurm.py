"""launch/slurm.py's batch script run by bash against stand-ins for srun, scontrol and sleep: the SIGTERM
before the time limit reaches the tasks, restart statuses requeue the job, the others never do, and each
NCCL profile is exported with its reason."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import exit_status

sys.path.insert(0, os.path.join(REPO_ROOT, "launch"))
import nccl  # noqa: E402  pylint: disable=wrong-import-position
import slurm  # noqa: E402  pylint: disable=wrong-import-position

MIDAS = ["train", "--gin_file=gin/experiments/midas_cpu.gin", "--workdir=/runs/x"]
# srun's stand-in: records its argv, then ends with $FAKE_STATUS, or (FAKE_STATUS=wait) waits for SIGTERM
# and ends with 76, as the run does once it has saved.
SRUN = """#!/bin/bash
echo "$@" > "$LOG/srun"
if [ "$FAKE_STATUS" = wait ]; then
  trap 'echo TERM > "$LOG/srun_got"; exit 76' TERM
  touch "$LOG/ready"
  for _ in $(seq 1200); do /bin/sleep 0.05; done  # about a minute at most, then fail
  exit 1
fi
exit "$FAKE_STATUS"
"""


def _script(tmp_path, *flags):
  args = slurm.parse([*flags, f"--chdir={tmp_path}", "--", *MIDAS])
  path = tmp_path / "job.sbatch"
  path.write_text(slurm.sbatch_script(args))
  return path


def _bin(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  stubs = {"srun": SRUN, "scontrol": '#!/bin/bash\necho "$@" >> "$LOG/scontrol"\n',
           "sleep": '#!/bin/bash\necho "$@" >> "$LOG/sleep"\n'}
  for name, text in stubs.items():
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  return bin_dir


def _env(tmp_path, status, restarts=0):
  return dict(os.environ, PATH=f"{_bin(tmp_path)}:/usr/bin:/bin", LOG=str(tmp_path), FAKE_STATUS=str(status),
              SLURM_JOB_ID="4242", SLURM_RESTART_COUNT=str(restarts))


def _read(path: pathlib.Path) -> str:
  return path.read_text() if path.exists() else ""


def test_signal_before_the_time_limit_and_requeue_are_asked_of_sbatch(tmp_path):
  text = _script(tmp_path).read_text()
  assert f"#SBATCH --signal=B:TERM@{slurm.SIGNAL_S}\n" in text and "#SBATCH --requeue\n" in text
  text = _script(tmp_path, "--signal_s=120", "--max_requeues=0").read_text()
  assert "#SBATCH --signal=B:TERM@120\n" in text and "--requeue" not in text and "scontrol" not in text


@pytest.mark.parametrize("klass", exit_status.ALL, ids=lambda c: str(c.status))
def test_each_exit_status_is_requeued_by_its_class(tmp_path, klass):
  script = _script(tmp_path)
  proc = subprocess.run(["bash", str(script)], env=_env(tmp_path, klass.status), capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == klass.status, proc.stderr
  assert _read(tmp_path / "srun").split()[-len(MIDAS):] == MIDAS
  if klass.status in exit_status.NEVER_RESTART:
    assert _read(tmp_path / "scontrol") == "" and "requeueing" not in proc.stdout
  else:
    assert _read(tmp_path / "scontrol") == "requeue 4242\n"
    assert _read(tmp_path / "sleep") == f"{slurm.REQUEUE_DELAY_S[klass.status]}\n"


def test_requeues_stop_at_max_requeues(tmp_path):
  script = _script(tmp_path, "--max_requeues=3")
  proc = subprocess.run(["bash", str(script)], env=_env(tmp_path, exit_status.PREEMPTED.status, restarts=3),
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == exit_status.PREEMPTED.status
  assert _read(tmp_path / "scontrol") == "" and "requeued 3 times already" in proc.stdout


def test_sigterm_to_the_batch_shell_reaches_the_run_and_the_saved_run_is_requeued(tmp_path):
  """SLURM's --signal=B: signals the batch shell only; the script passes it on to srun (which forwards it
  to every task): the run saves, ends with 76, and the job goes back in the queue."""
  script = _script(tmp_path)
  proc = subprocess.Popen(["bash", str(script)], env=_env(tmp_path, "wait"), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    for _ in range(1200):  # a hard bound of about a minute, should the stand-in never start
      if (tmp_path / "ready").exists():
        break
      assert proc.poll() is None, proc.communicate()
      subprocess.run(["sleep", "0.05"], check=True)  # /bin/sleep: the stub is only on the script's PATH
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == exit_status.PREEMPTED.status, err
  assert _read(tmp_path / "srun_got") == "TERM\n" and "SIGTERM from SLURM" in out
  assert _read(tmp_path / "scontrol") == "requeue 4242\n"


@pytest.mark.parametrize("profile", sorted(nccl.PROFILES))
def test_each_interconnect_exports_its_variables_with_a_reason(tmp_path, profile):
  lines = _script(tmp_path, f"--interconnect={profile}").read_text().splitlines()
  for setting in nccl.PROFILES[profile]:
    at = lines.index(setting.line)
    assert lines[at - 1] == f"# {setting.why} ({setting.source})" and setting.source.startswith("https://")
  assert "NCCL" not in _script(tmp_path).read_text().split("set -euo pipefail")[1].replace("NCCL's buffers", "")


def test_the_ib_profile_reaches_the_tasks(tmp_path):
  """The exports come before srun, so srun passes them to every task."""
  text = _script(tmp_path, "--interconnect=ib").read_text()
  assert text.index("export NCCL_IB_DISABLE=0") < text.index("srun ")
  env = _env(tmp_path, 0)
  (tmp_path / "bin" / "srun").write_text('#!/bin/bash\nenv > "$LOG/srun_env"\n')
  subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, check=True, capture_output=True, timeout=60)
  assert "NCCL_IB_TIMEOUT=22" in _read(tmp_path / "srun_env").splitlines()
