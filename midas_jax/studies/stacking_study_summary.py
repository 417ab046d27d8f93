"""The stacking study's numbers: effective speedups, loss gaps, the ladder, rates, matched-loss scores.

Everything here reads the cells stacking_study.py measured and computes nothing from a model. Every
figure is per seed first, then over seeds (studies/seed_stats.py):

  speedups  per length and stacked arm, per seed: the baseline ladder's compute to reach the arm's
            test loss over the arm's compute (studies/effective_speedup.py), read on that seed's own
            ladder; over seeds the geometric mean, its t-interval on the log scale and the sign-flip p,
            when every seed's value is a number (else the bounds, seed by seed)
  gaps      the arm's test loss minus the baseline's at equal steps, and minus the ladder's loss at the
            arm's compute (equal FLOPs), paired by seed
  ladder    the baseline's complete runs: steps, FLOPs, test loss
  matched   the ladder read at the arm's test loss: reasoning (the primitives' mean forced choice) and
            memorization (closed-book forced choice) interpolated between the two rungs that bracket
            it; arm minus baseline on each, and the difference in differences (reasoning minus
            memorization), paired by seed
  rates     the grid per arm, its best rate, bracketed or not, and the re-check at the longest length
  growths   the validation loss just before and just after each growth
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from midas_jax.studies import effective_speedup as speedup_lib
from midas_jax.studies import matched_loss
from midas_jax.studies.seed_stats import paired, ratios, spread
from midas_jax.studies.study_arms import parse_arm

REASONING_SCORE = "forced_choice"  # of every primitive task, averaged
MEMORY = ("closed_book", "forced_choice")  # recall from the weights


def _test(cell: Dict[str, Any]) -> Optional[float]:
  return None if cell.get("diverged") or not cell.get("test") else cell["test"]["loss"]


def _of(cells: Sequence[Dict[str, Any]], arm: str, length: Optional[int] = None) -> Dict[int, Dict[str, Any]]:
  return {c["seed"]: c for c in cells if c["arm"] == arm and (length is None or c["length"] == length)
          and not c.get("diverged")}


def ladder_of(cells: Sequence[Dict[str, Any]], seed: int) -> List[Dict[str, Any]]:
  """One seed's baseline runs (every length and ladder rung), in compute order."""
  rungs = [c for c in cells if c["arm"] == "baseline" and c["seed"] == seed and _test(c) is not None]
  return sorted(rungs, key=lambda c: c["total_flops"])


def _rungs(ladder: Sequence[Dict[str, Any]]):
  return [(c["total_flops"], _test(c)) for c in ladder]


def reasoning(scores: Dict[str, Any]) -> float:
  return float(np.mean([s[REASONING_SCORE] for s in scores["primitives"].values()]))


def memory(scores: Dict[str, Any]) -> Optional[float]:
  """Closed-book forced choice; None where memorization was not scored (a source other than the built-in corpus)."""
  condition = scores.get("memorization", {}).get(MEMORY[0])
  return None if condition is None else float(condition[MEMORY[1]])


def seed_speedups(cells: Sequence[Dict[str, Any]], arm: str, length: int) -> List[Dict[str, Any]]:
  """Per seed of the arm at a length: its effective speedup on that seed's ladder (None without a ladder)."""
  out = []
  for seed, cell in sorted(_of(cells, arm, length).items()):
    ladder = ladder_of(cells, seed)
    if len(ladder) < 2 or _test(cell) is None:
      continue
    s = speedup_lib.effective_speedup(_rungs(ladder), _test(cell), cell["total_flops"])
    out.append(dict(s, seed=seed, text=speedup_lib.text(s), flops=cell["total_flops"], loss=_test(cell)))
  return out


