"""`midas bench ...`: every benchmark (docs/benchmarks.md has one section each).

  midas bench train --gin_file=F [--gin.KEY=VALUE ...] [--steps=N]
  midas bench stacking --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas bench checkpoint --gin_file=F [--gin.KEY=VALUE ...] --workdir=DIR
  midas bench preemption --gin_file=F [--gin.KEY=VALUE ...] [--steps=N]   (on N processes: launch/local.py)
  midas bench data --gin_file=F [--gin.KEY=VALUE ...] [--seconds=S] [--consumption=SLICE] [--storage_latency_ms=MS]
  midas bench store [--targets=CONFIG@SLICE ...] [--documents=N] [--steps=N] [--json=OUT] [--results=OUT]
  midas bench compile --gin_file=F [--gin_file=MESH] [--topology=v5p-128|2xv5p-128] [--method=auto] [--json=OUT]
  midas bench compile-table --after REPORT.json ... [--before REPORT.json ...]
  midas bench estimate --gin_file=F [--gin_file=MESH] --topology=v5p-128 [--json=OUT]
  midas bench estimate-table --reports REPORT.json ... --results=docs/results/pod_estimated_speed.json
  midas bench attention [--shape=B,T,H,KV,D ...] [--dtypes ...] [--paths ...] [--json=OUT]
"""

from __future__ import annotations

import argparse

import jax

from midas_jax import distributed, fs, results, versions
from midas_jax.analysis import compile_table
from midas_jax.bench import (checkpoint_bench, compile_bench, data_bench, preemption_bench, stacking_bench,
                             store_requests, train_bench)
from midas_jax import exit_status
from midas_jax.bench import attention_check
from midas_jax.commands.common import CommandGroup, add_gin_flags, bench_group, load_run_config


