"""The collectives of an optimized HLO module, with the loops they run in.

A collective inside a while loop's body runs once per trip: a gradient reduction in the body of a
scanned layer stack runs once per layer, and, inside a microbatch loop, once per layer per
microbatch. Counting instructions alone (as dot_dtypes.py does for matmuls) cannot tell those
apart, so this reader walks the module from its ENTRY computation through every call (while
bodies and conditions, fusions, reductions' computations, conditionals' branches) and records,
for each collective, the while bodies it sits in, outermost first.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, List, Tuple

REDUCTIONS = ("all-reduce", "reduce-scatter")
_OPS = REDUCTIONS + ("all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?P<entry>ENTRY )?%?(?P<name>[\w.\-]+) \(.*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(.*?\bcondition=%(?P<condition>[\w.\-]+).*?\bbody=%(?P<body>[\w.\-]+)"
                    r"|\swhile\(.*?\bbody=%(?P<body2>[\w.\-]+).*?\bcondition=%(?P<condition2>[\w.\-]+)")
_COLLECTIVE = re.compile(r"\s(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str  # all-reduce, reduce-scatter, all-gather, all-to-all or collective-permute
  loops: Tuple[str, ...]  # the while bodies it runs in, outermost first; () runs once per call of the program
  text: str


def computations(text: str) -> Tuple[Dict[str, List[str]], str]:
  """({computation name: its instruction lines}, the ENTRY computation's name)."""
  found, entry, current = {}, "", None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header["name"]
      found[current] = []
      entry = current if header["entry"] else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      found[current].append(line)
  return found, entry


def _loops_of(found: Dict[str, List[str]], entry: str) -> Dict[str, Tuple[str, ...]]:
  """Each computation reachable from ENTRY and the while bodies it runs in (the deepest path found)."""
  loops: Dict[str, Tuple[str, ...]] = {}
  stack = [(entry, ())]
  while stack:
    name, path = stack.pop()
    if name in loops and len(loops[name]) >= len(path):
      continue
    loops[name] = path
    for line in found.get(name, ()):
      loop = _WHILE.search(line)
      if loop:
        body = loop["body"] or loop["body2"]
        stack += [(body, path + (body,)), (loop["condition"] or loop["condition2"], path + (body,))]
        continue
      called = _CALLS.findall(line) + [c for b in _BRANCHES.findall(line) for c in re.findall(r"%([\w.\-]+)", b)]
      stack += [(c, path) for c in called]
  return loops


def collectives(text: str) -> List[Collective]:
  """Every collective of the module that ENTRY reaches, with its loops (async pairs counted once, at -start)."""
  found, entry = computations(text)
  loops = _loops_of(found, entry)
  out = []
  for name, path in loops.items():
    for line in found.get(name, ()):
      m = _COLLECTIVE.search(line)
      if m:
        out.append(Collective(m["op"], path, line.strip()))
  return out


def reductions_by_depth(found: List[Collective]) -> Dict[int, int]:
  """{how many loops deep: reduction collectives (all-reduce, reduce-scatter) there}."""
  return dict(sorted(collections.Counter(len(c.loops) for c in found if c.op in REDUCTIONS).items()))
