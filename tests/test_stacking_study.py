"""`midas study stacking` end to end at a tiny size, each arm's config, resuming, and the study's statistics on
hand-made cells."""

import dataclasses
import functools
import json
import math
import os

import numpy as np
import pytest

from midas_jax import cli, configs
from midas_jax.checkpoint import load_model
from midas_jax.data.factory import load_data
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder
from midas_jax.studies import (effective_speedup, stacking_config, stacking_study, stacking_study_page,
                               stacking_study_summary, study_arms)
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


def _loss_by_hand(config, workdir, step=None):
  """A checkpoint's loss from the Decoder itself: mean token cross-entropy under the loss weights over the
  eval_batches held-out batches of `config`'s data (no StageBuild, eval step or study code)."""
  ckpt = load_model(str(workdir), step)
  _, pipeline = load_data(config)
  model, total, weight = Decoder(ckpt.model_config), 0.0, 0.0
  for i in range(config.trainer.eval_batches):
    batch = pipeline.batch(i, "validation")
    logits = np.asarray(model.apply({"params": ckpt.params}, batch), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    token_loss = lse - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    total += float((token_loss * batch["loss_weights"]).sum())
    weight += float(batch["loss_weights"].sum())
  return ckpt.model_config.num_layers, total / weight


STUDY = ["--gin.StackingStudyConfig.steps=[20]", "--gin.StackingStudyConfig.ladder_steps=[40]",
         "--gin.StackingStudyConfig.arms=['baseline', 'midas']", "--gin.StackingStudyConfig.seeds=[1, 2]",
         "--gin.StackingStudyConfig.matched_arms=['midas']", "--gin.StackingStudyConfig.test_batches=3",
         "--gin.StackingStudyConfig.memory_questions=3", "--gin.StackingStudyConfig.evals_per_run=4"]


def test_the_study_reads_each_arm_on_the_ladder_on_one_eval_set_and_resumes(tmp_path, repo_root, capsys, monkeypatch):
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  argv = ["study", "stacking", f"--gin_file={gin_file}", f"--workdir={tmp_path}"] + TINY + STUDY
  calls, real_train_cell = [], stacking_study.train_cell

  def train_cell(run, study, arm, seed, *args, cut_short=False, **kwargs):
    calls.append((run.trainer.num_steps, arm, seed))
    if cut_short and len(calls) == 2:
      raise RuntimeError("cut short")
    return real_train_cell(run, study, arm, seed, *args, **kwargs)

  # The first call dies in its second cell: the finished cell is on disk, the study is not.
  monkeypatch.setattr(stacking_study, "train_cell", functools.partial(train_cell, cut_short=True))
  with pytest.raises(RuntimeError, match="cut short"):
    cli.main(argv)
  assert calls == [(20, "baseline", 1), (20, "baseline", 2)] and not (tmp_path / "results.json").exists()
  (first,) = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
  out = capsys.readouterr().out
  assert "training baseline seed 1 at 20 steps" in out and "baseline seed 1: validation loss" in out
  # The re-run trains only the missing cells (the rate grid of one rate, the arms, then the ladder's rung).
  monkeypatch.setattr(stacking_study, "train_cell", train_cell)
  calls.clear()
  assert cli.main(argv) == 0
  assert calls == [(20, "baseline", 2), (20, "midas", 1), (20, "midas", 2), (40, "baseline", 1), (40, "baseline", 2)]
  result = json.loads((tmp_path / "results.json").read_text())
  cells = {(c["length"], c["arm"], c["seed"]): c for c in result["cells"]}
  assert {k: v for k, v in cells[(20, "baseline", 1)].items() if k != "test"} == {
      k: v for k, v in first.items() if k not in ("settings", "growth_steps")}
  midas = cells[(20, "midas", 1)]
  (growth,) = midas["growths"]
  assert (growth["from_depth"], growth["to_depth"]) == (1, 2) and growth["loss_before"] is not None
  # One eval set for everyone: both seeds' runs read identical held-out batches (validation and test halves, from
  # the study's eval seed) while their training batches differ; the halves are different batches.
  configs_ = {seed: load_model(str(tmp_path / "steps20" / "midas" / f"seed{seed}")).config for seed in (1, 2)}
  pipes = {seed: load_data(c)[1] for seed, c in configs_.items()}
  tests = {seed: load_data(study_arms.on_test_shard(c, 3))[1] for seed, c in configs_.items()}
  for step in (0, 2):
    for name in ("inputs", "targets", "loss_weights"):
      assert np.array_equal(pipes[1].batch(step, "validation")[name], pipes[2].batch(step, "validation")[name])
      assert np.array_equal(tests[1].batch(step, "validation")[name], tests[2].batch(step, "validation")[name])
    assert not np.array_equal(pipes[1].batch(step, "train")["inputs"], pipes[2].batch(step, "train")["inputs"])
    assert not np.array_equal(pipes[1].batch(step, "validation")["inputs"],
                              tests[1].batch(step, "validation")["inputs"])
  # The reported loss is the test half's, computed here by hand; the validation curve's last point is the other half.
  test_config = study_arms.on_test_shard(configs_[1], 3)
  assert _loss_by_hand(test_config, tmp_path / "steps20" / "midas" / "seed1") == (
      2, pytest.approx(midas["test"]["loss"], abs=1e-5))
  assert midas["test"]["batches"] == 3 and midas["test"]["se"] > 0 and midas["test"]["device"] == midas["device"]
  assert _loss_by_hand(configs_[1], tmp_path / "steps20" / "midas" / "seed1")[1] == pytest.approx(
      midas["final_eval_loss"], abs=1e-5)
  # The speedup is each seed's own ladder (baseline at 20 and 40 steps) read at the arm's test loss.
  summary = result["summary"]
  (speedup,) = summary["speedups"]
  for row in speedup["per_seed"]:
    ladder = [(cells[(n, "baseline", row["seed"])]["total_flops"], cells[(n, "baseline", row["seed"])]["test"]["loss"])
              for n in (20, 40)]
    mine = cells[(20, "midas", row["seed"])]
    assert row == dict(effective_speedup.effective_speedup(ladder, mine["test"]["loss"], mine["total_flops"]),
                       seed=row["seed"], text=row["text"], flops=mine["total_flops"], loss=mine["test"]["loss"])
  assert [r["length"] for r in summary["ladder"]] == [20, 40]
  # Results as data: provenance, tables, and a page rendered from the file alone.
  said = result["provenance"]
  assert said["device"] and said["commit"] and said["versions"]["jax"]
  assert {"speedup", "gaps", "arms", "ladder", "matched"} <= set(result["tables"])
  assert (tmp_path / "study.md").read_text() == stacking_study_page.markdown(result)
  small = json.loads((tmp_path / "results_tables.json").read_text())  # what docs commit: no cells
  assert small["tables"] == result["tables"] and small["provenance"] == said and "cells" not in small
  assert "Effective speedup" in (tmp_path / "study.md").read_text()
  scored = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
  assert len(scored) == 6 and set(scored[0]["scores"]) == {"primitives", "memorization"}
  assert (tmp_path / "study" / "loss_vs_flops.png").read_bytes()[:4] == b"\x89PNG"
  # More test batches re-measure the kept checkpoints and train nothing.
  monkeypatch.setattr(stacking_study, "train_cell", lambda *a, **k: pytest.fail("trained again"))
  assert cli.main(argv + ["--gin.StackingStudyConfig.test_batches=4"]) == 0
  again = json.loads((tmp_path / "results.json").read_text())
  assert {c["test"]["batches"] for c in again["cells"] if "test" in c} == {4}
  assert [c["final_eval_loss"] for c in again["cells"]] == [c["final_eval_loss"] for c in result["cells"]]


def test_an_edge_best_rate_grid_is_trained_past_its_edge():
  """The study's rate choice on cells whose validation loss is a known function of the rate: best at 1e-2 (the top
  edge) until a step past it shows the loss rising again."""
  trained = []

  class Cells:
    def get(self, steps, arm, rate, seed):
      trained.append((arm, rate, seed))
      return {"final_eval_loss": (math.log10(rate) + 1.6) ** 2 + 0.1 * seed}  # lowest near 10^-1.6 = 0.025

  study = stacking_config.StackingStudyConfig(seeds=(0, 1, 2), arms=("baseline",), steps=(200,),
                                             learning_rates=(1e-3, 3e-3, 1e-2), rate_seeds=1, max_rate_extensions=1)
  (choice,) = stacking_study.choose_rates(Cells(), study, 200, 3e-3, log=lambda line: None).values()
  assert [r for _, r, _ in trained] == [1e-3, 3e-3, 1e-2, 3.33e-2]  # one step past the edge, on the first seed only
  assert {s for _, _, s in trained} == {0}
  assert choice["best"] == 3.33e-2 and choice["extensions"] == 1 and choice["bracketed"] is False
  capped = dataclasses.replace(study, max_rate_extensions=3)
  trained.clear()
  (choice,) = stacking_study.choose_rates(Cells(), capped, 200, 3e-3, log=lambda line: None).values()
  assert [r for _, r, _ in trained][3:] == [3.33e-2, 0.111] and choice["best"] == 3.33e-2 and choice["bracketed"]


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
  settings, read, write = stacking_study._settings, stacking_study._read_rows, stacking_study._write_rows
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  run, study, _ = stacking_study_from_gin([gin_file], [])
  path = str(tmp_path / "cells.jsonl")
  key = (120, "midas", 3e-3, 0)
  write(path, {key: _cell("midas", 0, 2.0, 1.0, 120)}, settings(run, study))
  # Settings as a fresh parse computes them (tuples from gin, lists from JSON) compare equal; the
  # seeds, arms, lengths and rates pick cells, they are not settings.
  assert list(read(path, settings(run, study))) == [key]
  assert list(read(path, settings(run, dataclasses.replace(study, seeds=(5,))))) == [key]
  assert list(read(path, settings(run, dataclasses.replace(study, steps=(120, 480), learning_rates=(1e-3,))))) == [key]
  assert list(read(path, settings(run, dataclasses.replace(study, k_shot=1, ladder_steps=(30,))))) == [key]  # scoring
  assert not read(path, settings(run, dataclasses.replace(study, eval_seed=7)))  # another eval set
  assert list(read(path, settings(run, dataclasses.replace(study, test_batches=8)))) == [key]  # read after training
  # A cell written when the test set was measured inside it (its settings carry test_batches) is still read.
  old = settings(run, study)
  old["study"]["test_batches"] = 64
  write(path, {key: _cell("midas", 0, 2.0, 1.0, 120)}, old)
  assert list(read(path, settings(run, study))) == [key]
  assert not read(path, settings(dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, num_steps=240)),
                                 study))


