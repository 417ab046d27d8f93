"""The stacking study's numbers and page: seed spreads, paired differences, lengths, rates, matched loss, figures.

Everything here reads the cells stacking_study.py measured and computes nothing from a model:

  lengths       per training length, with its tokens per parameter, the one-length summary below
                of each arm's cells at the rate it is compared at
  arms          per arm, over seeds: steps, FLOPs, final held-out loss (mean, sd, range)
  comparisons   per stacked arm, paired by seed: its final loss minus the baseline's at equal
                steps, minus the baseline's loss interpolated at its total FLOPs (on the baseline's
                eval curve), and minus the equal-FLOPs baseline's final loss; each with the 95%
                t-interval of the mean difference over seeds and whether it excludes 0 ("resolved")
  growths       per stacked arm and growth: the held-out loss just before, just after, at the next
                eval, and the step-by-step records around it (grad norm, the copied block's update norm)
  primitives    per arm, task and score: the mean over seeds, its sd, and the task's chance level
  rate_grid     at the shortest length, every arm at every swept peak rate, and each arm's best
  matched       per length and arm: its primitive scores beside the baseline's at the same held-out loss

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
from midas_jax.evals.primitive_scores import SCORES
from midas_jax.studies.study_arms import parse_arm

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
  """The summary of one length's cells, one per (arm, seed); diverged cells are left out."""
  cells = [c for c in cells if not c.get("diverged")]
  arms = [a for a in study.arms if any(c["arm"] == a for c in cells)]
  out: Dict[str, Any] = {"seeds": list(study.seeds), "arms": {}, "comparisons": {}, "growths": {}, "primitives": {}}
  for arm in arms:
    mine = list(_by(cells, arm).values())
    out["arms"][arm] = {"steps": mine[0]["steps"], "total_flops": float(np.mean([c["total_flops"] for c in mine])),
                        "final_eval_loss": spread([c["final_eval_loss"] for c in mine]),
                        "train_seconds": spread([c["train_seconds"] for c in mine])}
  base, cut = _by(cells, "baseline"), _by(cells, "baseline_equal_flops")
  for arm in (a for a in arms if parse_arm(a).stacked):
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
                                      if r["loss_before"] is not None]),
                      "steps": _probe(mine.values(), g["step"])})
    out["growths"][arm] = growths
  for arm in arms:
    mine = list(_by(cells, arm).values())
    out["primitives"][arm] = {
        task: {score: dict(spread([c["primitives"][task][score]["value"] for c in mine]),
                           chance=first[score]["chance"])
               for score in SCORES}
        for task, first in mine[0]["primitives"].items()}
  return out


PROBED = ("loss", "grad_norm", "update_norm/copied", "update_norm/source", "update_norm/all")


def _probe(cells, growth_step: int) -> Dict[str, Any]:
  """The step-by-step records around one growth (train/growth_probe.py), per offset from it: the mean over
  seeds of each measure, and of the window before (offset < 0) and after it."""
  rows = [r for c in cells for r in c.get("growth_steps", []) if r["growth_step"] == growth_step]
  by_offset = {}
  for offset in sorted({r["offset"] for r in rows}):
    mine = [r for r in rows if r["offset"] == offset]
    by_offset[offset] = {k: spread([r.get(k) for r in mine])["mean"] for k in PROBED}
  sides = {side: {k: spread([r.get(k) for r in rows if (r["offset"] < 0) == (side == "before")])["mean"]
                  for k in PROBED} for side in ("before", "after")}
  return {"by_offset": by_offset, **sides}


