"""Run midas on Cloud TPU VMs: one slice, or slices from a queued resource, restarted by themselves.

  python launch/tpu_pod.py up --name=midas-v5p --zone=us-east5-a --accelerator=v5p-128 \\
      -- train --gin_file=gin/experiments/paper_1b_midas_prop1.gin \\
               --gin_file=gin/meshes/tpu_v5p_128.gin --workdir=gs://BUCKET/runs/paper_1b_midas

Actions on a TPU VM created directly: up (create it, or restart the run on it, then follow the log),
create, run (restart the run with this checkout and command), logs, stop (`systemctl stop`: SIGTERM,
the run saves and exits, and is not restarted until a boot or `run`), delete. With a queued resource
(the way to get most v5p/v5e capacity, and the only way to get several slices: --slices=N): queue
(request it), watch (request it if needed, then queue it again whenever it is SUSPENDED or FAILED,
e.g. a Spot slice preempted, and say at every poll how old the run's heartbeat is, STALE when the run
has stopped writing it: docs/pods.md#the-heartbeat), and logs, run, stop, delete with --queued.
--dry-run prints the commands instead of running them.

How a run survives: the checkout (a tarball), the run's systemd unit and a wheelhouse of every wheel
the workers install (once per set of constraints) go to a stage on GCS (--stage, default
WORKDIR/launch); every worker gets tpu_startup.sh as its metadata start-up script, which runs on
every boot, installs uv, Python 3.11 and `.[tpu]` from the wheelhouse (no package index), and
enables and starts the unit. The unit restarts the run by its exit status
(docs/pods.md#exit-statuses: a preemption at once, a failure or a storage outage after a delay,
never a finished, refused or halted run), a boot starts it, and every start resumes from the
workdir. Every worker runs the same command; jax finds the others from the TPU VM's metadata. The
run's output is the journal's (`logs` follows it); nothing of the run is written to a worker's disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (CACHE_DIR_VAR, REPO_ROOT, Runner, flag_value, parse_pod_args,  # noqa: E402  pylint: disable=wrong-import-position
                     require_midas_args, split_midas_args, with_accelerator, with_compile_cache, workdir_note)
import _tpu_worker as worker  # noqa: E402  pylint: disable=wrong-import-position
from midas_jax import hardware, heartbeat  # noqa: E402  pylint: disable=wrong-import-position

ACTIONS = ("up", "create", "run", "queue", "watch", "logs", "stop", "delete")
NEEDS_RUN = ("up", "create", "run", "queue", "watch")  # actions that install the run: a midas command after --
REQUEUE_STATES = ("SUSPENDED", "FAILED")  # a queued resource in these holds no slice any more
STARTUP_UNIT = "google-startup-scripts.service"  # the guest agent's unit that runs `startup-script`


def parse(argv: Sequence[str]) -> argparse.Namespace:
  own, midas_args = split_midas_args(argv)
  parser = argparse.ArgumentParser(prog="launch/tpu_pod.py", description=__doc__.split("\n")[0],
                                   epilog="Everything after `--` is the midas command every worker runs.")
  parser.add_argument("action", choices=ACTIONS)
  parser.add_argument("--name", required=True, help="TPU VM name, or the queued resource's (its slices: NAME-0, ...)")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
  parser.add_argument("--accelerator", default=None, help="accelerator type, e.g. v4-64, v5litepod-64, v5p-128")
  parser.add_argument("--version", default=None, help="TPU VM runtime (default: by accelerator generation)")
  tier = parser.add_mutually_exclusive_group()
  tier.add_argument("--spot", action="store_true", help="Spot capacity: cheaper, preemptible")
  tier.add_argument("--reserved", action="store_true", help="capacity from the project's reservation")
  parser.add_argument("--queued", action="store_true",
                      help="the slices belong to a queued resource (implied by queue, watch and --slices > 1)")
  parser.add_argument("--slices", type=int, default=1, help="slices joined by DCN (a multislice queued resource)")
  parser.add_argument("--poll_s", type=float, default=300, help="watch: seconds between looks at the queued resource")
  parser.add_argument("--stale_intervals", type=float, default=heartbeat.STALE_INTERVALS,
                      help="watch: a running run's heartbeat is STALE after this many log periods at its own recent "
                           "speed (TrainerConfig.log_every x its seconds a step) without a new one")
  parser.add_argument("--stale_floor_s", type=float, default=heartbeat.STALE_FLOOR_S,
                      help="watch: and never sooner than this many seconds (a compile, a restore or a save can take "
                           "minutes)")
  parser.add_argument("--restart_stale", action="store_true",
                      help="watch: when the slice is ACTIVE and its run's heartbeat says running but is STALE (a hung "
                           "run), restart the run's unit on every worker once (it resumes from its last save); "
                           "without it watch only reports")
  parser.add_argument("--source", default=REPO_ROOT, help="the midas_jax checkout to install")
  parser.add_argument("--stage", default=None,
                      help="gs:// folder the workers fetch the checkout and the run's unit from at every boot "
                           "(default: WORKDIR/launch)")
  parser.add_argument("--extras", default="tpu",
                      help="the package's extras to install (setup.py); `tpu` is all a run on a prepared store needs")
  parser.add_argument("--wheelhouse", choices=("on", "off"), default="on",
                      help="on: stage every wheel the workers install beside the checkout (once per set of "
                           "constraints), so that a boot needs no package index; off: workers install from PyPI")
  parser.add_argument("--run_name", default="midas", help="names the run's systemd unit on the workers (midas-NAME)")
  parser.add_argument("--log_worker", type=int, default=0, help="the worker (of the first slice) `logs` follows")
  args = parse_pod_args(parser, own, midas_args)
  if args.slices < 1:
    parser.error("--slices must be >= 1")
  args.queued = args.queued or args.slices > 1 or args.action in ("queue", "watch")
  if args.action in ("up", "create") and args.queued:
    parser.error(f"`{args.action}` creates a TPU VM directly; for a queued resource use `queue` or `watch`")
  if args.action in ("up", "create", "queue", "watch") and not args.accelerator:
    parser.error(f"`{args.action}` needs --accelerator, e.g. --accelerator=v5p-128")
  if args.action in NEEDS_RUN:
    require_midas_args(parser, midas_args)
    args.stage = args.stage or default_stage(midas_args)
    if not (args.stage or "").startswith("gs://"):
      parser.error("--stage: the workers fetch the checkout from GCS at every boot (a re-created slice has "
                   "a fresh disk): pass --stage=gs://BUCKET/DIR, or a gs:// --workdir (its launch/ folder)")
    args.stage = args.stage.rstrip("/")
  return args


def default_stage(midas_args: Sequence[str]):
  workdir = flag_value(midas_args, "workdir")
  return f"{workdir.rstrip('/')}/launch" if workdir and workdir.startswith("gs://") else None


def runtime_version(args) -> str:
  if args.version:
    return args.version
  generation = hardware.generation(args.accelerator)
  if generation is None:
    raise SystemExit(f"no default runtime for accelerator {args.accelerator!r}: pass --version "
                     f"(known generations: {', '.join(sorted(hardware.ACCELERATOR_NAMES))})")
  return hardware.TPUS[generation].runtime


def unit(args) -> str:
  return f"midas-{args.run_name}"


def nodes(args) -> List[str]:
  """The TPU VMs (slices) of the run: NAME, or NAME-0 ... NAME-(N-1) of a multislice queued resource."""
  return [args.name] if args.slices == 1 else [f"{args.name}-{i}" for i in range(args.slices)]


def _where(args) -> List[str]:
  return [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])


def _gcloud(args, verb: str, *rest: str) -> List[str]:
  return ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, *_where(args)]


def _queued(args, verb: str, *rest: str) -> List[str]:
  return ["gcloud", "compute", "tpus", "queued-resources", verb, args.name, *rest, *_where(args)]


def ssh(args, node: str, command: str, worker_id: str = "all") -> List[str]:
  return _gcloud(args, "ssh", node, f"--worker={worker_id}", f"--command={command}")


def local_file(args, name: str) -> str:
  folder = os.path.join(tempfile.gettempdir(), f"midas_launch_{args.name}")
  return os.path.join(folder, name)


def startup_file(args, runner: Runner) -> str:
  """Writes the workers' start-up script here; returns its path (gcloud reads it into the metadata)."""
  path = local_file(args, "startup.sh")
  if not runner.dry_run:
    os.makedirs(os.path.dirname(path), exist_ok=True)
  runner.write(path, worker.startup_script(args.stage, unit(args), args.extras, args.wheelhouse == "on"))
  return path


