"""`midas docs render`: the docs' tables of measured figures, rendered from their results files.

  midas docs render [--check] [PAGE ...]

A page quotes a table of a results file between `<!-- table: FILE TABLE -->` markers
(midas_jax/results.py); this rewrites each quoted table from its file. With no PAGE, README.md and
docs/*.md under the current directory (run it from the repository's root). `--check` writes nothing
and exits 1, naming the pages whose tables differ from their files.
"""

from __future__ import annotations

import argparse
import glob
from typing import List

from midas_jax import fs, results
from midas_jax.commands.common import CommandGroup
from midas_jax.console import say
from midas_jax.errors import ConfigError


def add_commands(root: CommandGroup) -> None:
  docs = root.group("docs", help="the docs' tables of measured figures")
  p = docs.command("render", _render, help="rewrite every marked table of the pages from its results file")
  p.add_argument("pages", nargs="*", help="markdown pages (default: README.md and docs/*.md here)")
  p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page's tables are stale")


def _render(args: argparse.Namespace, bindings: List[str]) -> int:
  if bindings:
    raise ConfigError("--gin.", "`midas docs render` reads no gin settings", "drop the --gin. flags")
  pages = args.pages or sorted(glob.glob("README.md") + glob.glob("docs/*.md"))
  if not pages:
    raise ConfigError("PAGE", "no pages given and no README.md or docs/*.md here", "run it from the repository root")
  stale = []
  for page in pages:
    rendered = results.render_page(page)
    if rendered != fs.read_text(page):
      stale.append(page)
      if not args.check:
        fs.write_text(page, rendered)
  verb = "differ from their results files" if args.check else "re-rendered"
  say(f"docs: {len(stale)} of {len(pages)} pages {verb}" + (f": {', '.join(stale)}" if stale else ""))
  return 1 if (args.check and stale) else 0