def _json_flag(parser) -> None:
  parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def add_commands(root: CommandGroup) -> None:
  bench = bench_group(root)
  p = bench.command("train", _train, help="steady-state tokens/s and MFU against the matmul peak")
  add_gin_flags(p)
  p.add_argument("--steps", type=int, default=10, help="timed steps (after warmup)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps, compile included")
  p.add_argument("--peak_size", type=int, default=2048, help="matmul size of the peak probe")
  _json_flag(p)

  p = bench.command("stacking", _stacking, help="measured vs theoretical speedup of MIDAS Prop-1, k=4")
  add_gin_flags(p)
  p.add_argument("--workdir", required=True, help="where the two runs write their outputs")
  _json_flag(p)

  p = bench.command("checkpoint", _checkpoint, help="save time, size, and how much an async save stalls training")
  add_gin_flags(p)
  p.add_argument("--workdir", required=True, help="where the benchmark's checkpoints are written")
  _json_flag(p)

  p = bench.command("preemption", _preemption, help="what the per-step preemption check costs a train step (run "
                    "it on several processes with launch/local.py)")
  add_gin_flags(p)
  p.add_argument("--steps", type=int, default=20, help="train steps per timed block")
  p.add_argument("--repeats", type=int, default=5, help="timed blocks per variant")
  _json_flag(p)
  distributed.add_flags(p)

  p = bench.command("data", _data, help="input pipeline tokens/s on one core vs t5/TF and training; peak memory "
                    "on a prepared store")
  add_gin_flags(p)
  p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per measurement")
  p.add_argument("--train_tokens_per_second", type=float, default=None,
                 help="training consumption to compare with, instead of timing train steps")
  p.add_argument("--consumption", default=None,
                 help="compare with one host's consumption on a TPU slice (e.g. v5p-128) at --mfu, computed from the "
                      "config, instead of timing train steps")
  p.add_argument("--mfu", type=float, default=0.4, help="the MFU --consumption assumes")
  p.add_argument("--train_steps", type=int, default=5, help="timed train steps (after 2 warmup)")
  p.add_argument("--synthetic_documents", type=int, default=None,
                 help="bench a synthetic prepared store of this many documents (written first, in a child process, "
                      "so the peak memory is the reader's)")
  p.add_argument("--synthetic_dir", default=None, help="where the synthetic store goes (default: a temp folder)")
  p.add_argument("--synthetic_mean_length", type=float, default=64.0,
                 help="mean document length of the synthetic store, in tokens (C4 with T5's model: about 430)")
  p.add_argument("--storage_latency_ms", type=float, default=0.0,
                 help="on a store on gs://: milliseconds added to every storage request, as a distant or loaded "
                      "bucket answers (the report counts the requests per step)")
  _json_flag(p)

  p = bench.command("store", _store, help="read requests per second per bucket for the paper configs on their "
                    "slices, before and after the reader coalesces a batch's ranges (a synthetic store, counted)")
  p.add_argument("--targets", nargs="+", default=list(store_requests.PAPER_SLICES),
                 help="CONFIG@SLICE: a gin/experiments name (or a .gin path) and a TPU slice")
  p.add_argument("--documents", type=int, default=100_000, help="documents of the synthetic store")
  p.add_argument("--mean_length", type=float, default=430.0, help="their mean length in tokens (C4 with T5's model)")
  p.add_argument("--synthetic_dir", default=None, help="where the synthetic stores go (default: a temp folder)")
  p.add_argument("--steps", type=int, default=16, help="steps counted")
  p.add_argument("--mfu", type=float, default=0.4, help="the MFU the step times assume")
  _json_flag(p)
  p.add_argument("--results", default=None, help="also write the docs table's results file (docs/results/...json)")

  p = bench.command("compile", _compile, help="will it fit: per-device memory of the train step, compiled ahead of "
                    "time (or estimated) for a mesh and topology")
  add_gin_flags(p)
  p.add_argument("--topology", default=None,
                 help="target: a TPU slice as gcloud names it (v4-64, v5litepod-64, v5p-128), several slices joined "
                      "by DCN (2xv5p-128, with a mesh that sets MeshConfig.dcn_data) or gpu-N; default: this "
                      "machine's devices (set XLA_FLAGS=--xla_force_host_platform_device_count=N to simulate N)")
  p.add_argument("--method", default="auto", choices=("auto", "compile", "analytic"),
                 help="auto: compile where jax can describe the target, else estimate analytically")
  p.add_argument("--hbm_gib", type=float, default=None, help="memory per device to check against")
  p.add_argument("--estimate", action=argparse.BooleanOptionalAction, default=True,
                 help="for a TPU target, also the TPU compiler's estimated step time (two more compiles; "
                      "--no-estimate skips them)")
  _json_flag(p)

  p = bench.command("estimate", _estimate, help="the TPU compiler's estimated step at each stage depth and MIDAS's "
                    "estimated wall-clock speedup, from the pricing compiles alone (no memory compile)")
  add_gin_flags(p)
  p.add_argument("--topology", required=True, help="a TPU slice as gcloud names it (v5p-128, v5litepod-64, 2xv5p-128)")
  _json_flag(p)

  p = bench.command("compile-table", _compile_table, help="the markdown table of docs/pods.md from `bench compile "
                    "--json` reports, before and after a change")
  # nargs="+" so a shell glob (`--after after/*.json`) passes every report; the flag may also repeat
  p.add_argument("--after", action="extend", nargs="+", default=[], required=True, help="reports; repeatable")
  p.add_argument("--before", action="extend", nargs="+", default=[], help="reports to compare with; repeatable")


  p = bench.command("estimate-table", _estimate_table, help="MIDAS's estimated speedups and the estimates' spread "
                    "over repeated compiles, from `bench estimate --json` reports, into a results file")
  p.add_argument("--reports", action="extend", nargs="+", default=[], required=True, help="reports; repeatable")
  p.add_argument("--results", required=True, help="the results file to write the two tables into (its other "
                 "tables stay)")

  _add_attention_command(bench)


def _add_attention_command(bench: CommandGroup) -> None:
  """`bench attention`: each attention path against the dense path on this device (launch/gpu_check.sh)."""
  p = bench.command("attention", _attention, help="each attention path (dense, flash, cuDNN) against the dense "
                    "path in float32, output and gradients, on packed UL2 rows, on this device")
  p.add_argument("--shape", action="append", default=None,
                 help="BATCH,LENGTH,HEADS,KV_HEADS,HEAD_DIM; repeatable (default: the paper 1B's attention at "
                      "2048 positions, and 4 query heads a kv head at 1024)")
  p.add_argument("--dtypes", nargs="+", default=list(attention_check.DTYPES), help="compute dtypes to check")
  p.add_argument("--paths", nargs="+", default=list(attention_check.PATHS), help="attention paths to check")
  p.add_argument("--repeats", type=int, default=3, help="timed runs of each path's program (after its compile)")
  _json_flag(p)


def _attention(args, bindings) -> int:
  del bindings
  shapes = [attention_check.parse_shape(text) for text in args.shape] if args.shape else attention_check.DEFAULT_SHAPES
  report = attention_check.run(shapes, args.dtypes, args.paths, args.repeats)
  _report(args, report, attention_check.format_report(report))
  return exit_status.FAILED.status if report["failed"] else exit_status.FINISHED.status


def _report(args, report, text: str) -> int:
  print(text)
  if args.json:
    fs.write_json(fs.check(args.json, "--json"), report)
  return 0


