"""`midas study stacking` end to end at a tiny size, each arm's config, resuming, and the study's statistics on
hand-made cells."""

import dataclasses
import functools
import json
import os

import numpy as np
import pytest

from midas_jax import cli, configs
from midas_jax.checkpoint import load_model
from midas_jax.data.factory import load_data
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder
from midas_jax.studies import stacking_config, stacking_study, stacking_study_page, study_arms
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


def _loss_by_hand(workdir, step):
  """A checkpoint's held-out loss from the Decoder itself: mean token cross-entropy under the loss weights over the
  first eval_batches validation batches of its own run's data (no StageBuild, eval step or study code)."""
  ckpt = load_model(str(workdir), step)
  _, pipeline = load_data(ckpt.config)
  model, total, weight = Decoder(ckpt.model_config), 0.0, 0.0
  for i in range(ckpt.config.trainer.eval_batches):
    batch = pipeline.batch(i, "validation")
    logits = np.asarray(model.apply({"params": ckpt.params}, batch), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    token_loss = lse - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    total += float((token_loss * batch["loss_weights"]).sum())
    weight += float(batch["loss_weights"].sum())
  return ckpt.model_config.num_layers, total / weight


def test_the_study_trains_a_stacked_arm_measures_growth_on_its_own_batches_scores_and_resumes(tmp_path, repo_root,
                                                                                              capsys, monkeypatch):
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  argv = ["study", "stacking", f"--gin_file={gin_file}", f"--workdir={tmp_path}"] + TINY
  argv += ["--gin.StackingStudyConfig.seeds=[1, 2]"]  # overrides TINY's [1]
  calls, real_train_cell = [], stacking_study.train_cell

  def train_cell(run, study, arm, seed, *args, cut_short=False, **kwargs):
    calls.append((arm, seed))
    if cut_short and seed == 2:
      raise RuntimeError("cut short")
    return real_train_cell(run, study, arm, seed, *args, **kwargs)

  # The first call dies in its second cell: the finished cell is on disk, the study is not.
  monkeypatch.setattr(stacking_study, "train_cell", functools.partial(train_cell, cut_short=True))
  with pytest.raises(RuntimeError, match="cut short"):
    cli.main(argv)
  assert calls == [("midas", 1), ("midas", 2)] and not (tmp_path / "study.json").exists()
  (first,) = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
  assert (first["arm"], first["seed"]) == ("midas", 1)
  out = capsys.readouterr().out
  assert "training midas seed 1" in out and "midas seed 1: eval loss" in out
  # The re-run trains only the missing cell and keeps the finished one as it was.
  monkeypatch.setattr(stacking_study, "train_cell", train_cell)
  calls.clear()
  assert cli.main(argv) == 0
  assert calls == [("midas", 2)]
  assert "training midas seed 1" not in capsys.readouterr().out
  result = json.loads((tmp_path / "study.json").read_text())
  midas, second = result["cells"]
  assert (midas["seed"], second["seed"]) == (1, 2) and second["arm"] == "midas"
  assert midas == {k: v for k, v in first.items() if k != "settings"}
  assert len((tmp_path / "cells.jsonl").read_text().splitlines()) == 2
  # Prop-1 over 6 steps and 2 stages: (2, 4); the eval at step 2 is the loss just before growth, and
  # the grown checkpoint's loss on the same batches the loss just after it.
  assert (midas["arm"], midas["seed"], midas["steps"]) == ("midas", 1, 6)
  assert [r["step"] for r in midas["eval_curve"]] == [2, 4, 6]
  assert midas["eval_curve"][-1]["flops"] == midas["total_flops"]
  (growth,) = midas["growths"]
  assert (growth["step"], growth["from_depth"], growth["to_depth"]) == (2, 1, 2)
  before = midas["eval_curve"][0]["loss"]
  assert growth["loss_before"] == before and growth["next_eval_step"] == 4
  # Computed by hand, the final checkpoint's loss is the loop's last eval (so the hand route is the eval's loss),
  # and the checkpoint at the growth step (the grown 2-layer state) gives the loss after growth.
  workdir = tmp_path / "midas" / "seed1"
  assert _loss_by_hand(workdir, 6) == (2, pytest.approx(midas["final_eval_loss"], abs=1e-5))
  assert _loss_by_hand(workdir, 2) == (2, pytest.approx(growth["loss_after"], abs=1e-5))
  assert abs(growth["loss_after"] - before) > 1e-3  # growth changed the function, so the check above can tell
  # held_out_loss reads the same batches: seed 1's, not the gin default's.
  assert midas["final_eval_loss_remeasured"] == pytest.approx(midas["final_eval_loss"], abs=1e-5)
  assert set(midas["primitives"]) == {"assignment_depth0", "copying"}
  fc = midas["primitives"]["copying"]["forced_choice"]
  assert 0 <= fc["ci95"][0] <= fc["value"] <= fc["ci95"][1] <= 1 and fc["chance"] == pytest.approx(1 / 3)
  jump = result["summary"]["lengths"][0]["growths"]["midas"][0]["jump"]
  assert jump["values"] == [pytest.approx(g["growths"][0]["loss_after"] - g["eval_curve"][0]["loss"])
                            for g in (midas, second)]
  page = (tmp_path / "study.md").read_text()
  for needle in ("equal FLOPs", "around each growth: midas", "forced_choice",
                 "![loss_vs_flops](study/loss_vs_flops.png)"):
    assert needle in page
  for name in ("loss_vs_flops", "scores_vs_loss"):
    assert (tmp_path / "study" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_every_arm_is_the_run_config_with_its_own_depth_steps_and_seed(repo_root):
  """The default study's four arms, as train_cell trains them: the cut baseline spends MIDAS's FLOPs."""
  from midas_jax.commands.study_commands import stacking_study_from_gin  # pylint: disable=import-outside-toplevel
  from midas_jax.data.vocab.factory import make_vocabulary  # pylint: disable=import-outside-toplevel
  # Stage lengths bound in gin (Prop-1's own here) must not reach the baselines' StackingConfig.
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  run, study, _ = stacking_study_from_gin([gin_file], ["StackingConfig.stage_steps = (12, 24, 36, 48)"])
  assert study.arms == stacking_config.ARMS and len(study.seeds) >= 2
  vocab = make_vocabulary(run.data).vocab_size
  model, data = run.model.with_vocab(vocab), run.data

  def total_flops(config):
    schedule = schedule_from_config(config.stacking, config.trainer.num_steps, model.num_layers)
    return cumulative_flops(model, data.seq_len, data.batch_size * data.seq_len, schedule, schedule.num_steps)

  arms = {arm: study_arms.arm_config(run, arm, 1, vocab) for arm in stacking_config.ARMS}
  for arm, config in arms.items():
    assert (config.trainer.seed, config.data.seed) == (1, 1), arm  # one seed: the init and the data order
    assert config.model == run.model and config.optimizer == run.optimizer, arm
    assert config.checkpoint.keep == run.stacking.num_stages + 1  # every boundary's checkpoint is kept
  for arm in ("baseline", "baseline_equal_flops"):
    assert arms[arm].stacking == configs.StackingConfig(num_stages=1, block_size=None, stage_steps=None)
  for arm in stacking_config.STACKED:
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
  key = (120, "midas", 3e-3, 0)
  write(path, {key: _cell("midas", 0, 2.0, 1.0)}, settings(run, study))
  # Settings as a fresh parse computes them (tuples from gin, lists from JSON) compare equal; the
  # seeds, arms, lengths and rates pick cells, they are not settings.
  assert list(read(path, settings(run, study))) == [key]
  assert list(read(path, settings(run, dataclasses.replace(study, seeds=(5,))))) == [key]
  assert list(read(path, settings(run, dataclasses.replace(study, steps=(120, 480), learning_rates=(1e-3,))))) == [key]
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
    stacking_config.StackingStudyConfig(seeds=(0, 0))


def _cell(arm, seed, loss, flops, curve=(), growths=(), fc=0.5):
  scores = {s: {"value": fc, "ci95": [0, 1], "chance": 0.25} for s in stacking_study_page.SCORES}
  return {"arm": arm, "seed": seed, "steps": 10, "length": 120, "learning_rate": 3e-3,
          "total_flops": flops, "final_eval_loss": loss,
          "train_seconds": 1.0, "eval_curve": list(curve), "growths": list(growths), "primitives": {"copying": scores}}


def test_paired_differences_interpolation_and_resolution_on_hand_made_cells():
  curve = [{"step": 5, "flops": 50.0, "loss": 3.0}, {"step": 10, "flops": 100.0, "loss": 2.0}]
  growth = lambda before, after: {"step": 5, "from_depth": 1, "to_depth": 2, "loss_before": before,  # noqa: E731
                                  "loss_after": after, "loss_next_eval": 2.5}
  cells = [_cell("baseline", 0, 2.0, 100.0, curve), _cell("baseline", 1, 2.1, 100.0, curve),
           _cell("midas", 0, 2.3, 75.0, growths=[growth(3.0, 3.4)]),
           _cell("midas", 1, 2.4, 75.0, growths=[growth(3.1, 3.6)])]
  study = stacking_config.StackingStudyConfig(seeds=(0, 1), arms=("baseline", "midas"))
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
