"""`midas eval` and `midas report`.

  midas eval --workdir=DIR --suite=NAME|all [--k_shot=5 --num_examples=N --seed=S --loop_repeats=2,3
             --loop_block_size=B --finetune_examples=N --finetune_steps=S --tasks=copying,psm --step=S
             --opt=KEY=VALUE ...]
  midas eval --workdir=DIR --suite=lm_eval --tasks=hellaswag,arc_easy [--include_path=TASKS_DIR --k_shot=N
             --num_examples=N --batch_size=B --out=DIR --opt=max_length=L --opt=add_bos=false --opt=log_samples=true]
  midas report --workdir=DIR [--out=FILE.md]
"""

from __future__ import annotations

import argparse
import json
from typing import Tuple

from midas_jax import fs
from midas_jax.checkpoint import load_model
from midas_jax.commands.common import CommandGroup, enable_compilation_cache, refuse_bindings
from midas_jax.errors import ConfigError
from midas_jax.evals import lm_eval_adapter, primitives, report, suites


def _int_list(text: str) -> Tuple[int, ...]:
  try:
    values = tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,3, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected integers >= 1 such as 2,3, got {text!r}")
  return values


def add_commands(root: CommandGroup) -> None:
  ev = root.command("eval", _eval, help="evaluate a checkpoint: JSON results and PNG figures under DIR/eval/")
  ev.add_argument("--workdir", required=True, help="a run's workdir (latest checkpoint) or a params-only export")
  ev.add_argument("--suite", required=True,
                  help="primitives, primitive_scores, primitives_finetune, memorization, looping, similarity, "
                       "embeddings, "
                       "delta_l, a comma-separated list, or all (every suite that applies); or lm_eval alone "
                       "(lm-evaluation-harness tasks, the eval extra)")
  ev.add_argument("--k_shot", type=int, default=None, help="solved examples before each question (default 5)")
  ev.add_argument("--num_examples", type=int, default=None, help="held-out questions per task (default 100)")
  ev.add_argument("--seed", type=int, default=None, help="seed of the generated questions (default 0)")
  ev.add_argument("--tasks", default=None,
                  help="primitive tasks, comma-separated (default: all); with --suite=lm_eval, lm_eval tasks or groups")
  ev.add_argument("--include_path", default=None,
                  help="--suite=lm_eval: a folder of lm_eval task YAML files (local or gs://) besides lm_eval's own")
  ev.add_argument("--loop_repeats", type=_int_list, default=None, help="looping: r values (default 2,3)")
  ev.add_argument("--loop_block_size", type=int, default=None,
                  help="looping: layers per block (default: the run's StackingConfig block size)")
  ev.add_argument("--finetune_examples", type=int, default=None, help="fine-tune examples per task (default 256)")
  ev.add_argument("--finetune_steps", type=int, default=None, help="fine-tune steps per task (default 100)")
  ev.add_argument("--batch_size", type=int, default=None, help="decoding rows per forward pass (default 32)")
  ev.add_argument("--step", type=int, default=None, help="evaluate this checkpoint step (default: the latest)")
  ev.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                  help="any other suite option, e.g. --opt=max_checkpoints=3 (VALUE read as JSON when it parses)")
  ev.add_argument("--out", default=None, help="output folder (default DIR/eval)")
  rep = root.command("report", _report, help="one Markdown page with figures from a run's metrics and evaluations")
  rep.add_argument("--workdir", required=True, help="a run's workdir, or a `midas compare` folder")
  rep.add_argument("--out", default=None, help="the page to write (default DIR/report.md)")


def options_from_args(args) -> dict:
  options = {name: getattr(args, name) for name in ("k_shot", "num_examples", "seed", "loop_repeats",
                                                     "loop_block_size", "finetune_examples", "finetune_steps",
                                                     "batch_size", "step")}
  options["tasks"] = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
  for name in ("num_examples", "batch_size", "loop_block_size", "finetune_examples", "finetune_steps"):
    if options[name] is not None and options[name] < 1:
      raise ConfigError(f"--{name}", f"must be >= 1, got {options[name]}", f"pass a positive --{name}")
  for name in ("k_shot", "seed", "step"):
    if options[name] is not None and options[name] < 0:
      raise ConfigError(f"--{name}", f"must be >= 0, got {options[name]}", f"pass a non-negative --{name}")
  for item in args.opt:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ConfigError("--opt", f"{item!r} is not KEY=VALUE", "write e.g. --opt=max_checkpoints=3")
    try:
      options[key] = json.loads(value)
    except json.JSONDecodeError:
      options[key] = value
  return {k: v for k, v in options.items() if v is not None}


