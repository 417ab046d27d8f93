"""Growth on a trigger (StackingConfig.trigger): the plateau rule, a run that grows on it, and a resume across it."""

import shutil

import pytest

from conftest import tiny_model
from midas_jax import configs
from midas_jax.errors import ConfigError
from midas_jax.stacking.checks import schedule_for
from midas_jax.stacking.trigger import MAX_STAGE_STEPS, PLATEAU, growth_due, plateaued
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train


def test_plateau_compares_the_loss_window_evaluations_back():
  assert not plateaued([4.0, 3.0], 0.1, 2)  # too few evaluations for the window
  assert not plateaued([4.0, 3.9, 3.0], 0.1, 2)  # 25% better than two evaluations back
  assert plateaued([4.0, 3.0, 3.95, 2.9], 0.1, 2)  # 3.0 -> 2.9 is 3.3%: only the last window counts
  assert plateaued([3.0, 3.2], 0.0, 1)  # a loss that rose has plateaued, whatever the fraction
  assert not plateaued([3.0, float("nan")], 0.5, 1)


def test_growth_due_honours_min_and_max_stage_steps():
  flat = [3.0, 3.0, 3.0]
  assert growth_due(9, flat, 0.01, 2, min_steps=10, max_steps=None) is None  # plateau, but the stage is too short
  assert growth_due(10, flat, 0.01, 2, min_steps=10, max_steps=None) == PLATEAU
  falling = [3.0, 2.0, 1.0]
  assert growth_due(19, falling, 0.01, 2, min_steps=10, max_steps=20) is None
  assert growth_due(20, falling, 0.01, 2, min_steps=10, max_steps=20) == MAX_STAGE_STEPS


def triggered_run(num_steps=11, **stacking):
  """Three stages of two layers; evals every 3 steps; saves at step 7, at each growth and at the end."""
  settings = dict(num_stages=3, trigger="plateau", plateau_fraction=10.0, plateau_window=1, min_stage_steps=1,
                  max_stage_steps=5)
  settings.update(stacking)
  return configs.RunConfig(
      model=tiny_model(num_layers=6), mesh=configs.MeshConfig(),
      optimizer=configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=1),
      data=configs.DataConfig(seq_len=32, batch_size=8),
      trainer=configs.TrainerConfig(num_steps=num_steps, log_every=1, eval_every=3, eval_batches=1,
                                    progress_bar=False, peak_flops_per_device=1e11),
      checkpoint=configs.CheckpointConfig(every=7, keep=100, async_save=False),
      stacking=configs.StackingConfig(**settings))


def test_settings_that_need_fixed_boundaries_or_evaluation_are_refused():
  with pytest.raises(ConfigError, match="StackingConfig.stage_steps"):
    configs.StackingConfig(num_stages=2, trigger="plateau", stage_steps=(2, 2))
  with pytest.raises(ConfigError, match="StackingConfig.max_stage_steps"):
    configs.StackingConfig(num_stages=2, trigger="plateau", min_stage_steps=4, max_stage_steps=3)
  config = triggered_run()
  off = configs.RunConfig(**{**config.__dict__, "trainer": configs.TrainerConfig(num_steps=11, eval_every=0)})
  with pytest.raises(ConfigError, match="TrainerConfig.eval_every"):
    schedule_for(off)


def test_triggered_growths_are_taken_recorded_and_followed_on_resume(tmp_path):
  # plateau_fraction 10: any two evaluations of a stage count as a plateau. Stage 1 (from 0) has one eval (step
  # 3) when it reaches max_stage_steps=5: grows at 5. Stage 2 (from 5) has evals at 6 and 9: plateau, grows at 9.
  # Stage 3 is the last and runs to num_steps.
  full = train(triggered_run(), str(tmp_path / "full"))
  assert [(g["step"], g["reason"]) for g in full.growths] == [(5, MAX_STAGE_STEPS), (9, PLATEAU)]
  stages = read_metrics(str(tmp_path / "full"), "stage")
  assert [(r["step"], r["stage"], r["plateau"]) for r in stages] == [(5, 2, 0), (9, 3, 1)]
  assert [r["depth"] for r in read_metrics(str(tmp_path / "full"), "train")] == [2] * 5 + [4] * 4 + [6] * 2

  # Resume from step 7: stage 2 with one evaluation (step 6) in its window, which the save's metadata holds.
  # Without it the plateau at 9 would be missed and the stage would end at max_stage_steps (step 10).
  resumed = tmp_path / "resumed"
  shutil.copytree(tmp_path / "full", resumed)
  for save in (resumed / "checkpoints").iterdir():
    if save.name.isdigit() and int(save.name) > 7:
      shutil.rmtree(save)
  again = train(triggered_run(), str(resumed))
  assert again.start_step == 7
  assert [(g["step"], g["reason"]) for g in again.growths] == [(5, MAX_STAGE_STEPS), (9, PLATEAU)]
  assert [(r["step"], r["plateau"]) for r in read_metrics(str(resumed), "stage")] == [(5, 0), (9, 1)]
  assert again.final_loss == pytest.approx(full.final_loss, rel=1e-5)
