"""What every `midas` command shares: how it is added, its gin flags, and loading its configs.

Each commands module has `add_commands(root: CommandGroup)`, which adds its parsers with a handler each;
cli.py builds the parser from those modules and calls the chosen handler as handler(args, bindings),
`bindings` being the `--gin.KEY=VALUE` flags. A handler returns the exit status.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax

from midas_jax import distributed, fs, gin_config, tpu_flags
from midas_jax.configs import RunConfig
from midas_jax.console import say
from midas_jax.errors import ConfigError

Handler = Callable[[argparse.Namespace, List[str]], int]
CACHE_DIR_VAR = "MIDAS_JAX_CACHE_DIR"  # a folder, a gs:// URL shared by the pod, or "off"
MIN_COMPILE_SECS_VAR = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"  # jax's own, honoured when set


class CommandGroup:
  """Commands at one level of `midas`: the top level, or a group such as `midas bench ...`."""

  def __init__(self, subparsers):
    self._subparsers = subparsers
    self._groups: Dict[str, "CommandGroup"] = {}

  def command(self, name: str, handler: Handler, help: str, **kwargs) -> argparse.ArgumentParser:  # noqa: A002
    """Adds `name`, run by `handler`; returns its parser for the command's flags."""
    parser = self._subparsers.add_parser(name, help=help, **kwargs)
    parser.set_defaults(handler=handler)
    return parser

  def group(self, name: str, help: str) -> "CommandGroup":  # noqa: A002
    """The commands under `name` (created by the first module that asks, shared by the rest)."""
    if name not in self._groups:
      parser = self._subparsers.add_parser(name, help=help)
      self._groups[name] = CommandGroup(parser.add_subparsers(dest=f"{name}_command", required=True,
                                                              metavar="COMMAND"))
    return self._groups[name]


def bench_group(root: CommandGroup) -> CommandGroup:
  """`midas bench NAME`: every benchmark is added here, whichever module defines it."""
  return root.group("bench", help="benchmarks: throughput, MFU, the data pipeline, compile fit, ...")


def split_gin_bindings(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
  """Separates t5x-style `--gin.KEY=VALUE` flags from the rest of argv."""
  bindings, rest = [], []
  for arg in argv:
    if arg.startswith("--gin."):
      key, sep, value = arg[len("--gin."):].partition("=")
      if not sep or not key:
        raise ConfigError(arg, "a gin binding needs a value", "write --gin.Class.setting=VALUE")
      bindings.append(f"{key}={value}")
    else:
      rest.append(arg)
  return bindings, rest


def add_gin_flags(parser: argparse.ArgumentParser, what: str = "gin config file") -> None:
  parser.add_argument("--gin_file", action="append", default=[],
                      help=f"{what}; repeatable, later files override earlier ones")


def parse_gin(gin_files: Sequence[str], bindings: Sequence[str],
              example: str = "gin/experiments/cpu_demo.gin") -> None:
  if not gin_files:
    raise ConfigError("--gin_file", "no gin file given", f"pass e.g. --gin_file={example}")
  gin_config.parse(gin_files, bindings)


def load_run_config(gin_files: Sequence[str], bindings: Sequence[str]) -> Tuple[RunConfig, str]:
  """(the RunConfig the gin files and bindings describe, the operative gin config)."""
  parse_gin(gin_files, bindings)
  return gin_config.run_config_from_gin(), gin_config.operative_config()


def start_backend(config: RunConfig, args: argparse.Namespace) -> None:
  """The libtpu flags of the run's TPU generation (libtpu reads them once, when the TPU backend starts),
  then the job's processes (jax.distributed), before anything asks jax for a device."""
  applied = tpu_flags.apply(config.mesh.tpu_flags, config.mesh.num_slices, config.model.remat_policy)
  if applied["added"]:
    say(f"libtpu flags for {applied['accelerator']}: {len(applied['added'])} set in {tpu_flags.ENV} "
        "(MeshConfig.tpu_flags; docs/pods.md#tpu-compiler-flags)")
  distributed.initialize(args)


def refuse_bindings(bindings: Sequence[str], command: str, fix: str) -> None:
  if bindings:
    raise ConfigError("--gin.*", f"{command} takes no gin bindings", fix)


def enable_compilation_cache() -> None:
  """Persistent XLA compilation cache, so a re-run (or a resumed run) reuses its compiles.

  MIDAS_JAX_CACHE_DIR picks the folder, or a gs:// URL that every host of a pod reads: jax writes
  entries from process 0 only, so a folder on each host would serve host 0 alone and every other
  host would compile every program again after each restart. "off" disables the cache. A program
  is kept if it took at least 1 s to compile, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says
  otherwise. Errors reading or writing the cache are warnings (jax's default): a compile, not a stop.
  """
  path = os.environ.get(CACHE_DIR_VAR, os.path.join(os.path.expanduser("~"), ".cache", "midas_jax", "xla"))
  if path == "off":
    return
  path = fs.check(path, CACHE_DIR_VAR)  # an unknown scheme stops here, naming the variable
  jax.config.update("jax_compilation_cache_dir", path)
  if MIN_COMPILE_SECS_VAR not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  if fs.is_remote(path):
    # XLA's own GPU caches (autotuning, kernels) would get the URL as a directory for its C++ file
    # I/O, which has no gs:// client; jax's cache of whole programs goes through etils.epath instead.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")


def profile_binding(text: Optional[str]) -> List[str]:
  """`--profile=START:STOP` as the gin binding it stands for (checked by TrainerConfig)."""
  if text is None:
    return []
  start, sep, stop = text.partition(":")
  if not (sep and start.strip().isdigit() and stop.strip().isdigit()):
    raise ConfigError("--profile", f"{text!r} is not START:STOP", "pass e.g. --profile=5:8 to trace steps 6 to 8")
  return [f"TrainerConfig.profile_steps=({int(start)}, {int(stop)})"]
