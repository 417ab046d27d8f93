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


def _speed(r: Optional[Dict[str, Any]]) -> str:
  """The TPU compiler's predicted full-depth step: 'ms / tokens/s per chip / MFU bound', or '-'."""
  steps = (r or {}).get("predicted", {}).get("steps")
  if not steps:
    return "-"
  s = steps[str(max(int(d) for d in steps))]
  mfu = "-" if s["mfu_bound"] is None else f"{s['mfu_bound']:.0%}"
  caution = f" (FLOPs counted: {r['predicted']['undercounted']:.0%}, no bound)" if "undercounted" in r["predicted"] else ""
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


HEADER = ("| model | target | batch | microbatches | attention (after) | before: peak GiB | fits "
          "| after: peak GiB | fits | HBM GiB | largest batch before | after "
          "| predicted step before: time / tokens/s per chip / MFU bound | after |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table(after: List[Dict[str, Any]], before: List[Dict[str, Any]] = ()) -> str:
  return "\n".join([HEADER] + rows(after, before))

