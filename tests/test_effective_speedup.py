"""The study's verdict on cases whose answer is known by hand: the effective speedup on a synthetic
ladder, its bounds outside the ladder, the rate grid's extension, and the small-n tests."""

import math

import pytest

from midas_jax.studies import effective_speedup, rate_choice, seed_stats
from midas_jax.studies.stacking_config import StackingStudyConfig
from midas_jax.studies.stacking_study_summary import aggregate, seed_speedups


def loss_of(flops):
  """The baseline's loss, a known function of compute: linear in log-compute (what the ladder interpolates)."""
  return 5.0 - 0.25 * math.log(flops)


LADDER = [(1e12, loss_of(1e12)), (4e12, loss_of(4e12)), (1.6e13, loss_of(1.6e13)), (6.4e13, loss_of(6.4e13))]


def test_an_arm_on_the_baselines_curve_at_0_8x_its_compute_is_a_1_25x_speedup():
  arm_flops = 8e12
  arm_loss = loss_of(arm_flops / 0.8)  # the baseline reaches the arm's loss with 1 / 0.8 of its compute
  s = effective_speedup.effective_speedup(LADDER, arm_loss, arm_flops)
  assert s["bound"] is None
  assert s["value"] == pytest.approx(1.25, rel=1e-12)
  assert effective_speedup.text(s) == "1.25x"
  # The rung order given does not matter, and a slower arm reads below 1.
  assert effective_speedup.effective_speedup(LADDER[::-1], loss_of(4e12), 8e12)["value"] == pytest.approx(0.5)


def test_outside_the_ladder_the_speedup_is_a_bound_never_an_extrapolation():
  below = effective_speedup.effective_speedup(LADDER, loss_of(1e14), 2e13)  # lower than the top rung's loss
  assert below["bound"] == ">" and below["value"] == pytest.approx(6.4e13 / 2e13)
  assert effective_speedup.text(below) == "> 3.20x"
  above = effective_speedup.effective_speedup(LADDER, loss_of(5e11), 2e12)  # higher than the bottom rung's
  assert above["bound"] == "<" and above["value"] == pytest.approx(0.5)
  assert effective_speedup.loss_at_compute(LADDER, 2e12) == pytest.approx(loss_of(2e12))
  assert effective_speedup.loss_at_compute(LADDER, 1e14) is None
  with pytest.raises(ValueError, match="two or more rungs"):
    effective_speedup.effective_speedup(LADDER[:1], 3.0, 1e12)


def _cell(arm, seed, flops, loss, length):
  return {"arm": arm, "seed": seed, "length": length, "learning_rate": 1e-3, "total_flops": flops,
          "test": {"loss": loss, "se": 0.01, "tokens": 1000}, "diverged": False}


def test_speedups_are_read_on_each_seeds_own_ladder_and_summarized_over_seeds():
  cells = []
  for seed, shift in ((0, 0.0), (1, 0.05), (2, -0.05)):  # each seed's ladder sits at its own level
    cells += [_cell("baseline", seed, c, loss_of(c) + shift, n) for n, (c, _) in zip((1, 2, 4, 8), LADDER)]
    cells.append(_cell("midas", seed, 8e12, loss_of(8e12 / 0.8) + shift, 3))  # 1.25x on its own ladder
  per_seed = seed_speedups(cells, "midas", 3)
  assert [s["value"] for s in per_seed] == [pytest.approx(1.25)] * 3
  summary = aggregate(per_seed)
  assert summary["geomean"] == pytest.approx(1.25) and summary["every_seed"] == "above 1"
  assert summary["p_sign_flip"] == pytest.approx(0.25)  # 3 seeds: 2 of the 8 sign patterns are as extreme
  cells.append(_cell("midas", 3, 2e13, loss_of(1e15), 3))  # a fourth seed below its (missing) ladder
  cells += [_cell("baseline", 3, c, l, n) for n, (c, l) in zip((1, 2, 4, 8), LADDER)]
  summary = aggregate(seed_speedups(cells, "midas", 3))
  assert summary["outside_ladder"] == 1 and "geomean" not in summary and summary["seeds"][-1] == "> 3.20x"


def test_an_edge_best_grid_is_extended_past_its_edge_until_bracketed():
  grid = {1e-3: [3.0, 3.1], 3e-3: [2.8, 2.9], 1e-2: [2.6, 2.7]}  # best on the top edge
  assert rate_choice.best_rate(grid) == 1e-2 and not rate_choice.bracketed(grid)
  assert rate_choice.extension(grid) == pytest.approx(3.33e-2)  # one step of 10/3 past 1e-2, three figures
  grid[3.33e-2] = [2.7, None]  # a seed diverged there: ranks after every rate where none did
  assert rate_choice.best_rate(grid) == 1e-2 and rate_choice.bracketed(grid)
  assert rate_choice.extension(grid) is None
  low = {1e-3: [2.5], 3e-3: [2.6]}
  assert rate_choice.extension(low) == pytest.approx(3.33e-4)
  assert rate_choice.neighbours([1e-3, 3e-3, 1e-2], 3e-3) == [1e-3, 1e-2]


def test_the_sign_flip_test_and_t_interval_by_hand():
  assert seed_stats.sign_flip_p([0.1, 0.2, 0.3]) == pytest.approx(0.25)
  assert seed_stats.sign_flip_p([0.1, -0.2, 0.3]) == pytest.approx(0.75)  # |mean| 0.0667: 6 of 8 as large
  p = seed_stats.paired([1.0, 2.0, 3.0])
  assert p["ci95"] == pytest.approx([2.0 - 4.302653 / math.sqrt(3), 2.0 + 4.302653 / math.sqrt(3)], rel=1e-5)
  r = seed_stats.ratios([1.1, 1.2, 1.3])
  assert r["geomean"] == pytest.approx((1.1 * 1.2 * 1.3) ** (1 / 3))


def test_shipped_study_configs_default_to_three_seeds_and_one_eval_seed():
  study = StackingStudyConfig()
  assert len(study.seeds) >= 3 and isinstance(study.eval_seed, int)
