"""`midas bench compile`, registered through cli.COMMAND_MODULES (nothing heavy imported here).

  midas bench compile --gin_file=F [--gin_file=MESH] [--topology=v5p-128|2xv5p-128] [--method=auto] [--json=OUT]
  midas bench compile-table --after=REPORT.json ... [--before=REPORT.json ...]
"""

from __future__ import annotations

from typing import Dict


def register(sub, bench_sub) -> Dict[str, object]:
  del sub
  p = bench_sub.add_parser("compile", help="will it fit: per-device memory of the train step, compiled "
                                           "ahead of time (or estimated) for a mesh and topology")
  p.add_argument("--gin_file", action="append", default=[],
                 help="gin config file; repeatable, later files override earlier ones")
  p.add_argument("--topology", default=None,
                 help="target: a TPU slice as gcloud names it (v4-64, v5litepod-64, v5p-128), several "
                      "slices joined by DCN (2xv5p-128, with a mesh that sets MeshConfig.dcn_data) or gpu-N; "
                      "default: this machine's devices (set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                      "to simulate N)")
  p.add_argument("--method", default="auto", choices=("auto", "compile", "analytic"),
                 help="auto: compile where jax can describe the target, else estimate analytically")
  p.add_argument("--hbm_gib", type=float, default=None, help="memory per device to check against")
  p.add_argument("--json", default=None, help="also write the report to this JSON file")
  table = bench_sub.add_parser("compile-table", help="the markdown table of docs/pods.md from `bench compile "
                                                     "--json` reports, before and after a change")
  table.add_argument("--after", action="append", default=[], required=True, help="a report; repeatable")
  table.add_argument("--before", action="append", default=[], help="a report to compare with; repeatable")
  return {"bench compile": _bench_compile, "bench compile-table": _bench_compile_table}


def _bench_compile_table(args, bindings) -> int:
  del bindings
  from midas_jax.bench import compile_table  # pylint: disable=import-outside-toplevel
  print(compile_table.table(compile_table.load_reports(args.after), compile_table.load_reports(args.before)))
  return 0


def _bench_compile(args, bindings) -> int:
  from midas_jax import cli  # pylint: disable=import-outside-toplevel
  from midas_jax.bench import compile_bench  # pylint: disable=import-outside-toplevel
  config, _ = cli._load_run_config(args.gin_file, bindings)  # pylint: disable=protected-access
  report = compile_bench.run(config, topology=args.topology, method=args.method, hbm_gib=args.hbm_gib)
  print(compile_bench.format_report(report))
  if args.json:
    from midas_jax import fs  # pylint: disable=import-outside-toplevel
    fs.write_json(fs.check(args.json, "--json"), report)
  return 0
