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

Ten minutes before the time limit SLURM sends the batch shell SIGTERM (--signal_s, `--signal=B:TERM@600`),
which passes it to srun and so to every task: the run saves and ends with 76 before SLURM's SIGKILL. A
run that ended with a restart status (76 preempted, 1 failed, 75 storage unavailable) is requeued by its
own script (`scontrol requeue`, after the same pause a TPU VM's unit takes) and resumes from the workdir;
0, 2 and 3 are never requeued. --interconnect names the cluster's fabric for NCCL (launch/nccl.py).
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
import nccl  # noqa: E402  pylint: disable=wrong-import-position
from _tpu_worker import OTHER_DELAY_S, RESTART_DELAY_S  # noqa: E402  pylint: disable=wrong-import-position
from midas_jax import exit_status  # noqa: E402  pylint: disable=wrong-import-position

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# How long before the time limit the run is told to stop: its SIGTERM save (an orbax save of the whole
# state to shared storage, then up to 60 s for the records) must be committed before SLURM's SIGKILL,
# which comes at the limit (plus the cluster's KillWait, often 30 s). Cf. the TPU VM unit's 900 s stop timeout.
SIGNAL_S = 600
# Requeues of one job at most (SLURM_RESTART_COUNT): a storage outage of hours would otherwise requeue it
# for good. A run that fails at the same step twice ends with 3 and is not requeued anyway. The cluster's
# own MaxBatchRequeue (slurm.conf) may be lower.
MAX_REQUEUES = 20
# The restart statuses, each with the pause before its requeue (the TPU VM unit's: at once, 30 s, 300 s).
REQUEUE_DELAY_S = {c.status: RESTART_DELAY_S[c.status] for c in exit_status.ALL
                   if c.status not in exit_status.NEVER_RESTART}


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
  parser.add_argument("--signal_s", type=int, default=SIGNAL_S,
                      help="seconds before the time limit that the run gets SIGTERM, to save and stop")
  parser.add_argument("--max_requeues", type=int, default=MAX_REQUEUES,
                      help="requeues on a restart status (76, 1, 75) at most; 0: never requeue")
  parser.add_argument("--interconnect", choices=["none", *nccl.PROFILES], default="none",
                      help="the nodes' fabric, for NCCL's settings (launch/nccl.py): ib (InfiniBand or RoCE), "
                           "efa (AWS), gcp-tcpxo (GCP A3 Mega); none: NCCL's own choice")
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
  if args.signal_s < 1 or args.max_requeues < 0:
    parser.error("--signal_s must be >= 1 and --max_requeues >= 0")
  if args.cpus_per_task is None:
    args.cpus_per_task = max(1, 96 // args.tasks_per_node)
  args.script = args.script or f"midas_{args.job_name}.sbatch"
  return args


def sbatch_script(args) -> str:
  """The batch script: resources, the environment, and one srun of the midas command."""
  options = [f"--job-name={args.job_name}", f"--nodes={args.nodes}", f"--ntasks-per-node={args.tasks_per_node}",
             f"--gpus-per-node={args.gpus_per_node}", f"--cpus-per-task={args.cpus_per_task}",
             f"--time={args.time}", f"--output={args.job_name}-%j.out", f"--signal=B:TERM@{args.signal_s}"]
  if args.max_requeues:
    options.append("--requeue")  # clusters whose JobRequeue=0 refuse `scontrol requeue` without it
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
  lines += nccl.script_lines(args.interconnect)
  lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(args.env.items())]
  lines += [
      "# jax's share of each GPU (leave room for NCCL's buffers); jaxlib reads XLA_CLIENT_MEM_FRACTION and refuses",
      "# it beside the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION, so a value the user set under either is kept",
      'export XLA_CLIENT_MEM_FRACTION="${XLA_CLIENT_MEM_FRACTION:-${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}}"',
      "unset XLA_PYTHON_CLIENT_MEM_FRACTION",
      "# srun runs in the background so that this shell can take SLURM's SIGTERM (--signal=B:) and pass it",
      "# on: srun forwards it to every task. `wait` returns early when the trap runs, so wait again.",
      "srun --kill-on-bad-exit=1 " + shlex.join(["python", "-m", "midas_jax", *args.midas_args]) + " &",
      "srun_pid=$!",
      "trap 'echo \"midas: SIGTERM from SLURM (time limit or preemption): the run saves and stops\"; "
      "kill -TERM \"$srun_pid\" 2>/dev/null || true' TERM",
      "status=0",
      'while :; do wait "$srun_pid" && status=0 || status=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
      *exit_report(),
      *requeue(args.max_requeues),
      'exit "$status"',
  ]
  return "\n".join(lines) + "\n"


def requeue(max_requeues: int) -> List[str]:
  """Lines that put the job back in the queue after a restart status, after its pause, at most max_requeues times."""
  if not max_requeues:
    return []
  arms = [f"  {status}) delay={delay} ;;" for status, delay in sorted(REQUEUE_DELAY_S.items())]
  return ['delay=""', 'case "$status" in', *arms,
          *(f"  {status}) ;;" for status in exit_status.NEVER_RESTART),
          f"  *) delay={OTHER_DELAY_S} ;;  # a signal's 128 + N or an unknown status: as a failure", "esac",
          f'if [ -n "$delay" ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then',
          '  echo "midas: requeueing job $SLURM_JOB_ID in ${delay} s (requeue $(( ${SLURM_RESTART_COUNT:-0} + 1 )) '
          f'of at most {max_requeues})"',
          '  sleep "$delay"',
          '  scontrol requeue "$SLURM_JOB_ID" || echo "midas: scontrol requeue failed: submit this script again"',
          'elif [ -n "$delay" ]; then',
          f'  echo "midas: requeued {max_requeues} times already (--max_requeues): not again"',
          "fi"]


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
