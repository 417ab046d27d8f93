"""The stacking study's results file and its page: tables from the summary, markdown from the tables.

`results` turns a summary (stacking_study_summary.py) into a results file (midas_jax/results.py:
provenance and tables, plus the cells and the summary as data); `markdown` renders the study page
from that file alone, so a committed results file re-renders the same page, and the tables the docs
quote are the same tables. Figures are drawn from the cells.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence

from midas_jax import fs, results
from midas_jax.evals import figures

FIGURES = "study"  # DIR/study/*.png
# The page: (table, heading, what it shows), in this order.
SECTIONS = (
    ("speedup", "Effective speedup",
     "The compute the baseline needs to reach each stacked arm's final test loss, over the arm's own compute "
     "(the MIDAS paper's metric): read per seed on that seed's ladder of complete baseline runs, linear in "
     "log-compute between the two rungs around the loss. `> x`: the arm's loss is below every rung (the baseline "
     "would need more than the top rung), `< x`: above every rung; nothing is extrapolated. Over seeds: the "
     "geometric mean and its 95% t-interval on the log scale (n - 1 degrees of freedom), and the exact sign-flip "
     "test of log speedup = 0 (with n seeds its smallest p is 2/2^n)."),
    ("gaps", "Loss gaps (secondary)",
     "Arm minus baseline on the test set, paired by seed (negative: the arm's loss is lower): at equal steps, and "
     "at equal FLOPs (the ladder's loss at the arm's compute, linear in log-compute; `-` outside the ladder). "
     "On a flattening curve a constant compute penalty looks like a closing loss gap: read the speedup first."),
    ("arms", "Every arm at every length", "Test loss (mean ± sd over seeds), its standard error on the test set, "
     "and the final validation loss the rates were chosen on."),
    ("ladder", "The baseline ladder", "Complete baseline runs, each with its own full learning-rate schedule."),
    ("rates", "Learning rates", "At the shortest length, each arm's final validation loss at every rate of its "
     "grid (mean over the grid's seeds; never the test set). A best rate on the grid's edge extends the grid one "
     "step past it, up to the cap."),
    ("recheck", "The rate choice at the longest length", "Each arm at its rate and the grid's neighbours of it, "
     "the first seed, validation loss."),
    ("matched", "Reasoning against memorization at matched loss",
     "The ladder read at each arm's test loss (scores interpolated between the two rungs that bracket it): arm "
     "minus baseline on reasoning (the primitives' forced choice, mean over tasks) and on memorization "
     "(closed-book forced choice over the world's facts), and their difference in differences, paired by seed."),
    ("growths", "Validation loss around each growth", "Just before the growth and just after it (the grown "
     "state, before any step), mean ± sd over seeds."),
)


def _ms(s: Dict[str, Any], digits: int = 4) -> str:
  if s is None or s.get("mean") is None:
    return "-"
  return f"{s['mean']:.{digits}f}" + ("" if s.get("sd") is None else f" ± {s['sd']:.{digits}f}")


def _pair(p: Dict[str, Any], digits: int = 4) -> str:
  if p is None or p.get("mean") is None:
    return "-"
  ci = "" if not p.get("ci95") else f" ({p['ci95'][0]:+.{digits}f} to {p['ci95'][1]:+.{digits}f})"
  return f"{p['mean']:+.{digits}f}{ci}"


def _p(p: Optional[float]) -> str:
  return "-" if p is None else f"{p:.3g}"


def tables(summary: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
  """The study's tables (midas_jax/results.py format) from its summary."""
  out = {}
  rows = []
  for s in summary["speedups"]:
    length = _length(summary, s["length"])
    rows.append([s["length"], length["tokens_per_param"], length["passes"] or "-", s["arm"],
                 ", ".join(s["seeds"]) or "-", s.get("geomean") or f"{s['outside_ladder']} outside",
                 "-" if not s.get("ci95") else f"{s['ci95'][0]:.2f}x to {s['ci95'][1]:.2f}x",
                 _p(s.get("p_sign_flip")), s["every_seed"]])
  out["speedup"] = results.table(
      ["steps", "tokens per parameter", "passes over the corpus", "arm", "per seed", "geometric mean",
       "95% interval", "sign-flip p", "every seed"], rows, [None, ".1f", ".2f", None, None, ".3f", None, None, None])
  out["gaps"] = results.table(
      ["steps", "arm", "equal steps", "equal FLOPs (on the ladder)", "equal-FLOPs run", "p (equal FLOPs)"],
      [[g["length"], g["arm"], _pair(g["equal_steps"]), _pair(g["equal_flops"]), _pair(g["equal_flops_run"]),
        _p(g["equal_flops"].get("p_sign_flip"))] for g in summary["gaps"]])
  out["arms"] = results.table(
      ["steps", "arm", "peak rate", "training FLOPs", "test loss", "test SE", "validation loss", "train seconds"],
      [[one["length"], arm, a["learning_rate"], a["flops"], _ms(a["test_loss"]),
        a["test_se"] if a["test_se"] is not None else "-", _ms(a["validation_loss"]), _ms(a["train_seconds"], 0)]
       for one in summary["lengths"] for arm, a in one["arms"].items()],
      [None, None, "g", ".3e", None, ".4f", None, None])
  out["ladder"] = results.table(
      ["steps", "tokens per parameter", "peak rate", "training FLOPs", "test loss", "test SE"],
      [[r["length"], r["tokens_per_param"], r["learning_rate"], r["flops"], _ms(r["test_loss"]),
        r["test_se"]["mean"] if r["test_se"]["mean"] is not None else "-"] for r in summary["ladder"]],
      [None, ".1f", "g", ".3e", None, ".4f"])
  rows = []
  for arm, r in summary["rates"].items():
    for rate, losses in r["grid"].items():
      kept = [x for x in losses if x is not None]
      mean = sum(kept) / len(kept) if kept and len(kept) == len(losses) else "diverged"
      chosen = float(rate) == float(r["best"])
      rows.append([arm, float(rate), mean, len(losses),
                   ("best" + ("" if r["bracketed"] in (True, None) else ", not bracketed")) if chosen else ""])
  out["rates"] = results.table(["arm", "peak rate", "validation loss", "seeds", "chosen"], rows,
                               [None, "g", ".4f", None, None])
  out["recheck"] = results.table(
      ["arm", "steps", "peak rate", "validation loss", "lowest here"],
      [[r["arm"], r["length"], r["learning_rate"], "diverged" if r["diverged"] else r["validation_loss"],
        "yes" if _lowest(summary["recheck"], r) else ""] for r in summary["recheck"]],
      [None, None, "g", ".4f", None])
  out["matched"] = results.table(
      ["steps", "arm", "seeds read", "reasoning: arm - baseline", "memorization: arm - baseline",
       "difference in differences", "p (sign flip)"],
      [[m["length"], m["arm"], f"{m['read']}/{m['seeds']}", _pair(m["reasoning"], 3), _pair(m["memory"], 3),
        _pair(m["did"], 3), _p(m["did"].get("p_sign_flip"))] for m in summary["matched"]])
  out["growths"] = results.table(
      ["steps", "arm", "growth step", "depth", "just before", "just after", "jump"],
      [[g["length"], g["arm"], g["step"], f"{g['from_depth']} -> {g['to_depth']}", _ms(g["loss_before"]),
        _ms(g["loss_after"]), _pair(g["jump"])] for g in summary["growths"]])
  return out


