"""The `midas` command line: end-to-end runs, and every kind of bad input refused with a clear message."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import cli

TINY_BINDINGS = [
    "--gin.ModelConfig.d_model=32", "--gin.ModelConfig.num_layers=2", "--gin.ModelConfig.num_heads=2",
    "--gin.ModelConfig.num_kv_heads=None", "--gin.ModelConfig.d_ff=64", "--gin.DataConfig.seq_len=32",
    "--gin.DataConfig.batch_size=8", "--gin.TrainerConfig.num_steps=4", "--gin.TrainerConfig.log_every=2",
    "--gin.TrainerConfig.eval_every=4", "--gin.TrainerConfig.eval_batches=1",
    "--gin.TrainerConfig.peak_flops_per_device=1e11",
]
DEMO = os.path.join(REPO_ROOT, "gin", "experiments", "cpu_demo.gin")


def test_python_m_midas_jax_train_end_to_end(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  env.pop("XLA_FLAGS", None)  # one device, as a user's laptop
  proc = subprocess.run([sys.executable, "-m", "midas_jax", "train", f"--gin_file={DEMO}",
                         f"--workdir={tmp_path}", *TINY_BINDINGS], capture_output=True, text=True,
                        env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["steps"] == 4 and summary["final_eval_loss"] is not None
  operative = (tmp_path / "operative_config.gin").read_text()
  assert "ModelConfig.d_model = 32" in operative and "TrainerConfig.num_steps = 4" in operative
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert {l["split"] for l in lines} == {"train", "eval"}


def _printed(pattern, text):
  """The numbers a regex captures in the printed report (thousands separators dropped)."""
  match = re.search(pattern, text)
  assert match, (pattern, text)
  return [float(g.replace(",", "")) for g in match.groups()]


def test_bench_train_reports_mfu_against_a_same_run_peak(capsys, tmp_path, no_compile_cache):
  out = tmp_path / "bench.json"
  rc = cli.main(["bench", "train", f"--gin_file={DEMO}", "--steps=2", "--warmup=1", "--peak_size=256", f"--json={out}",
                 *TINY_BINDINGS])
  assert rc == 0
  text = capsys.readouterr().out
  report = json.loads(out.read_text())
  achieved, peaks, ratios = report["achieved_flops_per_device"], report["peak_flops_per_device"], report["peak_ratios"]
  # TrainerConfig.peak_flops_per_device (1e11 in TINY_BINDINGS) is the MFU denominator, as in training.
  assert report["mfu_denominator"] == "override" and peaks["override"] == 1e11
  assert report["mfu"] == pytest.approx(achieved / 1e11, rel=1e-12)
  assert report["compute_peak"] == "bfloat16_f32_accum"  # the demo computes in bf16
  tokens = 8 * 32  # batch x seq_len of TINY_BINDINGS
  # The model FLOPs by hand, for TINY_BINDINGS on the demo: llama, d_model 32, 2 layers, 2 heads of 16
  # (num_kv_heads None: k and v span every head), d_ff 64, and a head tied to the embedding of 512 rows
  # (the byte vocabulary's 3 specials + 256 bytes + 128 extra ids = 387, padded to a multiple of 128).
  per_token = (6 * 2 * 4 * 32 * 32  # q, k, v, o (32 x 32 each) in 2 layers: 6 FLOPs a weight, 2 forward + 4 backward
               + 6 * 2 * 3 * 32 * 64  # gate, up, down (32 x 64 each) in 2 layers
               + 6 * 32 * 512  # the LM head: tied, yet a matmul
               + 6 * 2 * 2 * (32 // 2) * 2 * 16)  # QK^T and AV in 2 layers, the causal triangle once: 16 keys a query
  assert per_token == 233_472
  assert report["model_flops_per_step"] == tokens * per_token == 59_768_832
  assert report["tokens_per_second"] == pytest.approx(tokens / report["step_seconds_median"], rel=1e-12)
  assert achieved == pytest.approx(report["model_flops_per_step"] / report["step_seconds_median"] / 8, rel=1e-12)
  for name in ("float32", "bfloat16_f32_accum", "override"):
    assert ratios[name] == pytest.approx(achieved / peaks[name], rel=1e-12), name
  # Throughput per GFLOP/s of the same run's float32 peak, the figure that compares across machines.
  assert report["tokens_per_second_per_float32_peak_gflops"] == pytest.approx(
      report["tokens_per_second"] / (peaks["float32"] / 1e9), rel=1e-12)
  # The printed figures agree to their rounding: GFLOP/s to 0.005, percentages to 0.005 points.
  printed_achieved, = _printed(r"([\d,.]+) GFLOP/s per device \(model FLOPs", text)
  for name in ("float32", "bfloat16_f32_accum", "override"):
    peak, ratio = _printed(rf"peak {name} +([\d,.]+) GFLOP/s per device .*-> ratio ([\d.]+)%", text)
    low = (printed_achieved - 0.005) / (peak + 0.005) * 100 - 0.005
    high = (printed_achieved + 0.005) / max(peak - 0.005, 1e-9) * 100 + 0.005
    assert low <= ratio <= high, (name, printed_achieved, peak, ratio)
  mfu, = _printed(r"MFU +([\d.]+)% of the override peak", text)
  assert mfu == pytest.approx(ratios["override"] * 100, abs=0.005 + 1e-9)


def test_write_corpus(tmp_path, capsys):
  assert cli.main(["data", "write-corpus", f"--out={tmp_path}"]) == 0
  assert (tmp_path / "train.txt").stat().st_size > 1_000_000


@pytest.mark.parametrize("extra_args, setting, fix", [
    (["--gin.ModelConfig.d_modle=64"], "ModelConfig.d_modle", "did you mean d_model"),
    (["--gin.ModelConfg.d_model=64"], "ModelConfg", "did you mean ModelConfig"),
    (["--gin.ModelConfig.num_heads=3"], "ModelConfig.num_heads", "divides d_model"),
    (["--gin.ModelConfig.family=bert"], "ModelConfig.family", "use one of"),
    (["--gin.MeshConfig.data=3"], "MeshConfig", "needs 3 devices but 8"),
    (["--gin.DataConfig.source=text", "--gin.DataConfig.train_files=['/nonexistent/*.txt']"],
     "DataConfig.train_files", "matches no file"),
    (["--gin.DataConfig.seq_len=4096"], "DataConfig.seq_len", "max_seq_len"),
    (["--gin_file=gin/experiments/no_such.gin"], "--gin_file", "existing file"),
    (["--gin.ModelConfig.d_model"], "--gin.ModelConfig.d_model", "--gin.Class.setting=VALUE"),
])
def test_bad_input_gets_a_clear_error_before_compiling(tmp_path, capsys, extra_args, setting, fix):
  workdir = tmp_path / "run"
  rc = cli.main(["train", f"--gin_file={DEMO}", f"--workdir={workdir}", *extra_args])
  err = capsys.readouterr().err
  assert rc == 2
  assert setting in err and fix in err, err
  assert "Traceback" not in err
  assert not (workdir / "metrics.jsonl").exists()


def test_unwritable_workdir_and_unknown_flag(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  assert cli.main(["train", f"--gin_file={DEMO}", f"--workdir={blocker}/run"]) == 2
  assert "--workdir" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["train", f"--gin_file={DEMO}", "--workdir=x", "--no_such_flag"])


def test_data_sample_writes_decoded_examples(tmp_path, capsys):
  out = tmp_path / "sample.jsonl"
  assert cli.main(["data", "sample", f"--gin_file={DEMO}", "--steps=2", f"--out={out}",
                   "--gin.ObjectivesConfig.mode_tokens=True"]) == 0
  records = [json.loads(l) for l in out.read_text().splitlines()]
  assert {r["step"] for r in records} == {0, 1}
  assert {r["objective"] for r in records} == {"causal", "prefix", "span"}
  for r in records:
    assert r["prefix_tokens"] + r["target_tokens"] <= 256
    if r["objective"] == "span":
      assert r["prefix"].startswith("[NLU]") and "<extra_id_0>" in r["prefix"]
      assert r["target"].startswith("<extra_id_0>")
    elif r["objective"] == "prefix":
      assert r["prefix"].startswith("[S2S]")
    else:
      assert r["prefix"] == "" and r["prefix_tokens"] == 0


def _leaf_parsers(parser, path=()):
  """(command words, parser) for every command that runs something."""
  import argparse  # pylint: disable=import-outside-toplevel
  groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # pylint: disable=protected-access
  if not groups:
    yield path, parser
  for group in groups:
    for name, sub in group.choices.items():
      yield from _leaf_parsers(sub, path + (name,))


def test_every_command_is_added_the_same_way_with_a_handler():
  commands = dict(_leaf_parsers(cli.parser()))
  assert {("train",), ("compare",), ("inspect",), ("eval",), ("report",), ("export",), ("import",),
          ("study", "anchor"), ("study", "stacking"), ("bench", "train"), ("bench", "compile"),
          ("bench", "data"), ("data", "prepare"), ("data", "sample")} <= set(commands)
  for words, parser in commands.items():
    assert callable(parser.get_default("handler")), " ".join(words)
