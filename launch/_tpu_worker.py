"""What runs on each TPU VM worker: the run's systemd unit and the start-up script that installs and starts it.

The unit restarts a run by how it ended (midas_jax/exit_status.py, docs/pods.md#exit-statuses): a
preempted run at once, a failure or a storage outage after a delay, a finished run, bad input or a
halted run never. It is enabled, so a reboot starts it even before the start-up script has run, and
the start-up script runs on every boot, so a slice resumes its run by itself after maintenance or
after a queued resource re-creates it. Both are text, rendered here and tested in
tests/test_pod_launch.py and tests/test_unit_restarts.py.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
import sys
from typing import Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's midas_jax (exit_status is standard library only)
from midas_jax import exit_status  # noqa: E402  pylint: disable=wrong-import-position

STARTUP_TEMPLATE = os.path.join(HERE, "tpu_startup.sh")
SOURCE_ARCHIVE = "midas_src.tgz"  # the checkout, on the stage
ROOT = "@MIDAS_ROOT@"  # the install folder on the worker, filled in by the start-up script
PYTHON_VERSION = "3.11"  # what the pinned jax, numpy, flax and orbax wheels require (setup.py)
UV_VERSION = "0.13.8"
# Starts within an hour before systemd gives up (a reboot, or the start-up script, starts it again): each
# lost peer costs every worker one, and a rebooting worker keeps the others restarting until it is back.
START_LIMIT = 20
STOP_TIMEOUT_S = 900  # SIGTERM makes the run save and exit; the save of a large model takes minutes
# systemd has one RestartSec per unit (RestartSteps= and RestartMaxDelaySec= need systemd 254; TPU VM images
# run Ubuntu 22.04's 249), so RestartSec is the shortest pause, a preempted run's, and the rest of a longer
# one is slept by ExecStartPre, which reads how the run ended from the file ExecStopPost wrote.
RESTART_SEC = 5
RESTART_DELAY_S = {  # seconds from the end of a run to its next start, by exit status
    exit_status.PREEMPTED.status: RESTART_SEC,  # at once: every peer restarts too and waits for the others
    exit_status.FAILED.status: 30,
    exit_status.STORAGE_UNAVAILABLE.status: 300,  # the run waited out a few minutes already; do not hammer it
}
OTHER_DELAY_S = 30  # a death by a signal (the OOM killer, SIGKILL, an abort) or an unknown status: a failure's
# The wheels a worker needs, for its platform: TPU VMs are x86_64 Ubuntu 22.04 (glibc 2.35); pip takes
# every manylinux tag up to it. setuptools and wheel build the editable install of the checkout.
WORKER_PLATFORM = "manylinux_2_35_x86_64"
BUILD_REQUIREMENTS = ("setuptools>=64", "wheel")
WHEELHOUSE = "wheelhouse"  # the folder on the stage, and on the worker


def systemd_quote(arg: str, in_exec: bool = True) -> str:
  """One word of ExecStart= (in_exec) or Environment=, quoted so that systemd passes it on as it is:
  it expands % specifiers in both, and $VARIABLES in ExecStart= only."""
  escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
  if in_exec:
    escaped = escaped.replace("$", "$$")
  return f'"{escaped}"'


def last_exit_file(run: str) -> str:
  """Where the unit notes how the run last ended; /run is emptied by a reboot, so a boot starts at once."""
  return f"/run/midas-{run}.last_exit"


def ended_file(run: str) -> str:
  """Where the unit notes a never-restart ending (finished, bad input, halted), on the boot disk: while it
  exists a boot does not start the run again (ConditionPathExists); a new stage removes it."""
  return f"{ROOT}/midas-{run}.ended"


def record_exit_script(path: str, ended: str) -> str:
  """ExecStopPost's shell: systemd passes the ending as $EXIT_CODE (exited, killed, dumped) and $EXIT_STATUS."""
  never = "|".join(f'"exited {s}"' for s in exit_status.NEVER_RESTART)
  return (f'echo "$EXIT_CODE $EXIT_STATUS" > {path}; '
          f'case "$EXIT_CODE $EXIT_STATUS" in {never}) echo "$EXIT_CODE $EXIT_STATUS" > {ended} ;; esac')


def restart_delay_script(path: str) -> str:
  """ExecStartPre's shell: says how the run last ended, sleeps what that ending's delay adds to RestartSec,
  and forgets it. No ending noted (a boot, a start by hand or by the start-up script) starts at once."""
  arms: List[str] = ['"") ;;']
  for c in exit_status.ALL:
    if c.status in exit_status.NEVER_RESTART:  # not restarted: here only when started by hand
      arms.append(f'"exited {c.status}") ;;')
      continue
    delay = RESTART_DELAY_S[c.status]
    sleep = f"; sleep {delay - RESTART_SEC}" if delay > RESTART_SEC else ""
    arms.append(f'"exited {c.status}") echo "midas: the run ended with {exit_status.describe(c.status)}; '
                f'starting it again {delay} s after"{sleep} ;;')
  arms.append(f'*) echo "midas: the run ended: $last; starting it again {OTHER_DELAY_S} s after"; '
              f'sleep {OTHER_DELAY_S - RESTART_SEC} ;;')
  return f'last=$(cat {path} 2>/dev/null); rm -f {path}; case "$last" in {" ".join(arms)} esac'


