"""`midas bench compile`: per-device memory from an ahead-of-time compile, checked against counts
made here, and the analytic path for a TPU slice this machine cannot compile for."""

import dataclasses
import glob
import json
import os

import pytest

from conftest import REPO_ROOT, tiny_model, tiny_run
from midas_jax import cli, configs, flops, gin_config, results
from midas_jax.analysis import compile_table, memory_model, targets
from midas_jax.bench import compile_bench
from midas_jax.errors import ConfigError


def _fsdp_run(batch_size, **model):
  return tiny_run(model=tiny_model(num_layers=4, d_model=64, d_ff=128, vocab_size=512, **model),
                  mesh=configs.MeshConfig(data=1, fsdp=-1), data=configs.DataConfig(seq_len=64, batch_size=batch_size))


def test_compiled_on_the_simulated_mesh_matches_independent_counts():
  small, large = compile_bench.run(_fsdp_run(8)), compile_bench.run(_fsdp_run(16))
  assert small["method"] == "compiled" and small["devices"] == 8 and small["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  # Every parameter has one `embed` axis, split 8 ways under fsdp: float32 params / 8 per device.
  params = flops.param_counts(tiny_model(num_layers=4, d_model=64, d_ff=128, vocab_size=512))["total"]
  per_device = params * 4 // 8
  a = small["analytic"]
  assert a["params"] == per_device
  assert 0 <= a["optimizer"] - 2 * per_device <= 64  # Adam's mu and nu, plus a few int32 step counts
  # XLA's own count of the step's inputs: the state plus one row of seven [64] arrays (one of them bool).
  batch = 1 * 64 * (6 * 4 + 1)
  assert small["batch"]["bytes_per_device"] == batch
  assert small["compiled"]["argument"] == a["params"] + a["optimizer"] + batch
  assert small["compiled"]["alias"] == a["params"] + a["optimizer"]  # the donated state is updated in place
  # Activations grow with the rows each device holds (1 row, then 2). Measured: XLA's CPU temporaries grow
  # by 2,526,976 bytes per row, the formula by 1,998,848 (test_activation_terms_by_hand): a ratio of 1.264
  # (CPU XLA fuses and reuses buffers its own way, so the formula need not meet it). The 10% margin is for
  # another XLA's buffer assignment; dropping any one term of the formula (scores 458,752 bytes a row,
  # logits 393,216, working set 425,984) moves the ratio by more than 24%.
  compiled_per_row = large["compiled"]["temp"] - small["compiled"]["temp"]
  analytic_per_row = large["analytic"]["activations"] - small["analytic"]["activations"]
  assert compiled_per_row / analytic_per_row == pytest.approx(1.264, rel=0.10), (compiled_per_row, analytic_per_row)
  assert small["activation_parts"] == memory_model.activation_bytes(_fsdp_run(8).model, rows=1, seq_len=64)
  assert small["fits"] is None and "unknown" in compile_bench.format_report(small)


def test_activation_terms_by_hand():
  """Each term of memory_model.activation_bytes against its own formula, for the compiled test's model:
  llama, float32, d_model 64, 4 layers, 4 heads and 2 kv heads of 16, d_ff 128, vocab 512, 64 tokens a row."""
  model = _fsdp_run(8).model
  parts = lambda rows, seq: memory_model.activation_bytes(model, rows=rows, seq_len=seq)
  # Dense attention scores: [rows, heads, T, T], kept in the compute dtype by the forward (every layer's
  # `saved`, and once in `working`) and, in `working`, as float32 scores and their float32 softmax: 4 + 4 + 4
  # bytes an entry in `working`, 4 in each layer's `saved`. The only term quadratic in T: doubling T to 128
  # leaves, of 2 x parts(T=64), exactly the scores of the extra (128^2 - 2 x 64^2) entries.
  scores = lambda rows, seq: rows * 4 * seq * seq
  extra = {k: v - 2 * parts(1, 64)[k] for k, v in parts(1, 128).items()}
  extra_scores = scores(1, 128) - 2 * scores(1, 64)
  assert extra == {"saved": 4 * 4 * extra_scores, "working": 12 * extra_scores, "logits": 0}
  # Logits: float32 [rows, T, vocab], three times (the logits, their softmax, their gradient).
  assert parts(1, 64)["logits"] == 3 * 1 * 64 * 512 * 4 == 393_216
  assert parts(3, 64)["logits"] == 3 * 393_216
  # One layer's working set, per token: 4 tensors of d_model, 2 of the 4 query heads and 2 of the 2 kv heads
  # (16 wide each: q, k, v and their copies), the attention output (4 heads x 16), and gate, up and their
  # product (3 x d_ff 128), in float32: 896 values, 3,584 bytes a token, besides the scores.
  per_token = 4 * 64 + (2 * 4 + 2 * 2) * 16 + 4 * 16 + 3 * 128
  assert per_token == 896
  assert parts(1, 64)["working"] == 64 * per_token * 4 + scores(1, 64) * 12 == 425_984
  # No remat: the forward keeps all of it, less the float32 copies of the scores, for each of the 4 layers.
  assert parts(1, 64)["saved"] == 4 * (64 * per_token * 4 + scores(1, 64) * 4) == 1_179_648
  assert parts(2, 64) == {k: 2 * v for k, v in parts(1, 64).items()}  # linear in the rows


def test_tpu_slices_are_named_as_gcloud_names_them():
  for name, devices, topology in (("v4-64", 32, "v4:2x4x4"), ("v4-8", 4, "v4:2x2x1"), ("v5p-128", 64, "v5:4x4x4"),
                                  ("v5litepod-256", 256, "v5e:16x16"), ("v5e-8", 8, "v5e:2x4")):
    target = targets.parse_target(name)
    assert (target.num_devices, target.topology) == (devices, topology), name
  assert targets.parse_target("gpu-8").num_devices == 8
  two = targets.parse_target("2xv5p-128")
  assert (two.num_devices, two.num_slices, two.topology) == (128, 2, "v5:4x4x4")


def test_flash_chunked_loss_and_microbatches_shrink_the_estimate(tmp_path, capsys):
  model = tiny_model(num_layers=8, d_model=256, num_heads=4, d_ff=512, vocab_size=4096, max_seq_len=1024)
  dense = memory_model.activation_bytes(model, rows=4, seq_len=1024)
  flash = memory_model.activation_bytes(model, rows=4, seq_len=1024, attention="flash", loss_chunk=256)
  assert flash["working"] < dense["working"] / 3  # no [rows, heads, T, T] scores
  assert flash["logits"] == dense["logits"] // 4  # one chunk of 256 of the 1024 positions
  config = tiny_run(model=model, mesh=configs.MeshConfig(data=1, fsdp=-1),
                    data=configs.DataConfig(seq_len=256, batch_size=32),
                    trainer=configs.TrainerConfig(microbatches=4))
  whole = compile_bench.run(dataclasses.replace(config, trainer=configs.TrainerConfig()), "v5p-16", "analytic")
  micro = compile_bench.run(config, "v5p-16", "analytic")
  assert micro["model"]["attention"] == "flash"  # 'auto' on a TPU slice, even from this CPU host
  assert micro["analytic"]["activations"] < whole["analytic"]["activations"] / 3
  assert micro["analytic"]["gradients"] == 2 * whole["analytic"]["gradients"]  # the float32 gradient sum
  assert "in 4 microbatches" in compile_bench.format_report(micro)
  with pytest.raises(ConfigError, match="dcn_data"):
    compile_bench.run(config, "2xv5p-16", "analytic")  # a 2-slice target needs a 2-slice mesh
  # The docs table: a row per `after` report, its `before` matched by model, target and batch shape.
  refused = dict(whole, fits=False, method="compiled", compile_error="RESOURCE_EXHAUSTED: Ran out of memory on HBM, "
                 "the total memory required for HLO temporaries (31.96G) exceeds available HBM (30.75G).")
  table = compile_table.table([micro], [refused])
  assert "| 4 | flash | refused: temporaries 31.96G > 30.75G | **no** |" in table and table.count("\n") == 2
  # A `before` set that has the same microbatches too gives that one, and the single pass to the others.
  micro_before = dict(micro, compiled={"peak": 3 * 2 ** 30}, method="compiled")
  table = compile_table.table([micro, whole], [refused, micro_before])
  assert "| 4 | flash | 3.00 | yes |" in table and "| 1 | flash | refused: temporaries" in table
  # The command takes a shell glob's many reports after one flag (`--after after/*.json`).
  for name, report in [("micro", micro), ("whole", whole)]:
    (tmp_path / f"{name}.json").write_text(json.dumps(report))
  assert cli.main(["bench", "compile-table", "--after", str(tmp_path / "micro.json"), str(tmp_path / "whole.json"),
                   "--before", str(tmp_path / "whole.json")]) == 0
  assert capsys.readouterr().out.count("\n| 0B | `v5p-16` |") == 2


def test_analytic_estimate_for_a_tpu_slice(monkeypatch):
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")  # a compile for the slice sets its flags here: restored after
  config = _fsdp_run(64, attention="flash")  # 'auto' would pick dot_product for this CPU host's devices
  report = compile_bench.run(config, topology="v5p-16", method="analytic")
  assert report["method"] == "analytic" and report["devices"] == 8 and report["mesh"]["fsdp"] == 8
  local = compile_bench.run(config, method="analytic")  # the same mesh shape on the simulated devices
  assert report["analytic"] == local["analytic"]  # the mesh shape fixes every figure, not the device kind
  assert report["hbm"] == 95 * 2 ** 30 and report["fits"] is True
  assert report["max_global_batch"] >= 64
  text = compile_bench.format_report(report)
  assert "analytic" in text and "fits in 95.00 GiB" in text
  auto = compile_bench.run(config, topology="v5p-16")
  if targets.tpu_devices(targets.parse_target("v5p-16"))[0] is None:  # no libtpu here
    assert auto["method"] == "analytic" and "cannot describe a TPU slice" in auto["note"]
  else:  # the test extra's libtpu: compiled for the slice, with the v5p's libtpu flags set
    assert auto["method"] == "compiled" and auto["compiled"]["peak"] > 0 and auto["tpu_flags"]
    assert sum(auto["compiled"]["reductions_by_depth"].values()) > 0  # FSDP reduces gradients
    # and priced by the cost model at the config's depth (analysis/cost_model.py has the pricing's checks)
    step = auto["estimated"]["steps"][str(config.model.num_layers)]
    assert step["seconds"] > 0 and step["tokens_per_s_per_chip"] > 0 and 0 < step["mfu_estimate"] < 1
    text = compile_bench.format_report(auto)
    assert "an estimate, not a measured time" in text and "bound" not in text


def test_remat_policies_order_the_activation_estimate():
  model = tiny_model(num_layers=8, d_model=64, d_ff=128, vocab_size=512)
  saved = {policy: memory_model.activation_bytes(dataclasses.replace(model, remat_policy=policy),
                                                 rows=4, seq_len=256)["saved"]
           for policy in ("none", "save_dots", "minimal", "full")}
  assert saved["none"] > saved["save_dots"] > saved["minimal"] > saved["full"]
  assert saved["full"] == 8 * 4 * 256 * 64 * 4  # one float32 layer input per layer


def test_cli_reports_a_paper_config_and_every_paper_experiment_parses(tmp_path, capsys):
  out = tmp_path / "report.json"
  status = cli.main(["bench", "compile", "--gin_file=gin/experiments/paper_1b_midas_prop1.gin",
                     "--gin_file=gin/meshes/tpu_v5p_128.gin", "--topology=v5p-128", "--method=analytic",
                     f"--json={out}"])
  assert status == 0
  report = json.loads(out.read_text())
  assert report["model"]["layers"] == 24 and 1.0e9 < report["model"]["params"] < 1.1e9
  assert report["mesh"] == {"data": 1, "fsdp": 64, "tensor": 1} and report["batch"]["rows_per_device"] == 4
  assert report["growth_peak_state"] > report["analytic"]["params"] + report["analytic"]["optimizer"]
  assert "verdict" in capsys.readouterr().out
  sizes = {"1b": (1.0e9, 1.1e9, 24), "2b": (2.0e9, 2.1e9, 30), "8b": (8.1e9, 8.3e9, 48)}
  files = sorted(glob.glob(os.path.join(REPO_ROOT, "gin", "experiments", "paper_*.gin")))
  assert len(files) == 15
  for path in files:
    gin_config.parse([path], [])
    config = gin_config.run_config_from_gin()
    low, high, layers = sizes[os.path.basename(path).split("_")[1]]
    assert low < flops.param_counts(config.model)["total"] < high and config.model.num_layers == layers
    assert config.stacking.num_stages == (1 if path.endswith("baseline.gin") else 6), path
    assert open(path).readline().startswith("# "), path


@pytest.mark.parametrize("flag", ["--topology=v9-8", "--topology=v4-6"])
def test_bad_topology_is_a_config_error(flag, capsys):
  assert cli.main(["bench", "compile", "--gin_file=gin/experiments/cpu_demo.gin", flag]) == 2
  assert "--topology" in capsys.readouterr().err


def test_the_docs_speed_tables_are_estimates_rendered_from_their_results_file():
  """The compiler's cost model sums instruction costs: an estimate, not a bound (issue 39). Every table
  of the results file says so, and docs/pods.md quotes each as rendered from the file."""
  path = os.path.join(REPO_ROOT, "docs/results/pod_estimated_speed.json")
  tables = results.read(path)["tables"]
  assert {"estimated_step", "midas_speedup", "estimate_spread"} <= set(tables)
  page = results.render_page(os.path.join(REPO_ROOT, "docs/pods.md"))
  with open(os.path.join(REPO_ROOT, "docs/pods.md"), encoding="utf-8") as f:
    assert f.read() == page
  for name, spec in tables.items():
    text = results.markdown(spec)
    assert "bound" not in text.lower() and "predicted" not in text.lower(), name
    assert f"<!-- table: results/pod_estimated_speed.json {name} -->\n{text}\n" in page
