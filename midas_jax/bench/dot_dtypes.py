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


# `%dot.3 = bf16[8,512]{1,0} dot(bf16[8,64]{1,0} %a, bf16[64,512]{1,0} %b), lhs_contracting_dims={1}, ...`
_HLO_SHAPE = r"(?P<{0}>[a-z0-9]+)\[(?P<{0}_dims>[\d,]*)\](?:\{{[^}}]*\}})?"
_HLO_MATMUL = re.compile(r"=\s*" + _HLO_SHAPE.format("out") + r"\s+(?P<op>dot|convolution)\(\s*"
                         + _HLO_SHAPE.format("lhs") + r"\s+%?[\w.\-]+,\s*" + _HLO_SHAPE.format("rhs")
                         + r"\s+%?[\w.\-]+\)(?P<attrs>.*)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>[^_]+)_(?P<rhs>[^-]+)->(?P<out>\S+?)(?:,|$|\s)")
_GROUPS = re.compile(r"feature_group_count=(?P<n>\d+)")


def hlo_dots(text: str) -> List[Dot]:
  """Every dot and convolution of an optimized HLO module.

  A convolution's FLOPs: 2 x (result elements) x (kernel elements / output features), that is the
  input features and window taps each output multiplies; grouped convolutions divide their input
  features among the groups, which the kernel's shape already reflects.
  """
  dots = []
  for line in text.splitlines():
    m = _HLO_MATMUL.search(line)
    if not m:
      continue
    out_shape, lhs_shape, rhs_shape = (_ints(m[k + "_dims"]) for k in ("out", "lhs", "rhs"))
    dtypes = (_dtype(m["lhs"]), _dtype(m["rhs"]), _dtype(m["out"]))
    if m["op"] == "dot":
      contracting = _LHS_CONTRACTING.search(m["attrs"])
      per_output = math.prod(lhs_shape[d] for d in (_ints(contracting["dims"]) if contracting else ()))
    else:
      labels = _DIM_LABELS.search(m["attrs"])
      out_feature = labels["rhs"].index("o") if labels else len(rhs_shape) - 1
      per_output = math.prod(rhs_shape) // max(rhs_shape[out_feature], 1)
    dots.append(Dot(dtypes, 2.0 * math.prod(out_shape) * per_output, line.strip()))
  return dots


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
