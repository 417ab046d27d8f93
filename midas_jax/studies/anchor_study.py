"""The anchor-function study: trains the cells of an AnchorStudyConfig (studies/anchor_cells.py), draws
the phase diagram over (gamma, learning rate) x (arm, depth), and reports the arms' contrasts.

Cells are written to WORKDIR/cells.jsonl as they finish, so an interrupted study resumes where it
stopped; a cell trained under different settings is never reused.

Contrasts (CONTRASTS): arm A minus arm B in the seed-mean inferential and symmetric fractions, per
(gamma, learning rate, depth). A difference is *clear* in a cell when the two arms' seed ranges do not
overlap (every seed of A above every seed of B, or every one below: the difference exceeds the seed
spread on both sides); with one seed there is no spread and nothing is clear. A contrast *survives*
at a depth when it is clear in every (gamma, learning rate) cell of the grid with the same sign.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.evals import figures
from midas_jax.studies.anchor_cells import FRACTIONS, classify, eval_sets, train_cell
from midas_jax.studies.anchor_config import GROWN, AnchorStudyConfig

# (A, B, what A - B asks). gradstack vs fresh_block isolates copying: both put the new layer on top.
CONTRASTS: Tuple[Tuple[str, str, str], ...] = (
    ("midas", "fixed", "growing (MIDAS) vs training at the final depth"),
    ("gradstack", "fixed", "growing (GradStack) vs training at the final depth"),
    ("fresh_block", "fixed", "growing with fresh layers vs training at the final depth"),
    ("gradstack", "fresh_block", "copying vs growing: the new top layer a copy or a fresh draw"),
    ("midas", "fresh_block", "copying into the middle vs a fresh layer on top"),
    ("midas", "looped", "grown (MIDAS) vs weight-tied looped, same final compute per step"),
    ("gradstack", "looped", "grown (GradStack) vs weight-tied looped, same final compute per step"),
)
CONTRAST_METRICS = ("inferential", "symmetric")


def _training_settings(cfg: AnchorStudyConfig) -> dict:
  """The settings a cell's result depends on besides its (arm, gamma, learning rate, depth, seed):
  resume only if equal."""
  d = dataclasses.asdict(cfg)
  for grid in ("gammas", "learning_rates", "depths", "seeds", "arms", "fit_threshold", "stage_alpha", "loop_block"):
    d.pop(grid)  # stage_alpha, loop_block: only stacked / looped cells read them, and record them (_read_cells)
  d["optimizer"].pop("learning_rate")  # each cell's own, in its key
  return d


def _key(cell: dict) -> tuple:
  return (cell.get("arm", "fixed"), float(cell["gamma"]), float(cell.get("learning_rate", float("nan"))),
          int(cell["depth"]), int(cell["seed"]))


def _arm_settings(cfg: AnchorStudyConfig, arm: str) -> dict:
  """The settings only one arm's cells read, which they record."""
  if arm in GROWN:
    return {"stage_alpha": cfg.stage_alpha}
  return {"loop_block": cfg.loop_block} if arm == "looped" else {}


def _read_cells(path: str, settings: dict, cfg: AnchorStudyConfig) -> Dict[tuple, dict]:
  """The finished cells trained under `settings` (and their arm's own settings of `cfg`)."""
  cells = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      if line.strip():
        row = json.loads(line)
        own = _arm_settings(cfg, row.get("arm", "fixed"))
        if row.get("settings") == settings and all(row.get(k) == v for k, v in own.items()):
          cells[_key(row)] = row
  return cells


def rows_of(cfg: AnchorStudyConfig) -> List[Tuple[str, int]]:
  """The phase diagram's rows: (arm, depth), arms in config order."""
  return [(arm, depth) for arm in cfg.arms for depth in cfg.depths]


def _column_label(cfg: AnchorStudyConfig, gamma: float, lr: float) -> str:
  return f"{gamma:g}" if len(cfg.rates) == 1 else f"{gamma:g}, lr {lr:g}"