def aggregate(per_seed: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """Over seeds: the geometric mean and interval when every seed's speedup is a number; else the bounds
  (a verdict only where every seed lies on one side of 1.0)."""
  numbers = [s["value"] for s in per_seed if s["bound"] is None]
  out: Dict[str, Any] = {"n": len(per_seed), "outside_ladder": len(per_seed) - len(numbers),
                         "seeds": [s["text"] for s in per_seed]}
  if per_seed and len(numbers) == len(per_seed):
    out.update(ratios(numbers))
  above = all((s["bound"] != "<" and s["value"] > 1.0) for s in per_seed)
  below = all((s["bound"] != ">" and s["value"] < 1.0) for s in per_seed)
  out["every_seed"] = "above 1" if per_seed and above else "below 1" if per_seed and below else "mixed"
  return out


def matched_row(cells, scores, arm_cell) -> Optional[Dict[str, Any]]:
  """The seed's ladder read at the arm cell's test loss: interpolated reasoning and memorization, and the
  arm's own; None where no two rungs bracket the loss or a rung is unscored."""
  ladder = ladder_of(cells, arm_cell["seed"])
  curve = [{"step": i, "loss": _test(c)} for i, c in enumerate(ladder)]
  found = matched_loss.bracket(curve, _test(arm_cell)) if _test(arm_cell) is not None else None
  key = lambda c: (c["length"], c["arm"], float(c["learning_rate"]), c["seed"])  # noqa: E731
  if found is None or key(arm_cell) not in scores:
    return None
  a, b, w = found
  if key(ladder[a]) not in scores or key(ladder[b]) not in scores:
    return None
  sa, sb, mine = scores[key(ladder[a])], scores[key(ladder[b])], scores[key(arm_cell)]
  base_r = (1 - w) * reasoning(sa) + w * reasoning(sb)
  row = {"seed": arm_cell["seed"], "rungs": [ladder[a]["length"], ladder[b]["length"]], "w": w,
         "reasoning": reasoning(mine), "baseline_reasoning": base_r, "memory": None, "baseline_memory": None,
         "did": None}
  if None not in (memory(sa), memory(sb), memory(mine)):
    base_m = (1 - w) * memory(sa) + w * memory(sb)
    row.update(memory=memory(mine), baseline_memory=base_m, did=(reasoning(mine) - base_r) - (memory(mine) - base_m))
  return row


def summarize(compared: Sequence[Dict[str, Any]], rates: Dict[str, Any], recheck: Sequence[Dict[str, Any]],
              scores: Dict[tuple, Dict[str, Any]], study, tokens_per_step: int, params: int,
              corpus_tokens: Optional[int]) -> Dict[str, Any]:
  """The whole study from its compared cells (role "arm" or "ladder"), rate grids, re-check cells and scores."""
  arms_cells = [c for c in compared if c.get("role") == "arm"]
  lengths = sorted({c["length"] for c in arms_cells})
  stacked = [a for a in study.arms if parse_arm(a).stacked]
  live = [c for c in compared if not c.get("diverged")]
  out: Dict[str, Any] = {"seeds": list(study.seeds), "params": params, "tokens_per_step": tokens_per_step,
                         "corpus_tokens": corpus_tokens, "lengths": [], "speedups": [], "gaps": [], "matched": [],
                         "growths": [], "rates": rates, "recheck": [], "ladder": []}
  # Every device that trained a run or measured its test loss: the page warns when there is more than one.
  out["devices"] = sorted({c.get("device", "unknown") for c in compared}
                          | {c["test"]["device"] for c in compared if c.get("test") and "device" in c["test"]})
  tests = [c["test"] for c in live if c.get("test")]
  out["eval_set"] = {"eval_seed": study.eval_seed, "test_batches": study.test_batches,
                     "test_tokens": spread([t["tokens"] for t in tests])["mean"],
                     "se": spread([t["se"] for t in tests])}
  for n in lengths:
    mine = [c for c in arms_cells if c["length"] == n]
    steps_tokens = n * tokens_per_step
    entry = {"length": n, "tokens_per_param": steps_tokens / params,
             "passes": None if not corpus_tokens else steps_tokens / corpus_tokens, "arms": {}}
    for arm in study.arms:
      cs = list(_of(mine, arm).values())
      if cs:
        entry["arms"][arm] = {"steps": cs[0]["steps"], "learning_rate": cs[0]["learning_rate"],
                              "flops": float(np.mean([c["total_flops"] for c in cs])),
                              "test_loss": spread([_test(c) for c in cs]),
                              "test_se": spread([c["test"]["se"] for c in cs])["mean"],
                              "validation_loss": spread([c["final_eval_loss"] for c in cs]),
                              "train_seconds": spread([c["train_seconds"] for c in cs]),
                              "diverged": sum(1 for c in mine if c["arm"] == arm and c.get("diverged"))}
    out["lengths"].append(entry)
    base = _of(mine, "baseline")
    for arm in stacked:
      per_seed = seed_speedups(live, arm, n)
      out["speedups"].append({"length": n, "arm": arm, "per_seed": per_seed, **aggregate(per_seed)})
      arm_seeds = _of(mine, arm)
      at_flops = {}
      for seed, c in arm_seeds.items():
        ladder = ladder_of(live, seed)
        at_flops[seed] = (speedup_lib.loss_at_compute(_rungs(ladder), c["total_flops"])
                          if len(ladder) >= 2 else None)
      cut = _of(mine, "baseline_equal_flops")
      out["gaps"].append({
          "length": n, "arm": arm,
          "equal_steps": paired([_test(c) - _test(base[s]) for s, c in arm_seeds.items() if s in base]),
          "equal_flops": paired([None if at_flops.get(s) is None else _test(c) - at_flops[s]
                                 for s, c in arm_seeds.items()]),
          "equal_flops_run": paired([_test(c) - _test(cut[s]) for s, c in arm_seeds.items() if s in cut])})
      out["growths"] += _growths(n, arm, list(arm_seeds.values()))
      if arm in study.matched_arms and scores:
        rows = [r for r in (matched_row(live, scores, c) for c in arm_seeds.values()) if r is not None]
        out["matched"].append({"length": n, "arm": arm, "seeds": len(arm_seeds), "read": len(rows), "rows": rows,
                               **{k: paired([None if r[k] is None else r[k] - r["baseline_" + k] for r in rows])
                                  for k in ("reasoning", "memory")},
                               "did": paired([r["did"] for r in rows])})
  rung_lengths = sorted({c["length"] for c in live if c["arm"] == "baseline"})
  for n in rung_lengths:
    cs = [c for c in live if c["arm"] == "baseline" and c["length"] == n]
    out["ladder"].append({"length": n, "flops": float(np.mean([c["total_flops"] for c in cs])),
                          "tokens_per_param": n * tokens_per_step / params, "learning_rate": cs[0]["learning_rate"],
                          "test_loss": spread([_test(c) for c in cs]),
                          "test_se": spread([c["test"]["se"] for c in cs])})
  for c in recheck:
    out["recheck"].append({"arm": c["arm"], "length": c["length"], "seed": c["seed"],
                           "learning_rate": c["learning_rate"], "validation_loss": c.get("final_eval_loss"),
                           "diverged": bool(c.get("diverged"))})
  return out


def _growths(length: int, arm: str, cells: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  if not cells:
    return []
  rows = []
  for i, g in enumerate(cells[0]["growths"]):
    mine = [c["growths"][i] for c in cells]
    rows.append({"length": length, "arm": arm, "step": g["step"], "from_depth": g["from_depth"],
                 "to_depth": g["to_depth"], "loss_before": spread([r["loss_before"] for r in mine]),
                 "loss_after": spread([r["loss_after"] for r in mine]),
                 "jump": paired([r["loss_after"] - r["loss_before"] for r in mine if r["loss_before"] is not None])})
  return rows