def _eval(args, bindings) -> int:
  refuse_bindings(bindings, "midas eval reads the run's saved config and",
                  "drop the --gin. flags; the eval flags are listed by `midas eval --help`")
  if any(suites.runs_alone(s.strip()) for s in args.suite.split(",")):
    return _eval_harness(args)
  if args.include_path:
    raise ConfigError("--include_path", "only --suite=lm_eval reads task files", "drop --include_path")
  names = suites.resolve(args.suite)
  options = options_from_args(args)
  if options.get("tasks"):
    primitives.task_names(options)
  if not fs.exists(fs.check(args.workdir, "--workdir")):
    raise ConfigError("--workdir", f"{args.workdir} does not exist", "pass a run's workdir or a params-only export")
  enable_compilation_cache()  # a second eval of the same model reuses the decoding programs
  model = load_model(args.workdir, options.get("step"))
  out_dir = args.out or fs.join(args.workdir, "eval")
  done = suites.run_many(names, model, args.workdir, options, out_dir, skip_inapplicable=args.suite == "all")
  for name, record in done.items():
    print(json.dumps({"suite": name, **_summary(record)}))
  return 0


HARNESS_OPTIONS = ("max_length", "add_bos", "log_samples", "bootstrap_iters")


def _eval_harness(args) -> int:
  """--suite=lm_eval: the harness's tasks over the checkpoint; OUT/lm_eval.json and the harness's table."""
  if args.suite.strip() != "lm_eval":
    raise ConfigError("--suite", f"lm_eval runs alone, got {args.suite!r}", "run --suite=lm_eval and the others apart")
  options = options_from_args(args)
  unknown = sorted(set(options) - {"k_shot", "num_examples", "seed", "batch_size", "step", "tasks", *HARNESS_OPTIONS})
  if not options.get("tasks"):
    raise ConfigError("--tasks", "--suite=lm_eval needs tasks", "pass --tasks=hellaswag,arc_easy (any lm_eval task)")
  if unknown:
    raise ConfigError("--suite", f"--suite=lm_eval reads no {unknown}",
                      f"use --tasks, --include_path, --k_shot, --num_examples, --seed, --batch_size, --step, --out "
                      f"and --opt={{{','.join(HARNESS_OPTIONS)}}}=...")
  if not fs.exists(fs.check(args.workdir, "--workdir")):
    raise ConfigError("--workdir", f"{args.workdir} does not exist", "pass a run's workdir or a params-only export")
  include = fs.check(args.include_path, "--include_path") if args.include_path else None
  if include and not fs.isdir(include):
    raise ConfigError("--include_path", f"{include} is not a directory", "pass a folder of lm_eval task YAML files")
  enable_compilation_cache()
  model = load_model(args.workdir, options.get("step"))
  out_dir = args.out or fs.join(args.workdir, "eval")
  fs.makedirs(out_dir)
  path = fs.join(out_dir, "lm_eval.json")
  record, table = lm_eval_adapter.evaluate(
      model, options.get("tasks") or [], path, include_path=include, num_fewshot=options.get("k_shot"),
      limit=options.get("num_examples"), batch_size=options.get("batch_size", lm_eval_adapter.DEFAULT_BATCH_SIZE),
      seed=options.get("seed"), **{k: options[k] for k in HARNESS_OPTIONS if k in options})
  print(table)
  print(json.dumps({"suite": "lm_eval", "step": record["step"], "depth": record["depth"],
                    "seconds": record["seconds"], "json": path}))
  return 0


def _summary(record: dict) -> dict:
  """A one-line view of a suite's results: accuracies per task or condition where there are any."""
  if "skipped" in record:
    return {"skipped": record["skipped"]}
  results = record["results"]
  out: dict = {"step": record["step"], "depth": record["depth"], "seconds": record["seconds"],
               "json": f"{record['suite']}.json"}
  tasks = results.get("tasks") if isinstance(results, dict) else None
  if isinstance(tasks, dict):
    out["accuracy"] = {n: t["accuracy"] for n, t in tasks.items() if isinstance(t, dict) and "accuracy" in t}
  elif isinstance(results, dict):
    out["accuracy"] = {k: v["accuracy"] for k, v in results.items() if isinstance(v, dict) and "accuracy" in v}
  if not out.get("accuracy"):
    out.pop("accuracy", None)
  return out


def _report(args, bindings) -> int:
  del bindings
  path = report.write_report(args.workdir, args.out)
  print(path)
  return 0

