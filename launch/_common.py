"""What the launchers share: the midas command after `--`, and running (or printing) shell commands.

Plain standard-library Python, so the launchers start instantly and need no installed package; the
accelerators' facts come from this checkout's midas_jax/hardware.py and the exit statuses from its
midas_jax/exit_status.py, standard library only as well.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, REPO_ROOT)  # after launch/: `from midas_jax import hardware` reads this checkout's

Command = Union[str, Sequence[str]]
CACHE_DIR_VAR = "MIDAS_JAX_CACHE_DIR"  # midas_jax/commands/common.py: the compilation cache's folder or URL
ACCELERATOR_VAR = "MIDAS_TPU_ACCELERATOR"  # the run sets its libtpu flags by it (midas_jax/tpu_flags.py)


def split_midas_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
  """(launcher args, midas args): everything after the first `--` is the midas command line."""
  argv = list(argv)
  if "--" not in argv:
    return argv, []
  cut = argv.index("--")
  return argv[:cut], argv[cut + 1:]


def require_midas_args(parser: argparse.ArgumentParser, midas_args: Sequence[str]) -> None:
  if not midas_args:
    parser.error("no midas command: end the launcher's flags with `--` followed by e.g. "
                 "`train --gin_file=gin/experiments/cpu_demo.gin --workdir=DIR`")


def flag_value(args: Sequence[str], name: str) -> Optional[str]:
  """The value of `--name=V` or `--name V` in a midas command line, if present."""
  for i, arg in enumerate(args):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(args):
      return args[i + 1]
  return None


def add_env(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="environment variable for every process of the run (repeatable), e.g. "
                           "--env=XLA_FLAGS=--xla_dump_to=/tmp/dump")


def parse_env(parser: argparse.ArgumentParser, items: Sequence[str]) -> Dict[str, str]:
  """--env KEY=VALUE items as a dict; a malformed one is a usage error."""
  env: Dict[str, str] = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key or not (key[0].isalpha() or key[0] == "_") or not all(c.isalnum() or c == "_" for c in key):
      parser.error(f"--env={item}: expected KEY=VALUE with KEY a variable name")
    env[key] = value
  return env


def workdir_note(midas_args: Sequence[str], shared_by: str) -> Optional[str]:
  """A note when the run's --workdir is a path on each machine rather than a URL every one sees."""
  workdir = flag_value(midas_args, "workdir")
  if workdir is None or "://" in workdir:
    return None
  return (f"--workdir={workdir} is a path on each {shared_by}: checkpoints are written by every process "
          "together, so it must be storage all of them see; gs://BUCKET/DIR keeps the whole run in a bucket")


def bucket_of(url: Optional[str]) -> Optional[str]:
  """gs://BUCKET for a gs:// URL, else None."""
  if not url or not url.startswith("gs://"):
    return None
  return "gs://" + url[len("gs://"):].split("/", 1)[0]


def add_compile_cache(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--compile_cache", default=None, metavar="URL",
                      help="the XLA compilation cache every worker reads (MIDAS_JAX_CACHE_DIR): a gs:// URL, or "
                           "'off'; default gs://BUCKET/xla_cache when --workdir is on gs://BUCKET")


def with_compile_cache(env: Dict[str, str], midas_args: Sequence[str], flag: Optional[str]) -> Dict[str, str]:
  """The run's environment with MIDAS_JAX_CACHE_DIR on storage every worker sees.

  jax writes cache entries from process 0 only: a folder on each host would serve host 0 alone.
  An explicit --env=MIDAS_JAX_CACHE_DIR=... wins, then --compile_cache, then the workdir's bucket.
  """
  if CACHE_DIR_VAR in env:
    return dict(env)
  cache = flag
  if cache is None:
    bucket = bucket_of(flag_value(midas_args, "workdir"))
    cache = f"{bucket}/xla_cache" if bucket else None
  return dict(env, **{CACHE_DIR_VAR: cache}) if cache else dict(env)


def with_accelerator(env: Dict[str, str], accelerator: Optional[str]) -> Dict[str, str]:
  """The run's environment naming its TPU accelerator type (MIDAS_TPU_ACCELERATOR), from which the run
  picks its generation's libtpu flags (midas_jax/tpu_flags.py); an explicit --env wins."""
  if not accelerator or ACCELERATOR_VAR in env:
    return dict(env)
  return dict(env, **{ACCELERATOR_VAR: accelerator})


def parse_pod_args(parser: argparse.ArgumentParser, own: Sequence[str], midas_args: Sequence[str]) -> argparse.Namespace:
  """The TPU launchers' shared flags (--compile_cache, --env, --dry-run) added, then `own` parsed;
  the namespace carries the midas command and the environment as a dict."""
  add_compile_cache(parser)
  add_env(parser)
  add_dry_run(parser)
  args = parser.parse_args(own)
  args.midas_args = list(midas_args)
  args.env = parse_env(parser, args.env)
  return args


def add_dry_run(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                      help="print the commands instead of running them")


def as_text(cmd: Command) -> str:
  return cmd if isinstance(cmd, str) else shlex.join(cmd)


class Runner:
  """Runs commands, or with dry_run prints each as one shell line (`# ...` lines are comments)."""

  def __init__(self, dry_run: bool, out=None):
    self.dry_run = dry_run
    self.out = out or sys.stdout

  def note(self, text: str) -> None:
    print(f"# {text}", file=self.out, flush=True)

  def write(self, path: str, text: str) -> None:
    """Writes a file the commands use; a dry run prints it (`#   ` lines) instead."""
    if self.dry_run:
      self.note(f"would write {path}:")
      for line in text.splitlines():
        print(f"#   {line}", file=self.out, flush=True)
      return
    with open(path, "w") as f:
      f.write(text)
    self.note(f"wrote {path}")

  def run(self, cmd: Command, check: bool = True) -> int:
    print(as_text(cmd), file=self.out, flush=True)
    if self.dry_run:
      return 0
    result = subprocess.run(cmd, shell=isinstance(cmd, str), check=False)
    if check and result.returncode != 0:
      raise SystemExit(f"command failed with exit status {result.returncode}: {as_text(cmd)}")
    return result.returncode

  def output(self, cmd: Command, quiet: bool = False) -> Optional[str]:
    """A probe's stdout (stripped), None when it fails; a dry run prints it and returns None."""
    if not quiet:
      print(as_text(cmd), file=self.out, flush=True)
    if self.dry_run:
      return None
    result = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else None

  def succeeds(self, cmd: Command) -> bool:
    """Whether a probe (e.g. `describe`) exits 0; a dry run prints it and assumes it does not."""
    print(as_text(cmd), file=self.out, flush=True)
    if self.dry_run:
      return False
    return subprocess.run(cmd, shell=isinstance(cmd, str), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, check=False).returncode == 0