def _length(summary: Dict[str, Any], n: int) -> Dict[str, Any]:
  return next(one for one in summary["lengths"] if one["length"] == n)


def _lowest(rows: Sequence[Dict[str, Any]], row: Dict[str, Any]) -> bool:
  mine = [r for r in rows if r["arm"] == row["arm"] and not r["diverged"]]
  return not row["diverged"] and row["validation_loss"] == min(r["validation_loss"] for r in mine)


def results_file(summary: Dict[str, Any], cells: Sequence[Dict[str, Any]], run, study,
                 operative_config: str = "") -> Dict[str, Any]:
  """The study's results file: provenance, tables, the summary and the cells (per seed; without the
  step-by-step growth records, which stay in each run's metrics)."""
  devices = summary["devices"]
  said = results.provenance(devices[0] if len(devices) == 1 else "mixed: " + "; ".join(devices),
                            command="midas study stacking", config=operative_config)
  return {"provenance": said, "tables": tables(summary), "study": dataclasses.asdict(study), "summary": summary,
          "model": {"family": run.model.family, "num_layers": run.model.num_layers, "d_model": run.model.d_model,
                    "params": summary["params"], "source": run.data.source, "batch_size": run.data.batch_size,
                    "seq_len": run.data.seq_len, "num_stages": run.stacking.num_stages,
                    "alpha": run.stacking.alpha, "corpus_documents": run.data.corpus_documents},
          "cells": [{k: v for k, v in c.items() if k not in ("settings", "growth_steps")} for c in cells]}


def tables_file(result: Dict[str, Any]) -> Dict[str, Any]:
  """The results file's small part, to commit beside docs that quote its tables: provenance, tables, the
  study's settings and the model (no cells)."""
  return {k: result[k] for k in ("provenance", "tables", "study", "model")}


