"""The training loop: the loss falls, outputs land in the workdir, non-finite losses stop the run."""

import json
import math
import os

import jax
import numpy as np
import pytest

from conftest import replace, tiny_run
from midas_jax import configs
from midas_jax.errors import ConfigError, NonFiniteLossError
from midas_jax.train.checkpointer import NoCheckpointer
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train


class RecordingCheckpointer(NoCheckpointer):
  def __init__(self):
    super().__init__()
    self.saved = []

  def save(self, state, step, force=False, metadata=None):
    finite = all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(state.params))
    self.saved.append((step, finite))


def test_loss_falls_and_outputs_land_in_the_workdir(tmp_path):
  config = tiny_run(trainer=configs.TrainerConfig(num_steps=30, log_every=5, eval_every=15, eval_batches=2,
                                                  progress_bar=False, peak_flops_per_device=1e11))
  recorder = RecordingCheckpointer()
  result = train(config, str(tmp_path), checkpointer=recorder)
  train_rows = read_metrics(str(tmp_path), "train")
  eval_rows = read_metrics(str(tmp_path), "eval")
  assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
  assert [r["step"] for r in eval_rows] == [15, 30]
  assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0
  assert eval_rows[-1]["loss"] < eval_rows[0]["loss"]
  for key in ("grad_norm", "learning_rate", "tokens_per_second", "mfu", "loss/causal"):
    assert all(math.isfinite(r[key]) for r in train_rows[1:]), key
  assert result.final_loss == pytest.approx(train_rows[-1]["loss"])
  saved = json.load(open(tmp_path / "config.json"))
  assert saved["model"]["vocab_size"] == 512  # 259 bytes + 128 extra ids, padded to a multiple of 128
  assert os.listdir(tmp_path / "tensorboard" / "train")
  assert [s for s, _ in recorder.saved] == [5, 10, 15, 20, 25, 30, 30] and all(f for _, f in recorder.saved)


def test_non_finite_loss_stops_the_run_and_never_reaches_the_checkpointer(tmp_path):
  optimizer = configs.OptimizerConfig(learning_rate=1e9, warmup_steps=0, grad_clip_norm=None, decay="constant")
  config = tiny_run(optimizer=optimizer, trainer=configs.TrainerConfig(
      num_steps=20, log_every=4, eval_every=0, progress_bar=False, peak_flops_per_device=1e11))
  recorder = RecordingCheckpointer()
  with pytest.raises(NonFiniteLossError, match=r"non-finite at step \d+") as err:
    train(config, str(tmp_path), checkpointer=recorder)
  bad_step = int(err.value.args[0].split("step ")[1].split(";")[0])
  assert all(step < bad_step and finite for step, finite in recorder.saved)


def test_same_config_and_seed_give_the_same_losses(tmp_path):
  config = tiny_run()
  train(config, str(tmp_path / "a"))
  train(config, str(tmp_path / "b"))
  a = [r["loss"] for r in read_metrics(str(tmp_path / "a"), "train")]
  b = [r["loss"] for r in read_metrics(str(tmp_path / "b"), "train")]
  assert a == b
  train(replace(config, trainer=replace(config.trainer, seed=1)), str(tmp_path / "c"))
  assert [r["loss"] for r in read_metrics(str(tmp_path / "c"), "train")] != a


def test_unwritable_workdir_is_refused(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ConfigError, match="--workdir"):
    train(tiny_run(), str(blocker / "run"))


def test_trains_on_local_text_files_with_a_sentencepiece_vocabulary(tmp_path):
  from midas_jax.data.sources import corpus  # pylint: disable=import-outside-toplevel
  from midas_jax.data.vocab import vocabulary  # pylint: disable=import-outside-toplevel
  paths = corpus.write_text_files(str(tmp_path / "data"))
  spm = vocabulary.train_sentencepiece([paths["train"]], str(tmp_path / "spm"), vocab_size=600,
                                 input_sentence_size=5000, shuffle_input_sentence=True)
  data = configs.DataConfig(source="text", train_files=(paths["train"],), eval_files=(paths["validation"],),
                            vocab="sentencepiece", spm_model=spm, seq_len=32, batch_size=8)
  config = tiny_run(data=data, trainer=configs.TrainerConfig(
      num_steps=20, log_every=10, eval_every=20, eval_batches=1, progress_bar=False,
      peak_flops_per_device=1e11))
  train(config, str(tmp_path / "run"))
  rows = read_metrics(str(tmp_path / "run"), "train")
  assert json.load(open(tmp_path / "run" / "config.json"))["model"]["vocab_size"] == 768  # 600 + 128 extra
  assert rows[-1]["loss"] < rows[0]["loss"]
