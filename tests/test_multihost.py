"""Two processes of 4 simulated CPU devices each train exactly as one process of 8 devices.

The single process is `midas train` run here, on the test session's 8 simulated devices; the pair
is two `python -m midas_jax train` processes started by launch/local.py and joined by
jax.distributed on 127.0.0.1. The config is a tiny bfloat16 MIDAS run that grows from 2 to 4 layers
at step 3, with the state sharded over all 8 devices (fsdp), so every step crosses the process
boundary. Process 1 alone is told that this CPU cannot run the steps' bfloat16 matmuls (the test
hook MIDAS_TEST_FORCE_FLOAT32_DOTS, model/dot_support.py): both processes must agree to widen them
at every depth, without running a cross-process program to find out (a sharded check stopped
part-way leaves gloo's transport out of step: "collective mismatch"), and train as one process on
the same fallback. The pair must log the same losses and end with the same parameters as the
single process; then the pair's run is rewound to its checkpoint before the growth and resumed,
and must grow and end at the same parameters again.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np

from conftest import REPO_ROOT
from midas_jax import cli
from midas_jax.checkpoint import available_steps, checkpoint_dir, load_model
from midas_jax.model import dot_support
from midas_jax.train.metrics import read_metrics

NUM_STEPS = 6  # steps 0-2 at depth 2, growth at step 3, steps 3-5 at depth 4
GROWTH_STEP, REWIND_TO = 3, 2
ARGS = [
    "train", "--gin_file=gin/experiments/midas_cpu.gin",
    "--gin.ModelConfig.d_model=32", "--gin.ModelConfig.num_layers=4", "--gin.ModelConfig.num_heads=4",
    "--gin.ModelConfig.num_kv_heads=2", "--gin.ModelConfig.d_ff=64",
    "--gin.StackingConfig.num_stages=2", "--gin.StackingConfig.block_size=2",
    "--gin.StackingConfig.stage_steps=(3, 3)",
    f"--gin.TrainerConfig.num_steps={NUM_STEPS}", "--gin.TrainerConfig.log_every=1",
    "--gin.TrainerConfig.eval_every=0", "--gin.TrainerConfig.progress_bar=False",
    "--gin.TrainerConfig.peak_flops_per_device=1e11",
    "--gin.DataConfig.batch_size=8", "--gin.DataConfig.seq_len=32", "--gin.DataConfig.prefetch=0",
    "--gin.MeshConfig.data=1", "--gin.MeshConfig.fsdp=-1",
    "--gin.CheckpointConfig.every=2", "--gin.CheckpointConfig.keep=20",
]


WIDENED = "matmul operands: float32 at depth"


def _env(cache_dir):
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu", MIDAS_JAX_CACHE_DIR=str(cache_dir),
             PYTHONUNBUFFERED="1", **{dot_support.FORCE_FLOAT32_ENV: "1"})  # process 1 alone cannot run bf16
  env.pop("XLA_FLAGS", None)
  return env


def _check(proc):
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return proc.stdout


def train_two_processes(workdir, cache_dir) -> str:
  launcher = os.path.join(REPO_ROOT, "launch", "local.py")
  cmd = [sys.executable, launcher, "--num_processes=2", "--devices_per_process=4", "--",
         *ARGS, f"--workdir={workdir}"]
  return _check(subprocess.run(cmd, env=_env(cache_dir), cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=300))


def train_losses(workdir) -> dict:
  """step -> loss, checking that every step is logged exactly once: a resumed run truncates the
  metrics after its checkpoint, so the steps it redoes must not appear twice."""
  steps = [r["step"] for r in read_metrics(workdir, "train")]
  repeated = sorted({s for s in steps if steps.count(s) > 1})
  assert not repeated, f"train steps logged more than once in {workdir}: {repeated} (all: {steps})"
  return {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}


def assert_same_params(a, b):
  """Equal up to a flipped rounding: bfloat16 activations summed in another order (gloo's against one
  process's) move a parameter in the 6th decimal; one step's update is up to the learning rate (1e-3)."""
  flat_a, flat_b = (dict(zip(map(str, _paths(t)), _leaves(t))) for t in (a, b))
  assert flat_a.keys() == flat_b.keys()
  for key in flat_a:
    np.testing.assert_allclose(flat_a[key], flat_b[key], rtol=1e-5, atol=2e-5, err_msg=key)


def _paths(tree):
  return [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_two_processes_match_one_through_growth_and_resume(tmp_path, monkeypatch):
  cache = tmp_path / "xla_cache"
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  assert len(jax.devices()) == 8  # conftest's simulated devices
  monkeypatch.setenv(dot_support.FORCE_FLOAT32_ENV, "all")  # the one-process run, on the same fallback
  assert cli.main(ARGS + [f"--workdir={one}"]) == 0
  log = train_two_processes(two, cache)
  assert "[0] " in log and "[1] " in log  # both processes ran and were followed
  # Process 0 could run its own share, yet widened at both depths, following process 1; one console line.
  assert [line.split(WIDENED)[1].split()[0] for line in log.splitlines() if line.startswith(f"[0] {WIDENED}")] \
      == ["2", "4"], log[-4000:]
  assert f"[1] {WIDENED}" not in log

  reference = train_losses(one)
  assert sorted(reference) == list(range(1, NUM_STEPS + 1))
  pair = train_losses(two)
  np.testing.assert_allclose([pair[s] for s in sorted(reference)], [reference[s] for s in sorted(reference)],
                             rtol=1e-5)
  stages = json.load(open(os.path.join(two, "stages.json")))
  assert stages["depth"] == 4 and [g["step"] for g in stages["growths"]] == [GROWTH_STEP]
  final = load_model(one)
  assert final.step == NUM_STEPS and final.model_config.num_layers == 4
  assert_same_params(final.params, load_model(two).params)

  # Rewind the pair to its save before the growth and resume: it grows again and ends the same.
  assert REWIND_TO in available_steps(two)
  for step in available_steps(two):
    if step > REWIND_TO:
      shutil.rmtree(os.path.join(checkpoint_dir(two), str(step)))
  log = train_two_processes(two, cache)
  assert f"resuming from the checkpoint of step {REWIND_TO}" in log
  resumed = load_model(two)
  assert resumed.step == NUM_STEPS and resumed.stage == 2
  assert_same_params(final.params, resumed.params)
  pair = train_losses(two)
  assert sorted(pair) == list(range(1, NUM_STEPS + 1))
  assert [r["step"] for r in read_metrics(two, "stage")] == [GROWTH_STEP]  # the redone growth, once
  resumed_steps = range(REWIND_TO + 1, NUM_STEPS + 1)
  np.testing.assert_allclose([pair[s] for s in resumed_steps], [reference[s] for s in resumed_steps], rtol=1e-5)