def stage(args, runner: Runner) -> None:
  """The checkout and the run's unit, on GCS, where every worker fetches them at every boot."""
  note = workdir_note(args.midas_args, "worker")
  if note:
    runner.note(note)
  env = with_accelerator(with_compile_cache(args.env, args.midas_args, args.compile_cache), args.accelerator)
  if env.get(CACHE_DIR_VAR):
    runner.note(f"the compilation cache every worker reads: {env[CACHE_DIR_VAR]}")
  archive, service = local_file(args, worker.SOURCE_ARCHIVE), local_file(args, f"{unit(args)}.service")
  if not runner.dry_run:
    os.makedirs(os.path.dirname(archive), exist_ok=True)
  runner.run(["tar", "czf", archive, "--exclude=.git", "--exclude=.venv", "--exclude=runs",
              "--exclude=__pycache__", "-C", os.path.abspath(args.source), "."])
  runner.write(service, worker.unit_file(args.run_name, args.midas_args, env))
  runner.run(["gcloud", "storage", "cp", archive, service, f"{args.stage}/"])
  if args.wheelhouse == "on":
    stage_wheelhouse(args, runner)


def stage_wheelhouse(args, runner: Runner) -> None:
  """The wheels every worker installs from, without a package index: downloaded here and uploaded beside
  the checkout, once for each set of constraints and requirements (a marker names the set staged)."""
  source = os.path.abspath(args.source)
  key = worker.wheelhouse_key(source, args.extras)
  remote, marker = f"{args.stage}/{worker.WHEELHOUSE}", f"staged-{key}"
  if runner.succeeds(["gcloud", "storage", "ls", f"{remote}/{marker}"]):
    runner.note(f"the wheelhouse for these constraints is staged already: {remote}")
    return
  runner.note(f"if `ls` fails, the wheels the workers install are downloaded here and staged in {remote}:")
  local = local_file(args, f"{worker.WHEELHOUSE}-{key}")
  runner.run(worker.wheelhouse_download(source, args.extras, local))
  runner.run(["gcloud", "storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", local, remote])
  runner.write(local_file(args, marker), f"{key}\n")
  runner.run(["gcloud", "storage", "cp", local_file(args, marker), f"{remote}/{marker}"])


