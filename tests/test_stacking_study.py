"""`midas study stacking` end to end at a tiny size, each arm's config, resuming, and the study's statistics on
hand-made cells."""

import dataclasses
import json
import os

import pytest

from midas_jax import cli, configs
from midas_jax.errors import ConfigError
from midas_jax.studies import stacking_study, stacking_study_page
from midas_jax.stacking.schedule import cumulative_flops, schedule_from_config

TINY = ["--gin.ModelConfig.d_model=32", "--gin.ModelConfig.num_layers=2", "--gin.ModelConfig.num_heads=2",
        "--gin.ModelConfig.num_kv_heads=None", "--gin.ModelConfig.d_ff=64", "--gin.ModelConfig.max_seq_len=128",
        "--gin.ModelConfig.dtype='float32'", "--gin.StackingConfig.num_stages=2", "--gin.StackingConfig.block_size=1",
        "--gin.DataConfig.seq_len=128", "--gin.DataConfig.batch_size=8", "--gin.TrainerConfig.num_steps=6",
        "--gin.TrainerConfig.eval_every=2", "--gin.TrainerConfig.log_every=2", "--gin.TrainerConfig.eval_batches=1",
        "--gin.TrainerConfig.peak_flops_per_device=1e11", "--gin.TrainerConfig.progress_bar=False",
        "--gin.OptimizerConfig.warmup_steps=1", "--gin.StackingStudyConfig.seeds=[1]",
        "--gin.StackingStudyConfig.k_shot=1", "--gin.StackingStudyConfig.score_examples=4",
        "--gin.StackingStudyConfig.tasks=['assignment_depth0', 'copying']",
        # Every arm trains through the same train(); what differs is its config, which
        # test_every_arm_is_the_run_config_with_its_own_depth_steps_and_seed checks without training.
        "--gin.StackingStudyConfig.arms=['midas']"]


def test_the_study_trains_a_stacked_arm_measures_growth_on_its_own_batches_and_scores(tmp_path, repo_root, capsys):
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  argv = ["study", "stacking", f"--gin_file={gin_file}", f"--workdir={tmp_path}"] + TINY
  assert cli.main(argv) == 0
  result = json.loads((tmp_path / "study.json").read_text())
  (midas,) = result["cells"]
  # Prop-1 over 6 steps and 2 stages: (2, 4); the eval at step 2 is the loss just before growth, and
  # the grown checkpoint's loss on the same batches the loss just after it.
  assert (midas["arm"], midas["seed"], midas["steps"]) == ("midas", 1, 6)
  assert [r["step"] for r in midas["eval_curve"]] == [2, 4, 6]
  assert midas["eval_curve"][-1]["flops"] == midas["total_flops"]
  (growth,) = midas["growths"]
  assert (growth["step"], growth["from_depth"], growth["to_depth"]) == (2, 1, 2)
  before = midas["eval_curve"][0]["loss"]
  assert growth["loss_before"] == before and growth["loss_after"] != before and growth["next_eval_step"] == 4
  # The loss after growth is measured by held_out_loss; measured so, the final checkpoint gives the
  # loop's last eval: the same batches (seed 1's, not the gin default's).
  assert midas["final_eval_loss_remeasured"] == pytest.approx(midas["final_eval_loss"], abs=1e-5)
  assert set(midas["primitives"]) == {"assignment_depth0", "copying"}
  fc = midas["primitives"]["copying"]["forced_choice"]
  assert 0 <= fc["ci95"][0] <= fc["value"] <= fc["ci95"][1] <= 1 and fc["chance"] == pytest.approx(1 / 3)
  jump = result["summary"]["growths"]["midas"][0]["jump"]
  assert jump["values"] == [pytest.approx(growth["loss_after"] - before)]
  page = (tmp_path / "study.md").read_text()
  for needle in ("equal FLOPs", "around each growth: midas", "forced_choice",
                 "![loss_vs_flops](study/loss_vs_flops.png)"):
    assert needle in page
  for name in ("loss_vs_flops", "scores_vs_loss"):
    assert (tmp_path / "study" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
  assert "training midas seed 1" in capsys.readouterr().out


def test_every_arm_is_the_run_config_with_its_own_depth_steps_and_seed(repo_root):
  """The default study's four arms, as train_cell trains them: the cut baseline spends MIDAS's FLOPs."""
  from midas_jax.data.vocabularies import make_vocabulary  # pylint: disable=import-outside-toplevel
  from midas_jax.commands.study_commands import stacking_study_from_gin  # pylint: disable=import-outside-toplevel
  # Stage lengths bound in gin (Prop-1's own here) must not reach the baselines' StackingConfig.
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  run, study, _ = stacking_study_from_gin([gin_file], ["StackingConfig.stage_steps = (12, 24, 36, 48)"])
  assert study.arms == stacking_study.ARMS and len(study.seeds) >= 2
  vocab = make_vocabulary(run.data).vocab_size
  model, data = run.model.with_vocab(vocab), run.data

  def total_flops(config):
    schedule = schedule_from_config(config.stacking, config.trainer.num_steps, model.num_layers)
    return cumulative_flops(model, data.seq_len, data.batch_size * data.seq_len, schedule, schedule.num_steps)

  arms = {arm: stacking_study.arm_config(run, arm, 1, vocab) for arm in stacking_study.ARMS}
  for arm, config in arms.items():
    assert (config.trainer.seed, config.data.seed) == (1, 1), arm  # one seed: the init and the data order
    assert config.model == run.model and config.optimizer == run.optimizer, arm
    assert config.checkpoint.keep == run.stacking.num_stages + 1  # every boundary's checkpoint is kept
  for arm in ("baseline", "baseline_equal_flops"):
    assert arms[arm].stacking == configs.StackingConfig(num_stages=1, block_size=None, stage_steps=None)
  for arm in stacking_study.STACKED:
    assert arms[arm].stacking == dataclasses.replace(run.stacking, operator=arm)
    assert arms[arm].trainer.num_steps == arms["baseline"].trainer.num_steps == run.trainer.num_steps
  cut, stacked = arms["baseline_equal_flops"], total_flops(arms["midas"])
  assert total_flops(arms["gradstack"]) == stacked
  per_step = total_flops(arms["baseline"]) / run.trainer.num_steps
  assert cut.trainer.num_steps < run.trainer.num_steps
  assert abs(total_flops(cut) - stacked) <= per_step / 2  # the closest whole number of full-depth steps


def test_a_rerun_reuses_the_cells_of_equal_settings_only(tmp_path, repo_root):
  from midas_jax.commands.study_commands import stacking_study_from_gin  # pylint: disable=import-outside-toplevel
  # pylint: disable=protected-access
  settings, read, write = stacking_study._settings, stacking_study._read_cells, stacking_study._write_cells
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  run, study, _ = stacking_study_from_gin([gin_file], [])
  path = str(tmp_path / "cells.jsonl")
  write(path, {("midas", 0): _cell("midas", 0, 2.0, 1.0)}, settings(run, study))
  # Settings as a fresh parse computes them (tuples from gin, lists from JSON) compare equal; the
  # seeds and arms pick cells, they are not settings.
  assert list(read(path, settings(run, study))) == [("midas", 0)]
  assert list(read(path, settings(run, dataclasses.replace(study, seeds=(5,))))) == [("midas", 0)]
  assert not read(path, settings(run, dataclasses.replace(study, k_shot=1)))
  assert not read(path, settings(dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, num_steps=240)),
                                 study))


