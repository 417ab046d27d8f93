"""MetricWriter (JSONL, TensorBoard, stdout), read_metrics and Progress."""

import glob
import json
import math
import os
import struct

import numpy as np
import pytest

from midas_jax.train.metrics import MetricWriter, Progress, format_scalar, read_metrics


def read_tb_scalars(logdir):
  """{tag: [(step, value)]} from the TFRecord-framed Event protos tensorboardX wrote under logdir."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):  # record: u64 length, u32 crc, payload, u32 crc
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      payload = data[pos + 12:pos + 12 + length]
      pos += 12 + length + 4
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def test_jsonl_round_trip_and_append(tmp_path):
  rows = [(0, "train", {"loss": 5.5, "lr": 0.0}), (10, "train", {"loss": np.float32(4.25), "tokens": 40960}),
          (10, "eval", {"loss": 4.5, "accuracy": 0.125})]
  with MetricWriter(str(tmp_path), stdout=False, tensorboard=False) as w:
    for step, split, scalars in rows:
      w.write(step, split, scalars)
  with MetricWriter(str(tmp_path), stdout=False, tensorboard=False) as w:  # a resumed run appends
    w.write(20, "train", {"loss": float("nan")})
  got = read_metrics(str(tmp_path))
  assert got[:3] == [{"step": s, "split": sp, **{k: float(v) if isinstance(v, np.floating) else v
                                                  for k, v in sc.items()}} for s, sp, sc in rows]
  assert got[3]["step"] == 20 and math.isnan(got[3]["loss"])
  assert isinstance(got[1]["tokens"], int)
  assert [r["step"] for r in read_metrics(str(tmp_path), split="eval")] == [10]
  assert not os.path.exists(tmp_path / "tensorboard")


def test_each_write_is_on_disk_before_close(tmp_path):
  w = MetricWriter(str(tmp_path), stdout=False, tensorboard=False)
  w.write(1, "train", {"loss": 2.0})
  with open(tmp_path / "metrics.jsonl") as f:  # what a killed run would leave
    assert json.loads(f.read()) == {"step": 1, "split": "train", "loss": 2.0}
  w.close()
  w.close()  # idempotent


def test_read_metrics_tolerates_a_cut_off_last_line(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write('{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "spl')
  assert read_metrics(str(tmp_path)) == [{"step": 1, "split": "train", "loss": 2.0}]
  assert read_metrics(str(tmp_path / "missing")) == []


def test_reserved_names_and_bad_values_are_rejected(tmp_path):
  with MetricWriter(str(tmp_path), stdout=False, tensorboard=False) as w:
    with pytest.raises(ValueError, match="reserved"):
      w.write(1, "train", {"step": 3.0})
    with pytest.raises(TypeError, match="numbers"):
      w.write(1, "train", {"loss": "low"})


def test_tensorboard_events_per_split(tmp_path):
  with MetricWriter(str(tmp_path), stdout=False) as w:
    w.write(1, "train", {"loss": 3.0, "lr": 1e-3})
    w.write(2, "train", {"loss": 2.5, "lr": 2e-3})
    w.write(2, "eval", {"loss": 2.75})
  train = read_tb_scalars(tmp_path / "tensorboard" / "train")
  assert train["loss"] == [(1, 3.0), (2, 2.5)]
  assert [s for s, _ in train["lr"]] == [1, 2] and train["lr"][1][1] == pytest.approx(2e-3)
  assert read_tb_scalars(tmp_path / "tensorboard" / "eval") == {"loss": [(2, 2.75)]}


def test_a_resume_drops_redone_steps_from_jsonl_and_tensorboard(tmp_path):
  with MetricWriter(str(tmp_path), stdout=False) as w:
    for step in (1, 2, 3):
      w.write(step, "train", {"loss": float(step)})
  with MetricWriter(str(tmp_path), stdout=False, resume_step=2) as w:  # step 3 is trained again
    w.write(3, "train", {"loss": 30.0})
  assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 30.0)]
  assert read_tb_scalars(tmp_path / "tensorboard" / "train")["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_stdout_line(tmp_path, capsys):
  with MetricWriter(str(tmp_path), tensorboard=False) as w:
    w.write(100, "train", {"loss": 3.2141, "lr": 1e-3, "tokens/s": 12345.0, "mfu": 0.312})
  assert capsys.readouterr().out == "step 100 train loss=3.214 lr=1.0e-03 tokens/s=12.3k mfu=31.2%\n"


@pytest.mark.parametrize("name,value,text", [
    ("loss", 3.2141, "3.214"), ("loss", 123.456, "123.5"), ("loss", 0.05, "0.05"), ("loss", 0.0, "0"),
    ("lr", 3e-4, "3.0e-04"), ("lr", -2.5e-5, "-2.5e-05"), ("steps", 999, "999"), ("tokens", 40960, "41k"),
    ("tokens", 999_990, "1M"), ("tokens", 1_500_000, "1.5M"), ("params", 124_439_808, "124M"),
    ("flops", 3.2e12, "3.2T"), ("grad_norm", float("inf"), "inf"), ("loss", float("nan"), "nan"),
    ("train/mfu", 0.05, "5.0%"), ("finite", True, "true"), ("loss", np.float32(2.5), "2.5"),
])
def test_format_scalar(name, value, text):
  assert format_scalar(name, value) == text


def test_progress_disabled_is_silent(capsys):
  with Progress(100, enabled=False) as bar:
    for step in range(1, 101):
      bar.update(step, {"loss": 1.0})
  assert capsys.readouterr().err == ""


def test_progress_off_a_terminal_does_not_spam(capsys):
  bar = Progress(1000, initial_step=10)
  for step in range(11, 1001):
    bar.update(step, {"loss": 1.0 / step})
  bar.close()
  err = capsys.readouterr().err
  assert err.count("\r") <= 3  # the opening and the closing draw, nothing per step
  assert "1000/1000" in err and "loss=" in err


def test_progress_interleaves_with_metric_lines(tmp_path, capsys):
  with Progress(10) as bar, MetricWriter(str(tmp_path), tensorboard=False) as w:
    bar.update(5)
    w.write(5, "train", {"loss": 1.5})
  assert capsys.readouterr().out == "step 5 train loss=1.5\n"
