"""What runs on each TPU VM worker: the run's systemd unit and the start-up script that installs and starts it.

The unit restarts a run that fails (a crash, or a peer lost: jax then stops every process of the job),
and the start-up script runs on every boot, so a slice resumes its run by itself after maintenance
or after a queued resource re-creates it. Both are text, rendered here and tested in tests/test_launch.py.
"""

from __future__ import annotations

import os
import shlex
from typing import Dict, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_TEMPLATE = os.path.join(HERE, "tpu_startup.sh")
SOURCE_ARCHIVE = "midas_src.tgz"  # the checkout, on the stage
ROOT = "@MIDAS_ROOT@"  # the install folder on the worker, filled in by the start-up script
PYTHON_VERSION = "3.11"  # what the pinned jax, numpy, flax and orbax wheels require (setup.py)
UV_VERSION = "0.13.8"
# Restarts after failures, within an hour, before systemd gives up: each lost peer costs every worker
# one, and a rebooting worker keeps the others restarting (30 s apart) until it is back.
START_LIMIT = 20
STOP_TIMEOUT_S = 900  # SIGTERM makes the run save and exit; the save of a large model takes minutes


def systemd_quote(arg: str, in_exec: bool = True) -> str:
  """One word of ExecStart= (in_exec) or Environment=, quoted so that systemd passes it on as it is:
  it expands % specifiers in both, and $VARIABLES in ExecStart= only."""
  escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
  if in_exec:
    escaped = escaped.replace("$", "$$")
  return f'"{escaped}"'


def unit_file(run: str, midas_args: Sequence[str], env: Dict[str, str]) -> str:
  """The service that runs `python -m midas_jax ARGS` from the checkout, restarted when it fails."""
  environment = dict(env, PYTHONUNBUFFERED="1", HOME="/root")
  lines = [
      f"# Written by launch/tpu_pod.py: the run {run} on every worker, installed by its start-up script.",
      "[Unit]",
      f"Description=midas_jax run {run}",
      "After=network-online.target",
      "Wants=network-online.target",
      "StartLimitIntervalSec=3600",
      f"StartLimitBurst={START_LIMIT}",
      "",
      "[Service]",
      f"WorkingDirectory={ROOT}/src",
      *[f"Environment={systemd_quote(f'{k}={v}', in_exec=False)}" for k, v in sorted(environment.items())],
      "ExecStart=" + " ".join([f"{ROOT}/venv/bin/python", "-m", "midas_jax", *map(systemd_quote, midas_args)]),
      "# A failed run starts again and resumes from its workdir; status 2 is bad input, which would fail again.",
      "Restart=on-failure",
      "RestartSec=30",
      "RestartPreventExitStatus=2",
      "# SIGTERM (a stop, a shutdown for maintenance) makes the run save a checkpoint and exit with status 0.",
      "KillSignal=SIGTERM",
      f"TimeoutStopSec={STOP_TIMEOUT_S}",
  ]
  return "\n".join(lines) + "\n"


def startup_script(stage: str, unit: str, extras: str) -> str:
  """tpu_startup.sh with this run's settings: where its checkout and unit are, and what to install."""
  with open(STARTUP_TEMPLATE) as f:
    text = f.read()
  settings = {"STAGE": stage, "UNIT": unit, "EXTRAS": extras, "PYTHON_VERSION": PYTHON_VERSION,
              "UV_VERSION": UV_VERSION}
  for key, value in settings.items():
    text = text.replace(f"{key}=@{key}@", f"{key}={shlex.quote(value)}")
  return text