def summarize(cfg: AnchorStudyConfig, cells: Sequence[dict]) -> List[dict]:
  """Per (arm, gamma, learning rate, depth): the fractions averaged over seeds, their range over seeds,
  each seed's values, the seeds' kinds, and the kind of the mean."""
  out = []
  for arm, depth in rows_of(cfg):
    for gamma, lr in cfg.grid_cells:
      rows = [c for c in cells if _key(c)[:4] == (arm, gamma, lr, depth)]
      if not rows:
        continue
      mean = {k: float(np.mean([r[k] for r in rows])) for k in FRACTIONS}
      spread = {k: [float(min(r[k] for r in rows)), float(max(r[k] for r in rows))] for k in FRACTIONS}
      out.append(dict(arm=arm, gamma=gamma, learning_rate=lr, depth=depth, **mean, seed_range=spread,
                      seed_values={k: [float(r[k]) for r in rows] for k in FRACTIONS},
                      kind=classify(mean, cfg.fit_threshold), seed_kinds=[r["kind"] for r in rows]))
  return out


def compare(a: Sequence[float], b: Sequence[float]) -> dict:
  """A's seeds against B's in one cell: the difference of means, the separation of the two seed
  ranges (> 0 when they do not overlap, by how much), and whether the difference is clear (exceeds
  the seed spread: ranges apart, and at least two seeds on each side to have a spread)."""
  difference = float(np.mean(a) - np.mean(b))
  separation = float(min(a) - max(b) if difference >= 0 else min(b) - max(a))
  clear = len(a) >= 2 and len(b) >= 2 and separation > 0
  return {"difference": difference, "separation": separation, "clear": bool(clear),
          "sign": int(np.sign(difference)) if clear else 0}


def contrasts(cfg: AnchorStudyConfig, grid: Sequence[dict]) -> List[dict]:
  """Every contrast of CONTRASTS whose two arms the study has, per metric and (gamma, lr, depth)
  cell: compare() of the arms' seed values, their seed ranges, and whether both fit the task."""
  by = {(g["arm"], g["gamma"], g["learning_rate"], g["depth"]): g for g in grid}
  out = []
  for a, b, question in CONTRASTS:
    if a not in cfg.arms or b not in cfg.arms:
      continue
    for metric in CONTRAST_METRICS:
      for depth in cfg.depths:
        for gamma, lr in cfg.grid_cells:
          ga, gb = by.get((a, gamma, lr, depth)), by.get((b, gamma, lr, depth))
          if ga is None or gb is None:
            continue
          out.append(dict(a=a, b=b, question=question, metric=metric, gamma=gamma, learning_rate=lr, depth=depth,
                          **compare(ga["seed_values"][metric], gb["seed_values"][metric]),
                          a_range=ga["seed_range"][metric], b_range=gb["seed_range"][metric],
                          fit=ga["kind"] != "unfit" and gb["kind"] != "unfit"))
  return out


def verdicts(cfg: AnchorStudyConfig, rows: Sequence[dict]) -> List[dict]:
  """Per (contrast, metric, depth): survives when it is clear in every (gamma, lr) cell of the grid
  with the same sign; else why not (missing cells, one seed, within the seed spread, sign flips)."""
  out, expected = [], len(cfg.grid_cells)
  keys = list(dict.fromkeys((r["a"], r["b"], r["metric"], r["depth"]) for r in rows))
  for a, b, metric, depth in keys:
    cells = [r for r in rows if (r["a"], r["b"], r["metric"], r["depth"]) == (a, b, metric, depth)]
    signs = {int(np.sign(r["difference"])) for r in cells}
    unclear = sum(not r["clear"] for r in cells)
    if len(cells) < expected:
      why = f"{expected - len(cells)} of {expected} (gamma, lr) cells not trained"
    elif len(cfg.seeds) < 2:
      why = "one seed: no seed spread to exceed"
    elif len(signs) > 1:
      why = "the sign differs between (gamma, lr) cells"
    elif unclear:
      why = f"within the seed spread in {unclear} of {len(cells)} (gamma, lr) cells"
    else:
      why = ""
    direction = signs.pop() if len(signs) == 1 else 0
    out.append(dict(a=a, b=b, metric=metric, depth=depth, cells=len(cells), survives=not why,
                    direction=direction if not why else 0,
                    mean_difference=float(np.mean([r["difference"] for r in cells])), why=why or "survives"))
  return out


