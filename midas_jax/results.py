"""Results files, and the markdown tables rendered from them (DESIGN decision 13: results are data).

A results file is JSON: `provenance` (what produced the figures: date, commit, device kind, command,
config) and `tables`, each a name -> {"columns": [...], "rows": [[cell, ...], ...], "formats": [...]}.
A cell is a number, written with its column's format (a format spec such as ".4f", "+.3f", ",d" or
".3e"; exponents lose their "+" and leading zeros, "6.378e12"), or text, written as it is. A study
writes one (its page renders from it), and so does whoever measures a table of the docs: docs/results/.

A markdown page quotes a table between markers, the path relative to the page:

  <!-- table: results/NAME.json TABLE -->
  | ... the rendered table, then one caption line naming the file and its provenance ... |
  <!-- /table -->

`render_page` rewrites every marked block from its file; tests/test_docs_tables.py checks that the
committed pages equal their re-rendering, so a figure in the docs is never typed by hand.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re
import subprocess
from typing import Any, Dict, List, Optional, Sequence

from midas_jax import fs, versions

MARKED = re.compile(r"(<!-- table: (\S+) (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)
# Provenance shown in a table's caption, in this order; the file keeps the rest.
CAPTION_KEYS = ("device", "commit", "date")


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], formats: Optional[Sequence[Optional[str]]] = None,
          provenance: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """One table of a results file; `formats[i]` (or None: str()) writes column i's numbers; `provenance`
  is where this table's differs from the file's."""
  if any(len(r) != len(columns) for r in rows):
    raise ValueError(f"every row needs {len(columns)} cells: {columns}")
  spec = {"columns": list(columns), "formats": list(formats or [None] * len(columns)), "rows": [list(r) for r in rows]}
  return {**spec, "provenance": dict(provenance)} if provenance else spec


def _json(value: Any, indent: str = "") -> str:
  """JSON with one line per table row, so that a diff of a results file reads row by row."""
  flat = not isinstance(value, (dict, list)) or all(not isinstance(v, (dict, list)) for v in value)
  if (flat and not isinstance(value, dict)) or not value:
    return json.dumps(value, ensure_ascii=False)
  inner = indent + " "
  if isinstance(value, dict):
    items = [f"{inner}{json.dumps(k)}: {_json(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"
  return "[\n" + ",\n".join(inner + _json(v, inner) for v in value) + "\n" + indent + "]"


PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def commit() -> str:
  """The source tree's commit ("+changes" when it has uncommitted edits), or "unknown" outside a checkout."""
  root = pathlib.Path(__file__).resolve().parent.parent
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+changes" if dirty else "")


def provenance(device: str, **extra: Any) -> Dict[str, Any]:
  """What produced a results file: the date, the commit, the device kind (a CPU's model: the same seed
  gives different losses on different CPUs), the package versions, and `extra` (command, config)."""
  return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit(),
          "device": device, "versions": versions.installed(PACKAGES), **extra}


def dumps(value: Any) -> str:
  """A results file's text (one line per table row)."""
  return _json(value)


def write(path, tables: Dict[str, Dict[str, Any]], provenance: Dict[str, Any]) -> None:
  """A results file: the figures (`tables`) and what produced them (a local path or gs://, as a study's
  workdir may be)."""
  fs.write_text(str(path), _json({"provenance": provenance, "tables": tables}) + "\n")


def read(path) -> Dict[str, Any]:
  return json.loads(fs.read_text(str(path)))


def cell(value: Any, fmt: Optional[str]) -> str:
  """A cell's text: a number in its column's format, anything else as it is."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not fmt:
    return str(value)
  text = format(value, fmt)
  if fmt.endswith("e"):  # 6.378e+12 -> 6.378e12
    mantissa, exponent = text.split("e")
    text = f"{mantissa}e{int(exponent)}"
  return text


def markdown(spec: Dict[str, Any]) -> str:
  """The markdown table of one results table."""
  columns, formats = spec["columns"], spec.get("formats") or [None] * len(spec["columns"])
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for row in spec["rows"]:
    lines.append("| " + " | ".join(cell(v, f) for v, f in zip(row, formats)) + " |")
  return "\n".join(lines)


def table_provenance(results: Dict[str, Any], name: str) -> Dict[str, Any]:
  """A table's provenance: the file's, with what the table itself records over it."""
  return {**results.get("provenance", {}), **results["tables"][name].get("provenance", {})}


def caption(file_name: str, said: Dict[str, Any]) -> str:
  """One line under a table: where its figures live and what produced them."""
  parts = [("commit " if k == "commit" else "") + str(said[k]) for k in CAPTION_KEYS if said.get(k)]
  return f"Figures from [{file_name}]({file_name})" + (f": {'; '.join(parts)}." if parts else ".")


def rendered_block(page: pathlib.Path, file_name: str, name: str) -> str:
  results = read(page.parent / file_name)
  if name not in results["tables"]:
    raise KeyError(f"{page.name}: {file_name} has no table {name!r} (it has {sorted(results['tables'])})")
  return markdown(results["tables"][name]) + "\n\n" + caption(file_name, table_provenance(results, name)) + "\n"


def render_page(page) -> str:
  """The page's text with every marked table re-rendered from its results file."""
  page = pathlib.Path(page)
  return MARKED.sub(lambda m: m.group(1) + rendered_block(page, m.group(2), m.group(3)) + m.group(5),
                    fs.read_text(str(page)))


def marked_tables(page) -> List[tuple]:
  """(results file, table name) of every marked block of a page."""
  return [(m.group(2), m.group(3)) for m in MARKED.finditer(fs.read_text(str(page)))]
