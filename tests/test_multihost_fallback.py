"""A multi-process job on a CPU that cannot run the bfloat16 matmuls widens them in every process.

The decision is taken without a cross-process program (docs/model.md#on-a-cpu-that-cannot-run-them):
each process runs one device's share of the stage's steps on one local device, and all follow the
process that could not. tests/test_multihost.py runs the pair with process 1 alone told it cannot run
them (the test hook MIDAS_TEST_FORCE_FLOAT32_DOTS, model/dot_support.py) against one process on the
same fallback, through a growth and a resume. A process that decided alone would build another
program than its peer's, unless its own share cannot run either (so on this project's CPUs): the
agreement is tested here in one process, with the other process's verdict stubbed; and the share's
shapes against what each device of the sharded step multiplies.
"""

import collections

import jax
import pytest

from conftest import tiny_model, tiny_run
from midas_jax import configs, hosts
from midas_jax.analysis import dot_dtypes
from midas_jax.train import build as build_lib

WIDENED = "matmul operands: float32 at depth"


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