def summarize_study(cells: Sequence[Dict[str, Any]], chosen: Sequence[Dict[str, Any]],
                    matched: Sequence[Dict[str, Any]], study, best_rates: Dict[str, float],
                    tokens_per_step: int, params: int) -> Dict[str, Any]:
  """The whole study: per length the one-length summary of `chosen` (each arm's cells at the rate it is
  compared at) with its gaps and tokens per parameter; the rate grid of `cells` at the shortest length;
  the matched-loss rows summarized per length and arm."""
  lengths = sorted({c["length"] for c in chosen})
  out: Dict[str, Any] = {"seeds": list(study.seeds), "params": params, "tokens_per_step": tokens_per_step,
                         "best_rates": dict(best_rates), "lengths": [], "rate_grid": {}, "matched": []}
  for n in lengths:
    one = summarize([c for c in chosen if c["length"] == n], study)
    one.update(length=n, tokens=n * tokens_per_step, tokens_per_param=n * tokens_per_step / params,
               rates={a: best_rates.get(a) for a in one["arms"]} if study.longer_rate == "best" or n == lengths[0]
               else None)
    out["lengths"].append(one)
  shortest = [c for c in cells if lengths and c["length"] == lengths[0]]
  for arm in study.arms:
    out["rate_grid"][arm] = {}
    for rate in sorted({c["learning_rate"] for c in shortest if c["arm"] == arm}):
      mine = [c for c in shortest if c["arm"] == arm and c["learning_rate"] == rate]
      out["rate_grid"][arm][str(rate)] = dict(spread([c["final_eval_loss"] for c in mine if not c.get("diverged")]),
                                              diverged=sum(bool(c.get("diverged")) for c in mine))
  for n in lengths:
    for arm in study.matched_arms:
      rows = [m for m in matched if m["length"] == n and m["arm"] == arm]
      read = [m for m in rows if m["scores"] is not None]
      entry = {"length": n, "arm": arm, "seeds": len(rows), "read": len(read),
               "baseline_step": spread([m["baseline_step"] for m in read]),
               "target_loss": spread([m["target_loss"] for m in rows]), "tasks": {}}
      for task in (read[0]["scores"] if read else {}):
        entry["tasks"][task] = {score: {
            "arm": spread([m["arm_scores"][task][score]["value"] for m in read]),
            "baseline_at_matched_loss": spread([m["scores"][task][score] for m in read]),
            "arm_minus_baseline": paired([m["arm_scores"][task][score]["value"] - m["scores"][task][score]
                                          for m in read])} for score in SCORES}
      out["matched"].append(entry)
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


def _length_section(s: Dict[str, Any], study: Dict[str, Any], level: str) -> List[str]:
  """One length's tables: the arms, the paired comparisons, the growths and the primitives."""
  lines = [f"{level} Held-out loss at equal steps and at equal FLOPs", ""]
  lines += _table(["arm", "steps", "peak rate", "training FLOPs", "final eval loss", "train seconds"],
                  [[arm, str(a["steps"]), _f((s.get("rates") or {}).get(arm), 5) if s.get("rates") else "config",
                    f"{a['total_flops']:.3e}", _mean_sd(a["final_eval_loss"]), _mean_sd(a["train_seconds"], 1)]
                   for arm, a in s["arms"].items()])
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
    lines += ["", f"{level} Held-out loss around each growth: {arm}", ""]
    lines += _table(["step", "depth", "just before", "just after", "next eval", "jump (after - before)"],
                    [[str(g["step"]), f"{g['from_depth']} -> {g['to_depth']}", _mean_sd(g["loss_before"]),
                      _mean_sd(g["loss_after"]), _mean_sd(g["loss_next_eval"]), _diff(g["jump"])] for g in growths])
    probed = [g for g in growths if g.get("steps") and g["steps"]["by_offset"]]
    if probed:
      lines += ["", "Step by step around each growth (mean over seeds of the window's steps before -> after it): "
                "the gradient norm, the update norm of the copied block (before: of the layers it is copied from) "
                "and after it of its source layers; the highest training loss after.", ""]
      lines += _table(["step", "grad norm", "update norm, copied block", "update norm, source", "max loss after"],
                      [[str(g["step"]), f"{_f(g['steps']['before']['grad_norm'], 3)} -> "
                        f"{_f(g['steps']['after']['grad_norm'], 3)}",
                        f"{_f(g['steps']['before']['update_norm/copied'], 4)} -> "
                        f"{_f(g['steps']['after']['update_norm/copied'], 4)}",
                        _f(g["steps"]["after"]["update_norm/source"], 4),
                        _f(max((v["loss"] for o, v in g["steps"]["by_offset"].items()
                                if int(o) >= 0 and v["loss"] is not None), default=None), 4)] for g in probed])
  lines += ["", f"{level} Reasoning primitives", "",
            f"Scores of evals/primitive_scores.py on {study['score_examples']} held-out questions per task, "
            f"{study['k_shot']}-shot, on each run's final checkpoint; per arm the mean over seeds ± sd. "
            "`chance` is what a model with no skill scores (docs/evaluation.md#scores-that-move-early).", ""]
  arms = list(s["primitives"])
  for score in SCORES if arms else ():
    lines += [f"**{score}**", ""]
    tasks = list(next(iter(s["primitives"].values())))
    lines += _table(["task", "chance"] + arms,
                    [[t, _f(s["primitives"][arms[0]][t][score]["chance"], 3)]
                     + [_mean_sd(s["primitives"][a][t][score], 3) for a in arms] for t in tasks])
    lines.append("")
  return lines