def run_study(cfg: AnchorStudyConfig, workdir: str, log: Callable[[str], None] = print) -> dict:
  """Trains every missing cell (resuming from cells.jsonl), then writes anchor_study.json and the PNG."""
  fs.makedirs(workdir)
  settings = _training_settings(cfg)
  cells_path = fs.join(workdir, "cells.jsonl")
  done = _read_cells(cells_path, settings, cfg)
  sets = eval_sets(cfg.eval_examples)
  keys = [(arm, g, lr, d, s) for arm, d in rows_of(cfg) for g, lr in cfg.grid_cells for s in cfg.seeds]
  for key in keys:
    if key in done:
      continue
    arm, gamma, lr, depth, seed = key
    cell = train_cell(cfg, gamma, depth, seed, sets, arm=arm, learning_rate=lr)
    done[key] = cell
    fs.append_text(cells_path, json.dumps(dict(cell, settings=settings)) + "\n")
    log(f"{arm:<11} gamma={gamma:<5} lr={lr:<7g} depth={depth} seed={seed}: inferential {cell['inferential']:.2f} "
        f"symmetric {cell['symmetric']:.2f} seen {cell['seen']:.2f} -> {cell['kind']} ({cell['seconds']}s)")
  cells = [done[k] for k in keys]
  grid = summarize(cfg, cells)
  rows = contrasts(cfg, grid)
  result = {"config": dataclasses.asdict(cfg), "grid": grid, "contrasts": rows, "verdicts": verdicts(cfg, rows),
            "cells": [{k: v for k, v in c.items() if k != "settings"} for c in cells]}
  result["phase_diagram"] = fs.join(workdir, "phase_diagram.png")
  plot_phase_diagram(cfg, result["grid"], result["phase_diagram"])
  fs.write_json(fs.join(workdir, "anchor_study.json"), result)
  return result


def format_grid(cfg: AnchorStudyConfig, grid: Sequence[dict]) -> str:
  """A text phase diagram: one row per (arm, depth), one column per (gamma, lr), each cell 'I/S seen
  kind' (seed means), then one line per cell with each seed's fractions."""
  by = {(g["arm"], g["gamma"], g["learning_rate"], g["depth"]): g for g in grid}
  header = "gamma" if len(cfg.rates) == 1 else "gamma, lr"
  lines = [f"arm         depth \\ {header:<9}" + "".join(f"{_column_label(cfg, g, r):>22}" for g, r in cfg.grid_cells)]
  for arm, depth in rows_of(cfg):
    row = f"{arm:<11} {depth:>17} "
    for gamma, lr in cfg.grid_cells:
      g = by.get((arm, gamma, lr, depth))
      row += f"{'-':>22}" if g is None else (
          f"{g['inferential']:.2f}/{g['symmetric']:.2f} {g['seen']:.2f} {g['kind'][:5]:>5}".rjust(22))
    lines.append(row)
  lines.append("cells: inferential (key-10) / symmetric (key-6) fraction on the held-out pair (4,3), "
               f"seen-pair test accuracy, kind; means over {len(cfg.seeds)} seed(s)")
  if len(cfg.seeds) > 1:
    for g in grid:
      r = g["seed_range"]
      lr = "" if len(cfg.rates) == 1 else f" lr {g['learning_rate']:g}"
      lines.append(f"  {g['arm']} depth {g['depth']} gamma {g['gamma']:g}{lr}: inferential {r['inferential'][0]:.2f}-"
                   f"{r['inferential'][1]:.2f}, symmetric {r['symmetric'][0]:.2f}-{r['symmetric'][1]:.2f}, "
                   f"seen {r['seen'][0]:.2f}-{r['seen'][1]:.2f} over seeds; kinds {', '.join(g['seed_kinds'])}")
  return "\n".join(lines)


