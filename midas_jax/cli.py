"""The `midas` command line (also `python -m midas_jax`).

  midas train --gin_file=F [--gin_file=F2 ...] [--gin.KEY=VALUE ...] --workdir=DIR|gs://BUCKET/DIR [--profile=5:8]
  midas compare --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas inspect --workdir=DIR
  midas eval --workdir=DIR --suite=NAME|a,b|all [...]     midas report --workdir=DIR
  midas export --workdir=DIR --format=hf|torch|npz|params --out=OUT    midas import --hf=DIR --workdir=OUT
  midas study anchor|stacking --gin_file=F --workdir=DIR
  midas bench train|stacking|checkpoint|preemption|data|compile|compile-table ...
  midas data prepare|sample|write-corpus|train-spm ...
  midas docs render [--check]

Each commands module (midas_jax/commands/) adds its commands the same way; the module
docstrings there list every flag. Bad input (unknown flags or gin settings, impossible shapes,
missing files, an unwritable workdir) ends with a one-paragraph message naming the setting and the
fix, and exit status 2. A fault outside the config ends with a message saying what failed and what to do:
storage that does not answer with exit status 75 (transient: the same command later goes on), a loss that
is not finite with 3, others with 1; midas_jax/exit_status.py has the table. In a multi-process job the
process that stops tells the others first (peers.py), and they stop with the same status.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Optional, Sequence

from midas_jax.commands import (bench_commands, convert_commands, data_commands, docs_commands, eval_commands,
                                study_commands, train_commands)
from midas_jax.commands.common import CommandGroup, split_gin_bindings
from midas_jax import exit_status, peers
from midas_jax.errors import ConfigError, FaultError, NonFiniteLossError

COMMAND_MODULES = (train_commands, eval_commands, convert_commands, study_commands, bench_commands, data_commands,
                   docs_commands)


def parser() -> argparse.ArgumentParser:
  """The whole `midas` parser: every commands module's commands, each with its handler."""
  top = argparse.ArgumentParser(prog="midas", description="Pretrain language models that grow in depth.",
                                epilog="Override any gin setting with --gin.Class.setting=VALUE.")
  root = CommandGroup(top.add_subparsers(dest="command", required=True, metavar="COMMAND"))
  for module in COMMAND_MODULES:
    module.add_commands(root)
  return top


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    bindings, rest = split_gin_bindings(argv)
    args = parser().parse_args(rest)
    return args.handler(args, bindings)
  except ConfigError as e:
    return _stop(exit_status.BAD_INPUT.status, f"midas: error: {e}")
  except NonFiniteLossError as e:
    return _stop(exit_status.HALTED.status, f"midas: training stopped: {e}\n  {_HALTED_NOTE}")
  except FaultError as e:  # storage unavailable (exit 75: run it again later), out of memory, a peer gone
    return _stop(e.exit_status, f"midas: stopped: {e}")
  except Exception as e:  # an error nobody recognised: its traceback, and in a job every process told
    if peers.active():
      peers.announce(exit_status.FAILED.status, f"{type(e).__name__}: {' '.join(str(e).split())[:1000]}")
      traceback.print_exc()
      peers.leave()
      return exit_status.FAILED.status
    raise


_HALTED_NOTE = ("exit status 3: running the same command again would repeat it from the last save "
                "(docs/pods.md#exit-statuses)")


def _stop(status: int, message: str) -> int:
  """Prints why the command stopped; in a multi-process job, first tells every other process (peers.py),
  then waits for them at the distributed client's shutdown, so all of them exit with this status."""
  print(message, file=sys.stderr, flush=True)
  if peers.active():
    peers.announce(status, message)
    peers.leave()
  return status


if __name__ == "__main__":
  sys.exit(main())