def _gap(p: Dict[str, Any]) -> str:
  if p is None or p["mean"] is None:
    return "-"
  sd = "" if p["sd"] is None else f" ± {p['sd']:.4f}"
  return f"{p['mean']:+.4f}{sd} ({', '.join(f'{v:+.3f}' for v in p['values'])})"


def markdown(result: Dict[str, Any], run) -> str:
  s = result["summary"]
  study = result["study"]
  n = len(s["seeds"])
  m = run.model
  lengths = s["lengths"]
  multi = len(lengths) > 1
  lines = ["# Stacking study", "",
           f"One model ({m.family}, {m.num_layers} layers, d_model {m.d_model}, {s['params']:,} parameters, "
           f"residual init depth '{m.residual_init_depth}') on one data config ({run.data.source}, corpus holdout "
           f"'{run.data.corpus_holdout}', {run.data.batch_size} x {run.data.seq_len} tokens per step), "
           f"{run.optimizer.decay} decay; stacked arms grow in {run.stacking.num_stages} stages of "
           f"{run.stacking.resolved_block_size(m.num_layers)}-layer blocks (Prop-{run.stacking.alpha:g}). "
           f"Lengths {[one['length'] for one in lengths]} steps. Seeds {s['seeds']} (a seed sets the "
           f"initialization and the data order). Every number is a mean over the {n} seeds ± their standard "
           f"deviation (range, or each seed's value); cells took {s['cell_wall_seconds']:.0f} s of wall time in all.",
           ""]
  stacked = [a for a in (lengths[0]["comparisons"] if lengths else {})]
  if multi or study.get("steps"):
    lines += ["## The gap against training length", "",
              "Stacked minus baseline, paired by seed (negative: the stacked arm's loss is lower): at equal steps, "
              "and against the baseline trained on its own schedule to the stacked arm's FLOPs.", ""]
    rows = []
    for one in lengths:
      for arm in stacked:
        c = one["comparisons"].get(arm)
        if c:
          rows.append([str(one["length"]), f"{one['tokens']:.3g}", f"{one['tokens_per_param']:.2f}", arm,
                       _gap(c["minus_baseline_equal_steps"]), _gap(c["minus_baseline_equal_flops_run"])])
    lines += _table(["steps", "tokens", "tokens per parameter", "arm", "minus baseline (equal steps)",
                     "minus baseline_equal_flops"], rows)
    if "gap_vs_length" in result["figures"]:
      lines += ["", f"![gap_vs_length]({result['figures']['gap_vs_length']})"]
    lines.append("")
  if study.get("learning_rates"):
    rates = sorted({float(r) for grid in s["rate_grid"].values() for r in grid})
    lines += [f"## Peak learning rate per arm, at {lengths[0]['length']} steps", "",
              "Final held-out loss at every swept rate (mean ± sd over seeds; `diverged`: seeds whose loss turned "
              "non-finite). Each arm is compared at its own best rate (bold)"
              + (", and trains at it at the longer lengths." if study.get("longer_rate") == "best" else
                 "; the longer lengths train at the config's rate."), ""]
    rows = []
    for arm, grid in s["rate_grid"].items():
      row = [arm]
      for r in rates:
        g = grid.get(str(r))
        text = "-" if g is None else (_mean_sd(g) + (f" ({g['diverged']} diverged)" if g["diverged"] else ""))
        row.append(f"**{text}**" if s["best_rates"].get(arm) == r else text)
      rows.append(row)
    lines += _table(["arm"] + [f"{r:g}" for r in rates], rows) + [""]
  if s["matched"]:
    lines += ["## Primitives at matched held-out loss", "",
              "The baseline read at each arm's final held-out loss: its primitive scores interpolated in the loss "
              "between its two eval checkpoints that bracket it (`read`: seeds where it reached that loss; "
              "`baseline step`: where).", ""]
    rows = []
    for e in s["matched"]:
      for task, by_score in e["tasks"].items():
        for score, v in by_score.items():
          rows.append([str(e["length"]), e["arm"], f"{e['read']}/{e['seeds']}", _mean_sd(e["baseline_step"], 0),
                       task, score, _mean_sd(v["arm"], 3), _mean_sd(v["baseline_at_matched_loss"], 3),
                       _gap(v["arm_minus_baseline"])])
      if not e["tasks"]:
        rows.append([str(e["length"]), e["arm"], f"{e['read']}/{e['seeds']}", "-", "-", "-", "-", "-",
                     "the baseline never reached the arm's loss"])
    lines += _table(["steps", "arm", "read", "baseline step", "task", "score", "arm", "baseline at matched loss",
                     "arm minus baseline"], rows) + [""]
  for one in lengths:
    level = "##"
    if multi:
      lines += [f"## {one['length']} steps ({one['tokens_per_param']:.2f} tokens per parameter)", ""]
      level = "###"
    lines += _length_section(one, study, level)
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