def markdown(result: Dict[str, Any]) -> str:
  """The study page, from its results file alone."""
  s, m, said = result["summary"], result["model"], result["provenance"]
  e = s["eval_set"]
  lines = ["# Stacking study", "",
           f"{m['family']}, {m['num_layers']} layers, d_model {m['d_model']}, {m['params']:,} parameters; "
           f"{m['source']} data ({m['corpus_documents']} training documents), {m['batch_size']} x {m['seq_len']} "
           f"tokens per step; stacked arms grow in {m['num_stages']} stages (Prop-{m['alpha']:g}). Seeds "
           f"{s['seeds']}: a seed sets the initialization and the training rows. Every run is scored on the same "
           f"held-out batches (eval seed {e['eval_seed']}): the validation half for rates and curves, the test half "
           f"({e['test_batches']} batches, {e['test_tokens'] or 0:,.0f} tokens; standard error of a run's test loss "
           f"{_ms(e['se'])}) for every reported loss. Measured on {said['device']} at commit {said['commit']}, "
           f"{said['date']}; the cells took {s['cell_wall_seconds']:.0f} s of wall time.", ""]
  if len(s["devices"]) > 1:
    lines += [f"**Warning: the cells were measured on {len(s['devices'])} device kinds ({'; '.join(s['devices'])}).** "
              "The same seed gives different losses on different CPUs: compare figures from one kind only.", ""]
  for name, heading, note in SECTIONS:
    spec = result["tables"].get(name)
    if spec and spec["rows"]:
      lines += [f"## {heading}", "", note, "", results.markdown(spec), ""]
  for name, title in (("speedup_vs_length", "Effective speedup against training length"),
                      ("loss_vs_flops", "Test loss against training FLOPs (every run)")):
    if name in result.get("figures", {}):
      lines += [f"## {title}", "", f"![{name}]({result['figures'][name]})", ""]
  return "\n".join(lines).rstrip() + "\n"


def printable(result: Dict[str, Any]) -> str:
  """The page without its figure links: what `midas study stacking` prints."""
  return "\n".join(line for line in markdown(result).splitlines() if not line.startswith("!["))


# ---------------------------------------------------------------------------------------------
# Figures

COLORS = {"baseline": "tab:blue", "baseline_equal_flops": "tab:cyan", "midas": "tab:red", "gradstack": "tab:green",
          "midas_zero_moments": "tab:orange", "midas_rewarm": "tab:purple", "gradstack_zero_moments": "tab:olive",
          "gradstack_rewarm": "tab:brown"}


def _save(fig, workdir: str, name: str) -> str:
  plt = figures.pyplot()
  fig.tight_layout()
  fs.makedirs(fs.join(workdir, FIGURES))
  fs.write_figure(fs.join(workdir, FIGURES, f"{name}.png"), fig, dpi=100)
  plt.close(fig)
  return f"{FIGURES}/{name}.png"


def plot_all(cells: Sequence[Dict[str, Any]], workdir: str, summary: Dict[str, Any]) -> Dict[str, str]:
  """Test loss against FLOPs for every run (the ladder as a line per seed), and the speedup per length."""
  plt = figures.pyplot()
  paths = {}
  live = [c for c in cells if not c.get("diverged") and c.get("test")]
  if live:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    labelled = set()
    for seed in sorted({c["seed"] for c in live}):
      ladder = sorted((c for c in live if c["arm"] == "baseline" and c["seed"] == seed), key=lambda c: c["total_flops"])
      ax.plot([c["total_flops"] for c in ladder], [c["test"]["loss"] for c in ladder], color=COLORS["baseline"],
              alpha=0.5, linewidth=1)
    for c in live:
      ax.scatter([c["total_flops"]], [c["test"]["loss"]], color=COLORS.get(c["arm"], "gray"), s=18,
                 label=None if c["arm"] in labelled else c["arm"])
      labelled.add(c["arm"])
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("test loss")
    ax.set_title("final test loss against compute; lines: each seed's baseline ladder", fontsize=9)
    ax.legend(fontsize=8)
    paths["loss_vs_flops"] = _save(fig, workdir, "loss_vs_flops")
  points = [s for s in summary["speedups"] if s["per_seed"]]
  if len({s["length"] for s in points}) > 1:
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for s in points:
      for r in s["per_seed"]:
        marker = {None: "o", ">": "^", "<": "v"}[r["bound"]]
        ax.scatter([_length(summary, s["length"])["tokens_per_param"]], [r["value"]], marker=marker,
                   color=COLORS.get(s["arm"], "gray"), s=25)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens per parameter")
    ax.set_ylabel("effective speedup")
    ax.set_title("effective speedup per seed (triangles: bounds outside the ladder)", fontsize=9)
    paths["speedup_vs_length"] = _save(fig, workdir, "speedup_vs_length")
  return paths