def tier_flags(args) -> List[str]:
  return ["--spot"] if args.spot else ["--reserved"] if args.reserved else []


def create_vm(args, runner: Runner) -> bool:
  """Creates the TPU VM with the start-up script (its first boot starts the run); False if it existed."""
  if runner.succeeds(_gcloud(args, "describe", args.name, "--format=value(state)")):
    runner.note(f"the TPU VM {args.name} exists already")
    return False
  runner.note(f"if `describe` fails, {args.name} does not exist yet and is created; its first boot starts the run:")
  runner.run(_gcloud(args, "create", args.name, f"--accelerator-type={args.accelerator}",
                     f"--version={runtime_version(args)}", *tier_flags(args),
                     f"--metadata-from-file=startup-script={startup_file(args, runner)}"))
  return True


def queue_command(args, script: str) -> List[str]:
  slices = [f"--node-id={args.name}"] if args.slices == 1 else [f"--node-count={args.slices}",
                                                                f"--node-prefix={args.name}"]
  return _queued(args, "create", f"--accelerator-type={args.accelerator}",
                 f"--runtime-version={runtime_version(args)}", *slices, *tier_flags(args),
                 f"--metadata-from-file=startup-script={script}")


def restart_on_workers(args, runner: Runner) -> None:
  """Runs the start-up script again on every worker: the run saves, stops, and starts with the new stage."""
  if not args.queued:  # a VM made elsewhere gets the script too, so that its next boot resumes the run
    runner.run(_gcloud(args, "update", args.name, f"--metadata-from-file=startup-script={startup_file(args, runner)}"))
  for node in nodes(args):
    runner.run(ssh(args, node, "sudo google_metadata_script_runner startup"))


