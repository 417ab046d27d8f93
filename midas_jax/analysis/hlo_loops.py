"""The collectives of an optimized HLO module, with the loops they run in.

A collective inside a while loop's body runs once per trip: a gradient reduction in the body of a
scanned layer stack runs once per layer, and, inside a microbatch loop, once per layer per
microbatch. Counting instructions alone (as dot_dtypes.py does for matmuls) cannot tell those
apart, so this reader walks the module from its ENTRY computation through every call (while
bodies and conditions, fusions, reductions' computations, conditionals' branches) and records,
for each collective, the while bodies it sits in, outermost first, and the devices it joins
(its replica groups, read in any of XLA's three spellings), from which `mesh_axes` names the mesh
axes it runs over. `trip_counts` reads each loop's trip count from its condition, so `runs` says
how often a collective runs a step. On a multi-slice program the collectives across slices (over
DCN) are not XLA collectives but `send`s to the megascale runtime, tagged with the collective they
carry out (_xla_megascale_transfer_type); they are read as that collective, with dcn=True.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

REDUCTIONS = ("all-reduce", "reduce-scatter")
_OPS = REDUCTIONS + ("all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?P<entry>ENTRY )?%?(?P<name>[\w.\-]+) \(.*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(.*?\bcondition=%(?P<condition>[\w.\-]+).*?\bbody=%(?P<body>[\w.\-]+)"
                    r"|\swhile\(.*?\bbody=%(?P<body2>[\w.\-]+).*?\bcondition=%(?P<condition2>[\w.\-]+)")
_COLLECTIVE = re.compile(r"\s(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:, device_ids=\(\[(?P<dims>[\d,]+)\]"
                          r"(?:T\((?P<perm>[\d,]+)\))?\))?(?: \{(?P<over>[^}]*)\})?")
_DCN = re.compile(r"\ssend\(.*_xla_megascale_transfer_type=\"(?P<kind>\w+)\"")
_DCN_OPS = {"ALL_REDUCE": "all-reduce", "REDUCE_SCATTER": "reduce-scatter", "ALL_GATHER": "all-gather",
            "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}
_TRIP_LIMIT = re.compile(r"constant\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str  # all-reduce, reduce-scatter, all-gather, all-to-all or collective-permute
  loops: Tuple[str, ...]  # the while bodies it runs in, outermost first; () runs once per call of the program
  text: str
  # The devices of each group it joins, as positions in the program's device assignment (for a jax
  # mesh, its devices in row-major order); None: one group of every device.
  groups: Optional[Tuple[Tuple[int, ...], ...]] = None
  dcn: bool = False  # across slices, by the megascale runtime (groups then say nothing)


def _iota(dims: Sequence[int], perm: Optional[Sequence[int]]) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return (ids.transpose(perm) if perm else ids).reshape(-1)


def _ints(text: Optional[str]) -> List[int]:
  return [int(x) for x in text.split(",") if x] if text else []


def replica_groups(line: str) -> Optional[Tuple[Tuple[int, ...], ...]]:
  """The groups of devices a collective's line names: `{{0,1},{2,3}}`, the iota form `[2,2]<=[4]`
  (optionally transposed, `[2,2]<=[2,2]T(1,0)`), or the mesh form `mesh['axis_0'=2,'axis_1'=2],
  device_ids=([2,2]T(1,0)) {'axis_0'}` (groups along the named axes of a device mesh). None: every
  device in one group (`{}`, a mesh form naming no axes, or no groups at all)."""
  m = _EXPLICIT_GROUPS.search(line)
  if m:
    groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    return groups or None
  m = _IOTA_GROUPS.search(line)
  if m:
    shape, ids = _ints(m["shape"]), _iota(_ints(m["dims"]), _ints(m["perm"]))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
  m = _MESH_GROUPS.search(line)
  if m:
    names = re.findall(r"'([^']+)'=(\d+)", m["axes"])
    sizes = [int(n) for _, n in names]
    ids = _iota(_ints(m["dims"]), _ints(m["perm"])) if m["dims"] else np.arange(math.prod(sizes))
    over = re.findall(r"'([^']+)'", m["over"] or "")
    if not over:
      return None
    grid = ids.reshape(sizes)
    along = [i for i, (name, _) in enumerate(names) if name in over]
    rest = [i for i in range(len(names)) if i not in along]
    grid = grid.transpose(rest + along).reshape(-1, math.prod(sizes[i] for i in along))
    return tuple(tuple(int(i) for i in row) for row in grid)
  return None


def mesh_axes(groups: Optional[Tuple[Tuple[int, ...], ...]], mesh_shape: Mapping[str, int]) -> Tuple[str, ...]:
  """The mesh axes (of a mesh of `mesh_shape`, {axis: size} in order) along which the devices of a
  group differ: the axes a collective with these replica groups runs over."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  if groups is None:
    return tuple(n for n, size in zip(names, sizes) if size > 1)
  spanned = set()
  for group in groups:
    coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [members, axes]
    spanned |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
  return tuple(n for n in names if n in spanned)


def trip_counts(text: str) -> Dict[str, Optional[int]]:
  """{while body: its trip count} for loops whose condition compares the counter with one constant
  (`counter < N`, as lax.scan and fori_loop lower); None where the condition is another shape."""
  found, out = computations(text), {}
  for lines in found[0].values():
    for line in lines:
      loop = _WHILE.search(line)
      if not loop:
        continue
      condition = found[0].get(loop["condition"] or loop["condition2"], [])
      limits = [int(x) for l in condition for x in _TRIP_LIMIT.findall(l)]
      is_lt = any("direction=LT" in l for l in condition)
      out[loop["body"] or loop["body2"]] = limits[0] if len(limits) == 1 and is_lt else None
  return out


def runs(collective: Collective, trips: Mapping[str, Optional[int]]) -> Optional[int]:
  """How many times a collective runs per call of the program: the product of its loops' trip
  counts (None where one is unknown)."""
  counts = [trips.get(body) for body in collective.loops]
  return None if None in counts else math.prod(counts)


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
  """Every collective of the module that ENTRY reaches, with its loops (async pairs counted once, at
  -start; a DCN transfer once, at its send)."""
  found, entry = computations(text)
  loops = _loops_of(found, entry)
  out = []
  for name, path in loops.items():
    for line in found.get(name, ()):
      m = _COLLECTIVE.search(line)
      if m:
        out.append(Collective(m["op"], path, line.strip(), replica_groups(line)))
        continue
      m = _DCN.search(line)
      if m:
        out.append(Collective(_DCN_OPS.get(m["kind"], m["kind"].lower()), path, line.strip(), None, True))
  return out


def reductions_by_depth(found: List[Collective]) -> Dict[int, int]:
  """{how many loops deep: reduction collectives (all-reduce, reduce-scatter) there}."""
  return dict(sorted(collections.Counter(len(c.loops) for c in found if c.op in REDUCTIONS).items()))
