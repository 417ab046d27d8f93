"""`midas eval` and `midas report` end to end on a tiny trained, grown checkpoint."""

import json
import os
import re
import shutil

import pytest

from conftest import replace, tiny_model, tiny_run
from midas_jax import cli, configs
from midas_jax.checkpoint import load_model, write_params_export
from midas_jax.evals import primitives, suites
from midas_jax.train.run import train

STEPS = 6
EVAL_FLAGS = ["--k_shot=1", "--num_examples=4", "--finetune_examples=8", "--finetune_steps=3", "--loop_repeats=2",
              "--batch_size=8", "--opt=max_checkpoints=1", "--opt=score_examples=4"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
  """A 2-layer model grown from 1 layer at step 2 (MIDAS, blocks of 1), 6 steps, then `midas eval --suite=all`."""
  workdir = str(tmp_path_factory.mktemp("evals") / "run")
  config = tiny_run(model=tiny_model(max_seq_len=128), data=configs.DataConfig(seq_len=128, batch_size=8),
                    trainer=configs.TrainerConfig(num_steps=STEPS, log_every=2, eval_every=3, eval_batches=1,
                                                  progress_bar=False, peak_flops_per_device=1e11))
  train(replace(config, stacking=configs.StackingConfig(num_stages=2, block_size=1)), workdir)
  assert cli.main(["eval", f"--workdir={workdir}", "--suite=all"] + EVAL_FLAGS) == 0
  return workdir


def _read(workdir, suite):
  with open(os.path.join(workdir, "eval", f"{suite}.json")) as f:
    return json.load(f)


def test_every_suite_writes_json_with_the_checkpoint_step_stage_and_depth(evaluated):
  for name in suites.resolve("all"):
    record = _read(evaluated, name)
    assert (record["suite"], record["step"], record["stage"], record["depth"]) == (name, STEPS, 2, 2)
    assert record["options"]["k_shot"] == 1 and record["options"]["num_examples"] == 4
  prim = _read(evaluated, "primitives")["results"]
  assert list(prim["tasks"]) == list(primitives.TASKS) and prim["context_len"] == 128
  for name, task in prim["tasks"].items():
    assert task["total"] == 4 and task["accuracy"] == task["correct"] / 4 and task["shots_truncated"] == 0
    assert task["primitive"] == primitives.TASKS[name].primitive and task["depth"] == primitives.TASKS[name].depth
    for sample in task["samples"]:
      assert sample["prompt"].endswith(sample["meta"]["query"]) and sample["prompt"].count("\n") == 1  # one shot
      assert sample["correct"] == (sample["ended"] and sample["prediction"].split("\n")[0].strip().rstrip(".")
                                   == sample["answer"].strip())
  scores = _read(evaluated, "primitive_scores")["results"]
  assert list(scores["tasks"]) == list(primitives.TASKS) and scores["score_examples"] == 4
  for task in scores["tasks"].values():
    assert task["questions"] == 4 and set(task["scores"]) == {"log_likelihood", "forced_choice", "token_accuracy",
                                                              "exact_match"}
    for score in task["scores"].values():
      assert score["ci95"][0] <= score["value"] <= score["ci95"][1] and score["chance"] is not None
  ft = _read(evaluated, "primitives_finetune")["results"]
  assert all(t["total"] == 4 and t["train_examples"] == 8 and t["steps"] == 3 for t in ft["tasks"].values())
  mem = _read(evaluated, "memorization")["results"]
  assert mem["num_questions"] == 4 and 0 < mem["chance"] < 1
  assert {c: mem[c]["total"] for c in ("closed_book", "open_book", "open_book_counterfactual")} == \
      {"closed_book": 4, "open_book": 4, "open_book_counterfactual": 4}
  for suite, figure in (("primitives", "primitives.png"), ("looping", "looping.png"),
                        ("memorization", "memorization.png"), ("primitives_finetune", "primitives_finetune.png"),
                        ("primitive_scores", "primitive_scores.png")):
    assert figure in _read(evaluated, suite)["results"]["figures"]
    assert os.path.getsize(os.path.join(evaluated, "eval", figure)) > 1000


def test_looping_once_is_the_plain_model_and_the_block_is_the_one_midas_copies(evaluated):
  loop = _read(evaluated, "looping")["results"]
  prim = _read(evaluated, "primitives")["results"]["tasks"]
  # Depth 2 in blocks of 1: MIDAS's middle block is block ceil(2/2) = 1, layer 0.
  assert (loop["block_size"], loop["loop_start"], loop["repeats"]) == (1, 0, [1, 2])
  assert loop["effective_depth"] == {"1": 2, "2": 3}
  for name, task in loop["tasks"].items():
    assert task["accuracy"]["1"] == prim[name]["accuracy"]
    assert [s["prediction"] for s in task["samples"]["1"]] == [s["prediction"] for s in prim[name]["samples"]]
    assert set(task["accuracy"]) == {"1", "2"}


def test_report_assembles_curves_tables_and_figures(evaluated):
  assert cli.main(["report", f"--workdir={evaluated}"]) == 0
  page = open(os.path.join(evaluated, "report.md")).read()
  for heading in ("## Loss per objective", "## Throughput", "## Reasoning primitives, 1-shot",
                  "## Reasoning primitives: scores that move early, 1-shot", "**forced choice among candidates**",
                  "## Reasoning primitives after fine-tuning", "## Looping the middle block at inference",
                  "## Memorization against reasoning"):
    assert heading in page
  prim = _read(evaluated, "primitives")["results"]["tasks"]
  for name, task in prim.items():
    lo, hi = task["accuracy_ci95"]
    assert f"| {name} | {task['primitive']} | {'-' if task['depth'] is None else task['depth']} | " \
           f"{task['majority_share']:.3f} | {task['accuracy']:.3f} [{lo:.2f}, {hi:.2f}] |" in page
  scores = _read(evaluated, "primitive_scores")["results"]["tasks"]
  fc = scores["copying"]["scores"]["forced_choice"]
  assert f"| copying | {fc['chance']:.3f} | {fc['value']:.3f} [{fc['ci95'][0]:.3f}, {fc['ci95'][1]:.3f}] |" in page
  links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
  assert "report/loss_curves.png" in links and "eval/similarity_layers.png" in links
  assert all(os.path.isfile(os.path.join(evaluated, link)) for link in links)


def test_a_compare_folder_gets_one_column_per_run(evaluated, tmp_path):
  for name in ("baseline", "midas"):
    shutil.copytree(evaluated, tmp_path / name, ignore=shutil.ignore_patterns("checkpoints", "report*"))
  with open(tmp_path / "comparison.json", "w") as f:
    json.dump({"runs": [{"run": "baseline"}, {"run": "midas"}]}, f)
  assert cli.main(["report", f"--workdir={tmp_path}"]) == 0
  page = (tmp_path / "report.md").read_text()
  assert "| task | primitive | depth | majority | baseline | midas |" in page
  assert all(os.path.isfile(tmp_path / link) for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page))


