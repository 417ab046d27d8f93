"""The anchor study's controls: fresh_block draws its new layer at the gamma init (not a copy); the looped arm ties
its weights (one block's parameters, the final depth's FLOPs); the (gamma, learning rate) grid of the shipped
config; the contrasts and the "survives" rule on cells with a known answer; a tiny grid over two rates via the CLI."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from midas_jax import cli, flops
from midas_jax.commands.study_commands import study_config_from_gin
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder
from midas_jax.studies import anchor_cells, anchor_study
from midas_jax.studies.anchor_config import ANCHOR_MODEL, ANCHOR_OPTIMIZER, AnchorStudyConfig
from midas_jax.train_state import TrainState

# Each weight matrix's fan-in at d_model 64, one head of 64, d_ff 256 (ModelConfig's "gamma" init: std = fan_in^-gamma).
FAN_IN = {"query": 64, "key": 64, "value": 64, "out": 64, "fc": 64, "proj": 256}


def _leaves(tree):
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_shipped_controls_config_has_every_arm_three_seeds_and_a_two_by_two_grid(repo_root):
  cfg, _ = study_config_from_gin([os.path.join(repo_root, "gin", "experiments", "anchor_controls_cpu.gin")], [])
  assert cfg.arms == ("fixed", "midas", "gradstack", "fresh_block", "looped")
  assert cfg.seeds == (0, 1, 2) and cfg.depths == (4,) and cfg.loop_block == 1
  assert len(set(cfg.gammas)) >= 2 and len(set(cfg.rates)) >= 2
  assert cfg.grid_cells == tuple((g, r) for g in cfg.gammas for r in cfg.rates)
  assert cfg.num_cells == 5 * len(cfg.gammas) * len(cfg.rates) * 3
  # The cell's optimizer is the study's at the cell's peak rate, nothing else changed.
  for rate in cfg.rates:
    opt = cfg.cell_optimizer(rate)
    assert opt.learning_rate == rate and dataclasses.replace(opt, learning_rate=cfg.optimizer.learning_rate) == \
        cfg.optimizer
  assert AnchorStudyConfig().rates == (ANCHOR_OPTIMIZER.learning_rate,)  # no grid: the optimizer's one rate


def test_controls_settings_are_checked():
  with pytest.raises(ConfigError, match="AnchorStudyConfig.learning_rates"):
    AnchorStudyConfig(learning_rates=(1e-3, 1e-3))
  with pytest.raises(ConfigError, match="AnchorStudyConfig.learning_rates"):
    AnchorStudyConfig(learning_rates=(0.0,))
  with pytest.raises(ConfigError, match="AnchorStudyConfig.loop_block"):
    AnchorStudyConfig(arms=("looped",), depths=(3,), loop_block=2)  # 3 layers are not whole loops of 2
  with pytest.raises(ConfigError, match="AnchorStudyConfig.loop_block"):
    AnchorStudyConfig(arms=("looped",), depths=(2,), loop_block=2)  # one application is no loop
  with pytest.raises(ConfigError, match="AnchorStudyConfig.depths"):
    AnchorStudyConfig(arms=("fresh_block",), depths=(1,))
  with pytest.raises(ConfigError, match="AnchorStudyConfig.loop_block"):
    AnchorStudyConfig(arms=("looped",), depths=(1,))


def test_stage_plans_of_the_control_arms():
  cfg = AnchorStudyConfig(steps=1000, stage_alpha=1.0)
  assert anchor_cells.stage_plan(cfg, "fresh_block", 4) == [(1, 100), (2, 200), (3, 300), (4, 400)]
  assert anchor_cells.stage_plan(cfg, "looped", 4) == [(4, 1000)]  # one stage of 4 layer applications


def test_fresh_block_draws_its_new_layer_at_the_gamma_init_and_gradstack_copies():
  cfg = AnchorStudyConfig(arms=("gradstack", "fresh_block"), depths=(3,))  # the paper's d64 model
  gamma = 0.5
  model = Decoder(anchor_cells.arm_model(cfg, "fresh_block", gamma, 2))
  params = anchor_cells.init_params(model, jax.random.key(0))
  tx, _ = anchor_cells.cell_optimizer(cfg, cfg.optimizer.learning_rate)
  # Moments that are not zero (as after training), so a kept moment and a zeroed one differ.
  opt_state = jax.tree.map(lambda x: x + 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, tx.init(params))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  key = jax.random.key(7)
  fresh_model, fresh_state = anchor_cells.next_stage(cfg, "fresh_block", gamma, 3, model, tx, state, key)
  fresh, fresh_opt = fresh_state.params, fresh_state.opt_state
  copy_model, copied = anchor_cells.next_stage(cfg, "gradstack", gamma, 3, model, tx, state, key)
  copied = copied.params
  assert fresh_model.cfg.num_layers == copy_model.cfg.num_layers == 3
  draw = _leaves(anchor_cells.init_params(Decoder(anchor_cells.arm_model(cfg, "fresh_block", gamma, 3)), key))
  old, new, copy = _leaves(params), _leaves(fresh), _leaves(copied)
  checked = 0
  for name, x in old.items():
    if not name.startswith("['layers']"):
      np.testing.assert_array_equal(new[name], x)  # embeddings and the final norm are untouched
      continue
    np.testing.assert_array_equal(new[name][:2], x)  # the old layers stay, in place
    np.testing.assert_array_equal(copy[name][2], x[1])  # GradStack's new top layer is a copy of the old top
    np.testing.assert_array_equal(new[name][2], draw[name][2])  # fresh_block's is the deeper model's own draw
    matrix = name.split("['")[-1].rstrip("']")
    if matrix in FAN_IN:
      std = float(new[name][2].std())
      assert std == pytest.approx(FAN_IN[matrix] ** -gamma, rel=0.06), name  # the gamma init's std
      assert all(not np.allclose(new[name][2], x[i]) for i in range(2)), name  # not a copy of any old layer
      checked += 1
    elif "scale" in matrix:
      np.testing.assert_array_equal(new[name][2], 1.0)
    else:
      np.testing.assert_array_equal(new[name][2], 0.0)  # biases start at zero
  assert checked == len(FAN_IN)
  # The fresh layer's Adam moments start at zero; the old layers keep theirs.
  for name, x in _leaves(fresh_opt).items():
    if x.ndim and x.shape[0] == 3 and ("mu" in name or "nu" in name):
      np.testing.assert_array_equal(x[2], 0.0)
      np.testing.assert_array_equal(x[:2], 0.5)


def _batch(n, seed=0):
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 100, (n, 8)), jnp.int32)
  return anchor_cells.decoder_batch(tokens)


@pytest.mark.parametrize("depth,loop_block", [(3, 1), (4, 2)])
def test_looped_arm_ties_its_weights_and_costs_the_final_depth(depth, loop_block):
  cfg = AnchorStudyConfig(model=dataclasses.replace(ANCHOR_MODEL, d_model=16, d_ff=32), arms=("looped", "midas"),
                          depths=(depth,), loop_block=loop_block)
  looped_cfg = anchor_cells.arm_model(cfg, "looped", 0.5, depth)
  grown_final = anchor_cells.arm_model(cfg, "midas", 0.5, depth)
  assert (looped_cfg.num_layers, looped_cfg.loop_start, looped_cfg.loop_size, looped_cfg.loop_repeats) == (
      loop_block, 0, loop_block, depth // loop_block)
  looped = Decoder(looped_cfg)
  params = anchor_cells.init_params(looped, jax.random.key(1))
  counts = flops.param_counts(grown_final)
  layer_params = sum(x.size for x in jax.tree.leaves(params["layers"]))
  assert layer_params == loop_block * counts["per_layer"]  # the loop block's parameters, no more
  assert sum(x.size for x in jax.tree.leaves(params)) == counts["total"] - (depth - loop_block) * counts["per_layer"]
  assert anchor_cells.train_flops_per_step(cfg, looped_cfg) == anchor_cells.train_flops_per_step(cfg, grown_final)
  assert anchor_cells.train_flops_per_step(cfg, looped_cfg) > anchor_cells.train_flops_per_step(
      cfg, anchor_cells.arm_model(cfg, "midas", 0.5, loop_block))
  # Tied: the looped model computes what an untied depth-layer model whose layers repeat the block computes,
  # and its block's gradient is the sum of that model's per-layer gradients.
  untied = Decoder(grown_final)
  order = np.tile(np.arange(loop_block), depth // loop_block)
  unrolled = dict(params, layers=jax.tree.map(lambda x: x[order], params["layers"]))
  batch = _batch(4)
  np.testing.assert_allclose(looped.apply({"params": params}, batch), untied.apply({"params": unrolled}, batch),
                             rtol=1e-5, atol=1e-5)
  loss = lambda m: lambda p: jnp.mean(m.apply({"params": p}, batch)[:, -1] ** 2)  # noqa: E731
  g_looped = jax.grad(loss(looped))(params)["layers"]
  g_untied = jax.grad(loss(untied))(unrolled)["layers"]
  summed = jax.tree.map(lambda g: g.reshape((depth // loop_block, loop_block) + g.shape[1:]).sum(0), g_untied)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_looped, summed)


# Synthetic grids with a known answer: 2 gammas x 2 rates, 3 seeds, one value per seed per arm.
GAMMAS, RATES = (0.9, 0.7), (3e-3, 2e-3)
CELLS = [(g, r) for g in GAMMAS for r in RATES]
INFERENTIAL = {  # arm -> per (gamma, lr) cell, the three seeds' inferential fractions
    "fixed": [[0.1, 0.2, 0.15], [0.1, 0.2, 0.15], [0.3, 0.5, 0.4], [0.1, 0.2, 0.15]],
    "midas": [[0.9, 0.8, 0.85], [0.9, 0.8, 0.85], [0.45, 0.6, 0.7], [0.9, 0.8, 0.85]],  # cell 3 overlaps fixed
    "gradstack": [[0.9, 0.85, 0.95], [0.7, 0.75, 0.8], [0.9, 0.95, 0.92], [0.6, 0.65, 0.7]],
    "fresh_block": [[0.1, 0.2, 0.15], [0.3, 0.2, 0.25], [0.0, 0.05, 0.1], [0.4, 0.45, 0.5]],
    "looped": [[0.5, 0.55, 0.6], [0.95, 0.99, 0.97], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1]],  # midas above, below, above
}


def _synthetic_cells(seeds=(0, 1, 2), drop=None):
  out = []
  for arm, per_cell in INFERENTIAL.items():
    for (gamma, lr), values in zip(CELLS, per_cell):
      for seed in seeds:
        if (arm, gamma, lr, seed) == drop:
          continue
        inferential = values[seed]
        out.append({"arm": arm, "gamma": gamma, "learning_rate": lr, "depth": 4, "seed": seed, "seen": 1.0,
                    "inferential": inferential, "symmetric": round(1.0 - inferential, 6), "kind": "x"})
  return out


def _study(seeds=(0, 1, 2)):
  return AnchorStudyConfig(arms=tuple(INFERENTIAL), gammas=GAMMAS, learning_rates=RATES, depths=(4,), seeds=seeds)


def _verdict(verdicts, a, b, metric="inferential"):
  (v,) = [v for v in verdicts if (v["a"], v["b"], v["metric"]) == (a, b, metric)]
  return v


def test_compare_is_clear_only_when_the_seed_ranges_do_not_overlap():
  assert anchor_study.compare([0.9, 0.8], [0.1, 0.2]) == pytest.approx(
      {"difference": 0.7, "separation": 0.6, "clear": True, "sign": 1})
  below = anchor_study.compare([0.1, 0.3], [0.5, 0.4])
  assert (below["clear"], below["sign"], below["separation"]) == (True, -1, pytest.approx(0.1))
  overlap = anchor_study.compare([0.45, 0.6, 0.7], [0.3, 0.5, 0.4])
  assert not overlap["clear"] and overlap["difference"] > 0 and overlap["separation"] < 0
  assert not anchor_study.compare([0.9], [0.1])["clear"]  # one seed has no spread to exceed


def test_which_contrasts_survive_on_synthetic_cells():
  cfg = _study()
  rows = anchor_study.contrasts(cfg, anchor_study.summarize(cfg, _synthetic_cells()))
  asked = {(a, b) for a, b, _ in anchor_study.CONTRASTS}
  assert {(r["a"], r["b"]) for r in rows} == asked  # every arm is present: every contrast is reported
  assert len(rows) == len(asked) * 2 * len(CELLS)  # per metric and (gamma, lr) cell
  midas_fixed = [r for r in rows if (r["a"], r["b"], r["metric"]) == ("midas", "fixed", "inferential")]
  assert [(r["gamma"], r["learning_rate"]) for r in midas_fixed] == CELLS
  assert [r["clear"] for r in midas_fixed] == [True, True, False, True]
  assert midas_fixed[0]["difference"] == pytest.approx(0.85 - 0.15)
  assert midas_fixed[2]["a_range"] == [0.45, 0.7] and midas_fixed[2]["b_range"] == [0.3, 0.5]
  verdicts = anchor_study.verdicts(cfg, rows)
  survivors = {(v["a"], v["b"], v["metric"], v["direction"]) for v in verdicts if v["survives"]}
  # Known answer (read off INFERENTIAL): both copying arms beat fresh layers in every cell beyond the seed range,
  # GradStack beats the fixed model too; symmetric = 1 - inferential, so each survives there with the opposite sign.
  known = {("gradstack", "fresh_block"), ("midas", "fresh_block"), ("gradstack", "fixed")}
  assert survivors == {(a, b, "inferential", 1) for a, b in known} | {(a, b, "symmetric", -1) for a, b in known}
  assert _verdict(verdicts, "midas", "fixed")["why"] == "within the seed spread in 1 of 4 (gamma, lr) cells"
  for a, b in (("midas", "looped"), ("gradstack", "looped"), ("fresh_block", "fixed")):
    assert _verdict(verdicts, a, b)["why"] == "the sign differs between (gamma, lr) cells"
  assert _verdict(verdicts, "gradstack", "fresh_block")["mean_difference"] == pytest.approx(
      np.mean([0.9 - 0.15, 0.75 - 0.25, np.mean([0.9, 0.95, 0.92]) - 0.05, 0.65 - 0.45]))
  text = anchor_study.format_contrasts(cfg, rows, verdicts)
  assert "gradstack - fresh_block, inferential, depth 4: mean +0.58; SURVIVES, gradstack above fresh_block" in text
  assert "gradstack - fresh_block, symmetric, depth 4: mean -0.58; SURVIVES, gradstack below fresh_block" in text
  assert "    gamma 0.7 lr 0.003: +0.18   [0.45, 0.70] vs [0.30, 0.50]" in text  # midas - fixed, not clear
  assert "    gamma 0.7 lr 0.003: +0.87*  [0.90, 0.95] vs [0.00, 0.10]" in text  # gradstack - fresh_block, clear


def test_nothing_survives_with_one_seed_or_a_missing_cell():
  one = _study(seeds=(0,))
  rows = anchor_study.contrasts(one, anchor_study.summarize(one, _synthetic_cells(seeds=(0,))))
  assert not any(v["survives"] for v in anchor_study.verdicts(one, rows))
  assert _verdict(anchor_study.verdicts(one, rows), "gradstack", "fresh_block")["why"].startswith("one seed")
  cfg = _study()
  # A cell of one arm missing entirely (its three seeds): that contrast is not judged on a partial grid.
  cells = [c for c in _synthetic_cells() if not (c["arm"] == "fresh_block" and c["gamma"] == 0.7 and
                                                 c["learning_rate"] == 2e-3)]
  v = _verdict(anchor_study.verdicts(cfg, anchor_study.contrasts(cfg, anchor_study.summarize(cfg, cells))),
               "gradstack", "fresh_block")
  assert not v["survives"] and v["why"] == "1 of 4 (gamma, lr) cells not trained"


TINY = ["--gin.AnchorStudyConfig.gammas=[0.5]", "--gin.AnchorStudyConfig.depths=[2]",
        "--gin.AnchorStudyConfig.arms=['looped']", "--gin.AnchorStudyConfig.learning_rates=[1e-3, 1e-2]",
        "--gin.AnchorStudyConfig.seeds=[0]", "--gin.ModelConfig.d_model=16", "--gin.ModelConfig.d_ff=32",
        "--gin.AnchorStudyConfig.train_examples=1024", "--gin.AnchorStudyConfig.batch_size=32",
        "--gin.AnchorStudyConfig.steps=8", "--gin.OptimizerConfig.warmup_steps=2",
        "--gin.AnchorStudyConfig.eval_every=0", "--gin.AnchorStudyConfig.eval_examples=8"]


def test_cli_trains_the_looped_arm_at_two_rates_and_resumes(tmp_path, repo_root, capsys):
  """Two cells of the shipped controls config made tiny: the looped arm (one tied layer, applied twice) at two
  peak rates; each cell is keyed and trained at its own rate, and a re-run trains nothing."""
  gin_file = os.path.join(repo_root, "gin", "experiments", "anchor_controls_cpu.gin")
  args = ["study", "anchor", f"--gin_file={gin_file}", f"--workdir={tmp_path}"] + TINY
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "2 cells (1 arms x 1 gammas x 2 learning rates x 1 depths x 1 seeds)" in out
  result = json.load(open(tmp_path / "anchor_study.json"))
  cells = {c["learning_rate"]: c for c in result["cells"]}
  assert set(cells) == {1e-3, 1e-2} and all(c["arm"] == "looped" and c["loop_block"] == 1 for c in cells.values())
  cfg = anchor_cells.arm_model(AnchorStudyConfig(model=dataclasses.replace(ANCHOR_MODEL, d_model=16, d_ff=32)),
                               "fixed", 0.5, 2)
  counts = flops.param_counts(cfg)
  assert cells[1e-3]["params"] == counts["total"] - counts["per_layer"]  # one stored layer of the two applied
  assert cells[1e-3]["train_flops"] == 8 * 32 * 8 * flops.train_flops_per_token(cfg, 8)  # steps x batch x length
  assert cells[1e-3]["final_loss"] != cells[1e-2]["final_loss"]  # each cell trained at its own rate
  assert [(g["arm"], g["learning_rate"]) for g in result["grid"]] == [("looped", 1e-3), ("looped", 1e-2)]
  assert result["contrasts"] == [] and result["verdicts"] == []  # one arm: no contrast to report
  assert "contrasts: none" in out and "0.5, lr 0.001" in out
  assert os.path.getsize(tmp_path / "phase_diagram.png") > 1000
  assert cli.main(args) == 0  # resumes: nothing trained again
  assert "gamma=" not in capsys.readouterr().out
  assert len(open(tmp_path / "cells.jsonl").read().splitlines()) == 2
