"""`midas report`: one Markdown page (with PNGs) about a run, or about the runs of a `midas compare` folder.

It reads what training and evaluation left in the workdir and computes nothing new:
  metrics.jsonl  -> loss curves per objective (train lines, eval points) with stage boundaries, throughput
  stages.json    -> the growth steps drawn as stage boundaries, and the final stage and depth
  eval/*.json    -> tables: k-shot and fine-tuned primitive accuracy, looping, closed vs open book
  eval/*.png     -> embedded as they are (similarity heatmaps and the suites' own figures)
  time/* records -> where the run's wall time went (goodput): a table and a stacked bar
It writes DIR/report.md and its figures under DIR/report/. A compare folder (baseline/ and the
stacked run side by side) gets one page with a column per run.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from midas_jax import fs
from midas_jax.errors import ConfigError
from midas_jax.evals import figures
from midas_jax.train import goodput
from midas_jax.train.metrics import has_metrics, read_metrics

OBJECTIVE_KEYS = ("loss", "loss/causal", "loss/prefix", "loss/span")


# ---------------------------------------------------------------------------------------------
# Reading a run

def _is_run(path: str) -> bool:
  return has_metrics(path) or any(fs.exists(fs.join(path, f)) for f in ("stages.json", "eval"))


def find_runs(workdir: str) -> List[Tuple[str, str]]:
  """(name, directory) of the run in `workdir`, or of each run of a compare folder (baseline first)."""
  if _is_run(workdir):
    return [(fs.basename(workdir) or "run", workdir)]
  names = []
  comparison = fs.join(workdir, "comparison.json")
  if fs.isfile(comparison):
    names = [row["run"] for row in fs.read_json(comparison).get("runs", [])]
  names += sorted(n for n in fs.listdir(workdir) if n not in names) if fs.isdir(workdir) else []
  runs = [(n, fs.join(workdir, n)) for n in names if fs.isdir(fs.join(workdir, n))]
  return [(n, d) for n, d in runs if _is_run(d)]


def _last_per_step(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """A resumed run can log a step twice: keep the last record of each step."""
  by_step = {r["step"]: r for r in rows}
  return [by_step[s] for s in sorted(by_step)]


def _read_json(path: str) -> Optional[Dict[str, Any]]:
  if not fs.isfile(path):
    return None
  return fs.read_json(path)


def load_run(name: str, directory: str) -> Dict[str, Any]:
  stages = _read_json(fs.join(directory, "stages.json")) or {}
  evals = {}
  for path in fs.glob(fs.join(directory, "eval", "*.json")):
    record = _read_json(path)
    if isinstance(record, dict) and "results" in record:
      evals[fs.basename(path)[:-len(".json")]] = record
  growth_steps = [g["step"] for g in stages.get("growths", [])]
  if not growth_steps:
    growth_steps = [r["step"] for r in read_metrics(directory, "stage")]
  return {"name": name, "dir": directory, "train": _last_per_step(read_metrics(directory, "train")),
          "eval_loss": _last_per_step(read_metrics(directory, "eval")), "stages": stages,
          "growth_steps": growth_steps, "evals": evals,
          "time": read_metrics(directory, "train"),
          "pngs": fs.glob(fs.join(directory, "eval", "*.png"))}


# ---------------------------------------------------------------------------------------------
# Figures of the training curves

def plot_losses(runs: List[Dict[str, Any]], path: str) -> Optional[str]:
  keys = [k for k in OBJECTIVE_KEYS if any(k in r for run in runs for r in run["train"])]
  if not keys:
    return None
  plt = figures.pyplot()
  fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
  for ax, key in zip(axes[0], keys):
    for run in runs:
      train = [r for r in run["train"] if key in r]
      line, = ax.plot([r["step"] for r in train], [r[key] for r in train], label=f"{run['name']} train")
      evals = [r for r in run["eval_loss"] if key in r]
      if evals:
        ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o", color=line.get_color(),
                label=f"{run['name']} eval")
      for i, step in enumerate(run["growth_steps"]):
        ax.axvline(step, color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.7,
                   label=f"{run['name']} stage boundary" if i == 0 else None)
    ax.set_title(key)
    ax.set_xlabel("step")
  axes[0][0].set_ylabel("loss")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)
  return path


def plot_throughput(runs: List[Dict[str, Any]], path: str) -> Optional[str]:
  if not any("tokens_per_second" in r for run in runs for r in run["train"]):
    return None
  plt = figures.pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 3.6))
  for run in runs:
    rows = [r for r in run["train"] if "tokens_per_second" in r]
    line, = ax.plot([r["step"] for r in rows], [r["tokens_per_second"] for r in rows], marker=".",
                    label=run["name"])
    for step in run["growth_steps"]:
      ax.axvline(step, color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.7)
  ax.set_xlabel("step")
  ax.set_ylabel("training tokens / s")
  ax.set_title("throughput (dashed: stage boundaries)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)
  return path


# ---------------------------------------------------------------------------------------------
# Tables

def _fmt(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.3f}" if abs(value) < 1e4 else f"{value:.3g}"
  return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]


def _median(values: List[float]) -> Optional[float]:
  values = sorted(values)
  return values[len(values) // 2] if values else None


def runs_table(runs: List[Dict[str, Any]]) -> List[str]:
  rows = []
  for run in runs:
    last = run["train"][-1] if run["train"] else {}
    last_eval = run["eval_loss"][-1] if run["eval_loss"] else {}
    rows.append([run["name"], last.get("step"), run["stages"].get("stage", last.get("stage")),
                 run["stages"].get("depth", last.get("depth")), last.get("loss"), last_eval.get("loss"),
                 _median([r["tokens_per_second"] for r in run["train"] if "tokens_per_second" in r]),
                 last.get("cumulative_flops"), ", ".join(str(s) for s in run["growth_steps"]) or "-"])
  return _table(["run", "step", "stage", "depth", "train loss", "eval loss", "tokens/s (median)",
                 "training FLOPs", "stage boundaries"], rows)


def _task_rows(runs, suite: str, value) -> List[List[Any]]:
  tasks: List[str] = []
  for run in runs:
    for name in run["evals"].get(suite, {}).get("results", {}).get("tasks", {}):
      if name not in tasks:
        tasks.append(name)
  rows = []
  for name in tasks:
    first = next(r["evals"][suite]["results"]["tasks"][name] for r in runs
                 if name in r["evals"].get(suite, {}).get("results", {}).get("tasks", {}))
    cells = []
    for run in runs:
      task = run["evals"].get(suite, {}).get("results", {}).get("tasks", {}).get(name)
      cells.append(value(task) if task else None)
    rows.append([name, first["primitive"], first["depth"], first.get("majority_share")] + cells)
  return rows


def _suite_note(runs, suite: str) -> str:
  parts = []
  for run in runs:
    record = run["evals"].get(suite)
    if record:
      parts.append(f"{run['name']}: step {record['step']}, depth {record['depth']}")
  return "; ".join(parts)


def _with_interval(task: Dict[str, Any]) -> str:
  """An accuracy and its 95% interval, when the suite recorded one."""
  ci = task.get("accuracy_ci95")
  return _fmt(task["accuracy"]) + ("" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]")


SCORE_TITLES = (("log_likelihood", "mean log-likelihood of the answer tokens (nats per token)"),
                ("forced_choice", "forced choice among candidates"),
                ("token_accuracy", "teacher-forced per-token accuracy"),
                ("exact_match", "exact match of greedy decoding, strict (teacher-forced check)"))


def _primitive_scores_section(runs, names: List[str]) -> List[str]:
  """One table per score of the `primitive_scores` suite: value [95% interval] per run, and chance."""
  record = next(r["evals"]["primitive_scores"] for r in runs if "primitive_scores" in r["evals"])
  res = record["results"]
  lines = ["", f"## Reasoning primitives: scores that move early, {res['k_shot']}-shot", "",
           f"{res['score_examples']} held-out questions per task ({_suite_note(runs, 'primitive_scores')}); each "
           "cell is the score and its 95% interval; `chance` is what a model with no skill scores.", ""]
  for key, title in SCORE_TITLES:
    lines += [f"**{title}**", ""]
    rows = []
    for task, first in res["tasks"].items():
      cells = []
      for run in runs:
        t = run["evals"].get("primitive_scores", {}).get("results", {}).get("tasks", {}).get(task)
        score = t["scores"][key] if t else None
        cells.append(None if score is None else
                     f"{score['value']:.3f} [{score['ci95'][0]:.3f}, {score['ci95'][1]:.3f}]")
      rows.append([task, first["scores"][key]["chance"]] + cells)
    lines += _table(["task", "chance"] + names, rows) + [""]
  return lines


# ---------------------------------------------------------------------------------------------
# Goodput: where the wall time went

def goodput_rows(runs: List[Dict[str, Any]]) -> List[Tuple[str, Dict[str, float]]]:
  """(run name, seconds per activity) for the runs whose records carry time/* breakdowns."""
  rows = []
  for run in runs:
    totals = goodput.summarize(run["time"])
    if sum(totals.values()) > 0:
      rows.append((run["name"], totals))
  return rows


def plot_goodput(rows: List[Tuple[str, Dict[str, float]]], path: str) -> str:
  """One horizontal bar per run, stacked by activity, as shares of its wall time."""
  plt = figures.pyplot()
  activities = list(rows[0][1])
  fig, ax = plt.subplots(figsize=(7.5, 0.7 * len(rows) + 1.6))
  colors = plt.get_cmap("tab10").colors
  for i, (name, totals) in enumerate(rows):
    wall = sum(totals.values()) or 1.0
    left = 0.0
    for j, activity in enumerate(activities):
      share = totals[activity] / wall
      ax.barh(i, share, left=left, color=colors[j % len(colors)], label=activity if i == 0 else None)
      if share >= 0.06:
        ax.text(left + share / 2, i, f"{share:.0%}", ha="center", va="center", fontsize=7, color="white")
      left += share
  ax.set_yticks(range(len(rows)), [name for name, _ in rows])
  ax.set_xlim(0, 1)
  ax.set_xlabel("share of wall time")
  ax.set_title("where the time went (goodput: the 'step' share)", fontsize=9)
  ax.legend(fontsize=7, ncol=len(activities), loc="upper center", bbox_to_anchor=(0.5, -0.35))
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)
  return path


def goodput_section(runs: List[Dict[str, Any]], path: str, rel) -> List[str]:
  rows = goodput_rows(runs)
  if not rows:
    return []
  activities = list(rows[0][1])
  table = []
  for name, totals in rows:
    wall = sum(totals.values())
    table.append([name, wall] + [f"{totals[a]:.1f} s ({totals[a] / wall:.0%})" for a in activities])
  return (["", "## Where the time went", "",
           "Seconds of wall time per activity, summed over the log lines (a resumed run counts the "
           "attempts its records kept); `step` is productive training, its share the run's goodput.", ""]
          + _table(["run", "wall seconds"] + activities, table)
          + ["", f"![where the time went]({rel(plot_goodput(rows, path))})"])


def eval_sections(runs: List[Dict[str, Any]], rel=lambda p: p) -> List[str]:
  names = [run["name"] for run in runs]
  lines: List[str] = []
  has = lambda suite: any(suite in run["evals"] for run in runs)  # noqa: E731
  if has("primitives"):
    k = next(r["evals"]["primitives"]["results"]["k_shot"] for r in runs if "primitives" in r["evals"])
    lines += ["", f"## Reasoning primitives, {k}-shot", "",
              f"Exact match of greedy decoding ({_suite_note(runs, 'primitives')}); `majority` is what always "
              "giving the most common answer would score.", ""]
    lines += _table(["task", "primitive", "depth", "majority"] + names,
                    _task_rows(runs, "primitives", _with_interval))
  if has("primitive_scores"):
    lines += _primitive_scores_section(runs, names)
  if has("primitives_finetune"):
    lines += ["", "## Reasoning primitives after fine-tuning", "",
              f"Held-out accuracy after a short fine-tune per task ({_suite_note(runs, 'primitives_finetune')}).", ""]
    lines += _table(["task", "primitive", "depth", "majority"] + names,
                    _task_rows(runs, "primitives_finetune", lambda t: t["accuracy"]))
  if has("looping"):
    lines += ["", "## Looping the middle block at inference", ""]
    header, rows = None, []
    for run in runs:
      record = run["evals"].get("looping")
      if not record:
        continue
      res = record["results"]
      header = ["run", "task"] + [f"r={r}" for r in res["repeats"]]
      for task, t in res["tasks"].items():
        rows.append([run["name"], task] + [t["accuracy"][str(r)] for r in res["repeats"]])
      lines.append(f"- {run['name']}: block of {res['block_size']} layers from layer {res['loop_start']}")
    lines += [""] + _table(header, rows)
  if has("memorization"):
    lines += ["", "## Memorization against reasoning: world facts, closed vs open book", ""]
    rows = []
    for condition in ("closed_book", "open_book", "open_book_counterfactual"):
      rows.append([condition] + [run["evals"].get("memorization", {}).get("results", {}).get(condition, {})
                                 .get("accuracy") for run in runs])
    rows.append(["counterfactual answered from memory"] + [
        run["evals"].get("memorization", {}).get("results", {}).get("open_book_counterfactual", {}).get("recalled")
        for run in runs])
    rows.append(["chance"] + [run["evals"].get("memorization", {}).get("results", {}).get("chance") for run in runs])
    lines += _table(["condition"] + names, rows)
  others = sorted({s for run in runs for s in run["evals"]} - {"primitives", "primitive_scores",
                                                                "primitives_finetune", "looping", "memorization"})
  if others:
    lines += ["", "## Other evaluations", ""]
    for run in runs:
      for suite in others:
        if suite in run["evals"]:
          path = rel(fs.join(run["dir"], "eval", f"{suite}.json"))
          lines.append(f"- {run['name']}: `{suite}` at step {run['evals'][suite]['step']}: see `{path}`")
  return lines


def write_report(workdir: str, out: Optional[str] = None) -> str:
  """Writes the report page and its figures; returns the page's path (a local path or a URL)."""
  workdir = fs.absolute(workdir, "--workdir")
  if not fs.isdir(workdir):
    raise ConfigError("--workdir", f"{workdir} is not a directory", "pass the --workdir of a run or of `midas compare`")
  found = find_runs(workdir)
  if not found:
    raise ConfigError("--workdir", f"no run in {workdir} (no metrics.jsonl, stages.json or eval/)",
                      "pass the --workdir of a `midas train`, `midas compare` or `midas eval` run")
  runs = [load_run(name, d) for name, d in found]
  out = fs.absolute(out, "--out") if out else fs.join(workdir, "report.md")
  base = fs.dirname(out)
  fig_dir = fs.join(base, "report")
  fs.makedirs(fig_dir)
  rel = lambda p: fs.relative(p, base)  # noqa: E731
  lines = [f"# Run report: {fs.basename(workdir)}", "", f"Runs: {', '.join(r['name'] for r in runs)}.", ""]
  lines += runs_table(runs)
  losses = plot_losses(runs, fs.join(fig_dir, "loss_curves.png"))
  if losses:
    lines += ["", "## Loss per objective", "",
              "Train loss (lines) and held-out loss (points); dashed lines are stage boundaries.", "",
              f"![loss curves]({rel(losses)})"]
  compared = fs.join(workdir, "loss_vs_flops.png")  # written by `midas compare`
  if len(runs) > 1 and fs.isfile(compared):
    lines += ["", "## Loss against training FLOPs", "", f"![loss against FLOPs]({rel(compared)})"]
  throughput = plot_throughput(runs, fs.join(fig_dir, "throughput.png"))
  if throughput:
    lines += ["", "## Throughput", "", f"![throughput]({rel(throughput)})"]
  lines += goodput_section(runs, fs.join(fig_dir, "goodput.png"), rel)
  lines += eval_sections(runs, rel)
  pngs = [(run["name"], p) for run in runs for p in run["pngs"]]
  if pngs:
    lines += ["", "## Evaluation figures", ""]
    for name, path in pngs:
      file = fs.basename(path)
      lines += [f"**{name}: {file[:-len('.png')]}**", "", f"![{name} {file}]({rel(path)})", ""]
  fs.write_text(out, "\n".join(lines).rstrip() + "\n")
  return out
