"""The matmuls of a program, read from its text, with their FLOPs by operand and result dtype.

Two readers, for the two texts a program has:
  stablehlo_dots  the lowered program (`jit(f).lower(...).as_text()`): what JAX hands to XLA, before
                  any backend pass; a CPU without native bfloat16 widens dtypes only after this.
  hlo_dots        an optimized HLO module (`compiled.as_text()`, e.g. a libtpu compile): `dot` and
                  `convolution` instructions, inside fusions included, as the backend will run them.

A matmul's FLOPs are 2 x (elements of the result) x (product of the contracted sizes): a
multiply and an add per contracted pair. Both readers count each instruction once, as written: a
dot inside a loop body (a scanned layer stack) counts once, not once per trip, so the shares
between dtypes are per distinct matmul, which is what a dtype policy is about.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Dict, Iterable, List, Sequence, Tuple

DTypes = Tuple[str, str, str]  # (lhs, rhs, result)

# StableHLO names an element type inside tensor<...>; HLO uses its short names. One vocabulary:
_SHORT = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "f8e4m3fn": "float8_e4m3fn",
          "f8e5m2": "float8_e5m2", "s8": "int8", "s32": "int32", "i8": "int8", "i32": "int32", "u8": "uint8"}


@dataclasses.dataclass(frozen=True)
class Dot:
  dtypes: DTypes
  flops: float
  text: str  # the instruction, for a failure message


def _dtype(name: str) -> str:
  return _SHORT.get(name, name)


def _tensor(spec: str) -> Tuple[Tuple[int, ...], str]:
  """'8x16xbf16' -> ((8, 16), 'bfloat16'); a scalar 'f32' -> ((), 'float32')."""
  *dims, element = spec.split("x")
  return tuple(int(d) for d in dims), _dtype(element)


_STABLEHLO_DOT = re.compile(r"stablehlo\.dot_general\b(?P<attrs>.*?):\s*\(tensor<(?P<lhs>[^>]*)>,\s*"
                            r"tensor<(?P<rhs>[^>]*)>\)\s*->\s*tensor<(?P<out>[^>]*)>")
_CONTRACTING = re.compile(r"contracting_dims\s*=\s*\[(?P<lhs>[\d,\s]*)\]\s*x\s*\[[\d,\s]*\]")


def stablehlo_dots(text: str) -> List[Dot]:
  """Every stablehlo.dot_general of a lowered program (jnp.einsum, jnp.dot and lax.dot_general lower to it)."""
  dots = []
  for line in text.splitlines():
    m = _STABLEHLO_DOT.search(line)
    if not m:
      continue
    (lhs_shape, lhs), (_, rhs), (out_shape, out) = (_tensor(m[k]) for k in ("lhs", "rhs", "out"))
    contracting = _CONTRACTING.search(m["attrs"])
    dims = _ints(contracting["lhs"]) if contracting else ()
    dots.append(Dot((lhs, rhs, out), 2.0 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in dims),
                    line.strip()))
  return dots


# An instruction: `%dot.3 = bf16[8,512]{1,0} dot(%a, %b), lhs_contracting_dims={1}, ...`. Operands are
# named, and some printers put each operand's shape before its name; a TPU module does not.
_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,]*)\]"
                      r"(?:\{[^ ]*\})?\s+(?P<op>[\w\-]+)\(")
_HLO_OPERAND = re.compile(r"(?:(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,]*)\]\S*\s+)?%(?P<name>[\w.\-]+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
_RHS_LABELS = re.compile(r"dim_labels=[^_]+_(?P<rhs>[^-]+)->")


def hlo_dots(text: str) -> List[Dot]:
  """Every dot and convolution of an optimized HLO module, inside fusions included.

  A convolution (how TPU modules write most matmuls) multiplies each output by (kernel elements /
  output features): the input features and window taps; a grouped convolution's kernel already
  holds only its group's input features.
  """
  shapes: Dict[str, Tuple[Tuple[int, ...], str]] = {}
  matmuls = []
  for line in text.splitlines():
    m = _HLO_DEF.search(line)
    if not m:
      continue
    shapes[m["name"]] = (_ints(m["dims"]), _dtype(m["dtype"]))
    if m["op"] in ("dot", "convolution"):
      matmuls.append((m, line))
  dots = []
  for m, line in matmuls:
    operands, attrs = _call(line, m.end())
    (lhs_shape, lhs), (rhs_shape, rhs) = (_operand(o, shapes) for o in operands[:2])
    out_shape = _ints(m["dims"])
    if m["op"] == "dot":
      contracting = _LHS_CONTRACTING.search(attrs)
      per_output = math.prod(lhs_shape[d] for d in (_ints(contracting["dims"]) if contracting else ()))
    else:
      labels = _RHS_LABELS.search(attrs)
      out_feature = labels["rhs"].index("o") if labels else len(rhs_shape) - 1
      per_output = math.prod(rhs_shape) // max(rhs_shape[out_feature], 1)
    dots.append(Dot((lhs, rhs, _dtype(m["dtype"])), 2.0 * math.prod(out_shape) * per_output, line.strip()))
  return dots


def _call(line: str, start: int) -> Tuple[List[str], str]:
  """The operands of the call whose '(' ends at `start`, split at top-level commas, and what follows."""
  depth, operands, current = 1, [], ""
  for i in range(start, len(line)):
    c = line[i]
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(c, 0)
    if depth == 0:
      return operands + [current.strip()], line[i + 1:]
    if c == "," and depth == 1:
      operands.append(current.strip())
      current = ""
    else:
      current += c
  return operands + [current.strip()], ""


def _operand(text: str, shapes) -> Tuple[Tuple[int, ...], str]:
  m = _HLO_OPERAND.search(text)
  if m["dtype"]:
    return _ints(m["dims"]), _dtype(m["dtype"])
  return shapes[m["name"]]


def _ints(csv: str) -> Tuple[int, ...]:
  return tuple(int(x) for x in csv.replace(" ", "").split(",") if x)


def flops_by_dtypes(dots: Iterable[Dot]) -> Dict[DTypes, Dict[str, float]]:
  """{(lhs, rhs, result): {"count": matmuls, "flops": their FLOPs}}."""
  table: Dict[DTypes, Dict[str, float]] = {}
  for dot in dots:
    row = table.setdefault(dot.dtypes, {"count": 0, "flops": 0.0})
    row["count"] += 1
    row["flops"] += dot.flops
  return table


def operand_share(dots: Sequence[Dot], dtype: str) -> float:
  """The fraction of the matmul FLOPs whose two operands are both `dtype`."""
  total = sum(d.flops for d in dots)
  return sum(d.flops for d in dots if d.dtypes[:2] == (dtype, dtype)) / total if total else 0.0


def summary(dots: Sequence[Dot]) -> Dict[str, Any]:
  """A JSON-ready report: the matmul count, the bfloat16-operand share, and rows by dtypes, largest first."""
  table = flops_by_dtypes(dots)
  total = sum(row["flops"] for row in table.values()) or 1.0
  rows = sorted(table.items(), key=lambda kv: -kv[1]["flops"])
  return {"count": len(dots), "bfloat16_operand_share": operand_share(dots, "bfloat16"),
          "by_dtypes": [{"lhs": lhs, "rhs": rhs, "result": out, "count": int(row["count"]),
                         "flop_share": row["flops"] / total} for (lhs, rhs, out), row in rows]}
