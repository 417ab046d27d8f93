"""`midas bench compile-table`: the markdown table of docs/pods.md, made from `midas bench compile --json` reports.

Rows are matched between the `before` and `after` report sets by model size, target and batch
shape, so one table shows what a change did to every configuration both sets compiled: a `before`
report of the same microbatches and attention where the set has one, else the one of that shape (a
single pass where there is one), so a change that made microbatches or flash possible is compared
with the step as it was.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

from midas_jax import fs

GIB = 1024 ** 3


def load_reports(paths: Iterable[str]) -> List[Dict[str, Any]]:
  return [fs.read_json(fs.check(p, "--report")) for p in paths]


def _key(r: Dict[str, Any]) -> Tuple:
  b = r["batch"]
  return (round(r["model"]["params"] / 1e8), r["target"], b["global"], b["seq_len"])


def _exact_key(r: Dict[str, Any]) -> Tuple:
  return _key(r) + (r["batch"].get("microbatches", 1), r["model"].get("attention", "dot_product"))


def _matcher(before: Iterable[Dict[str, Any]]):
  """after report -> its `before` report (or None): the same step settings, else the same shape."""
  before = list(before)  # read twice
  exact = {_exact_key(r): r for r in before}
  by_shape: Dict[Tuple, Dict[str, Any]] = {}
  for r in sorted(before, key=lambda r: r["batch"].get("microbatches", 1), reverse=True):
    by_shape[_key(r)] = r  # the fewest microbatches wins
  return lambda r: exact.get(_exact_key(r), by_shape.get(_key(r)))


def _size(r: Dict[str, Any]) -> str:
  return f"{r['model']['params'] / 1e9:.0f}B"


def _peak(r: Optional[Dict[str, Any]]) -> str:
  """The compiler's peak per device, or what it said when it refused the program."""
  if r is None:
    return "-"
  if r.get("compile_error"):
    # libtpu: "... required for HLO temporaries (31.96G) exceeds available HBM (30.75G)."
    counts = re.search(r"temporaries \(([^)]+)\) exceeds available HBM \(([^)]+)\)", r["compile_error"])
    return "refused" + (f": temporaries {counts[1]} > {counts[2]}" if counts else "")
  if r.get("method") != "compiled":
    return f"{r['total'] / GIB:.1f} (analytic)"
  return f"{r['compiled']['peak'] / GIB:.2f}"


def _fits(r: Optional[Dict[str, Any]]) -> str:
  return "-" if r is None or r["fits"] is None else ("yes" if r["fits"] else "**no**")


def _estimated(r: Optional[Dict[str, Any]]) -> Dict[str, Any]:
  """A report's estimated step (reports made before the rename call it 'predicted')."""
  return (r or {}).get("estimated") or (r or {}).get("predicted") or {}


def _mfu(s: Dict[str, Any]) -> Optional[float]:
  return s["mfu_estimate"] if "mfu_estimate" in s else s.get("mfu_bound")


def _speed(r: Optional[Dict[str, Any]]) -> str:
  """The TPU compiler's estimated full-depth step: 'ms / tokens/s per chip / MFU', or '-'."""
  estimated = _estimated(r)
  steps = estimated.get("steps")
  if not steps:
    return "-"
  s = steps[str(max(int(d) for d in steps))]
  mfu = "-" if _mfu(s) is None else f"{_mfu(s):.0%}"
  caution = f" (FLOPs counted: {estimated['undercounted']:.0%}, {UNDERCOUNTED})" if "undercounted" in estimated else ""
  if s.get("dcn_seconds"):
    caution += f" (DCN {s['dcn_seconds'] * 1e3:,.0f} ms; {s['seconds_without_overlap'] * 1e3:,.0f} ms not overlapped)"
  return f"{s['seconds'] * 1e3:,.0f} ms / {s['tokens_per_s_per_chip']:,.0f} / {mfu}{caution}"


def rows(after: List[Dict[str, Any]], before: List[Dict[str, Any]] = ()) -> List[str]:
  """One markdown line per `after` report, in model then target order."""
  earlier = _matcher(before)
  out = []
  order = lambda r: (r["model"]["params"], r["target"].startswith("gpu"), "x" in r["target"], r["target"],
                     r["batch"]["seq_len"], r["batch"].get("microbatches", 1))
  for r in sorted(after, key=order):  # one model's TPU slices, then multi-slice, then GPUs
    old, b = earlier(r), r["batch"]
    out.append(" | ".join([
        "", _size(r), f"`{r['target']}`", f"{b['global']} x {b['seq_len']}", str(b.get("microbatches", 1)),
        r["model"].get("attention", "dot_product"), _peak(old), _fits(old), _peak(r), _fits(r),
        f"{r['hbm'] / GIB:.0f}", str(old["max_global_batch"]) if old else "-", str(r["max_global_batch"]),
        _speed(old), _speed(r), ""]).strip())
  return out


UNDERCOUNTED = "time too low"  # the cost model counted under COUNTED_AT_LEAST of the model's FLOPs

