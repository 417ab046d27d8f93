"""The stacking study's numbers and page: seed spreads, paired differences, growth jumps, figures.

Everything here reads the cells stacking_study.py measured and computes nothing from a model:

  arms          per arm, over seeds: steps, FLOPs, final held-out loss (mean, sd, range)
  comparisons   per stacked arm, paired by seed: its final loss minus the baseline's at equal
                steps, minus the baseline's loss interpolated at its total FLOPs (on the baseline's
                eval curve), and minus the equal-FLOPs baseline's final loss; each with the 95%
                t-interval of the mean difference over seeds and whether it excludes 0 ("resolved")
  growths       per stacked arm and growth: the held-out loss just before, just after, at the next eval
  primitives    per arm, task and score: the mean over seeds, its sd, and the task's chance level

With n seeds the t-interval has n-1 degrees of freedom, so two seeds resolve only differences far
larger than their spread; the page says how many seeds each number averages.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from midas_jax import fs
from midas_jax.compare import loss_at_flops
from midas_jax.evals import figures
from midas_jax.evals.likelihood import SCORES

FIGURES = "study"  # DIR/study/*.png


def spread(values: Sequence[Optional[float]]) -> Dict[str, Any]:
  """mean, sd (n-1), min, max and n of the values that are not None."""
  v = [float(x) for x in values if x is not None]
  if not v:
    return {"n": 0, "mean": None, "sd": None, "min": None, "max": None, "values": []}
  return {"n": len(v), "mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)) if len(v) > 1 else None,
          "min": min(v), "max": max(v), "values": v}


def paired(differences: Sequence[Optional[float]]) -> Dict[str, Any]:
  """The spread of per-seed differences, the 95% t-interval of their mean, and whether it excludes 0."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  out = spread(differences)
  if out["n"] >= 2 and out["sd"] is not None:
    half = float(stats.t.ppf(0.975, out["n"] - 1)) * out["sd"] / math.sqrt(out["n"])
    out["ci95"] = [out["mean"] - half, out["mean"] + half]
    out["resolved"] = bool(out["ci95"][0] > 0 or out["ci95"][1] < 0)
  else:
    out["ci95"], out["resolved"] = None, False
  return out


def _by(cells: Sequence[Dict[str, Any]], arm: str) -> Dict[int, Dict[str, Any]]:
  return {c["seed"]: c for c in cells if c["arm"] == arm}


def summarize(cells: Sequence[Dict[str, Any]], study) -> Dict[str, Any]:
  arms = [a for a in study.arms if any(c["arm"] == a for c in cells)]
  out: Dict[str, Any] = {"seeds": list(study.seeds), "arms": {}, "comparisons": {}, "growths": {}, "primitives": {}}
  for arm in arms:
    mine = list(_by(cells, arm).values())
    out["arms"][arm] = {"steps": mine[0]["steps"], "total_flops": float(np.mean([c["total_flops"] for c in mine])),
                        "final_eval_loss": spread([c["final_eval_loss"] for c in mine]),
                        "train_seconds": spread([c["train_seconds"] for c in mine])}
  base, cut = _by(cells, "baseline"), _by(cells, "baseline_equal_flops")
  for arm in (a for a in arms if a in ("midas", "gradstack")):
    mine = _by(cells, arm)
    at_flops = {s: loss_at_flops([{"cumulative_flops": r["flops"], "loss": r["loss"]} for r in base[s]["eval_curve"]],
                                 c["total_flops"]) for s, c in mine.items() if s in base}
    out["comparisons"][arm] = {
        "minus_baseline_equal_steps": paired([c["final_eval_loss"] - base[s]["final_eval_loss"]
                                              for s, c in mine.items() if s in base]),
        "baseline_at_equal_flops": spread(list(at_flops.values())),
        "minus_baseline_at_equal_flops": paired([None if at_flops.get(s) is None else c["final_eval_loss"] - at_flops[s]
                                                 for s, c in mine.items() if s in base]),
        "minus_baseline_equal_flops_run": paired([c["final_eval_loss"] - cut[s]["final_eval_loss"]
                                                  for s, c in mine.items() if s in cut])}
    growths = []
    for i, g in enumerate(next(iter(mine.values()))["growths"]):
      rows = [c["growths"][i] for c in mine.values()]
      growths.append({"step": g["step"], "from_depth": g["from_depth"], "to_depth": g["to_depth"],
                      **{k: spread([r[k] for r in rows]) for k in ("loss_before", "loss_after", "loss_next_eval")},
                      "jump": paired([r["loss_after"] - r["loss_before"] for r in rows
                                      if r["loss_before"] is not None])})
    out["growths"][arm] = growths
  for arm in arms:
    mine = list(_by(cells, arm).values())
    out["primitives"][arm] = {
        task: {score: dict(spread([c["primitives"][task][score]["value"] for c in mine]),
                           chance=first[score]["chance"])
               for score in SCORES}
        for task, first in mine[0]["primitives"].items()}
  return out