def test_a_params_only_export_is_enough_and_a_baseline_needs_a_block_size(evaluated, tmp_path, capsys):
  model = load_model(evaluated)
  export = str(tmp_path / "export")
  baseline_like = replace(model.config, stacking=configs.StackingConfig())  # a run that never grew
  write_params_export(export, model.params, baseline_like, {"step": model.step, "stage": 1, "depth": 2})
  assert cli.main(["eval", f"--workdir={export}", "--suite=primitives,looping", "--loop_block_size=1"]
                  + EVAL_FLAGS) == 0
  for suite in ("primitives", "looping"):
    assert _read(export, suite)["results"]["tasks"] == _read(evaluated, suite)["results"]["tasks"]
  capsys.readouterr()
  assert cli.main(["eval", f"--workdir={export}", "--suite=looping"] + EVAL_FLAGS) == 2
  assert "--loop_block_size" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--suite=nonsense"], "--suite"),
    (["--suite=looping", "--loop_block_size=3"], "--suite"),
    (["--suite=primitives", "--tasks=copying,nope"], "--tasks"),
    (["--suite=primitives", "--num_examples=0"], "--num_examples"),
    (["--suite=primitives", "--opt=novalue"], "--opt"),
])
def test_bad_eval_flags_exit_2_naming_the_setting(evaluated, argv, named, capsys):
  assert cli.main(["eval", f"--workdir={evaluated}"] + argv) == 2
  assert named in capsys.readouterr().err


def test_suites_live_in_modules_named_for_them_and_lm_eval_runs_alone():
  named_otherwise = {"primitives_finetune": "finetune", "lm_eval": "lm_eval_adapter"}
  for name, module in suites.SUITES.items():
    assert module.__name__ == f"midas_jax.evals.{named_otherwise.get(name, name)}"
  assert suites.runs_alone("lm_eval") and not any(suites.runs_alone(n) for n in suites.SUITES if n != "lm_eval")
  assert suites.resolve("all") == [n for n in suites.SUITES if n != "lm_eval"]


def test_missing_workdirs_exit_2(tmp_path, capsys):
  assert cli.main(["eval", f"--workdir={tmp_path / 'nowhere'}", "--suite=primitives"]) == 2
  assert cli.main(["eval", f"--workdir={tmp_path}", "--suite=primitives"]) == 2  # no checkpoints, no export
  assert cli.main(["report", f"--workdir={tmp_path}"]) == 2
  assert "--workdir" in capsys.readouterr().err