def follow(args, runner: Runner) -> None:
  """Follows one worker's start-up script and run until the run ends (stopped, finished, or given up)."""
  runner.note(f"following worker {args.log_worker} of {nodes(args)[0]} until its run ends "
              "(Ctrl-C stops following, not the run)")
  name = unit(args)
  journal = f"sudo journalctl --unit={STARTUP_UNIT} --unit={name} --follow --lines=all --output=cat"
  state = f"systemctl show --property=ActiveState --value {name}"
  # The unit appears once the start-up script has installed the run; a restarting run is `activating`.
  remote = (f"{journal} & J=$!; until systemctl cat {name} >/dev/null 2>&1; do sleep 10; done; "
            f"while [ \"$({state})\" != inactive ] && [ \"$({state})\" != failed ]; do sleep 5; done; "
            f"sleep 2; kill $J")
  runner.run(ssh(args, nodes(args)[0], remote, worker_id=str(args.log_worker)), check=False)


def stop(args, runner: Runner) -> None:
  """Stops the unit: SIGTERM, the run saves and exits, and systemd does not restart a unit it was told to
  stop (it waits up to the unit's TimeoutStopSec for the save, then kills it)."""
  for node in nodes(args):
    runner.run(ssh(args, node, f"sudo systemctl stop {unit(args)} 2>/dev/null || true"))
  runner.note("the run saved and stopped; a worker's next boot, or `run`, starts it again (`delete` when it is done)")


def delete(args, runner: Runner) -> None:
  if args.queued:  # --force deletes the slices with the request
    runner.run(_queued(args, "delete", "--force", "--quiet"))
  else:
    runner.run(_gcloud(args, "delete", args.name, "--quiet"))


def queue(args, runner: Runner, script: str = None) -> None:
  runner.run(queue_command(args, script or startup_file(args, runner)))
  slices = f" --slices={args.slices}" if args.slices > 1 else ""
  runner.note("each worker starts the run when its slice boots; follow it with "
              f"`python launch/tpu_pod.py logs --queued{slices} --name={args.name} --zone={args.zone}`")


def queued_state(args, runner: Runner, quiet: bool = False):
  return runner.output(_queued(args, "describe", "--format=value(state.state)"), quiet=quiet)


def heartbeat_url(args):
  """The run's heartbeat object (midas_jax/heartbeat.py), or None when its workdir is not on gs://."""
  workdir = flag_value(args.midas_args, "workdir")
  return f"{workdir.rstrip('/')}/{heartbeat.FILE}" if workdir and workdir.startswith("gs://") else None