# ---------------------------------------------------------------------------------------------
# The page


def _f(v: Optional[float], digits: int = 4) -> str:
  return "-" if v is None else f"{v:.{digits}f}"


def _mean_sd(s: Dict[str, Any], digits: int = 4) -> str:
  if s["mean"] is None:
    return "-"
  text = _f(s["mean"], digits)
  if s["sd"] is not None:
    text += f" ± {_f(s['sd'], digits)} ({_f(s['min'], digits)} to {_f(s['max'], digits)})"
  return text


def _diff(p: Dict[str, Any]) -> str:
  if p["mean"] is None:
    return "-"
  seeds = ", ".join(f"{v:+.4f}" for v in p["values"])
  ci = "" if p["ci95"] is None else f"; 95% CI {p['ci95'][0]:+.4f} to {p['ci95'][1]:+.4f}"
  return f"{p['mean']:+.4f} (seeds {seeds}{ci}){' resolved' if p['resolved'] else ''}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(result: Dict[str, Any], run) -> str:
  s = result["summary"]
  n = len(s["seeds"])
  m = run.model
  lines = ["# Stacking study", "",
           f"One model ({m.family}, {m.num_layers} layers, d_model {m.d_model}) on one data config "
           f"({run.data.source}, {run.data.batch_size} x {run.data.seq_len} tokens per step), "
           f"{run.trainer.num_steps} steps; stacked arms grow in {run.stacking.num_stages} stages of "
           f"{run.stacking.resolved_block_size(m.num_layers)}-layer blocks. Seeds {s['seeds']} (a seed sets the "
           f"initialization and the data order). Every number is a mean over the {n} seeds ± their standard "
           f"deviation (range); cells took {s['cell_wall_seconds']:.0f} s of wall time in all.", "",
           "## Held-out loss at equal steps and at equal FLOPs", ""]
  lines += _table(["arm", "steps", "training FLOPs", "final eval loss", "train seconds"],
                  [[arm, str(a["steps"]), f"{a['total_flops']:.3e}", _mean_sd(a["final_eval_loss"]),
                    _mean_sd(a["train_seconds"], 1)] for arm, a in s["arms"].items()])
  if s["comparisons"]:
    lines += ["", "Stacked arms against the baselines, paired by seed (negative: the stacked arm's loss is lower). "
              "`resolved`: the 95% t-interval of the mean difference over seeds excludes 0.", ""]
    rows = []
    for arm, c in s["comparisons"].items():
      rows.append([arm, _diff(c["minus_baseline_equal_steps"]), _mean_sd(c["baseline_at_equal_flops"]),
                   _diff(c["minus_baseline_at_equal_flops"]), _diff(c["minus_baseline_equal_flops_run"])])
    lines += _table(["arm", "minus baseline, equal steps", "baseline's loss at the arm's FLOPs (interpolated)",
                     "minus that", "minus baseline_equal_flops (trained)"], rows)
  for arm, growths in s["growths"].items():
    lines += ["", f"## Held-out loss around each growth: {arm}", ""]
    lines += _table(["step", "depth", "just before", "just after", "next eval", "jump (after - before)"],
                    [[str(g["step"]), f"{g['from_depth']} -> {g['to_depth']}", _mean_sd(g["loss_before"]),
                      _mean_sd(g["loss_after"]), _mean_sd(g["loss_next_eval"]), _diff(g["jump"])] for g in growths])
  lines += ["", "## Reasoning primitives", "",
            f"Scores of evals/likelihood.py on {result['study']['score_examples']} held-out questions per task, "
            f"{result['study']['k_shot']}-shot, on each run's final checkpoint; per arm the mean over seeds ± sd. "
            "`chance` is what a model with no skill scores (docs/evaluation.md#scores-that-move-early).", ""]
  arms = list(s["primitives"])
  for score in SCORES:
    lines += [f"**{score}**", ""]
    tasks = list(next(iter(s["primitives"].values())))
    lines += _table(["task", "chance"] + arms,
                    [[t, _f(s["primitives"][arms[0]][t][score]["chance"], 3)]
                     + [_mean_sd(s["primitives"][a][t][score], 3) for a in arms] for t in tasks])
    lines.append("")
  for name, title in (("loss_vs_flops", "Held-out loss against training FLOPs (every seed)"),
                      ("scores_vs_loss", "Primitive scores against held-out loss (every run; equal perplexity)")):
    if name in result["figures"]:
      lines += [f"## {title}", "", f"![{name}]({result['figures'][name]})", ""]
  return "\n".join(lines).rstrip() + "\n"


