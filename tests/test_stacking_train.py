"""Training that grows: stages, growth in the loop, metrics at equal compute, `midas inspect`."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from conftest import REPO_ROOT, tiny_model
from midas_jax import cli, configs
from midas_jax.train.run import train
from midas_jax.train.metrics import read_metrics


def stacked_run(operator="midas", **stacking):
  return configs.RunConfig(
      model=tiny_model(num_layers=4), mesh=configs.MeshConfig(),
      optimizer=configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=2),
      data=configs.DataConfig(seq_len=32, batch_size=8),
      trainer=configs.TrainerConfig(num_steps=8, log_every=1, eval_every=8, eval_batches=1,
                                    progress_bar=False, peak_flops_per_device=1e11),
      stacking=configs.StackingConfig(operator=operator, **stacking))


@pytest.mark.parametrize("operator, provenance", [("midas", [0, 1, 0, 1]), ("gradstack", [0, 1, 0, 1])])
def test_two_stage_run_grows_at_the_boundary(tmp_path, capsys, operator, provenance):
  config = stacked_run(operator, num_stages=2, stage_steps=(3, 5))
  result = train(config, str(tmp_path))
  rows = read_metrics(str(tmp_path), "train")
  assert [r["depth"] for r in rows] == [2, 2, 2, 4, 4, 4, 4, 4]
  assert [r["stage"] for r in rows] == [1, 1, 1, 2, 2, 2, 2, 2]
  flops = [r["cumulative_flops"] for r in rows]
  per_step = np.diff([0] + flops)
  assert np.all(per_step[:3] == per_step[0]) and np.all(per_step[3:] == per_step[3])
  assert per_step[3] > 1.5 * per_step[0]  # twice the layers, plus the same embedding/head cost
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert result.growths[0]["step"] == 3 and result.growths[0]["provenance"] == provenance
  stages = json.loads((tmp_path / "stages.json").read_text())
  assert stages["depth"] == 4 and stages["stage"] == 2 and stages["block_size"] == 2
  assert [l["origin"] for l in stages["layers"]] == [0, 1, 0, 1]
  assert [l["born_stage"] for l in stages["layers"]] == [1, 1, 2, 2]
  capsys.readouterr()
  assert cli.main(["inspect", f"--workdir={tmp_path}"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["schedule"]["stage_steps"] == [3, 5] and printed["config"]["stacking"]["operator"] == operator


def test_rewarm_restarts_the_learning_rate_after_growth(tmp_path):
  config = stacked_run("midas", num_stages=2, stage_steps=(4, 4), lr_schedule="rewarm", rewarm_steps=2)
  train(config, str(tmp_path))
  lr = [r["learning_rate"] for r in read_metrics(str(tmp_path), "train")]
  assert lr[4] < lr[3] and lr[5] > lr[4]  # step 4 is the first of stage 2: half-way up the ramp
  global_run = stacked_run("midas", num_stages=2, stage_steps=(4, 4))
  train(global_run, str(tmp_path / "global"))
  lr_global = [r["learning_rate"] for r in read_metrics(str(tmp_path / "global"), "train")]
  assert lr_global[4] == pytest.approx(2 * lr[4], rel=1e-5) and lr_global[5] == pytest.approx(lr[5], rel=1e-5)


def test_inspect_without_a_run_is_a_clear_error(tmp_path, capsys):
  assert cli.main(["inspect", f"--workdir={tmp_path}"]) == 2
  assert "--workdir" in capsys.readouterr().err


def test_compare_trains_the_pair_and_writes_table_and_plot(tmp_path):
  from midas_jax import compare  # pylint: disable=import-outside-toplevel
  config = stacked_run("midas", num_stages=2, stage_steps=(4, 4))
  config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, eval_every=2))
  report = compare.compare(config, str(tmp_path))
  base, stacked = report["runs"]
  assert base["run"] == "baseline" and stacked["run"] == "midas"
  assert base["steps"] == stacked["steps"] == 8
  assert report["flop_ratio"] > 1.2 and stacked["total_flops"] < base["total_flops"]
  for row in (base, stacked):
    assert row["final_eval_loss"] is not None and row["eval_loss/causal"] is not None
  table = (tmp_path / "comparison.md").read_text()
  assert "| baseline |" in table
  # Equal FLOPs: the baseline's eval curve (steps 2, 4, 6, 8) read at MIDAS's total, by interpolation.
  evals = read_metrics(base["workdir"], "eval")
  at = report["baseline_eval_loss_at_stacked_flops"]
  assert at == pytest.approx(np.interp(stacked["total_flops"], [r["cumulative_flops"] for r in evals],
                                       [r["loss"] for r in evals]))
  assert f"at midas's total {stacked['total_flops']:.3e} FLOPs (interpolated on its eval curve) is {at:.4f}" in table
  assert compare.loss_at_flops(evals, evals[0]["cumulative_flops"] / 2) is None  # no extrapolation
  png = (tmp_path / "loss_vs_flops.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  assert json.loads((tmp_path / "comparison.json").read_text())["growths"][0]["step"] == 4


def test_a_registered_operator_runs_through_the_trainer(tmp_path):
  """fresh_block (an extension example) appends a freshly initialized block: provenance -1."""
  result = train(stacked_run("fresh_block", num_stages=2, stage_steps=(3, 5)), str(tmp_path))
  assert result.growths[0]["provenance"] == [0, 1, -1, -1]
  rows = read_metrics(str(tmp_path), "train")
  assert rows[-1]["depth"] == 4 and np.isfinite(rows[-1]["loss"])
  layers = json.loads((tmp_path / "stages.json").read_text())["layers"]
  assert [l["origin"] for l in layers] == [0, 1, None, None]


def test_bench_stacking_reports_measured_against_theoretical(tmp_path, capsys, no_compile_cache):
  bindings = ["--gin.ModelConfig.d_model=32", "--gin.ModelConfig.num_layers=4", "--gin.ModelConfig.num_heads=2",
              "--gin.ModelConfig.num_kv_heads=None", "--gin.ModelConfig.d_ff=64", "--gin.DataConfig.seq_len=32",
              "--gin.DataConfig.batch_size=8", "--gin.TrainerConfig.num_steps=8", "--gin.TrainerConfig.log_every=4",
              "--gin.TrainerConfig.eval_every=8", "--gin.TrainerConfig.eval_batches=1",
              "--gin.TrainerConfig.peak_flops_per_device=1e11"]
  out = tmp_path / "bench.json"
  demo = os.path.join(REPO_ROOT, "gin", "experiments", "cpu_demo.gin")
  assert cli.main(["bench", "stacking", f"--gin_file={demo}", f"--workdir={tmp_path}/runs",
                   f"--json={out}", *bindings]) == 0
  text = capsys.readouterr().out
  assert "measured/theoretical" in text and "theoretical speedup" in text
  report = json.loads(out.read_text())
  # Prop-1, k = 4 over 8 steps rounds to stages of (1, 2, 2, 3) steps at depths 1, 2, 3, 4:
  # 8 * 4 layer-steps at full depth over 1 * 1 + 2 * 2 + 2 * 3 + 3 * 4 = 23.
  assert report["layer_only_speedup"] == 32 / 23
  # Training FLOPs per token at depth n, by hand: a layer has q, k, v, o (32 x 32 each: 2 heads of 16,
  # num_kv_heads None) and gate, up, down (32 x 64 each), 6 FLOPs a weight (2 forward + 4 backward), plus
  # QK^T and AV over the causal triangle (16 of the 32 keys a query on average) for 2 heads of 16; the
  # head, tied to the 512-row embedding (byte vocabulary: 387 ids padded to a multiple of 128), once.
  layer = 6 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * (32 // 2) * 2 * 16)
  head = 6 * 32 * 512
  per_token = {n: n * layer + head for n in (1, 2, 3, 4)}
  assert (layer, head) == (67_584, 98_304)
  stacked_flops = 1 * per_token[1] + 2 * per_token[2] + 2 * per_token[3] + 3 * per_token[4]
  assert report["theoretical_speedup"] == pytest.approx(8 * per_token[4] / stacked_flops, rel=1e-12)
  assert 8 * per_token[4] / stacked_flops == 160 / 127  # 2,949,120 over 2,340,864: below 32 / 23 (the head)
  # The two runs' logged FLOPs (8 rows of 32 tokens a step) are the same hand counts.
  base, stacked = report["runs"]
  assert base["total_flops"] == 8 * 32 * 8 * per_token[4] and stacked["total_flops"] == 8 * 32 * stacked_flops
  assert report["flop_ratio"] == pytest.approx(160 / 127, rel=1e-12)
  assert [g["step"] for g in report["growths"]] == [1, 3, 5]
  # The measured speedup is the ratio of the unrounded training times the report carries.
  assert report["measured_speedup"] == base["train_seconds"] / stacked["train_seconds"]
  assert all(r["train_seconds"] != round(r["train_seconds"], 2) for r in (base, stacked))  # not rounded
  printed, = re.search(r"measured speedup +([\d.]+)x", text).groups()
  assert float(printed) == pytest.approx(report["measured_speedup"], abs=5e-4)
