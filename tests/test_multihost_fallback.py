"""A multi-process job on a CPU that cannot run the bfloat16 matmuls widens them in every process.

The decision is taken without a cross-process program (docs/model.md#on-a-cpu-that-cannot-run-them):
each process runs one device's share of the stage's steps on one local device, and all follow the
process that could not. The test hook MIDAS_TEST_FORCE_FLOAT32_DOTS (model/dot_support.py) makes
process 1 alone report "cannot run" at every depth, whatever this CPU does: both processes must
build float32-operand programs through both growths and train exactly as one process forced to
the same fallback. A check that ran the sharded program stops it with gloo's "collective mismatch"
(or a hang: the hard timeout). A process that decided alone would build another program than its
peer's, unless its own share cannot run either (so on this project's CPUs): the agreement is also
tested in one process, with the other process's verdict stubbed.
"""

import collections
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO_ROOT, tiny_model, tiny_run
from midas_jax import cli, configs, hosts
from midas_jax.analysis import dot_dtypes
from midas_jax.checkpoint import load_model
from midas_jax.model import dot_support
from midas_jax.train import build as build_lib
from test_multihost import _env, train_losses

NUM_STEPS = 6  # depth 2 for steps 1-2, 4 for steps 3-4, 6 for steps 5-6
ARGS = [
    "train", "--gin_file=gin/experiments/midas_cpu.gin",  # bfloat16 compute, as the issue ran it
    "--gin.ModelConfig.d_model=32", "--gin.ModelConfig.num_heads=4", "--gin.ModelConfig.num_kv_heads=2",
    "--gin.ModelConfig.d_ff=64", "--gin.ModelConfig.num_layers=6", "--gin.ModelConfig.max_seq_len=64",
    "--gin.StackingConfig.num_stages=3", "--gin.StackingConfig.block_size=2",
    "--gin.StackingConfig.stage_steps=(2, 2, 2)",
    f"--gin.TrainerConfig.num_steps={NUM_STEPS}", "--gin.TrainerConfig.log_every=1",
    "--gin.TrainerConfig.eval_every=0", "--gin.TrainerConfig.progress_bar=False",
    "--gin.TrainerConfig.peak_flops_per_device=1e11",
    "--gin.DataConfig.batch_size=16", "--gin.DataConfig.seq_len=32", "--gin.DataConfig.prefetch=0",
    "--gin.MeshConfig.data=2", "--gin.MeshConfig.fsdp=-1", "--gin.MeshConfig.tensor=1",
    "--gin.CheckpointConfig.every=0",
]
WIDENED = "matmul operands: float32 at depth"


def train_two_processes_forced(workdir, cache_dir, timeout=300) -> str:
  """The pair, with process 1 alone told that it cannot run the bfloat16 steps. Its own process
  group, killed whole on a timeout, so that a hang leaves no process behind."""
  cmd = [sys.executable, os.path.join(REPO_ROOT, "launch", "local.py"), "--num_processes=2",
         "--devices_per_process=4", "--", *ARGS, f"--workdir={workdir}"]
  env = dict(_env(cache_dir), **{dot_support.FORCE_FLOAT32_ENV: "1"})
  proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    out = f"the pair did not finish in {timeout} s:\n{out}"
  assert proc.returncode == 0, out[-6000:]
  return out


def test_one_process_that_cannot_run_bfloat16_widens_every_process_through_both_growths(tmp_path, monkeypatch):
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  log = train_two_processes_forced(two, tmp_path / "xla_cache")
  # Process 0 ran its own share and widened at every depth (following process 1, where its share ran).
  assert [line.split(WIDENED)[1].split()[0] for line in log.splitlines() if line.startswith(f"[0] {WIDENED}")] \
      == ["2", "4", "6"], log[-6000:]
  assert f"[1] {WIDENED}" not in log  # one console line, process 0's

  monkeypatch.setenv(dot_support.FORCE_FLOAT32_ENV, "all")  # the one-process run, on the same fallback
  assert len(jax.devices()) == 8  # conftest's simulated devices: the pair's 2 x 4, the same (2, 4, 1) mesh
  assert cli.main(ARGS + [f"--workdir={one}"]) == 0

  reference, pair = train_losses(one), train_losses(two)
  assert sorted(pair) == sorted(reference) == list(range(1, NUM_STEPS + 1))
  np.testing.assert_allclose([pair[s] for s in sorted(pair)], [reference[s] for s in sorted(pair)], rtol=1e-5)
  final, paired = load_model(one), load_model(two)
  assert final.step == paired.step == NUM_STEPS and paired.model_config.num_layers == 6
  # bfloat16 activations: a float32 sum in another order (gloo's against one process's) can flip a
  # rounding, so parameters differ in the 6th decimal; one step's update is up to the learning rate (1e-3).
  flat, paired_flat = (jax.tree_util.tree_flatten_with_path(m.params)[0] for m in (final, paired))
  assert [p for p, _ in flat] == [p for p, _ in paired_flat]
  for (path, a), (_, b) in zip(flat, paired_flat):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5, err_msg=jax.tree_util.keystr(path))


def test_a_process_that_can_run_its_share_widens_when_another_cannot(monkeypatch, capsys):
  # The agreement alone, in this process: on a CPU whose own share cannot run bfloat16 either, the
  # pair above widens every process without it.
  run = tiny_run(model=tiny_model(dtype="bfloat16"),
                 trainer=configs.TrainerConfig(num_steps=2, log_every=1, eval_every=0, progress_bar=False))
  verdicts = []
  monkeypatch.setattr(hosts, "multi_process", lambda: True)
  monkeypatch.setattr(build_lib.StageBuild, "runs_on_one_device", lambda self: True)
  monkeypatch.setattr(build_lib.StageBuild, "checked_steps", lambda self: pytest.fail("ran the sharded steps"))
  for others_can, operands in ((False, "float32"), (True, "auto")):
    monkeypatch.setattr(hosts, "exchange",
                        lambda name, flag, others_can=others_can: verdicts.append((name, flag)) or [flag, others_can])
    build = build_lib.build_stage(run, devices=jax.devices()[:1])
    assert (build.model_config.matmul_operands, build.checked) == (operands, None)
  assert verdicts == [("matmul_operands", True)] * 2
  assert capsys.readouterr().out.count(WIDENED) == 1


def test_one_device_share_multiplies_what_each_device_of_the_sharded_step_multiplies():
  # Tensor-sharded heads, d_ff and vocab and two microbatches of 2 rows per device. float32: the
  # shapes are the bfloat16 step's, and nothing is run.
  run = tiny_run(model=tiny_model(tie_embeddings=False),
                 mesh=configs.MeshConfig(data=2, fsdp=2, tensor=2),
                 data=configs.DataConfig(seq_len=32, batch_size=16),
                 trainer=configs.TrainerConfig(num_steps=2, log_every=1, eval_every=0, progress_bar=False,
                                               microbatches=2))
  stage = build_lib.build_stage(run)
  share = stage.one_device_share()
  assert share.mesh.devices.size == 1 and share.config.data.batch_size == 4
  assert (share.model_config.num_heads, share.model_config.kv_heads, share.model_config.d_ff) == (2, 1, 32)

  def dots(build):  # each device's matmuls after SPMD partitioning, by FLOPs (a transposed operand counts the same)
    state, batch = build.abstract_args()
    with build.context():
      text = build.jit_train_step().lower(state, batch).compile().as_text()
    return collections.Counter(d.flops for d in dot_dtypes.hlo_dots(text))

  sharded = dots(stage)
  assert sum(sharded.values()) > 20
  assert dots(share) == sharded