def unit_file(run: str, midas_args: Sequence[str], env: Dict[str, str]) -> str:
  """The service that runs `python -m midas_jax ARGS` from the checkout, restarted by how it ended."""
  environment = dict(env, PYTHONUNBUFFERED="1", HOME="/root")
  status_file = last_exit_file(run)
  never = " ".join(str(s) for s in exit_status.NEVER_RESTART)
  lines = [
      f"# Written by launch/tpu_pod.py: the run {run} on every worker, installed and enabled by its start-up script.",
      "# What each exit status means and does: docs/pods.md#exit-statuses (midas_jax/exit_status.py).",
      "[Unit]",
      f"Description=midas_jax run {run}",
      "After=network-online.target",
      "Wants=network-online.target",
      "# A run that finished, or stopped for a reason a restart repeats, stays down after a reboot too.",
      f"ConditionPathExists=!{ended_file(run)}",
      "StartLimitIntervalSec=3600",
      f"StartLimitBurst={START_LIMIT}",
      "",
      "[Service]",
      f"WorkingDirectory={ROOT}/src",
      *[f"Environment={systemd_quote(f'{k}={v}', in_exec=False)}" for k, v in sorted(environment.items())],
      "ExecStartPre=-/bin/sh -c " + systemd_quote(restart_delay_script(status_file)),
      "ExecStart=" + " ".join([f"{ROOT}/venv/bin/python", "-m", "midas_jax", *map(systemd_quote, midas_args)]),
      "ExecStopPost=-/bin/sh -c " + systemd_quote(record_exit_script(status_file, ended_file(run))),
      f"# Every ending restarts the run, which resumes from its workdir, except {never}: finished, bad input",
      "# (it would fail again) and halted (a loss that is not finite, or the same step failing twice).",
      "# A `systemctl stop` is not restarted either.",
      "Restart=always",
      f"RestartSec={RESTART_SEC}",
      f"RestartPreventExitStatus={never}",
      f"TimeoutStartSec={max(RESTART_DELAY_S.values()) + 60}",  # ExecStartPre's sleep is part of the start
      "# SIGTERM (a stop, a shutdown for maintenance) makes the run save and exit with status "
      f"{exit_status.PREEMPTED.status}.",
      "KillSignal=SIGTERM",
      f"TimeoutStopSec={STOP_TIMEOUT_S}",
      "",
      "[Install]",
      "# `systemctl enable` (the start-up script): every boot starts the run, whatever the start-up script does.",
      "WantedBy=multi-user.target",
  ]
  return "\n".join(lines) + "\n"


def requirements(source: str, extras: str) -> List[str]:
  """What `pip install SOURCE[EXTRAS]` asks for, read from setup.py's CORE and EXTRAS without running it."""
  with open(os.path.join(source, "setup.py")) as f:
    tree = ast.parse(f.read())
  found = {node.targets[0].id: node.value for node in ast.walk(tree)
           if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
  listed = dict(ast.literal_eval(found["EXTRAS"]))
  chosen = [e.strip() for e in extras.split(",") if e.strip()]
  unknown = [e for e in chosen if e not in listed]
  if unknown:
    raise SystemExit(f"--extras={extras}: setup.py has no extra {', '.join(unknown)} (it has {', '.join(listed)})")
  return list(ast.literal_eval(found["CORE"])) + [r for e in chosen for r in listed[e]]


def wheelhouse_download(source: str, extras: str, dest: str) -> List[str]:
  """The `pip download` of every wheel a worker installs: the package's requirements under its constraints,
  uv, and the build requirements, for the workers' Python and platform (not this machine's). Markers in
  the requirements are judged by the machine that runs it, as pip does."""
  return [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest, "--only-binary=:all:",
          f"--platform={WORKER_PLATFORM}", f"--python-version={PYTHON_VERSION}", "--implementation=cp",
          "-c", os.path.join(source, "requirements", "constraints.txt"),
          *requirements(source, extras), f"uv=={UV_VERSION}", *BUILD_REQUIREMENTS]


def wheelhouse_key(source: str, extras: str) -> str:
  """Names a wheelhouse by what it holds: the same constraints, requirements, Python and uv stage it once."""
  with open(os.path.join(source, "requirements", "constraints.txt"), "rb") as f:
    constraints = f.read()
  what = "\n".join([*requirements(source, extras), PYTHON_VERSION, UV_VERSION, WORKER_PLATFORM, *BUILD_REQUIREMENTS])
  return hashlib.sha256(constraints + what.encode()).hexdigest()[:16]


def startup_script(stage: str, unit: str, extras: str, wheelhouse: bool = True) -> str:
  """tpu_startup.sh with this run's settings: where its checkout and unit are, what to install, and whether
  from the stage's wheelhouse (no package index) or from the index."""
  with open(STARTUP_TEMPLATE) as f:
    text = f.read()
  settings = {"STAGE": stage, "UNIT": unit, "EXTRAS": extras, "PYTHON_VERSION": PYTHON_VERSION,
              "UV_VERSION": UV_VERSION, "WHEELHOUSE": WHEELHOUSE if wheelhouse else "off"}
  for key, value in settings.items():
    text = text.replace(f"{key}=@{key}@", f"{key}={shlex.quote(value)}")
  return text
