"""`midas bench data`: a short run reports every figure, and the CLI prints the report."""

import importlib.util
import json
import os
import sys

import pytest

from conftest import tiny_run
from midas_jax import cli
from midas_jax.bench import data_bench
from test_cli import DEMO, TINY_BINDINGS

T5_INSTALLED = all(importlib.util.find_spec(p) is not None for p in ("tensorflow", "seqio", "t5"))


def _positive(d, keys):
  for k in keys:
    assert d[k] > 0, (k, d[k])


def test_short_run_reports_all_fields(no_compile_cache):
  affinity_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
  r = data_bench.run(tiny_run(), seconds=0.5, train_steps=2)
  if affinity_before is not None:
    assert os.sched_getaffinity(0) == affinity_before  # the one-core pin is undone
    assert r["cpu"] in affinity_before
  for name in ("ours_mixture", "ours_span"):
    _positive(r[name], ("tokens_per_second", "real_tokens_per_second", "rows_per_second",
                        "packing_efficiency", "real_tokens_per_cpu_second"))
    assert r[name]["packing_efficiency"] <= 1.0
    assert r[name]["cores_used"] < 1.5  # pinned: one core, allowing for timer granularity
  assert r["training"]["source"] == "measured"
  _positive(r["training"], ("tokens_per_second", "step_seconds"))
  assert r["ratios"]["ours_vs_training"] > 0
  t5 = r["t5"]
  # Installed (the README's test command installs it), the reference must run: a broken install
  # raises (test below) rather than reporting "unavailable".
  assert t5["available"] == T5_INSTALLED, t5.get("reason")
  if t5["available"]:
    _positive(t5, ("tokens_per_second", "examples_per_second", "tokens_per_cpu_second"))
    assert t5["inputs_length"] + t5["targets_length"] <= r["seq_len"]
    _positive(t5["packed"], ("real_tokens_per_second", "packing_efficiency"))
    assert t5["cores_used"] < 1.5
    _positive(r["ratios"], ("ours_vs_tf", "ours_vs_tf_packed", "ours_vs_tf_per_cpu_second"))
  else:
    assert "ours_vs_tf" not in r["ratios"] and "not installed" in t5["reason"]
  text = data_bench.format_report(r)
  assert "ours, mixture" in text and "ours / training" in text and "ours / TF" in text


def test_cli_prints_the_report(capsys, tmp_path):
  out = tmp_path / "data.json"
  # A given training rate skips the train steps: this test is about the CLI, not the model.
  rc = cli.main(["bench", "data", f"--gin_file={DEMO}", "--seconds=0.3", "--train_tokens_per_second=1000",
                 f"--json={out}", *TINY_BINDINGS])
  assert rc == 0
  text = capsys.readouterr().out
  assert "slots/s" in text and "packing" in text and "(given)" in text and "ours / training" in text
  report = json.loads(out.read_text())
  assert report["training"]["tokens_per_second"] == 1000.0
  assert report["ratios"]["ours_vs_training"] == report["ours_mixture"]["tokens_per_second"] / 1000.0


@pytest.mark.skipif(not T5_INSTALLED, reason="needs an environment that installed the t5 reference")
def test_a_broken_t5_install_fails_naming_the_package(capsys, monkeypatch):
  # t5 stays installed, but its preprocessors cannot be imported (None in sys.modules stops an import).
  monkeypatch.setitem(sys.modules, "t5.data.preprocessors", None)
  rc = cli.main(["bench", "data", f"--gin_file={DEMO}", "--seconds=0.1", "--train_tokens_per_second=1000",
                 *TINY_BINDINGS])
  err = capsys.readouterr().err
  assert rc == 2, err
  assert "midas: error: t5: is installed, but `import t5.data.preprocessors` fails" in err
  assert "pip install --no-deps t5==0.9.4" in err and "Traceback" not in err


def test_a_synthetic_store_reports_its_memory_and_one_pod_hosts_consumption(capsys, tmp_path):
  out = tmp_path / "store.json"
  rc = cli.main(["bench", "data", "--gin_file=gin/experiments/paper_1b_baseline.gin", "--gin.DataConfig.vocab='byte'",
                 "--synthetic_documents=3000", f"--synthetic_dir={tmp_path / 'store'}", "--consumption=v5p-128",
                 "--seconds=0.3", f"--json={out}"])
  assert rc == 0
  text = capsys.readouterr().out
  assert "peak RSS" in text and "one host of v5p-128" in text and "ours / training" in text
  r = json.loads(out.read_text())
  assert r["num_documents"] == 3000 and r["rows_per_host"] == 256 // 16
  assert 0 < r["rss_growth_bytes"] < r["peak_rss_bytes"] and r["ours_mixture"]["packing_efficiency"] > 0.95
  c = r["training"]
  assert (c["chips"], c["hosts"], c["peak_flops_per_chip"]) == (64, 16, 459e12)
  # paper_1b: 256 x 2048 tokens per step at 40% of 64 chips' peak, shared by 16 hosts.
  step = c["train_flops_per_token"] * 256 * 2048 / (64 * 459e12 * 0.4)
  assert c["tokens_per_second"] == 256 * 2048 / step / 16 and 80_000 < c["tokens_per_second"] < 120_000
