"""`midas train`, `midas compare` and `midas inspect`.

  midas train --gin_file=F [--gin_file=F2 ...] [--gin.KEY=VALUE ...] --workdir=DIR|gs://BUCKET/DIR [--profile=5:8]
  midas compare --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas inspect --workdir=DIR
"""

from __future__ import annotations

import json

from midas_jax import compare, distributed, exit_status, fs
from midas_jax.commands.common import (CommandGroup, add_gin_flags, enable_compilation_cache, load_run_config,
                                       profile_binding, start_backend)
from midas_jax.errors import ConfigError, NonFiniteLossError
from midas_jax.train import attempts
from midas_jax.train.run import train


def add_commands(root: CommandGroup) -> None:
  p = root.command("train", _train, help="train (or resume) a model")
  add_gin_flags(p)
  p.add_argument("--workdir", required=True,
                 help="output directory or gs:// URL: config, metrics, checkpoints; a workdir with checkpoints resumes")
  p.add_argument("--profile", default=None, metavar="START:STOP",
                 help="write a jax.profiler trace of steps START+1..STOP under WORKDIR/profile "
                      "(TrainerConfig.profile_steps)")
  p.add_argument("--allow_config_changes", default="",
                 help="comma-separated settings (e.g. optimizer.learning_rate,trainer.num_steps, or a section like "
                      "optimizer.) that may differ from the checkpoint's config on resume; 'all' allows any change")
  distributed.add_flags(p)

  p = root.command("compare", _compare, help="train a stacked config and its full-depth baseline side by side")
  add_gin_flags(p)
  p.add_argument("--workdir", required=True, help="output: one folder per run, table and loss-vs-FLOPs plot")
  distributed.add_flags(p)

  p = root.command("inspect", _inspect, help="JSON: step, stage, depth, schedule and layer provenance of a run")
  p.add_argument("--workdir", required=True)


def _train(args, bindings) -> int:
  fs.check(args.workdir, "--workdir")  # an unknown scheme fails before anything starts
  bindings = list(bindings) + profile_binding(args.profile)
  config, operative = load_run_config(args.gin_file, bindings)  # touches no device
  start_backend(config, args)  # libtpu flags, then jax.distributed: before anything asks jax for its devices
  enable_compilation_cache()
  allowed = [k.strip() for k in args.allow_config_changes.split(",") if k.strip()]
  try:
    result = train(config, args.workdir, operative_config=operative, allow_config_changes=allowed)
  except (ConfigError, NonFiniteLossError):  # never restarted anyway
    raise
  except Exception as e:  # pylint: disable=broad-except
    if getattr(e, "exit_status", exit_status.FAILED.status) == exit_status.FAILED.status:
      attempts.check_repeat(args.workdir, e)  # the same step twice: HaltedError, status 3
    raise
  attempts.clear(args.workdir)
  print(json.dumps({"steps": result.steps, "preempted": result.preempted, "final_loss": result.final_loss,
                    "final_eval_loss": result.final_eval_loss,
                    "wall_seconds": round(result.wall_seconds, 1), "workdir": result.workdir}))
  # A preemption's save stands: 76 tells a supervisor to start the run again (it resumes from that save).
  return exit_status.PREEMPTED.status if result.preempted else exit_status.FINISHED.status


def _compare(args, bindings) -> int:
  config, operative = load_run_config(args.gin_file, bindings)
  start_backend(config, args)
  enable_compilation_cache()
  report = compare.compare(config, args.workdir, operative_config=operative)
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
