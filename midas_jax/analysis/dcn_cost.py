"""What a multi-slice step sends over the data-center network, and how long that takes at its bandwidth.

Slices of a multi-slice run are joined by the data-center network (DCN), not by the chips' own links:
a collective across slices is lowered to `send`s to the megascale runtime (hlo_loops.py reads
them). XLA's cost model prices those transfers as if they moved at on-chip speed (4 MB a chip across
two v5p-8 slices priced at 10.5 us, about 60 times faster than the v5p's 50 Gbps of DCN per chip), so
the step's price (cost_model.py) leaves the network out. This module counts the bytes each chip
sends across slices per step, from the optimized program, and divides them by the generation's DCN
bandwidth per chip (hardware.py).

Bytes a chip sends for one transfer of `payload` bytes among n slices (bandwidth-optimal algorithms):
all-reduce 2(n-1)/n x payload (reduce-scatter, then all-gather, of the payload); all-gather (n-1) x
payload (its own part to every other slice); reduce-scatter (n-1)/n x payload; anything else 1 x payload.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

from midas_jax import hardware
from midas_jax.analysis import hlo_loops

_SEND_PAYLOAD = re.compile(r"=\s*\((?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
             "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _payload_bytes(send_line: str) -> int:
  """The bytes a `send` carries: the first element of its (payload, context, token) tuple."""
  m = _SEND_PAYLOAD.search(send_line)
  if not m:
    raise ValueError(f"no payload shape in a cross-slice send: {send_line[:200]}")
  elements = 1
  for d in filter(None, m["dims"].split(",")):
    elements *= int(d)
  return elements * _ITEMSIZE[m["dtype"]]


def _sent_per_payload(op: str, slices: int) -> float:
  n = slices
  return {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1, "reduce-scatter": (n - 1) / n}.get(op, 1.0)


def bytes_sent(hlo_text: str, slices: int) -> Dict[str, float]:
  """{collective: bytes one chip sends across slices per call of the program} (loops' trips counted)."""
  if slices < 2:
    return {}
  trips = hlo_loops.trip_counts(hlo_text)
  out: Dict[str, float] = {}
  for c in hlo_loops.collectives(hlo_text):
    if not c.dcn:
      continue
    runs = hlo_loops.runs(c, trips)
    if runs is None:
      raise ValueError(f"a cross-slice {c.op} runs in a loop of unknown trip count; price an unrolled program")
    out[c.op] = out.get(c.op, 0.0) + runs * _payload_bytes(c.text) * _sent_per_payload(c.op, slices)
  return out


def seconds(hlo_text: str, slices: int, device_kind: str) -> Dict[str, Optional[float]]:
  """{'dcn_bytes': bytes one chip sends across slices a call, 'dcn_seconds': those at the generation's DCN
  bandwidth per chip (None where the generation's bandwidth is not known)}; both 0 on one slice."""
  sent = sum(bytes_sent(hlo_text, slices).values())
  bandwidth = hardware.dcn_bytes_per_s(device_kind)
  return {"dcn_bytes": sent, "dcn_seconds": sent / bandwidth if bandwidth else (0.0 if not sent else None)}
