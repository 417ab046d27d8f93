"""Run midas on a SLURM GPU cluster: write an sbatch script whose srun starts one process per GPU.

  python launch/slurm.py --nodes=2 --gpus_per_node=8 --partition=gpu --time=24:00:00 \
      --venv=$PWD/.venv -- train --gin_file=gin/experiments/paper_1b_midas_prop1.gin \
      --gin_file=gin/meshes/gpu_8.gin --gin.MeshConfig.data=2 --workdir=/nfs/runs/paper_1b_midas

The script is written to --script (default midas_<job_name>.sbatch) and submitted with sbatch;
--dry-run prints both instead. Each task finds the job from srun's SLURM_* variables (jax reads
the coordinator, process count and rank from them; midas_jax/distributed.py), so the midas command
needs no coordinator flags. With one task per GPU (the default) each process drives the GPU
numbered by its local rank; --tasks_per_node=1 gives one process all of its node's GPUs. The
workdir must be on storage every node sees (a shared file system, or a gs:// URL, which every
output is written to directly): checkpoints are written by all processes together. --env=KEY=VALUE
exports a variable to every task (srun passes the script's environment on). The job ends with the
run's exit status, and its log says what that status means (docs/pods.md#exit-statuses).
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
from midas_jax import exit_status  # noqa: E402  pylint: disable=wrong-import-position

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv: Sequence[str]) -> argparse.Namespace:
  own, midas_args = split_midas_args(argv)
  parser = argparse.ArgumentParser(prog="launch/slurm.py", description=__doc__.split("\n")[0],
                                   epilog="Everything after `--` is the midas command every task runs.")
  parser.add_argument("--nodes", type=int, default=1)
  parser.add_argument("--gpus_per_node", type=int, default=8)
  parser.add_argument("--tasks_per_node", type=int, default=None,
                      help="processes per node: gpus_per_node (the default, one per GPU) or 1")
  parser.add_argument("--cpus_per_task", type=int, default=None, help="default: 96 / tasks_per_node")
  parser.add_argument("--partition", default=None)
  parser.add_argument("--account", default=None)
  parser.add_argument("--time", default="24:00:00", help="wall-clock limit, HH:MM:SS")
  parser.add_argument("--job_name", default="midas")
  parser.add_argument("--venv", default=None, help="virtual environment to activate on every node")
  parser.add_argument("--chdir", default=REPO_ROOT, help="directory the tasks run in (the checkout)")
  parser.add_argument("--script", default=None, help="where to write the sbatch script")
  parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                      help="extra sbatch option, e.g. --sbatch=--exclusive (repeatable)")
  add_env(parser)
  add_dry_run(parser)
  args = parser.parse_args(own)
  args.midas_args = midas_args
  args.env = parse_env(parser, args.env)
  require_midas_args(parser, midas_args)
  if args.tasks_per_node is None:
    args.tasks_per_node = args.gpus_per_node
  if args.tasks_per_node not in (1, args.gpus_per_node):
    parser.error(f"--tasks_per_node must be 1 or --gpus_per_node ({args.gpus_per_node}): a process drives "
                 "either one GPU or all of its node's")
  for name in ("nodes", "gpus_per_node"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1")
  if args.cpus_per_task is None:
    args.cpus_per_task = max(1, 96 // args.tasks_per_node)
  args.script = args.script or f"midas_{args.job_name}.sbatch"
  return args


def sbatch_script(args) -> str:
  """The batch script: resources, the environment, and one srun of the midas command."""
  options = [f"--job-name={args.job_name}", f"--nodes={args.nodes}", f"--ntasks-per-node={args.tasks_per_node}",
             f"--gpus-per-node={args.gpus_per_node}", f"--cpus-per-task={args.cpus_per_task}",
             f"--time={args.time}", f"--output={args.job_name}-%j.out"]
  if args.partition:
    options.append(f"--partition={args.partition}")
  if args.account:
    options.append(f"--account={args.account}")
  options += args.sbatch
  lines: List[str] = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in options] + [
      "# Written by launch/slurm.py. jax.distributed reads SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS,",
      "# SLURM_PROCID and SLURM_LOCALID in every task: the first node of the step hosts the coordinator.",
      "set -euo pipefail",
      f"cd {shlex.quote(os.path.abspath(args.chdir))}",
  ]
  if args.venv:
    lines.append(f"source {shlex.quote(os.path.join(args.venv, 'bin', 'activate'))}")
  lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(args.env.items())]
  lines += [
      "export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # leave room for NCCL's buffers",
      "status=0",
      "srun --kill-on-bad-exit=1 " + shlex.join(["python", "-m", "midas_jax", *args.midas_args]) + " || status=$?",
      *exit_report(),
      'exit "$status"',
  ]
  return "\n".join(lines) + "\n"


def exit_report() -> List[str]:
  """Lines of the batch script that say what the run's exit status means, and what to do next."""
  arms = []
  for c in exit_status.ALL:
    if c.status == exit_status.FINISHED.status:
      continue
    again = ("do not submit it again unchanged" if c.status in exit_status.NEVER_RESTART else
             "submit this script again (it resumes from the workdir)" + ("" if c.restart == "now" else ", later"))
    arms.append(f"  {c.status}) echo {shlex.quote(f'midas: ended with {exit_status.describe(c.status)}: {again}')} ;;")
  return ['case "$status" in', "  0) ;;", *arms,
          '  *) echo "midas: ended with status $status (a signal or a crash): submit this script again (it resumes '
          'from the workdir)" ;;', "esac"]


def main(argv: Sequence[str] = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  runner = Runner(args.dry_run)
  script = sbatch_script(args)
  note = workdir_note(args.midas_args, "node")
  if note:
    runner.note(note)
  if args.dry_run:
    runner.note(f"would write {args.script}:")
    for line in script.splitlines():
      print(f"#   {line}")
  else:
    with open(args.script, "w") as f:
      f.write(script)
    runner.note(f"wrote {args.script}")
  runner.run(["sbatch", args.script])
  return 0


if __name__ == "__main__":
  sys.exit(main())
