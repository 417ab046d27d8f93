"""A stacked run against its baseline: the same config trained at full depth throughout and grown.

`midas compare` (the default job) and `midas bench stacking` use this: both runs share data, seed,
steps and schedule, so their losses compare at equal steps, and the FLOP axis compares them at equal
compute: the table's last line is the baseline's eval loss at the stacked run's total FLOPs,
interpolated on the baseline's eval curve. Writes comparison.json, comparison.md and loss_vs_flops.png
under the workdir, with each run's own outputs in <workdir>/<run name>/.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import jax
import numpy as np

from midas_jax import fs
from midas_jax.configs import RunConfig, StackingConfig
from midas_jax.data.ul2.objectives import OBJECTIVES
from midas_jax.evals import figures
from midas_jax.stacking.checks import schedule_for
from midas_jax.train.checkpointer import NoCheckpointer
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import TrainResult, train
from midas_jax.train.workdir import prepare_workdir


def run_pair(config: RunConfig) -> Dict[str, RunConfig]:
  """{"baseline": full depth throughout, <operator>: the config's stacking}, both checked (the
  stacked arm's schedule fails here, before the baseline has trained)."""
  if config.stacking.num_stages == 1:
    raise ValueError("the config does not grow (StackingConfig.num_stages = 1): nothing to compare")
  pair = {"baseline": dataclasses.replace(config, stacking=StackingConfig()), config.stacking.operator: config}
  for arm in pair.values():
    schedule_for(arm)
  return pair


def summarize(name: str, result: TrainResult) -> Dict[str, object]:
  evals = read_metrics(result.workdir, "eval")
  train_rows = read_metrics(result.workdir, "train")
  last_eval = evals[-1] if evals else {}
  # Times stay unrounded: the speedup is their ratio, and the table rounds them for display only.
  row = {"run": name, "steps": result.steps, "train_seconds": result.train_seconds,
         "total_flops": train_rows[-1]["cumulative_flops"] if train_rows else None,
         "final_train_loss": result.final_loss, "final_eval_loss": last_eval.get("loss"),
         "growth_seconds": sum(g["seconds"] for g in result.growths), "workdir": result.workdir}
  for objective in OBJECTIVES:
    row[f"eval_loss/{objective}"] = last_eval.get(f"loss/{objective}")
  return row


def loss_at_flops(eval_rows: Sequence[Dict[str, object]], flops: float) -> Optional[float]:
  """The eval loss a run had spent `flops` training FLOPs into, interpolated linearly between its
  eval points; None outside them (no extrapolation)."""
  points = sorted((r["cumulative_flops"], r["loss"]) for r in eval_rows
                  if r.get("cumulative_flops") is not None and r.get("loss") is not None)
  if not points or not points[0][0] <= flops <= points[-1][0]:
    return None
  xs, ys = zip(*points)
  return float(np.interp(flops, xs, ys))


def equal_flops_line(stacked: Dict[str, object], baseline_loss: Optional[float]) -> str:
  """One line: the baseline's eval loss at the stacked run's total FLOPs, beside the stacked run's."""
  fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
  got = "outside its eval points" if baseline_loss is None else fmt(baseline_loss)
  return (f"At equal FLOPs: the baseline's eval loss at {stacked['run']}'s total {stacked['total_flops']:.3e} "
          f"FLOPs (interpolated on its eval curve) is {got}; {stacked['run']} ends at "
          f"{fmt(stacked['final_eval_loss'])}.")


def markdown_table(rows: List[Dict[str, object]]) -> str:
  cols = ["run", "steps", "train_seconds", "total_flops", "final_eval_loss"] + \
      [f"eval_loss/{o}" for o in OBJECTIVES]

  def fmt(col, v):
    if v is None:
      return "-"
    if col == "train_seconds":
      return f"{v:.1f}"
    if isinstance(v, float):
      return f"{v:.3e}" if abs(v) >= 1e5 else f"{v:.4f}"
    return str(v)

  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(c, r.get(c)) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def plot_loss_vs_flops(rows: List[Dict[str, object]], growths: List[dict], path: str) -> None:
  plt = figures.pyplot()

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for row in rows:
    train_rows = read_metrics(row["workdir"], "train")
    evals = read_metrics(row["workdir"], "eval")
    line, = ax.plot([r["cumulative_flops"] for r in train_rows], [r["loss"] for r in train_rows],
                    label=f"{row['run']} (train)", alpha=0.8)
    if evals:
      ax.plot([r["cumulative_flops"] for r in evals], [r["loss"] for r in evals], "o", color=line.get_color(),
              label=f"{row['run']} (eval)")
  stacked = next(r for r in rows if r["run"] != "baseline")
  flops_at = {r["step"]: r["cumulative_flops"] for r in read_metrics(stacked["workdir"], "train")}
  for i, g in enumerate(growths):
    x = flops_at.get(g["step"])
    if x is not None:
      ax.axvline(x, color="gray", linestyle="--", linewidth=0.8,
                 label="stage boundary" if i == 0 else None)
  ax.set_xlabel("training FLOPs")
  ax.set_ylabel("loss")
  ax.set_title("loss against training compute")
  ax.legend()
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=110)
  plt.close(fig)


def compare(config: RunConfig, workdir: str, operative_config: str = "",
            save_checkpoints: bool = True) -> Dict[str, object]:
  """save_checkpoints=False times training alone (the stacking benchmark)."""
  workdir = prepare_workdir(workdir)
  rows, growths = [], []
  for name, cfg in run_pair(config).items():
    checkpointer = None if save_checkpoints else NoCheckpointer()
    result = train(cfg, fs.join(workdir, name), operative_config=operative_config, checkpointer=checkpointer)
    rows.append(summarize(name, result))
    growths = result.growths or growths
  baseline, stacked = rows
  report = {"runs": rows, "growths": growths,
            "measured_speedup": baseline["train_seconds"] / max(stacked["train_seconds"], 1e-9),
            "flop_ratio": baseline["total_flops"] / stacked["total_flops"]}
  at_equal_flops = loss_at_flops(read_metrics(baseline["workdir"], "eval"), stacked["total_flops"])
  report["baseline_eval_loss_at_stacked_flops"] = at_equal_flops
  table = markdown_table(rows) + "\n\n" + equal_flops_line(stacked, at_equal_flops)
  if jax.process_index() == 0:  # files come from process 0 only
    fs.write_json(fs.join(workdir, "comparison.json"), report)
    fs.write_text(fs.join(workdir, "comparison.md"), table + "\n")
    plot_loss_vs_flops(rows, growths, fs.join(workdir, "loss_vs_flops.png"))
  report["table"] = table
  return report