def format_contrasts(cfg: AnchorStudyConfig, rows: Sequence[dict], verdict_rows: Sequence[dict]) -> str:
  """Each contrast's difference per (gamma, lr) cell with both arms' seed ranges ('*': clear, beyond the
  seed spread; '!': an arm did not fit the task), then which contrasts survive."""
  if not rows:
    pairs = ", ".join(f"{a}-{b}" for a, b, _ in CONTRASTS)
    return f"contrasts: none (the study needs both arms of one of {pairs})"
  lines = [f"contrasts: A - B in the seed-mean fraction of (4,3) answered so, per (gamma, lr); [A's seed range] "
           f"[B's]; * clear (the ranges do not overlap), ! an arm unfit; {len(cfg.seeds)} seed(s)"]
  for key in dict.fromkeys((r["a"], r["b"], r["metric"], r["depth"]) for r in rows):
    a, b, metric, depth = key
    cells = [r for r in rows if (r["a"], r["b"], r["metric"], r["depth"]) == key]
    lines.append(f"  {a} - {b}, {metric}, depth {depth} ({cells[0]['question']}):")
    for r in cells:
      mark = ("*" if r["clear"] else " ") + (" " if r["fit"] else "!")
      lines.append(f"    gamma {r['gamma']:g} lr {r['learning_rate']:g}: {r['difference']:+.2f}{mark} "
                   f"[{r['a_range'][0]:.2f}, {r['a_range'][1]:.2f}] vs [{r['b_range'][0]:.2f}, {r['b_range'][1]:.2f}]")
  lines.append("which survive (clear with one sign in every (gamma, lr) cell):")
  for v in verdict_rows:
    verdict = (f"SURVIVES, {v['a']} {'above' if v['direction'] > 0 else 'below'} {v['b']}" if v["survives"]
               else f"does not survive: {v['why']}")
    lines.append(f"  {v['a']} - {v['b']}, {v['metric']}, depth {v['depth']}: mean {v['mean_difference']:+.2f}; "
                 f"{verdict}")
  return "\n".join(lines)


def plot_phase_diagram(cfg: AnchorStudyConfig, grid: Sequence[dict], path: str) -> None:
  """Three heatmaps over gamma x (arm, depth): inferential fraction, symmetric fraction, seen-pair
  accuracy (seed means). Cells whose seen-pair accuracy is below fit_threshold (the task was not
  fitted) are hatched."""
  plt = figures.pyplot()
  columns, rows = list(cfg.grid_cells), rows_of(cfg)
  by = {(g["arm"], g["gamma"], g["learning_rate"], g["depth"]): g for g in grid}
  panels = (("inferential", "held-out (4,3) answered key-10 (inferential)", "Greens"),
            ("symmetric", "held-out (4,3) answered key-6 (symmetric)", "Reds"),
            ("seen", "seen-pair test accuracy", "Blues"))
  width = max(4.2, 1.0 * len(columns) + 1.6)
  fig, axes = plt.subplots(1, 3, figsize=(width * 3, 0.6 * len(rows) + 2.2), squeeze=False)
  for ax, (key, title, cmap) in zip(axes[0], panels):
    values = np.full((len(rows), len(columns)), np.nan)
    for i, (arm, d) in enumerate(rows):
      for j, (g, lr) in enumerate(columns):
        cell = by.get((arm, g, lr, d))
        if cell is None:
          continue
        values[i, j] = cell[key]
        ax.text(j, i, f"{cell[key]:.2f}\n{cell['kind']}", ha="center", va="center", fontsize=8,
                color="w" if cell[key] > 0.6 else "k")
        if cell["kind"] == "unfit":
          ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", lw=0, alpha=0.5))
    ax.imshow(values, cmap=cmap, vmin=0, vmax=1, origin="lower", aspect="auto")
    ax.set_xticks(range(len(columns)), [_column_label(cfg, g, lr) for g, lr in columns], fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{arm} {d}" for arm, d in rows])
    ax.set_xlabel("gamma (larger = smaller init)" + ("" if len(cfg.rates) == 1 else ", peak learning rate"), fontsize=9)
    ax.set_ylabel("arm, depth (layers)")
    ax.set_title(title, fontsize=9)
  fig.suptitle(f"anchor-function study ({cfg.model.family}, d_model {cfg.model.d_model}, {cfg.steps} steps, "
               f"{len(cfg.seeds)} seed(s); init std = d_in ** -gamma; hatched: seen accuracy < {cfg.fit_threshold:g})",
               fontsize=10)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=110)
  plt.close(fig)
