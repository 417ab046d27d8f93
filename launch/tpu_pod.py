"""Run midas on a Cloud TPU VM slice: create (or reuse) it, install, run on every worker, follow, stop.

  python launch/tpu_pod.py up --name=midas-v5p --zone=us-east5-a --accelerator=v5p-128 \
      -- train --gin_file=gin/experiments/paper_1b_midas_prop1.gin \
               --gin_file=gin/meshes/tpu_v5p_128.gin --workdir=/mnt/runs/paper_1b_midas

Actions: up (create or reuse, install, run, follow the log), create, install, run (start on every
worker, then follow), logs, stop (SIGTERM: the run saves a checkpoint and exits), delete.
--dry-run prints the gcloud commands instead of running them. Every worker runs the same command;
jax finds the other workers from the TPU VM's metadata (midas_jax/distributed.py), so no
coordinator flags are needed. The workdir must be storage every worker sees: a gs:// URL (orbax
and every other output write to the bucket directly), or an NFS mount. The run is a transient
systemd unit on each worker (`systemd-run`), so its log is the journal's and no log, pid or other
file of the run is written to a worker's disk; --env=KEY=VALUE sets variables for it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import List, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Runner, add_dry_run, add_env, parse_env, require_midas_args, split_midas_args,  # noqa: E402  pylint: disable=wrong-import-position
                     workdir_note)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTIONS = ("up", "create", "install", "run", "logs", "stop", "delete")
# The TPU VM software version each generation boots with (gcloud's --version).
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite", "v5e": "v2-alpha-tpuv5-lite",
            "v5p": "v2-alpha-tpuv5"}
REMOTE_ARCHIVE = "~/midas_src.tgz"


def parse(argv: Sequence[str]) -> argparse.Namespace:
  own, midas_args = split_midas_args(argv)
  parser = argparse.ArgumentParser(prog="launch/tpu_pod.py", description=__doc__.split("\n")[0],
                                   epilog="Everything after `--` is the midas command every worker runs.")
  parser.add_argument("action", choices=ACTIONS)
  parser.add_argument("--name", required=True, help="TPU VM name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
  parser.add_argument("--accelerator", default=None, help="accelerator type, e.g. v4-64, v5litepod-64, v5p-128")
  parser.add_argument("--version", default=None, help="TPU VM runtime (default: by accelerator generation)")
  parser.add_argument("--spot", action="store_true", help="create a Spot (preemptible) slice")
  parser.add_argument("--source", default=REPO_ROOT, help="the midas_jax checkout to install")
  parser.add_argument("--remote_dir", default="midas_jax", help="install directory on each worker (under ~)")
  parser.add_argument("--extras", default="data,tpu", help="the package's extras to install (setup.py)")
  parser.add_argument("--run_name", default="midas", help="names the run's systemd unit on the workers (midas-NAME)")
  parser.add_argument("--log_worker", type=int, default=0, help="the worker whose log `logs` follows")
  add_env(parser)
  add_dry_run(parser)
  args = parser.parse_args(own)
  args.midas_args = midas_args
  args.env = parse_env(parser, args.env)
  if args.action in ("up", "create") and not args.accelerator:
    parser.error(f"`{args.action}` needs --accelerator, e.g. --accelerator=v5p-128")
  if args.action in ("up", "run"):
    require_midas_args(parser, midas_args)
  return args


def runtime_version(args) -> str:
  if args.version:
    return args.version
  generation = args.accelerator.split("-")[0]
  if generation not in RUNTIMES:
    raise SystemExit(f"no default runtime for accelerator {args.accelerator!r}: pass --version "
                     f"(known generations: {', '.join(sorted(RUNTIMES))})")
  return RUNTIMES[generation]


def _gcloud(args, verb: str, *rest: str) -> List[str]:
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}"]
  if args.project:
    cmd.append(f"--project={args.project}")
  return cmd


def ssh(args, command: str, worker: str = "all") -> List[str]:
  return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={command}")


def unit(args) -> str:
  return f"midas-{args.run_name}"


def create(args, runner: Runner) -> None:
  if runner.succeeds(_gcloud(args, "describe", args.name, "--format=value(state)")):
    runner.note(f"reusing the existing TPU VM {args.name}")
    return
  runner.note(f"if `describe` fails, {args.name} does not exist yet and is created:")
  cmd = _gcloud(args, "create", args.name, f"--accelerator-type={args.accelerator}",
                f"--version={runtime_version(args)}")
  if args.spot:
    cmd.append("--spot")
  runner.run(cmd)


def install(args, runner: Runner) -> None:
  archive = f"/tmp/midas_src_{args.name}.tgz"
  runner.run(["tar", "czf", archive, "--exclude=.git", "--exclude=.venv", "--exclude=runs",
              "--exclude=__pycache__", "-C", os.path.abspath(args.source), "."])
  runner.run(_gcloud(args, "scp", archive, f"{args.name}:{REMOTE_ARCHIVE}", "--worker=all"))
  remote = (f"mkdir -p ~/{args.remote_dir} && tar xzf {REMOTE_ARCHIVE} -C ~/{args.remote_dir} && "
            f"rm -f {REMOTE_ARCHIVE} && cd ~/{args.remote_dir} && python3 -m pip install -q -e '.[{args.extras}]'")
  runner.run(ssh(args, remote))


def start(args, runner: Runner) -> None:
  note = workdir_note(args.midas_args, "worker")
  if note:
    runner.note(note)
  # A transient unit as this user, in the checkout: the journal keeps its output, systemd its pid.
  # The first part is expanded by the worker's shell ($(id -u), $HOME); the rest is quoted.
  worker_side = ["sudo", "systemd-run", f"--unit={unit(args)}", "--collect", "--quiet", "--uid=$(id -u)",
                 "--gid=$(id -g)", f"--working-directory=$HOME/{args.remote_dir}", "--setenv=HOME=$HOME"]
  setenv = [f"--setenv={k}={v}" for k, v in sorted(dict(args.env, PYTHONUNBUFFERED="1").items())]
  command = " ".join(worker_side) + " " + shlex.join([*setenv, "python3", "-m", "midas_jax", *args.midas_args])
  runner.run(ssh(args, f"sudo systemctl reset-failed {unit(args)} 2>/dev/null; {command}"))


def follow(args, runner: Runner) -> None:
  runner.note(f"following worker {args.log_worker}'s log until its run ends (Ctrl-C stops following, not the run)")
  journal = f"sudo journalctl --unit={unit(args)} --follow --lines=all --output=cat"
  remote = (f"{journal} & J=$!; while systemctl is-active --quiet {unit(args)}; do sleep 5; done; "
            f"sleep 2; kill $J")
  runner.run(ssh(args, remote, worker=str(args.log_worker)), check=False)


def stop(args, runner: Runner) -> None:
  runner.run(ssh(args, f"sudo systemctl kill --signal=SIGTERM {unit(args)} 2>/dev/null || true"))


def delete(args, runner: Runner) -> None:
  runner.run(_gcloud(args, "delete", args.name, "--quiet"))


def main(argv: Sequence[str] = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  runner = Runner(args.dry_run)
  steps = {"up": (create, install, start, follow), "create": (create,), "install": (install,),
           "run": (start, follow), "logs": (follow,), "stop": (stop,), "delete": (delete,)}[args.action]
  for step in steps:
    step(args, runner)
  return 0


if __name__ == "__main__":
  sys.exit(main())