def _train(args, bindings) -> int:
  config, _ = load_run_config(args.gin_file, bindings)
  report = train_bench.run(config, steps=args.steps, warmup=args.warmup, peak_size=args.peak_size)
  return _report(args, report, train_bench.format_report(report))


def _stacking(args, bindings) -> int:
  config, _ = load_run_config(args.gin_file, bindings)
  report = stacking_bench.run(config, args.workdir)
  return _report(args, report, stacking_bench.format_report(report))


def _checkpoint(args, bindings) -> int:
  config, _ = load_run_config(args.gin_file, bindings)
  report = checkpoint_bench.run(config, args.workdir)
  return _report(args, report, checkpoint_bench.format_report(report))


def _preemption(args, bindings) -> int:
  distributed.initialize(args)  # before anything asks jax for its devices
  config, _ = load_run_config(args.gin_file, bindings)
  report = preemption_bench.run(config, steps=args.steps, repeats=args.repeats)
  if jax.process_index() != 0:
    return 0
  return _report(args, report, preemption_bench.format_report(report))


def _data(args, bindings) -> int:
  config, _ = load_run_config(args.gin_file, bindings)
  report = data_bench.run(config, seconds=args.seconds, train_tokens_per_second=args.train_tokens_per_second,
                          train_steps=args.train_steps, consumption=args.consumption, mfu=args.mfu,
                          synthetic_documents=args.synthetic_documents, synthetic_dir=args.synthetic_dir,
                          synthetic_mean_length=args.synthetic_mean_length,
                          storage_latency_ms=args.storage_latency_ms)
  return _report(args, report, data_bench.format_report(report))


def _store(args, bindings) -> int:
  targets = []
  for target in args.targets:
    path, topology = store_requests.parse_target(target)
    config, _ = load_run_config([path], ["DataConfig.vocab='byte'"] + list(bindings))
    targets.append((fs.basename(path)[:-len(".gin")], config, topology))
  report = store_requests.run(targets, documents=args.documents, mean_length=args.mean_length, steps=args.steps,
                              mfu=args.mfu, folder=args.synthetic_dir)
  if args.results:
    command = "midas bench store " + " ".join(f"--targets={t}" for t in args.targets) + (
        f" --documents={args.documents} --steps={args.steps} --mfu={args.mfu:g}")
    results.write(fs.check(args.results, "--results"), {"requests_per_bucket": store_requests.results_table(report)},
                  results.provenance("the reader's request counts on a synthetic store on local disk (the same "
                                     "requests on gs://)", command=command))
  return _report(args, report, store_requests.format_report(report))


def _compile(args, bindings) -> int:
  config, _ = load_run_config(args.gin_file, bindings)
  report = compile_bench.run(config, topology=args.topology, method=args.method, hbm_gib=args.hbm_gib,
                             estimate_step=args.estimate)
  return _report(args, report, compile_bench.format_report(report))


def _estimate(args, bindings) -> int:
  config, _ = load_run_config(args.gin_file, bindings)
  report = compile_bench.estimate(config, args.topology)
  text = "\n".join([f"target          {report['target']} ({report['devices']} devices, {report['device_kind']})",
                    f"libtpu flags    {report['libtpu_init_args'] or 'none'}"]
                   + compile_bench.estimated_lines(report["estimated"]))
  return _report(args, report, text)


def _estimate_table(args, bindings) -> int:
  del bindings
  reports = compile_table.load_reports(args.reports)
  path = fs.check(args.results, "--results")
  old = results.read(path) if fs.exists(path) else {"provenance": {}, "tables": {}}
  tables = dict(old["tables"])
  tables["midas_speedup"] = results.table(compile_table.MIDAS_COLUMNS, compile_table.midas_rows(reports),
                                          compile_table.MIDAS_FORMATS)
  tables["estimate_spread"] = results.table(compile_table.SPREAD_COLUMNS, compile_table.spread_rows(reports),
                                            compile_table.SPREAD_FORMATS)
  kinds = sorted({r.get("device_kind", "?") for r in reports})
  said = results.provenance(f"TPU targets ({', '.join(kinds)}) compiled ahead of time by libtpu "
                            f"{versions.installed(['libtpu']).get('libtpu', '?')} on a CPU-only machine", command="midas bench estimate ... --json=R.json per run (one process each), "
                            "then midas bench estimate-table --reports R.json ...")
  for name in ("midas_speedup", "estimate_spread"):
    tables[name]["provenance"] = said
  results.write(path, tables, old["provenance"])
  print(results.markdown(tables["midas_speedup"]) + "\n\n" + results.markdown(tables["estimate_spread"]))
  return 0


def _compile_table(args, bindings) -> int:
  del bindings
  print(compile_table.table(compile_table.load_reports(args.after), compile_table.load_reports(args.before)))
  return 0