def test_bad_study_settings_are_named(tmp_path, repo_root, capsys):
  gin_file = os.path.join(repo_root, "gin", "experiments", "study_stacking_cpu.gin")
  args = ["study", "stacking", f"--gin_file={gin_file}", f"--workdir={tmp_path}"]
  assert cli.main(args + ["--gin.StackingStudyConfig.seed=[0]"]) == 2
  assert "seeds" in capsys.readouterr().err
  assert cli.main(args + ["--gin.StackingStudyConfig.arms=['baseline_equal_flops']"]) == 2
  assert "StackingStudyConfig.arms" in capsys.readouterr().err
  assert cli.main(args + ["--gin.StackingStudyConfig.ladder_steps=[120]"]) == 2  # a length already
  assert "StackingStudyConfig.ladder_steps" in capsys.readouterr().err
  assert cli.main(args + ["--gin.StackingStudyConfig.steps=[]", "--gin.TrainerConfig.eval_every=5"]) == 2
  assert "StackingStudyConfig.ladder_steps" in capsys.readouterr().err  # a ladder needs the lengths listed
  assert cli.main(args + ["--gin.StackingStudyConfig.steps=[]", "--gin.StackingStudyConfig.ladder_steps=[]",
                          "--gin.TrainerConfig.eval_every=5"]) == 2  # misses the boundaries 12, 36, 72
  assert "TrainerConfig.eval_every" in capsys.readouterr().err
  with pytest.raises(ConfigError, match="StackingStudyConfig.seeds"):
    stacking_config.StackingStudyConfig(seeds=(0, 0))


