"""The length study: each length's arms (configs, FLOPs, steps), the rate sweep's cells, the matched-loss
readout on a known curve, the residual init at the final depth, the growth ablations as arms, and the GPU
script's path at tiny sizes on the CPU."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from midas_jax import configs, flops, gin_config
from midas_jax.commands.study_commands import stacking_study_from_gin
from midas_jax.data.factory import load_data
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError
from midas_jax.stacking.schedule import cumulative_flops, schedule_from_config
from midas_jax.studies import matched_loss, stacking_config, stacking_study, study_arms
from midas_jax.train.build import build_stage
from midas_jax.train.metrics import read_metrics


def _length_study(repo_root, bindings=()):
  return stacking_study_from_gin([os.path.join(repo_root, "gin", "experiments", "study_length_cpu.gin")],
                                 list(bindings))


def _total_flops(config, model):
  schedule = schedule_from_config(config.stacking, config.trainer.num_steps, model.num_layers)
  tokens = config.data.batch_size * config.data.seq_len
  return cumulative_flops(model, config.data.seq_len, tokens, schedule, schedule.num_steps)


def test_every_length_builds_each_arms_schedule_for_itself(repo_root):
  run, study, _ = _length_study(repo_root)
  assert study.steps == (200, 400, 800) and len(study.seeds) >= 2 and study.learning_rates == (1e-3, 3e-3, 1e-2)
  assert run.model.residual_init_depth == "final" and run.optimizer.decay == "wsd"
  vocab = make_vocabulary(run.data).vocab_size
  model = run.model.with_vocab(vocab)
  tokens = run.data.batch_size * run.data.seq_len
  per_token = [flops.train_flops_per_token(model, run.data.seq_len, d) for d in (2, 4, 6, 8)]
  for steps, eval_every in ((200, 20), (400, 40), (800, 80)):
    length = study_arms.length_run(run, steps, study.evals_per_run)
    stages = tuple(steps * i // 10 for i in (1, 2, 3, 4))  # Prop-1 in 4 stages: 1:2:3:4
    assert length.trainer.num_steps == steps and length.trainer.eval_every == eval_every
    assert length.optimizer.warmup_steps == min(20, stages[0])  # inside stage 1
    arms = {arm: study_arms.arm_config(length, arm, 1, vocab) for arm in study.arms}
    midas = arms["midas"]
    schedule = schedule_from_config(midas.stacking, steps, model.num_layers)
    assert schedule.stage_steps == stages and schedule.depths == (2, 4, 6, 8)
    assert all(b % eval_every == 0 for b in schedule.boundaries)
    assert arms["baseline"].trainer.num_steps == midas.trainer.num_steps == steps
    assert arms["baseline"].stacking == configs.StackingConfig()
    # The cut baseline: as many full-depth steps as MIDAS's FLOPs, counted here from the per-depth costs.
    midas_flops = tokens * sum(t * f for t, f in zip(stages, per_token))
    assert _total_flops(midas, model) == pytest.approx(midas_flops, rel=1e-12)
    cut = arms["baseline_equal_flops"]
    assert cut.trainer.num_steps == round(midas_flops / (tokens * per_token[-1]))
    assert 0.6 * steps < cut.trainer.num_steps < 0.85 * steps
    assert cut.stacking == configs.StackingConfig() and cut.optimizer.warmup_steps == length.optimizer.warmup_steps
    for arm, config in arms.items():
      assert (config.trainer.seed, config.data.seed) == (1, 1), arm
      assert config.model == run.model and config.optimizer.learning_rate == run.optimizer.learning_rate
  # Every arm keeps its boundaries' checkpoints and the final one; the ladder replaces per-eval saves.
  length = study_arms.length_run(run, 400, study.evals_per_run)
  for arm in study.arms:
    assert study_arms.arm_config(length, arm, 0, vocab).checkpoint.every == 0
  # With the study's eval seed, every seed reads the validation half of one eval set; the test half is the other.
  one = study_arms.arm_config(length, "midas", 3, vocab, eval_seed=study.eval_seed)
  assert (one.data.seed, one.data.eval_seed, one.data.heldout_shard) == (3, study.eval_seed, (0, 2))
  assert study_arms.on_test_shard(one, 64).data.heldout_shard == (1, 2)
  assert study_arms.on_test_shard(one, 64).trainer.eval_batches == 64
  # A length too short for 4 stages of 10 steps is refused, naming the setting.
  with pytest.raises(ConfigError, match="StackingStudyConfig.steps"):
    _length_study(repo_root, ["StackingStudyConfig.steps = [30, 200]"])
  # A short length cuts the warm-up to its 10-step first stage.
  assert study_arms.length_run(run, 100, 10).optimizer.warmup_steps == 10


def test_the_ablation_arms_are_the_stacked_arm_with_one_growth_setting_changed(repo_root):
  run, _, _ = _length_study(repo_root, ["StackingStudyConfig.arms = ['baseline', 'midas', 'midas_zero_moments', "
                                        "'midas_rewarm', 'gradstack_zero_moments_rewarm']"])
  length = study_arms.length_run(run, 200, 10)
  vocab = make_vocabulary(run.data).vocab_size
  base = study_arms.arm_config(length, "midas", 0, vocab).stacking
  assert (base.operator, base.new_moments, base.lr_schedule) == ("midas", "copy", "global")
  expect = {"midas_zero_moments": ("midas", "zero", "global"), "midas_rewarm": ("midas", "copy", "rewarm"),
            "gradstack_zero_moments_rewarm": ("gradstack", "zero", "rewarm")}
  for arm, (operator, moments, lr) in expect.items():
    st = study_arms.arm_config(length, arm, 0, vocab).stacking
    assert st == dataclasses.replace(base, operator=operator, new_moments=moments, lr_schedule=lr), arm
    # Same stages, depths and FLOPs as MIDAS: only how growth treats the optimizer differs.
    assert schedule_from_config(st, 200, 8).stage_steps == schedule_from_config(base, 200, 8).stage_steps
  for bad in ("midas_rewarm_zero_moments", "midas_fresh", "stacked"):
    with pytest.raises(ConfigError, match="StackingStudyConfig.arms"):
      study_arms.parse_arm(bad)
  # A re-warm longer than a stage is refused before anything trains.
  with pytest.raises(ConfigError, match="rewarm_steps"):
    _length_study(repo_root, ["StackingStudyConfig.arms = ['baseline', 'midas_rewarm']",
                              "StackingStudyConfig.matched_arms = []",
                              "StackingConfig.rewarm_steps = 50"])


def test_the_plan_trains_each_arm_at_its_best_rate_then_the_ladder_then_the_recheck():
  study = stacking_config.StackingStudyConfig(seeds=(0, 1), arms=("baseline", "midas"), steps=(200, 800),
                                             ladder_steps=(100, 1200), learning_rates=(1e-3, 3e-3, 1e-2),
                                             recheck_rates=True)
  best = {"baseline": 3e-3, "midas": 1e-2}
  plan = stacking_study.compared_plan(study, (200, 800), best, 3e-3)
  assert plan[:4] == [(200, "baseline", 3e-3, 0, "arm"), (200, "midas", 1e-2, 0, "arm"),
                      (200, "baseline", 3e-3, 1, "arm"), (200, "midas", 1e-2, 1, "arm")]
  assert {(n, a, r) for n, a, r, _, role in plan if role == "arm" and n == 800} == {(800, "baseline", 3e-3),
                                                                                      (800, "midas", 1e-2)}
  assert [(n, a, r, s) for n, a, r, s, role in plan if role == "ladder"] == [
      (100, "baseline", 3e-3, 0), (100, "baseline", 3e-3, 1), (1200, "baseline", 3e-3, 0), (1200, "baseline", 3e-3, 1)]
  fixed = dataclasses.replace(study, longer_rate="config")
  plan = stacking_study.compared_plan(fixed, (200, 800), best, 5e-3)
  assert {r for n, a, r, _, _ in plan if n != 200} == {5e-3}
  assert {r for n, a, r, _, _ in plan if n == 200} == {3e-3, 1e-2}
  grids = {"baseline": {"0.001": [], "0.003": [], "0.01": []}, "midas": {"0.001": [], "0.003": [], "0.01": []}}
  assert stacking_study.recheck_plan(study, (200, 800), best, 3e-3, grids) == [
      (800, "baseline", 3e-3, 0), (800, "baseline", 1e-3, 0), (800, "baseline", 1e-2, 0),
      (800, "midas", 1e-2, 0), (800, "midas", 3e-3, 0)]
  assert stacking_study.recheck_plan(dataclasses.replace(study, recheck_rates=False), (200, 800), best, 3e-3,
                                     grids) == []


def test_the_matched_loss_readout_on_a_curve_whose_answer_is_known():
  # loss = 4 - step / 100 on evals every 10 steps: 3.55 is reached at step 45, halfway from 40 to 50.
  curve = [{"step": s, "loss": 4 - s / 100} for s in range(10, 101, 10)]
  assert matched_loss.bracket(curve, 3.55) == (40, 50, pytest.approx(0.5))
  assert matched_loss.step_at_loss(curve, 3.55) == pytest.approx(45.0)
  assert matched_loss.bracket(curve, 3.9) == (10, 20, 0.0)  # exactly on an eval
  assert matched_loss.bracket(curve, 3.0) == (90, 100, pytest.approx(1.0))
  assert matched_loss.bracket(curve, 2.9) is None and matched_loss.bracket(curve, 4.5) is None  # no extrapolation
  # Scores linear in the loss come back exactly at the matched loss; a curve that dips and rises
  # again is read at its first crossing.
  score = lambda loss: {"copying": {"answer_logprob": -2 * loss, "forced_choice": 1.5 - loss / 4}}  # noqa: E731
  a, b, w = matched_loss.bracket(curve, 3.27)
  got = matched_loss.interpolate(score(4 - a / 100), score(4 - b / 100), w)
  assert got["copying"]["answer_logprob"] == pytest.approx(-6.54)
  assert got["copying"]["forced_choice"] == pytest.approx(1.5 - 3.27 / 4)
  bumpy = [{"step": 10, "loss": 3.0}, {"step": 30, "loss": 2.0}, {"step": 20, "loss": 2.5}, {"step": 40, "loss": 2.6}]
  assert matched_loss.bracket(bumpy, 2.55) == (10, 20, pytest.approx(0.9))  # sorted by step first


def _init_std(run, depth, data):
  """The std of the residual output projections of the model build_stage makes for a stage of `depth` layers."""
  build = build_stage(run, data=data, num_layers=depth)
  batch = jax.tree.map(lambda x: x[:1], data[1].batch(0, "validation"))
  params = jax.device_get(build.model.init(jax.random.PRNGKey(0), batch)["params"])
  flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  out = [v for k, v in flat.items() if "['out']" in k or "['down']" in k]
  assert len(out) == 2, sorted(flat)  # the attention and the MLP output projections
  assert out, sorted(flat)
  return float(np.concatenate([v.ravel() for v in out]).std())


def test_a_final_depth_residual_init_gives_a_stage_one_model_the_final_depths_scale(repo_root):
  run, _, _ = _length_study(repo_root, ["ModelConfig.dtype = 'float32'"])
  assert run.model.num_layers == 8
  data = load_data(run)
  final = _init_std(run, 2, data)  # stage 1 of 4: 2 of 8 layers
  stage = _init_std(dataclasses.replace(run, model=dataclasses.replace(run.model, residual_init_depth="stage")), 2,
                    data)
  assert final == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
  assert stage == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.05)
  with pytest.raises(ConfigError, match="ModelConfig.residual_init_depth"):
    configs.ModelConfig(residual_init_depth="first")


def test_the_corpus_holdout_leaves_depth_two_chains_and_math_out_of_both_splits():
  from midas_jax.data.sources import corpus  # pylint: disable=import-outside-toplevel
  for split in ("train", "validation"):
    held = [d.text for d in corpus.documents(split, 0, "composition") if d.kind == "assignment"]
    full = [d.text for d in corpus.documents(split, 0) if d.kind == "assignment"]
    lines = [line for doc in held for line in doc.splitlines()]
    assert lines and not any("+" in line or "-" in line.split("print")[0] for line in lines)
    hops = [sum(1 for s in line.split("; ")[:-1] if s.split("=")[1].isalpha()) for line in lines]
    assert max(hops) == 1 and min(hops) == 0
    assert any("+" in line for doc in full for line in doc.splitlines())  # the default still has them
  assert [d.text for d in corpus.documents("train", 0, "composition") if d.kind == "story"] == \
      [d.text for d in corpus.documents("train", 0) if d.kind == "story"]
  with pytest.raises(ConfigError, match="DataConfig.corpus_holdout"):
    configs.DataConfig(corpus_holdout="depth2")


TINY = ["--gin.ModelConfig.d_model=32", "--gin.ModelConfig.num_layers=2", "--gin.ModelConfig.num_heads=2",
        "--gin.ModelConfig.d_ff=64", "--gin.ModelConfig.max_seq_len=64", "--gin.ModelConfig.dtype='float32'",
        "--gin.StackingConfig.num_stages=2", "--gin.StackingConfig.block_size=1", "--gin.DataConfig.seq_len=64",
        "--gin.DataConfig.batch_size=8", "--gin.TrainerConfig.eval_batches=1", "--gin.TrainerConfig.log_every=10",
        "--gin.TrainerConfig.peak_flops_per_device=1e11", "--gin.StackingStudyConfig.steps=[30]",
        "--gin.StackingStudyConfig.evals_per_run=4", "--gin.StackingStudyConfig.seeds=[0]",
        "--gin.StackingStudyConfig.arms=['baseline', 'midas']", "--gin.StackingStudyConfig.growth_window=2",
        "--gin.StackingStudyConfig.score_examples=4", "--gin.StackingStudyConfig.k_shot=1",
        "--gin.StackingStudyConfig.eval_batch_size=4", "--gin.StackingStudyConfig.tasks=['copying']",
        "--gin.StackingStudyConfig.ladder_steps=[60]", "--gin.StackingStudyConfig.test_batches=2",
        "--gin.DataConfig.corpus_documents=2000"]


def test_the_gpu_study_script_runs_its_study_at_tiny_sizes_on_the_cpu(tmp_path, repo_root):
  workdir = tmp_path / "gpu_study"
  env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
  done = subprocess.run(["bash", os.path.join(repo_root, "launch", "gpu_study.sh"), str(workdir)] + TINY,
                        env=env, capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  # The smoke run came first and passed; the study read MIDAS on the baseline's ladder; no checkpoint is left.
  log = (workdir / "gpu_study.log").read_text()
  assert log.index("smoke wall seconds") < log.index("study wall seconds") and "(exit 0)" in log
  assert (workdir / "smoke" / "results.json").exists()
  result = json.loads((workdir / "results.json").read_text())
  cells = {(c["arm"], c["length"]): c for c in result["cells"]}
  assert set(cells) == {("baseline", 30), ("midas", 30), ("baseline", 60)}
  (speedup,) = result["summary"]["speedups"]
  assert speedup["arm"] == "midas" and len(speedup["per_seed"]) == 1
  assert not list(workdir.rglob("checkpoints"))
  # The GPU config's settings reach the cells: dense attention, a final-depth residual init, the length.
  config = json.loads((workdir / "steps30" / "midas" / "seed0" / "config.json").read_text())
  assert (config["model"]["attention"], config["model"]["residual_init_depth"]) == ("dot_product", "final")
  assert config["data"]["eval_seed"] == result["study"]["eval_seed"] and config["data"]["heldout_shard"] == [0, 2]
  assert cells[("midas", 30)]["steps"] == 30 and cells[("midas", 30)]["eval_every"] == 5
  # Prop-1 of 30 in 2 stages: growth before step 10 (10, 20 steps); the two steps either side are recorded
  # (in the run's metrics: the results file keeps the growth's losses, not every step).
  probe = read_metrics(str(workdir / "steps30" / "midas" / "seed0"), "growth")
  assert [r["offset"] for r in probe] == [-2, -1, 0, 1] and all(r["growth_step"] == 10 for r in probe)
  assert all(r["update_norm/copied"] > 0 and r["grad_norm"] > 0 for r in probe)
  assert "Effective speedup" in (workdir / "study.md").read_text()
  assert "wall seconds:" in log


def test_the_growth_ablation_config_trains_the_default_job_at_its_outlier_seed(repo_root):
  run, study, _ = stacking_study_from_gin([os.path.join(repo_root, "gin", "experiments", "study_growth_cpu.gin")], [])
  gin_config.parse([os.path.join(repo_root, "gin", "experiments", "midas_cpu.gin")], [])
  default = gin_config.run_config_from_gin()
  # The default job's model, data and schedule; only the eval cadence differs (evals do not train).
  assert (run.model, run.data, run.optimizer, run.stacking) == (default.model, default.data, default.optimizer,
                                                                default.stacking)
  assert run.trainer.num_steps == default.trainer.num_steps and 2 in study.seeds and study.growth_window == 10
  vocab = make_vocabulary(run.data).vocab_size
  arms = {arm: study_arms.arm_config(run, arm, 2, vocab).stacking for arm in study.arms}
  assert (arms["midas"].new_moments, arms["midas"].lr_schedule) == ("copy", "global")
  assert (arms["midas_zero_moments"].new_moments, arms["midas_zero_moments"].lr_schedule) == ("zero", "global")
  assert (arms["midas_rewarm"].new_moments, arms["midas_rewarm"].lr_schedule) == ("copy", "rewarm")