def printable(result: Dict[str, Any], run) -> str:
  """The page without its figure links: what `midas study stacking` prints."""
  return "\n".join(line for line in markdown(result, run).splitlines() if not line.startswith("!["))


# ---------------------------------------------------------------------------------------------
# Figures

COLORS = {"baseline": "tab:blue", "baseline_equal_flops": "tab:cyan", "midas": "tab:red", "gradstack": "tab:green"}


def _save(fig, workdir: str, name: str) -> str:
  plt = figures.pyplot()
  fig.tight_layout()
  fs.makedirs(fs.join(workdir, FIGURES))
  fs.write_figure(fs.join(workdir, FIGURES, f"{name}.png"), fig, dpi=100)
  plt.close(fig)
  return f"{FIGURES}/{name}.png"


def plot_all(cells: Sequence[Dict[str, Any]], workdir: str) -> Dict[str, str]:
  plt = figures.pyplot()
  paths = {}
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  labelled = set()
  for c in cells:
    color = COLORS.get(c["arm"], "gray")
    ax.plot([r["flops"] for r in c["eval_curve"]], [r["loss"] for r in c["eval_curve"]], marker="o", ms=3,
            color=color, alpha=0.8, label=None if c["arm"] in labelled else c["arm"])
    labelled.add(c["arm"])
    for g in c["growths"]:
      flops = next((r["flops"] for r in c["eval_curve"] if r["step"] == g["step"]), None)
      if flops is not None:
        ax.plot([flops, flops], [g["loss_before"], g["loss_after"]], color=color, linestyle=":", linewidth=1)
  ax.set_xlabel("training FLOPs")
  ax.set_ylabel("held-out loss")
  ax.set_title("held-out loss against compute, one line per seed (dotted: the jump at each growth)", fontsize=9)
  ax.legend(fontsize=8)
  paths["loss_vs_flops"] = _save(fig, workdir, "loss_vs_flops")
  tasks = list(cells[0]["primitives"])
  fig, axes = plt.subplots(1, len(SCORES), figsize=(4.0 * len(SCORES), 3.8), squeeze=False)
  for ax, score in zip(axes[0], SCORES):
    labelled = set()
    for c in cells:
      value = float(np.mean([c["primitives"][t][score]["value"] for t in tasks]))
      ax.scatter([c["final_eval_loss"]], [value], color=COLORS.get(c["arm"], "gray"), s=25,
                 label=None if c["arm"] in labelled else c["arm"])
      labelled.add(c["arm"])
    chance = float(np.mean([cells[0]["primitives"][t][score]["chance"] for t in tasks]))
    ax.axhline(chance, color="gray", linestyle="--", linewidth=0.8, label="chance")
    ax.set_xlabel("final held-out loss")
    ax.set_title(f"{score} (mean over tasks)", fontsize=9)
  axes[0][0].legend(fontsize=7)
  paths["scores_vs_loss"] = _save(fig, workdir, "scores_vs_loss")
  return paths