def plot_gaps(summary: Dict[str, Any], workdir: str) -> Optional[str]:
  """The stacked arms' gaps (equal steps; the equal-FLOPs run) against tokens per parameter, mean ± sd."""
  lengths = summary["lengths"]
  arms = sorted({a for one in lengths for a in one["comparisons"]})
  if not lengths or not arms:
    return None
  plt = figures.pyplot()
  fig, ax = plt.subplots(figsize=(7.0, 4.2))
  for arm in arms:
    for key, style, label in (("minus_baseline_equal_steps", "-o", "equal steps"),
                              ("minus_baseline_equal_flops_run", "--s", "equal FLOPs (trained)")):
      points = [(one["tokens_per_param"], one["comparisons"][arm][key]) for one in lengths
                if arm in one["comparisons"] and one["comparisons"][arm][key]["mean"] is not None]
      if points:
        ax.errorbar([x for x, _ in points], [p["mean"] for _, p in points], yerr=[p["sd"] or 0 for _, p in points],
                    fmt=style, color=COLORS.get(arm, None), capsize=3, ms=4, label=f"{arm} - baseline, {label}")
  ax.axhline(0, color="gray", linewidth=0.8)
  ax.set_xscale("log")
  ax.set_xlabel("training tokens per parameter")
  ax.set_ylabel("held-out loss difference")
  ax.set_title("stacked minus baseline against training length (mean ± sd over seeds)", fontsize=9)
  ax.legend(fontsize=7)
  return _save(fig, workdir, "gap_vs_length")


def plot_all(cells: Sequence[Dict[str, Any]], workdir: str, summary: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
  plt = figures.pyplot()
  paths = {}
  cells = [c for c in cells if not c.get("diverged")]
  if summary is not None and len(summary["lengths"]) > 1:
    paths["gap_vs_length"] = plot_gaps(summary, workdir)
  if not cells:
    return paths
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
  if not tasks:
    return paths
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
