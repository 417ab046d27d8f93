"""The anchor-function study: trains the cells of an AnchorStudyConfig (studies/anchor_cells.py) and
draws the gamma x depth phase diagram.

Cells are written to WORKDIR/cells.jsonl as they finish, so an interrupted study resumes where it
stopped; a cell trained under different settings is never reused.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.evals import figures
from midas_jax.studies.anchor_cells import FRACTIONS, classify, eval_sets, train_cell
from midas_jax.studies.anchor_config import AnchorStudyConfig


def _training_settings(cfg: AnchorStudyConfig) -> dict:
  """The settings a cell's result depends on besides its (arm, gamma, depth, seed): resume only if equal."""
  d = dataclasses.asdict(cfg)
  for grid in ("gammas", "depths", "seeds", "arms", "fit_threshold", "stage_alpha"):
    d.pop(grid)  # stage_alpha: only stacked cells read it, and they record it (_read_cells)
  return d


def _key(cell: dict) -> tuple:
  return (cell.get("arm", "fixed"), float(cell["gamma"]), int(cell["depth"]), int(cell["seed"]))


def _read_cells(path: str, settings: dict, stage_alpha: float) -> Dict[tuple, dict]:
  """The finished cells trained under `settings` (stacked ones also under `stage_alpha`)."""
  cells = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      if line.strip():
        row = json.loads(line)
        stacked = row.get("arm", "fixed") != "fixed"
        if row.get("settings") == settings and (not stacked or row.get("stage_alpha") == stage_alpha):
          cells[_key(row)] = row
  return cells


def rows_of(cfg: AnchorStudyConfig) -> List[Tuple[str, int]]:
  """The phase diagram's rows: (arm, depth), arms in config order."""
  return [(arm, depth) for arm in cfg.arms for depth in cfg.depths]


def summarize(cfg: AnchorStudyConfig, cells: Sequence[dict]) -> List[dict]:
  """Per (arm, gamma, depth): the fractions averaged over seeds, their range over seeds, the seeds'
  kinds, and the kind of the mean."""
  out = []
  for arm, depth in rows_of(cfg):
    for gamma in cfg.gammas:
      rows = [c for c in cells if _key(c)[:3] == (arm, float(gamma), depth)]
      if not rows:
        continue
      mean = {k: float(np.mean([r[k] for r in rows])) for k in FRACTIONS}
      spread = {k: [float(min(r[k] for r in rows)), float(max(r[k] for r in rows))] for k in FRACTIONS}
      out.append(dict(arm=arm, gamma=float(gamma), depth=depth, **mean, seed_range=spread,
                      kind=classify(mean, cfg.fit_threshold), seed_kinds=[r["kind"] for r in rows]))
  return out


def run_study(cfg: AnchorStudyConfig, workdir: str, log: Callable[[str], None] = print) -> dict:
  """Trains every missing cell (resuming from cells.jsonl), then writes anchor_study.json and the PNG."""
  fs.makedirs(workdir)
  settings = _training_settings(cfg)
  cells_path = fs.join(workdir, "cells.jsonl")
  done = _read_cells(cells_path, settings, cfg.stage_alpha)
  sets = eval_sets(cfg.eval_examples)
  keys = [(arm, float(g), d, s) for arm, d in rows_of(cfg) for g in cfg.gammas for s in cfg.seeds]
  for key in keys:
    if key in done:
      continue
    arm, gamma, depth, seed = key
    cell = train_cell(cfg, gamma, depth, seed, sets, arm=arm)
    done[key] = cell
    fs.append_text(cells_path, json.dumps(dict(cell, settings=settings)) + "\n")
    log(f"{arm:<9} gamma={gamma:<5} depth={depth} seed={seed}: inferential {cell['inferential']:.2f} "
        f"symmetric {cell['symmetric']:.2f} seen {cell['seen']:.2f} -> {cell['kind']} ({cell['seconds']}s)")
  cells = [done[k] for k in keys]
  result = {"config": dataclasses.asdict(cfg), "grid": summarize(cfg, cells),
            "cells": [{k: v for k, v in c.items() if k != "settings"} for c in cells]}
  result["phase_diagram"] = fs.join(workdir, "phase_diagram.png")
  plot_phase_diagram(cfg, result["grid"], result["phase_diagram"])
  fs.write_json(fs.join(workdir, "anchor_study.json"), result)
  return result