class HeartbeatWatch:
  """One look at the run's heartbeat per poll: a line with its step and age, STALE when the run stopped
  writing it; with --restart_stale, a hung run's unit restarted on every worker (once per stale record)."""

  def __init__(self, args, runner: Runner):
    self.args, self.runner, self.url = args, runner, heartbeat_url(args)
    self.seen = False
    self.restarted_for = None  # the time of the stale record whose run was restarted

  def read_command(self) -> List[str]:
    return ["gcloud", "storage", "cat", self.url]

  def look(self, state) -> None:
    if self.url is None:
      return
    text = self.runner.output(self.read_command(), quiet=True)
    now = time.time()
    try:
      rec = heartbeat.parse(text)
    except ValueError as e:
      rec, line = None, f"heartbeat unreadable ({e})"
    else:
      line = (heartbeat.describe(rec, now, self.args.stale_intervals, self.args.stale_floor_s)
              if rec is not None or not self.seen else f"heartbeat not readable now ({self.url})")
    self.seen = self.seen or rec is not None
    self.runner.note(f"{time.strftime('%H:%M:%S')} {self.args.name} heartbeat: {line}")
    if rec is not None and self.args.restart_stale and state == "ACTIVE" and rec.get("status") == heartbeat.RUNNING:
      if heartbeat.staleness(rec, now, self.args.stale_intervals, self.args.stale_floor_s).stale:
        self.restart(rec)

  def restart(self, rec) -> None:
    if rec["time"] == self.restarted_for:
      return  # restarted for this record already: the new attempt has not written one (watch only reports)
    self.restarted_for = rec["time"]
    self.runner.note(f"the slice is ACTIVE and its run has not written a heartbeat since step {rec['step']}: "
                     f"restarting {unit(self.args)} on every worker (--restart_stale)")
    for node in nodes(self.args):
      self.runner.run(ssh(self.args, node, f"sudo systemctl restart {unit(self.args)}"), check=False)


def watch(args, runner: Runner) -> None:
  """Keeps the queued resource alive: queued again whenever it is SUSPENDED or FAILED, until it is deleted;
  says at every poll how old the run's heartbeat is."""
  script = startup_file(args, runner)
  if queued_state(args, runner) is None:
    runner.note(f"if `describe` fails, {args.name} is not queued yet and is queued now:")
    stage(args, runner)
    queue(args, runner, script)
  runner.note(f"then every {args.poll_s:g} s: when the state is {' or '.join(REQUEUE_STATES)} (a Spot slice "
              "preempted, a request that failed), it is deleted and queued again; the new slice's start-up "
              "script resumes the run from its workdir:")
  requeue = [_queued(args, "delete", "--force", "--quiet"), queue_command(args, script)]
  beat = HeartbeatWatch(args, runner)
  if beat.url is None:
    runner.note("the run's heartbeat is read from a gs:// --workdir only: this one is not watched")
  if runner.dry_run:
    for cmd in requeue:
      runner.run(cmd)
    if beat.url is not None:
      runner.note(f"and every poll reads the run's heartbeat (STALE after max({args.stale_intervals:g} log periods, "
                  f"{args.stale_floor_s:g} s) without one):")
      runner.output(beat.read_command())
    return
  last, missing, pending = None, 0, False  # pending: a re-queue whose `create` has not gone through yet
  while True:
    time.sleep(args.poll_s)
    state = queued_state(args, runner, quiet=True)
    if state is not None and state != last:
      runner.note(f"{time.strftime('%H:%M:%S')} {args.name}: {state}")
      last = state
    if state is None and pending:  # deleted by us, not queued again yet: try again
      pending = runner.run(requeue[1], check=False) != 0
    elif state is None:
      missing += 1
      if missing >= 3:
        raise SystemExit(f"the queued resource {args.name} could not be described 3 times running (deleted?): "
                         "stopped watching")
    elif state in REQUEUE_STATES:
      missing = 0
      runner.run(requeue[0], check=False)
      pending = runner.run(requeue[1], check=False) != 0
    else:
      missing = 0
    beat.look(state)


def main(argv: Sequence[str] = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  runner = Runner(args.dry_run)
  if args.action == "up":
    stage(args, runner)
    if not create_vm(args, runner):
      restart_on_workers(args, runner)
    follow(args, runner)
  elif args.action == "create":
    stage(args, runner)
    if not create_vm(args, runner):
      runner.note(f"nothing changed on {args.name}: `run` restarts its run with this checkout and command")
  else:
    steps = {"run": (stage, restart_on_workers, follow), "queue": (stage, queue), "watch": (watch,),
             "logs": (follow,), "stop": (stop,), "delete": (delete,)}[args.action]
    for step in steps:
      step(args, runner)
  return 0


if __name__ == "__main__":
  sys.exit(main())