HEADER = ("| model | target | batch | microbatches | attention (after) | before: peak GiB | fits "
          "| after: peak GiB | fits | HBM GiB | largest batch before | after "
          "| estimated step before: time / tokens/s per chip / MFU | after |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table(after: List[Dict[str, Any]], before: List[Dict[str, Any]] = ()) -> str:
  return "\n".join([HEADER] + rows(after, before))



# The tables of `midas bench estimate` reports (docs/results/pod_estimated_speed.json): MIDAS's estimated
# speedups, and how much the same compile's estimate moves between processes.
MIDAS_COLUMNS = ("model", "target", "batch", "microbatches", "attention", "compiled with", "schedule",
                 "estimated ms a step at each stage's depth", "baseline: estimated h", "MIDAS: estimated h",
                 "wall-clock speedup (estimated)", "FLOP speedup", "runs")
MIDAS_FORMATS = (None, None, None, "d", None, None, None, None, ".2f", ".2f", ".2f", ".2f", "d")
SPREAD_COLUMNS = ("model", "target", "batch", "microbatches", "attention", "runs", "compiled with",
                  "estimated step, full depth: min ms", "max ms", "spread", "step at 2 layers: min ms", "max ms",
                  "at 3 layers: min ms", "max ms")
SPREAD_FORMATS = (None, None, None, "d", None, "d", None, ",.1f", ",.1f", ".1%", ",.2f", ",.2f", ",.2f", ",.2f")


def _order(r: Dict[str, Any]) -> Tuple:
  return (r["model"]["params"], "x" in r["target"], r["target"], r["batch"]["seq_len"],
          r["batch"].get("microbatches", 1), r["model"].get("attention", ""))


def _flags(r: Dict[str, Any]) -> List[str]:
  """The libtpu flags a report was compiled under: the user's and ours (older reports: ours)."""
  return r["libtpu_init_args"].split() if "libtpu_init_args" in r else r.get("tpu_flags", [])


def _setting(r: Dict[str, Any]) -> str:
  """How a report was compiled beyond its config: the libtpu flags in effect (the user's and ours) and
  the environment it kept."""
  flags = _flags(r)
  vmem = [f.split("=", 1)[1] for f in flags if f.startswith("--xla_tpu_scoped_vmem_limit_kib=")]
  text = f"{len(flags)} flags" + (f", scoped VMEM {vmem[0]} KiB" if vmem else "")
  env = r.get("environment") or {}
  shown = ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")  # what can reach the compile
  return text + "".join(f", {k}={v}" for k, v in sorted(env.items()) if k in shown)


def _same_compiles(reports: Iterable[Dict[str, Any]], by_setting: bool = False) -> List[List[Dict[str, Any]]]:
  """Reports grouped by what was compiled (model, target, batch shape, microbatches, attention; and with
  `by_setting` the flags and environment), in table order."""
  groups: Dict[Tuple, List[Dict[str, Any]]] = {}
  for r in sorted(reports, key=lambda r: (_order(r), _setting(r) if by_setting else "")):
    groups.setdefault(_exact_key(r) + ((_setting(r),) if by_setting else ()), []).append(r)
  return list(groups.values())


def _stem(r: Dict[str, Any]) -> List[Any]:
  b = r["batch"]
  return [_size(r), f"`{r['target']}`", f"{b['global']} x {b['seq_len']}", b.get("microbatches", 1),
          r["model"].get("attention", "dot_product")]


def midas_rows(reports: Iterable[Dict[str, Any]]) -> List[List[Any]]:
  """One row per compiled configuration and paper MIDAS schedule: the estimated step at each stage's
  depth, the whole run's estimated hours against the full-depth baseline's (the same steps), and the
  estimated wall-clock speedup beside the FLOP speedup. Of a configuration estimated in several settings
  (flags, environment), the one with the most runs; of its runs, the one whose full-depth step is the
  median."""
  out = []
  for config in _same_compiles(reports):
    by_setting = _same_compiles([r for r in config if _estimated(r).get("midas")], by_setting=True)
    if not by_setting:
      continue
    # The setting estimated most often, then the one with the most flags (the tree's own over 'none');
    # the spread table has the others.
    priced = max(by_setting, key=lambda g: (len(g), len(_flags(g[0]))))
    full = lambda r: _estimated(r)["steps"][str(max(int(d) for d in _estimated(r)["steps"]))]["seconds"]
    r = sorted(priced, key=full)[(len(priced) - 1) // 2]
    estimated = _estimated(r)
    for name, m in estimated["midas"].items():
      steps = ", ".join(f"{s['depth']}: {s['seconds'] * 1e3:,.0f}" for s in m["stages"])
      if "undercounted" in estimated:
        steps += f" (FLOPs counted: {estimated['undercounted']:.0%}, {UNDERCOUNTED})"
      schedule = f"{estimated.get('operator', 'midas')} {name}"
      out.append(_stem(r) + [_setting(r), schedule, steps, m["baseline_seconds"] / 3600,
                             m["stacked_seconds"] / 3600, m["wall_clock"], m["flops"], len(priced)])
  return out


def spread_rows(reports: Iterable[Dict[str, Any]]) -> List[List[Any]]:
  """One row per compiled configuration and setting (flags, environment): the lowest and highest
  estimate over its repeated compiles (each run a separate process), at full depth and at the two
  priced depths."""
  out = []
  for group in _same_compiles(reports, by_setting=True):
    group = [r for r in group if _estimated(r).get("steps")]
    if not group:
      continue
    full = [_estimated(r)["steps"][str(max(int(d) for d in _estimated(r)["steps"]))]["seconds"] * 1e3 for r in group]
    prices = {d: [_estimated(r)["prices"][d]["optimal_seconds"] * 1e3 for r in group] for d in ("2", "3")}
    out.append(_stem(group[0]) + [len(group), _setting(group[0]), min(full), max(full),
                                  max(full) / min(full) - 1, min(prices["2"]), max(prices["2"]),
                                  min(prices["3"]), max(prices["3"])])
  return out