def format_grid(cfg: AnchorStudyConfig, grid: Sequence[dict]) -> str:
  """A text phase diagram: one row per (arm, depth), one column per gamma, each cell 'I/S seen kind'
  (seed means), then one line per cell with each seed's fractions."""
  by = {(g["arm"], g["gamma"], g["depth"]): g for g in grid}
  lines = ["arm       depth \\ gamma " + "".join(f"{g:>22}" for g in cfg.gammas)]
  for arm, depth in rows_of(cfg):
    row = f"{arm:<9} {depth:>13} "
    for gamma in cfg.gammas:
      g = by.get((arm, float(gamma), depth))
      row += f"{'-':>22}" if g is None else (
          f"{g['inferential']:.2f}/{g['symmetric']:.2f} {g['seen']:.2f} {g['kind'][:5]:>5}".rjust(22))
    lines.append(row)
  lines.append("cells: inferential (key-10) / symmetric (key-6) fraction on the held-out pair (4,3), "
               f"seen-pair test accuracy, kind; means over {len(cfg.seeds)} seed(s)")
  if len(cfg.seeds) > 1:
    for g in grid:
      r = g["seed_range"]
      lines.append(f"  {g['arm']} depth {g['depth']} gamma {g['gamma']:g}: inferential {r['inferential'][0]:.2f}-"
                   f"{r['inferential'][1]:.2f}, symmetric {r['symmetric'][0]:.2f}-{r['symmetric'][1]:.2f}, "
                   f"seen {r['seen'][0]:.2f}-{r['seen'][1]:.2f} over seeds; kinds {', '.join(g['seed_kinds'])}")
  return "\n".join(lines)


def plot_phase_diagram(cfg: AnchorStudyConfig, grid: Sequence[dict], path: str) -> None:
  """Three heatmaps over gamma x (arm, depth): inferential fraction, symmetric fraction, seen-pair
  accuracy (seed means). Cells whose seen-pair accuracy is below fit_threshold (the task was not
  fitted) are hatched."""
  plt = figures.pyplot()
  gammas, rows = list(cfg.gammas), rows_of(cfg)
  by = {(g["arm"], g["gamma"], g["depth"]): g for g in grid}
  panels = (("inferential", "held-out (4,3) answered key-10 (inferential)", "Greens"),
            ("symmetric", "held-out (4,3) answered key-6 (symmetric)", "Reds"),
            ("seen", "seen-pair test accuracy", "Blues"))
  fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 0.6 * len(rows) + 2.2), squeeze=False)
  for ax, (key, title, cmap) in zip(axes[0], panels):
    values = np.full((len(rows), len(gammas)), np.nan)
    for i, (arm, d) in enumerate(rows):
      for j, g in enumerate(gammas):
        cell = by.get((arm, float(g), d))
        if cell is None:
          continue
        values[i, j] = cell[key]
        ax.text(j, i, f"{cell[key]:.2f}\n{cell['kind']}", ha="center", va="center", fontsize=8,
                color="w" if cell[key] > 0.6 else "k")
        if cell["kind"] == "unfit":
          ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", lw=0, alpha=0.5))
    ax.imshow(values, cmap=cmap, vmin=0, vmax=1, origin="lower", aspect="auto")
    ax.set_xticks(range(len(gammas)), [f"{g:g}" for g in gammas])
    ax.set_yticks(range(len(rows)), [f"{arm} {d}" for arm, d in rows])
    ax.set_xlabel("gamma (larger = smaller init)", fontsize=9)
    ax.set_ylabel("arm, depth (layers)")
    ax.set_title(title, fontsize=9)
  fig.suptitle(f"anchor-function study ({cfg.model.family}, d_model {cfg.model.d_model}, {cfg.steps} steps, "
               f"{len(cfg.seeds)} seed(s); init std = d_in ** -gamma; hatched: seen accuracy < {cfg.fit_threshold:g})",
               fontsize=10)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=110)
  plt.close(fig)
