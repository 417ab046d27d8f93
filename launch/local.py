"""Run a multi-process midas job on this machine: N processes joined by jax.distributed on 127.0.0.1.

  python launch/local.py --num_processes=2 --devices_per_process=4 \
      -- train --gin_file=gin/experiments/midas_cpu.gin --workdir=/tmp/midas_2proc

Each process gets --coordinator_address, --num_processes and --process_id, and (with
--devices_per_process, the default) that many simulated CPU devices, so a laptop rehearses what a
pod does: every process builds only its rows of the global batch, and the mesh spans all of them.
Their output is followed here, each line prefixed with [process id]; if one fails the others are
stopped. --dry-run prints the commands instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Runner, add_dry_run, add_env, parse_env, require_midas_args, split_midas_args  # noqa: E402  pylint: disable=wrong-import-position

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv: Sequence[str]) -> argparse.Namespace:
  own, midas_args = split_midas_args(argv)
  parser = argparse.ArgumentParser(prog="launch/local.py", description=__doc__.split("\n")[0],
                                   epilog="Everything after `--` is the midas command each process runs.")
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4,
                      help="simulated CPU devices per process; 0 keeps the machine's own devices")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--python", default=sys.executable, help="interpreter that runs midas_jax")
  add_env(parser)
  add_dry_run(parser)
  args = parser.parse_args(own)
  args.midas_args = midas_args
  args.env = parse_env(parser, args.env)
  require_midas_args(parser, midas_args)
  if args.num_processes < 1:
    parser.error("--num_processes must be >= 1")
  if args.devices_per_process < 0:
    parser.error("--devices_per_process must be >= 0")
  return args


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(args) -> Dict[str, str]:
  """The variables each process gets on top of this one's environment (--env last, so it wins)."""
  if not args.devices_per_process:
    return dict(args.env)
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  flags.append(f"--xla_force_host_platform_device_count={args.devices_per_process}")
  return dict({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}, **args.env)


def commands(args, port: int) -> List[Tuple[Dict[str, str], List[str]]]:
  """(extra environment, argv) of every process."""
  env = process_env(args)
  coordinator = f"127.0.0.1:{port}"
  return [(env, [args.python, "-m", "midas_jax", *args.midas_args, f"--coordinator_address={coordinator}",
                 f"--num_processes={args.num_processes}", f"--process_id={i}"])
          for i in range(args.num_processes)]


def _follow(index: int, proc: subprocess.Popen, lock: threading.Lock) -> None:
  for line in proc.stdout:
    with lock:
      sys.stdout.write(f"[{index}] {line}")
      sys.stdout.flush()


def run(procs_spec: List[Tuple[Dict[str, str], List[str]]]) -> int:
  """Starts every process, relays their output, and returns the first non-zero exit status (or 0)."""
  pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
  procs = []
  for extra, argv in procs_spec:
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1", **extra)
    procs.append(subprocess.Popen(argv, env=env, cwd=os.getcwd(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  lock = threading.Lock()
  readers = [threading.Thread(target=_follow, args=(i, p, lock), daemon=True) for i, p in enumerate(procs)]
  for r in readers:
    r.start()
  status = 0
  try:
    pending = list(procs)
    while pending:
      for p in list(pending):
        try:
          rc = p.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
          continue
        pending.remove(p)
        if rc != 0 and status == 0:
          status = rc
          for other in pending:  # the rest would wait forever for their lost peer
            other.terminate()
  except KeyboardInterrupt:
    for p in procs:
      if p.poll() is None:
        p.terminate()
    status = 130
  for r in readers:
    r.join(timeout=5)
  return status


def main(argv: Sequence[str] = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  port = args.port or free_port()
  spec = commands(args, port)
  runner = Runner(args.dry_run)
  runner.note(f"{args.num_processes} processes, coordinator 127.0.0.1:{port}")
  for extra, argv_ in spec:  # one shell line per process, as it could be typed by hand
    env = ["env"] + [f"{k}={v}" for k, v in sorted(extra.items())] if extra else []
    print(shlex.join(env + argv_), flush=True)
  if args.dry_run:
    return 0
  return run(spec)


if __name__ == "__main__":
  sys.exit(main())