def _cell(arm, seed, loss, flops, length, role="arm"):
  return {"arm": arm, "seed": seed, "steps": length, "length": length, "learning_rate": 3e-3, "role": role,
          "total_flops": flops, "final_eval_loss": loss + 0.01, "test": {"loss": loss, "se": 0.005, "tokens": 100},
          "train_seconds": 1.0, "growths": [], "diverged": False, "device": "cpu"}


def _scores(fc, closed_book):
  return {"primitives": {"copying": {"forced_choice": fc}, "psm": {"forced_choice": fc + 0.1}},
          "memorization": {"closed_book": {"forced_choice": closed_book}}}


def test_gaps_and_reasoning_against_memorization_at_matched_loss_on_hand_made_cells():
  """Two seeds; the ladder's rungs at 1e12 and 4e12 FLOPs end at 3.0 and 2.0; MIDAS at 2e12 FLOPs ends at 2.5:
  halfway in loss, so the baseline's scores there are the rungs' mean, and halfway in log-compute, so the
  baseline needs exactly 2e12 FLOPs: a speedup of 1.0."""
  cells, scores = [], {}
  for seed in (0, 1):
    for n, flops, loss, fc, memory in ((10, 1e12, 3.0, 0.2, 0.4), (40, 4e12, 2.0, 0.4, 0.6)):
      cells.append(_cell("baseline", seed, loss, flops, n, "arm" if n == 10 else "ladder"))
      scores[(n, "baseline", 3e-3, seed)] = _scores(fc, memory)
    cells.append(_cell("midas", seed, 2.5, 2e12, 10))
    scores[(10, "midas", 3e-3, seed)] = _scores(0.5 + 0.1 * seed, 0.5)
  study = stacking_config.StackingStudyConfig(seeds=(0, 1), arms=("baseline", "midas"), steps=(10,),
                                             ladder_steps=(40,), matched_arms=("midas",))
  summary = stacking_study_summary.summarize(cells, {}, [], scores, study, tokens_per_step=100, params=10,
                                             corpus_tokens=1000)
  (speedup,) = summary["speedups"]
  assert [r["value"] for r in speedup["per_seed"]] == [pytest.approx(1.0)] * 2
  (gaps,) = summary["gaps"]
  assert gaps["equal_steps"]["values"] == [pytest.approx(-0.5)] * 2  # 2.5 - 3.0
  assert gaps["equal_flops"]["values"] == [pytest.approx(0.0, abs=1e-12)] * 2  # the ladder at 2e12 is 2.5
  (matched,) = summary["matched"]
  # Reasoning: the arm's mean forced choice (0.55, 0.65) minus the rungs' mean ((0.25 + 0.45) / 2 = 0.35);
  # memorization: 0.5 minus (0.4 + 0.6) / 2 = 0.5, so the difference in differences is the reasoning gap.
  assert matched["reasoning"]["values"] == [pytest.approx(0.2), pytest.approx(0.3)]
  assert matched["memory"]["values"] == [pytest.approx(0.0, abs=1e-12)] * 2
  assert matched["did"]["values"] == [pytest.approx(0.2), pytest.approx(0.3)]
  assert matched["did"]["p_sign_flip"] == pytest.approx(0.5)  # two seeds, both positive: 2 of 4 patterns
  assert summary["lengths"][0]["passes"] == pytest.approx(1.0) and summary["devices"] == ["cpu"]
  cells[-1]["test"]["device"] = "another cpu"  # a test loss measured elsewhere than it trained is flagged
  mixed = stacking_study_summary.summarize(cells, {}, [], scores, study, tokens_per_step=100, params=10,
                                           corpus_tokens=1000)
  assert mixed["devices"] == ["another cpu", "cpu"]
  tables = stacking_study_page.tables(dict(summary, rates={}, recheck=[]))
  assert tables["speedup"]["rows"][0][4] == "1.00x, 1.00x"
