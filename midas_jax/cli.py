"""The `midas` command line (also `python -m midas_jax`).

  midas train --gin_file=F [--gin_file=F2 ...] [--gin.KEY=VALUE ...] --workdir=DIR|gs://BUCKET/DIR [--profile=5:8]
  midas compare --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas inspect --workdir=DIR
  midas eval --workdir=DIR --suite=NAME|a,b|all [...]     midas report --workdir=DIR
  midas export --workdir=DIR --format=hf|torch|npz|params --out=OUT    midas import --hf=DIR --workdir=OUT
  midas study anchor --gin_file=F --workdir=DIR
  midas bench compile --gin_file=F [--topology=v5p-128|gpu-8]
  midas bench stacking --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas bench train --gin_file=F [--gin.KEY=VALUE ...] [--steps=N]
  midas bench checkpoint --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas bench preemption --gin_file=F [--gin.KEY=VALUE ...] [--steps=N]   (on N processes: launch/local.py)
  midas bench data --gin_file=F [--gin.KEY=VALUE ...] [--seconds=S] [--train_tokens_per_second=X]
  midas data prepare --gin_file=F [--gin.KEY=VALUE ...] --out=PATH [--runner=R] [--num_workers=N] [-- BEAM_OPTIONS]
  midas data sample --gin_file=F --steps=N --out=FILE.jsonl
  midas data write-corpus --out=DIR
  midas data train-spm --files=GLOB [--files=GLOB ...] --vocab_size=N --out=PREFIX

Bad input (unknown flags or gin settings, impossible shapes, missing files, an unwritable workdir)
ends with a one-paragraph message naming the setting and the fix, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple

from midas_jax import distributed, fs
from midas_jax.errors import ConfigError, NonFiniteLossError


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


def _add_gin_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--gin_file", action="append", default=[],
                      help="gin config file; repeatable, later files override earlier ones")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="midas", description="Pretrain language models that grow in depth.",
                                   epilog="Override any gin setting with --gin.Class.setting=VALUE.")
  sub = parser.add_subparsers(dest="command", required=True)

  train = sub.add_parser("train", help="train (or resume) a model")
  _add_gin_flags(train)
  train.add_argument("--workdir", required=True,
                     help="output directory or gs:// URL: config, metrics, checkpoints; a workdir with "
                          "checkpoints resumes")
  train.add_argument("--profile", default=None, metavar="START:STOP",
                     help="write a jax.profiler trace of steps START+1..STOP under WORKDIR/profile "
                          "(TrainerConfig.profile_steps)")
  train.add_argument("--allow_config_changes", default="",
                     help="comma-separated settings (e.g. optimizer.learning_rate,trainer.num_steps, or a "
                          "section like optimizer.) that may differ from the checkpoint's config on resume; "
                          "'all' allows any change")
  distributed.add_flags(train)

  comp = sub.add_parser("compare", help="train a stacked config and its full-depth baseline side by side")
  _add_gin_flags(comp)
  comp.add_argument("--workdir", required=True, help="output: one folder per run, table and loss-vs-FLOPs plot")
  distributed.add_flags(comp)

  inspect = sub.add_parser("inspect", help="JSON: step, stage, depth, schedule and layer provenance of a run")
  inspect.add_argument("--workdir", required=True)

  bench = sub.add_parser("bench", help="benchmarks")
  bench_sub = bench.add_subparsers(dest="bench", required=True)
  bench_train = bench_sub.add_parser("train", help="steady-state tokens/s and MFU against the matmul peak")
  _add_gin_flags(bench_train)
  bench_train.add_argument("--steps", type=int, default=10, help="timed steps (after warmup)")
  bench_train.add_argument("--warmup", type=int, default=2, help="untimed steps, compile included")
  bench_train.add_argument("--peak_size", type=int, default=2048, help="matmul size of the peak probe")
  bench_train.add_argument("--json", default=None, help="also write the results to this JSON file")
  bench_stack = bench_sub.add_parser("stacking", help="measured vs theoretical speedup of MIDAS Prop-1, k=4")
  _add_gin_flags(bench_stack)
  bench_stack.add_argument("--workdir", required=True, help="where the two runs write their outputs")
  bench_stack.add_argument("--json", default=None, help="also write the results to this JSON file")
  bench_ckpt = bench_sub.add_parser("checkpoint", help="save time, size, and how much an async save stalls training")
  _add_gin_flags(bench_ckpt)
  bench_ckpt.add_argument("--workdir", required=True, help="where the benchmark's checkpoints are written")
  bench_ckpt.add_argument("--json", default=None, help="also write the results to this JSON file")
  bench_preempt = bench_sub.add_parser("preemption", help="what the per-step preemption check costs a train "
                                      "step (run it on several processes with launch/local.py)")
  _add_gin_flags(bench_preempt)
  bench_preempt.add_argument("--steps", type=int, default=20, help="train steps per timed block")
  bench_preempt.add_argument("--repeats", type=int, default=5, help="timed blocks per variant")
  bench_preempt.add_argument("--json", default=None, help="also write the results to this JSON file")
  distributed.add_flags(bench_preempt)
  return parser


# Commands that live beside the code they drive. Each module has
# `register(sub, bench_sub) -> {name: handler}`: it adds its parsers to `sub` (top-level commands) or
# `bench_sub` (`midas bench NAME`, keyed "bench NAME") and imports nothing heavy at module level.
# A handler is called as handler(args, bindings) and returns the exit status.
COMMAND_MODULES: Tuple[str, ...] = ("midas_jax.convert.commands", "midas_jax.evals.commands",
                                     "midas_jax.evals.study_commands", "midas_jax.scale_commands",
                                     "midas_jax.data.commands")


def _parser_and_plugins() -> Tuple[argparse.ArgumentParser, dict]:
  import importlib  # pylint: disable=import-outside-toplevel
  parser = _parser()
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  bench_parser = sub.choices["bench"]
  bench_sub = next(a for a in bench_parser._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  handlers = {}
  for name in COMMAND_MODULES:
    handlers.update(importlib.import_module(name).register(sub, bench_sub))
  return parser, handlers


def _load_run_config(gin_files, bindings):
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  if not gin_files:
    raise ConfigError("--gin_file", "no gin file given", "pass e.g. --gin_file=gin/experiments/cpu_demo.gin")
  gin_config.parse(gin_files, bindings)
  return gin_config.run_config_from_gin(), gin_config


def enable_compilation_cache() -> None:
  """Persistent XLA compilation cache, so a re-run (or a resumed run) reuses its compiles.

  MIDAS_JAX_CACHE_DIR picks the folder; set it to "off" to disable.
  """
  path = os.environ.get("MIDAS_JAX_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "midas_jax", "xla"))
  if path == "off":
    return
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def profile_binding(text: Optional[str]) -> List[str]:
  """`--profile=START:STOP` as the gin binding it stands for (checked by TrainerConfig)."""
  if text is None:
    return []
  start, sep, stop = text.partition(":")
  if not (sep and start.strip().isdigit() and stop.strip().isdigit()):
    raise ConfigError("--profile", f"{text!r} is not START:STOP", "pass e.g. --profile=5:8 to trace steps 6 to 8")
  return [f"TrainerConfig.profile_steps=({int(start)}, {int(stop)})"]


def _train(args, bindings) -> int:
  fs.check(args.workdir, "--workdir")  # an unknown scheme fails before anything starts
  bindings = list(bindings) + profile_binding(args.profile)
  distributed.initialize(args)  # before anything asks jax for its devices
  from midas_jax.train.loop import train  # pylint: disable=import-outside-toplevel
  enable_compilation_cache()
  config, gin_config = _load_run_config(args.gin_file, bindings)
  allowed = [k.strip() for k in args.allow_config_changes.split(",") if k.strip()]
  result = train(config, args.workdir, operative_config=gin_config.operative_config(),
                 allow_config_changes=allowed)
  print(json.dumps({"steps": result.steps, "preempted": result.preempted, "final_loss": result.final_loss,
                    "final_eval_loss": result.final_eval_loss,
                    "wall_seconds": round(result.wall_seconds, 1), "workdir": result.workdir}))
  return 0


def _compare(args, bindings) -> int:
  distributed.initialize(args)
  from midas_jax import compare  # pylint: disable=import-outside-toplevel
  enable_compilation_cache()
  config, gin_config = _load_run_config(args.gin_file, bindings)
  report = compare.compare(config, args.workdir, operative_config=gin_config.operative_config())
  print(report["table"])
  print(f"wall-clock speedup {report['measured_speedup']:.2f}x at {report['flop_ratio']:.2f}x fewer FLOPs; "
        f"plot: {fs.join(args.workdir, 'loss_vs_flops.png')}")
  return 0


def _inspect(args, bindings) -> int:
  del bindings
  workdir = fs.check(args.workdir, "--workdir")
  path = fs.join(workdir, "stages.json")
  if not fs.isfile(path):
    raise ConfigError("--workdir", f"no run in {args.workdir} (stages.json is missing)",
                      "pass the --workdir of a `midas train` run")
  report = fs.read_json(path)
  config_path = fs.join(workdir, "config.json")
  if fs.isfile(config_path):
    report["config"] = fs.read_json(config_path)
  print(json.dumps(report, indent=2))
  return 0


def _bench(args, bindings) -> int:
  if args.bench == "preemption":
    distributed.initialize(args)  # before anything asks jax for its devices
  from midas_jax.bench import train_bench  # pylint: disable=import-outside-toplevel
  config, _ = _load_run_config(args.gin_file, bindings)
  if args.bench == "preemption":
    from midas_jax.bench import preemption_bench  # pylint: disable=import-outside-toplevel
    report = preemption_bench.run(config, steps=args.steps, repeats=args.repeats)
    import jax  # pylint: disable=import-outside-toplevel
    if jax.process_index() != 0:
      return 0
    print(preemption_bench.format_report(report))
  elif args.bench == "stacking":
    from midas_jax.bench import stacking_bench  # pylint: disable=import-outside-toplevel
    report = stacking_bench.run(config, args.workdir)
    print(stacking_bench.format_report(report))
  elif args.bench == "checkpoint":
    from midas_jax.bench import checkpoint_bench  # pylint: disable=import-outside-toplevel
    report = checkpoint_bench.run(config, args.workdir)
    print(checkpoint_bench.format_report(report))
  else:
    report = train_bench.run(config, steps=args.steps, warmup=args.warmup, peak_size=args.peak_size)
    print(train_bench.format_report(report))
  if args.json:
    fs.write_json(args.json, report)
  return 0


COMMANDS = {"train": _train, "compare": _compare, "inspect": _inspect, "bench": _bench}


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    bindings, rest = split_gin_bindings(argv)
    parser, plugins = _parser_and_plugins()
    args = parser.parse_args(rest)
    key = f"bench {args.bench}" if args.command == "bench" else args.command
    handler = plugins.get(key) or COMMANDS[args.command]
    return handler(args, bindings)
  except ConfigError as e:
    print(f"midas: error: {e}", file=sys.stderr)
    return 2
  except NonFiniteLossError as e:
    print(f"midas: training stopped: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
