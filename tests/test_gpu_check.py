"""launch/gpu_check.sh, the GPU day's one script, rehearsed on the CPU with --dry-run: every step runs at a
tiny size (the pytest step collects with the arguments the GPU run passes), so a broken line fails here and
not on the day (docs/benchmarks.md#gpu-day-one). And launch/gpu_wheelhouse.py, which builds the wheels it
installs there."""

import json
import os
import re
import subprocess
import sys
from xml.etree import ElementTree

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "launch"))
import gpu_wheelhouse  # noqa: E402  pylint: disable=wrong-import-position

# What the script's header says it may write to OUT (8 at most, the device tool's limit).
DOCUMENTED = {"gpu_check.log", "summary.json", "attention.json", "train_dot_product.json", "train_cudnn.json",
              "train_flash.json", "pytest.xml", "study.json"}


def test_the_dry_run_runs_every_step_and_writes_the_documented_files(tmp_path):
  out = tmp_path / "out"
  # An XLA flag no jaxlib knows would stop every process at start: the script must drop it and say so.
  env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path), XLA_FLAGS="--xla_gpu_no_such_flag=true")
  done = subprocess.run(["bash", os.path.join(REPO_ROOT, "launch", "gpu_check.sh"), str(out), "--dry-run"],
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  files = {p.name for p in out.iterdir()}
  assert len(DOCUMENTED) <= 8 and files <= DOCUMENTED
  assert files == {"gpu_check.log", "summary.json", "attention.json", "train_dot_product.json", "pytest.xml"}
  summary = json.loads((out / "summary.json").read_text())
  assert {s["step"]: s["status"] for s in summary["steps"]} == {
      "wheels": "ok", "xla_flags": "ok", "versions": "ok", "attention": "ok", "train_dot_product": "ok",
      "train_cudnn": "skipped", "train_flash": "skipped", "pytest": "ok", "study": "ok"}
  assert summary["failed"] == [] and summary["dry_run"] is True
  assert summary["versions"]["platform"] == "cpu" and summary["versions"]["versions"]["gin-config"] != "not installed"

  log = (out / "gpu_check.log").read_text()
  assert "dropped --xla_gpu_no_such_flag=true" in log and "--xla_gpu_no_such_flag" not in summary["xla_flags"]
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in summary["xla_flags"]
  assert summary["xla_client_mem_fraction"] == "0.90"
  collected = re.search(r"(\d+)/\d+ tests collected", log)  # the real selection, collected
  assert collected and int(collected.group(1)) >= 5, log[-3000:]
  assert ElementTree.parse(out / "pytest.xml").getroot().tag == "testsuites"

  # The attention check ran each path the CPU has against the float32 reference: the dense path and XLA's
  # call exactly (float32), the interpreted flash kernels within float32 rounding, bfloat16 within its bound.
  attention = json.loads((out / "attention.json").read_text())
  assert attention["failed"] == [] and [c["dtype"] for c in attention["cases"]] == ["float32", "bfloat16"]
  for case in attention["cases"]:
    paths = case["paths"]
    assert paths["cudnn"]["status"] == "skipped"
    for path in ("dot_product", "flash", "xla"):
      worst = max(paths[path]["relative_error"].values())
      assert paths[path]["status"] == "ok" and worst <= (1e-5 if case["dtype"] == "float32" else 2 ** -6), (path, worst)
  assert max(attention["cases"][1]["paths"]["flash"]["relative_error"].values()) > 0  # really bfloat16
  train = summary["figures"]["train"]["dot_product"]  # two steps of the 1B's config at a tiny override
  assert train["step_seconds_median"] > 0 and train["mfu"] > 0 and list(summary["figures"]["train"]) == ["dot_product"]
  assert json.loads((out / "train_dot_product.json").read_text())["batch_size"] == 2


def test_the_script_refuses_a_missing_out_or_an_unknown_flag():
  for args in ([], ["out", "--dryrun"]):
    done = subprocess.run(["bash", os.path.join(REPO_ROOT, "launch", "gpu_check.sh"), *args],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and "usage: bash launch/gpu_check.sh OUT [--dry-run]" in done.stderr
    assert ("unknown flag --dryrun" in done.stderr) == bool(args)


def test_the_wheelhouse_holds_the_pinned_packages_the_gpu_image_lacks(tmp_path):
  pins = gpu_wheelhouse.pinned_versions()
  assert set(pins) == {"gin-config", "tensorboardX"} and all(re.fullmatch(r"[\d.]+", v) for v in pins.values())
  assert gpu_wheelhouse.missing(["gin-config", "no-such-distribution-here"]) == ["no-such-distribution-here"]
  # Nothing missing: nothing to install, no folder needed; missing and no folder: a failure that says what to do.
  assert gpu_wheelhouse.install(str(tmp_path / "none"), str(tmp_path / "site")) == 0
  assert gpu_wheelhouse.install(str(tmp_path / "none"), str(tmp_path / "site"), ["no-such-distribution-here"]) == 1
  with pytest.raises(SystemExit, match="pins no version of no-such-distribution-here"):
    gpu_wheelhouse.pinned_versions(["no-such-distribution-here"])
