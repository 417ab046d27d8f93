"""gs:// end to end, against a real GCS server on 127.0.0.1 (fake-gcs-server, tests/gcs_emulator.py).

One small MIDAS run (4 layers grown in 2 stages at step 4, saves every 3 steps) is trained to the end
on gs:// with a profiler window; a second copy is SIGKILLed after its growth and resumed with the
same command. Then the path layer, TensorBoard, goodput, `midas inspect`, `midas eval`, `midas report`,
`midas export --format=hf` and `midas import` are checked on the bucket, and the local disk is
searched for a `gs:` directory (what a path layer that treats URLs as paths would leave).
"""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO_ROOT
from midas_jax import cli, fs
from midas_jax.checkpoint import available_steps, load_model
from midas_jax.train import run as train_run
from midas_jax.train.goodput import KEYS, Goodput
from midas_jax.train.metrics import read_metrics
import test_kill_resume as kill_resume
from test_metrics import read_tb_scalars

# test_kill_resume.py's run, shortened: 12 steps, the growth at step 4.
GIN = kill_resume.GIN + """
TrainerConfig.num_steps = 12
TrainerConfig.eval_every = 6
StackingConfig.stage_steps = (4, 8)
"""
BOUNDARY, NUM_STEPS = 4, 12


@pytest.fixture(scope="module")
def runs(gcs, tmp_path_factory):
  """(bucket, reference URL, resumed URL, the subprocesses' cwd and TMPDIR, the reference's clock) after both
  runs ended. The clock, read beside the reference run's own: perf_counter as its Goodput starts (before the
  restore, here the init) and at each take()."""
  bucket = gcs.new_bucket()
  root = tmp_path_factory.mktemp("gcs")
  gin_file = root / "run.gin"
  gin_file.write_text(GIN)
  cwd, tmp = root / "cwd", root / "tmp"
  cwd.mkdir()
  tmp.mkdir()
  env = dict(os.environ, **gcs.environment(), JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT, TMPDIR=str(tmp),
             XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONUNBUFFERED="1")
  reference, resumed = f"{bucket}/reference", f"{bucket}/resumed"
  args = ["train", f"--gin_file={gin_file}"]
  clock = {"takes": []}

  class Watched(Goodput):
    def __init__(self):
      super().__init__()
      clock["takes"].append(time.perf_counter())

    def take(self):
      clock["takes"].append(time.perf_counter())
      return super().take()

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train_run, "Goodput", Watched)
    assert cli.main(args + [f"--workdir={reference}", "--profile=2:4"]) == 0  # in this process: no start-up

  cmd = [sys.executable, "-m", "midas_jax", *args, f"--workdir={resumed}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if re.search(rf"step {BOUNDARY + 3} train", line):  # past the growth, the save of step 6 in flight
      proc.send_signal(signal.SIGKILL)
      break
  proc.communicate(timeout=120)
  assert proc.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
  with contextlib.redirect_stdout(io.StringIO()) as out:  # the same command, here: no second start-up
    assert cli.main(args + [f"--workdir={resumed}"]) == 0
  assert "resuming from the checkpoint of step" in out.getvalue()
  return bucket, reference, resumed, cwd, tmp, clock


def test_path_layer_on_gcs(gcs):
  base = gcs.new_bucket() + "/layer"
  fs.write_json(fs.join(base, "a", "b.json"), {"x": 1})
  fs.write_text(fs.join(base, "a", "deep", "c.txt"), "c")
  assert fs.read_json(fs.join(base, "a", "b.json")) == {"x": 1} and fs.isdir(fs.join(base, "a"))
  assert fs.listdir(fs.join(base, "a")) == ["b.json", "deep"]
  assert fs.glob(fs.join(base, "**", "*.txt")) == [f"{base}/a/deep/c.txt"]
  assert fs.glob(fs.join(base, "a", "*.json")) == [f"{base}/a/b.json"]
  assert fs.glob(fs.join(base, "a", "**", "b.json")) == [f"{base}/a/b.json"]  # `**` matches no directory too
  assert fs.glob(fs.join(base, "missing", "**", "*")) == [] and fs.glob(fs.join(base, "a", "*.csv")) == []
  fs.append_text(fs.join(base, "log.jsonl"), "1\n")
  fs.append_text(fs.join(base, "log.jsonl"), "2\n")
  log = fs.Appender(fs.join(base, "log.jsonl"))  # on gs://: numbered parts after the file, stored by a thread
  log.write("3\n")
  assert log.close()
  assert fs.read_appended(fs.join(base, "log.jsonl")) == "1\n2\n3\n"
  assert fs.read_text(fs.join(base, "log.jsonl.000000")) == "3\n"
  fs.rename(fs.join(base, "a"), fs.join(base, "moved"))
  assert not fs.exists(fs.join(base, "a")) and fs.read_text(fs.join(base, "moved", "deep", "c.txt")) == "c"
  with fs.staged_dir(fs.join(base, "staged")) as local:
    with open(os.path.join(local, "f.bin"), "wb") as f:
      f.write(b"\0\1")
  with fs.local_tree(fs.join(base, "staged")) as local:
    assert open(os.path.join(local, "f.bin"), "rb").read() == b"\0\1"
  assert fs.tree_size(fs.join(base, "moved")) == len('{\n  "x": 1\n}') + 1
  fs.rmtree(base)
  assert not fs.exists(fs.join(base, "moved", "b.json"))


def test_sigkill_and_resume_on_gcs_end_bitwise_equal(runs):
  _, reference, resumed, _, _, _ = runs
  ours, theirs = load_model(resumed), load_model(reference)
  assert ours.step == theirs.step == NUM_STEPS and ours.stage == 2
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(ours.params),
                               jax.tree_util.tree_leaves_with_path(theirs.params)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  losses = lambda w: [(r["step"], r["loss"]) for r in read_metrics(w, "train")]  # noqa: E731
  assert losses(resumed) == losses(reference) and [s for s, _ in losses(resumed)] == list(range(1, NUM_STEPS + 1))
  assert available_steps(resumed)[-1] == NUM_STEPS


def test_tensorboard_on_gcs_shows_each_step_once_after_the_resume(runs):
  _, _, resumed, _, _, _ = runs
  with fs.local_tree(fs.join(resumed, "tensorboard")) as local:
    loss = read_tb_scalars(os.path.join(local, "train"))["loss"]
  assert [step for step, _ in loss] == list(range(1, NUM_STEPS + 1))  # the killed attempt's redone steps dropped
  want = [r["loss"] for r in read_metrics(resumed, "train")]
  np.testing.assert_allclose([value for _, value in loss], want, rtol=1e-6)


def test_profile_trace_and_goodput_on_gcs(runs):
  _, reference, _, _, _, clock = runs
  assert fs.glob(fs.join(reference, "profile", "plugins", "profile", "*", "*.xplane.pb"))
  train = read_metrics(reference, "train")
  assert all(set(KEYS) <= set(r) for r in train)
  # Each record's parts add up to the wall time since the previous record (the first: since the run's start,
  # its restore or init included), timed here by a clock read beside the run's own: within 50 ms, as another
  # thread may take the GIL between the two reads (over the run the gaps cancel but for the first and last).
  takes = clock["takes"]
  assert len(takes) == len(train) + 1  # the start, then one take() per train record
  parts = [sum(r[k] for k in KEYS) for r in train]
  intervals = [end - start for start, end in zip(takes, takes[1:])]
  for record, part, interval in zip(train, parts, intervals):
    assert part == pytest.approx(interval, abs=0.05), (record["step"], record)
  assert sum(parts) == pytest.approx(takes[-1] - takes[0], abs=0.05)
  assert train[0]["time/compile"] > 0 and sum(r["time/step"] for r in train) > 0
  growth = next(r for r in train if r["step"] == BOUNDARY + 1)  # the line after the growth carries it
  assert growth["time/growth"] > 0 and growth["time/compile"] > 0  # the deeper step compiled (or was cached)
  assert sum(r["time/eval"] for r in train) > 0 and train[-1]["time/checkpoint"] > 0  # the last save's wait


def test_inspect_eval_report_on_gcs(runs, capsys):
  _, reference, _, _, _, _ = runs
  assert cli.main(["inspect", f"--workdir={reference}"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["depth"] == 4 and [g["step"] for g in report["growths"]] == [BOUNDARY]
  assert cli.main(["eval", f"--workdir={reference}", "--suite=similarity"]) == 0
  assert fs.read_json(fs.join(reference, "eval", "similarity.json"))["step"] == NUM_STEPS
  assert fs.isfile(fs.join(reference, "eval", "similarity_blocks.png"))
  assert cli.main(["report", f"--workdir={reference}"]) == 0
  page = fs.read_text(fs.join(reference, "report.md"))
  assert "## Where the time went" in page and "![where the time went](report/goodput.png)" in page
  assert "similarity_blocks.png" in page
  for figure in ("goodput.png", "loss_curves.png"):
    assert fs.read_bytes(fs.join(reference, "report", figure))[:4] == b"\x89PNG"


def test_export_hf_to_gcs_and_import_back(runs):
  pytest.importorskip("transformers", reason="install the convert extra: pip install -e .[convert]")
  bucket, reference, _, _, _, _ = runs
  hf_dir, imported = f"{bucket}/hf", f"{bucket}/imported"
  assert cli.main(["export", f"--workdir={reference}", "--format=hf", f"--out={hf_dir}"]) == 0
  assert {"config.json", "model.safetensors", "midas_jax.json"} <= set(fs.listdir(hf_dir))
  assert cli.main(["import", f"--hf={hf_dir}", f"--workdir={imported}"]) == 0
  back, original = load_model(imported), load_model(reference)
  assert back.step == original.step and back.model_config == original.model_config
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(original.params)):
    np.testing.assert_array_equal(a, b)


def test_no_gs_directory_on_the_local_disk(runs):
  _, _, _, cwd, tmp, _ = runs
  for root in (cwd, tmp, REPO_ROOT, os.getcwd()):
    for directory, subdirs, _ in os.walk(root):
      subdirs[:] = [d for d in subdirs if d not in (".git", ".venv", "node_modules")]
      assert not any(d.startswith("gs:") for d in subdirs), os.path.join(directory, "gs:")


def test_an_unknown_scheme_fails_at_start_naming_the_setting(capsys):
  assert cli.main(["train", "--gin_file=gin/experiments/cpu_demo.gin", "--workdir=ftp://host/run"]) == 2
  assert "--workdir" in capsys.readouterr().err