def test_bad_study_settings_are_named(tmp_path, repo_root, capsys):
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  args = ["study", "stacking", f"--gin_file={gin_file}", f"--workdir={tmp_path}"]
  assert cli.main(args + ["--gin.StackingStudyConfig.seed=[0]"]) == 2
  assert "seeds" in capsys.readouterr().err
  assert cli.main(args + ["--gin.StackingStudyConfig.arms=['baseline_equal_flops']"]) == 2
  assert "StackingStudyConfig.arms" in capsys.readouterr().err
  assert cli.main(args + ["--gin.TrainerConfig.eval_every=5"]) == 2  # misses the boundaries 12, 36, 72
  assert "TrainerConfig.eval_every" in capsys.readouterr().err
  with pytest.raises(ConfigError, match="StackingStudyConfig.seeds"):
    stacking_study.StackingStudyConfig(seeds=(0, 0))


def _cell(arm, seed, loss, flops, curve=(), growths=(), fc=0.5):
  scores = {s: {"value": fc, "ci95": [0, 1], "chance": 0.25} for s in stacking_study_page.SCORES}
  return {"arm": arm, "seed": seed, "steps": 10, "total_flops": flops, "final_eval_loss": loss,
          "train_seconds": 1.0, "eval_curve": list(curve), "growths": list(growths), "primitives": {"copying": scores}}


def test_paired_differences_interpolation_and_resolution_on_hand_made_cells():
  curve = [{"step": 5, "flops": 50.0, "loss": 3.0}, {"step": 10, "flops": 100.0, "loss": 2.0}]
  growth = lambda before, after: {"step": 5, "from_depth": 1, "to_depth": 2, "loss_before": before,  # noqa: E731
                                  "loss_after": after, "loss_next_eval": 2.5}
  cells = [_cell("baseline", 0, 2.0, 100.0, curve), _cell("baseline", 1, 2.1, 100.0, curve),
           _cell("midas", 0, 2.3, 75.0, growths=[growth(3.0, 3.4)]),
           _cell("midas", 1, 2.4, 75.0, growths=[growth(3.1, 3.6)])]
  study = stacking_study.StackingStudyConfig(seeds=(0, 1), arms=("baseline", "midas"))
  summary = stacking_study_page.summarize(cells, study)
  midas = summary["comparisons"]["midas"]
  assert midas["minus_baseline_equal_steps"]["values"] == [pytest.approx(0.3), pytest.approx(0.3)]
  assert midas["minus_baseline_equal_steps"]["resolved"]  # identical differences: a zero-width interval
  assert midas["baseline_at_equal_flops"]["values"] == [pytest.approx(2.5)] * 2  # halfway between 3.0 and 2.0
  assert midas["minus_baseline_at_equal_flops"]["values"] == [pytest.approx(-0.2), pytest.approx(-0.1)]
  assert not midas["minus_baseline_at_equal_flops"]["resolved"]  # t(1) = 12.7: two seeds this noisy cannot
  (g,) = summary["growths"]["midas"]
  assert g["jump"]["values"] == [pytest.approx(0.4), pytest.approx(0.5)]
  assert summary["arms"]["baseline"]["final_eval_loss"]["sd"] == pytest.approx(0.0707, abs=1e-4)
  assert summary["primitives"]["midas"]["copying"]["forced_choice"]["chance"] == 0.25
