"""Trackers (TrainerConfig.trackers): a real run's Weights & Biases records, read back from wandb's offline run.

wandb runs offline (WANDB_MODE=offline, WANDB_DIR under tmp_path): each start of a run writes
<WANDB_DIR>/wandb/offline-run-<time>-<run id>/run-<run id>.wandb, wandb's transaction log of protobuf
records (wandb.proto.wandb_internal_pb2.Record). wandb 0.31 has no Python reader for it (its readers are
in the Go service), so `read_offline_run` reads the log's framing here and decodes the records with wandb's
own protobufs: the scalars, the config, the summary's growths and the run id are checked against what the
run wrote to metrics.jsonl, config.json, stages.json and its checkpoints' metadata.
"""

import dataclasses
import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from typing import Any, Dict

import pytest

from conftest import REPO_ROOT, tiny_gin, tiny_run
from midas_jax import configs
from midas_jax.checkpoint import available_steps, load_model
from midas_jax.errors import ConfigError
from midas_jax.train.metrics import read_metrics
from midas_jax.train.run import train
from midas_jax.train.trackers import wandb_tracker

wandb = pytest.importorskip("wandb")

# The transaction log (wandb-core's leveldb-style framing): a 7-byte file header (":W&B", magic 0xBEE1,
# version 0), then 32 KiB blocks of records, each a 7-byte header (CRC-32, length, kind) and its data; a
# record too long for its block is cut into FIRST, MIDDLE..., LAST pieces; a block's tail under 7 bytes
# is padding.
_BLOCK, _FULL, _FIRST, _MIDDLE, _LAST = 32 * 1024, 1, 2, 3, 4
BOUNDARY = 3  # 4 layers grown in 2 stages (Prop-1, alpha 1): the growth of the 8-step runs below


def _log_records(path: str):
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), f"{path}: not a W&B log"
  pos, pieces = 7, b""
  while pos + 7 <= len(data):
    if _BLOCK - pos % _BLOCK < 7:
      pos += _BLOCK - pos % _BLOCK
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if len(chunk) < length:  # the cut-off tail of a killed run
      return
    if kind == _FULL:
      yield chunk
    elif kind == _FIRST:
      pieces = chunk
    elif kind == _MIDDLE:
      pieces += chunk
    elif kind == _LAST:
      yield pieces + chunk


def _key(item) -> str:
  return item.key or "/".join(item.nested_key)


def _records(path: str, finished: bool):
  """The log's records; finished: those of a run that finished, once its exit record is on disk (wandb's
  finish() returns before its service has written the log's last block)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  deadline = time.time() + 60
  while True:
    records = []
    for raw in _log_records(path):
      records.append(wandb_internal_pb2.Record())
      records[-1].ParseFromString(raw)
    if not finished or any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
      return records
    time.sleep(0.2)


def read_offline_run(run_dir: str, finished: bool = True) -> Dict[str, Any]:
  """{"id", "name", "tags", "config", "history": {step: {key: value}}, "summary"} of one offline run dir;
  finished=False reads a killed run's records as they are."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  run: Dict[str, Any] = {"config": {}, "history": {}, "summary": {}}
  for record in _records(path, finished):
    kind = record.WhichOneof("record_type")
    if kind == "run":
      run.update(id=record.run.run_id, name=record.run.display_name, tags=list(record.run.tags))
      run["config"].update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
    elif kind == "config":
      run["config"].update({_key(i): json.loads(i.value_json) for i in record.config.update})
    elif kind == "history":
      row = {_key(i): json.loads(i.value_json) for i in record.history.item}
      run["history"].setdefault(row["_step"], {}).update(row)
    elif kind == "summary":
      run["summary"].update({_key(i): json.loads(i.value_json) for i in record.summary.update})
  return run


def offline_runs(wandb_dir, run_id: str) -> list:
  """The offline run dirs of W&B run `run_id` under WANDB_DIR, oldest first (one per start of the run)."""
  return sorted(glob.glob(os.path.join(str(wandb_dir), "wandb", f"offline-run-*-{run_id}")))


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
  """WANDB_DIR for the module: wandb reads it once per process (at its first run), so the runs share it."""
  wandb_dir = tmp_path_factory.mktemp("wandb_dir")
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_DIR", str(wandb_dir))
    patch.setenv("WANDB_SILENT", "true")
    yield wandb_dir


def _grown_run(**trainer) -> configs.RunConfig:
  # tiny_gin's shape, so that the subprocess runs below find these programs in the session's compile cache
  base = tiny_run(model=dataclasses.replace(tiny_run().model, num_layers=4, max_seq_len=64))
  trainer = dataclasses.replace(base.trainer, num_steps=8, log_every=2, eval_every=4, **trainer)
  return dataclasses.replace(base, trainer=trainer, stacking=configs.StackingConfig(num_stages=2, alpha=1.0),
                             checkpoint=configs.CheckpointConfig(every=4, async_save=False))


def test_tracker_names_and_wandb_settings_are_checked():
  assert configs.TrainerConfig().trackers == ("tensorboard",)
  assert configs.TrainerConfig(trackers="wandb").trackers == ("wandb",)  # one bare name, as gin hands it over
  for bad, problem in ((("tensorbord",), "unknown tracker"), (("wandb", "wandb"), "twice"), ((3,), "tuple of names")):
    with pytest.raises(ConfigError, match=r"TrainerConfig\.trackers.*" + problem):
      configs.TrainerConfig(trackers=bad)
  with pytest.raises(ConfigError, match=r"TrainerConfig\.wandb_mode"):
    configs.TrainerConfig(wandb_mode="offlin")
  with pytest.raises(ConfigError, match=r"TrainerConfig\.wandb_tags"):
    configs.TrainerConfig(wandb_tags=(1,))


def test_wandb_without_the_package_stops_the_run_at_start_naming_the_fix(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # what an install without the extra finds
  with pytest.raises(ConfigError, match=r"(?s)TrainerConfig\.trackers.*wandb.*not installed.*pip install"):
    train(_grown_run(trackers=("wandb",)), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # refused before the run opened anything


def test_a_run_logs_its_scalars_config_and_growths_to_wandb(tmp_path, offline):
  workdir = str(tmp_path / "run")
  config = _grown_run(trackers=("tensorboard", "wandb"), wandb_name="tiny", wandb_tags=("midas", "test"))
  result = train(config, workdir)
  assert result.steps == 8 and [g["step"] for g in result.growths] == [BOUNDARY]
  run_id = json.load(open(os.path.join(workdir, wandb_tracker.RUN_ID_FILE)))["id"]
  (run_dir,) = offline_runs(offline, run_id)
  run = read_offline_run(run_dir)
  assert run["id"] == run_id
  assert run["name"] == "tiny" and run["tags"] == ["midas", "test"]
  for step in available_steps(workdir):  # every save names the W&B run a restart continues
    assert load_model(workdir, step=step).metadata["trackers"] == {"wandb_run_id": run_id}

  # The scalars: every record of metrics.jsonl, as <split>/<name> at its step.
  records = read_metrics(workdir)
  assert {r["split"] for r in records} == {"train", "eval", "stage"}
  for record in records:
    row = run["history"][record["step"]]
    for name, value in record.items():
      if name not in ("step", "split"):
        assert row[f"{record['split']}/{name}"] == pytest.approx(value, rel=1e-12), (record["step"], name)
  assert run["history"][8]["train/depth"] == 4 and run["history"][2]["train/depth"] == 2

  # The config: the resolved config the run recorded (the final depth's model, the trackers themselves).
  resolved = {k: v for k, v in json.load(open(os.path.join(workdir, "config.json"))).items() if k != "data_mixture"}
  assert {k: run["config"][k] for k in resolved} == resolved
  assert run["config"]["model"]["num_layers"] == 4 and run["config"]["trainer"]["trackers"] == ["tensorboard", "wandb"]

  # The growth: a marker at its step in the history, and its stage, depth and provenance in the summary.
  marked = sorted(s for s, row in run["history"].items() if "stage/stage" in row)
  assert marked == [BOUNDARY] and run["history"][BOUNDARY]["stage/depth"] == 4
  growth = json.load(open(os.path.join(workdir, "stages.json")))["growths"][0]
  assert run["summary"]["growths"] == [{"step": BOUNDARY, "stage": 2, "depth": 4, "provenance": growth["provenance"]}]
  assert os.listdir(os.path.join(workdir, "tensorboard", "train"))  # TensorBoard is still written beside it


def test_a_wandb_failure_turns_the_tracker_off_and_never_the_run(tmp_path, offline, capsys):
  tracker = wandb_tracker.WandbTracker(configs.TrainerConfig(), str(tmp_path / "run"), {"a": 1}, {}, [])
  tracker.write(1, "train", {"loss": 2.0})
  tracker.write(2, "train", {"loss": 1.5})  # commits step 1's row
  wandb.run.finish()  # wandb refuses every later call of this run
  tracker.write(3, "train", {"loss": 1.0})
  assert not tracker.active and "W&B tracking is off for the rest of this run" in capsys.readouterr().out
  tracker.write(4, "train", {"loss": 0.5})
  tracker.mark_growth(4, 2, 4, [0, 1, 0, 1])
  tracker.close()
  assert tracker.resume_state() == {"wandb_run_id": tracker.run_id}
  (run_dir,) = offline_runs(offline, tracker.run_id)
  logged = read_offline_run(run_dir)
  assert 1 in logged["history"] and not {3, 4} & set(logged["history"]) and "growths" not in logged["summary"]


GIN = tiny_gin("""
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 2
TrainerConfig.num_steps = 8
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 4
TrainerConfig.eval_batches = 1
StackingConfig.num_stages = 2
StackingConfig.alpha = 1.0
CheckpointConfig.every = 2
CheckpointConfig.async_save = False
TrainerConfig.trackers = ('tensorboard', 'wandb')
TrainerConfig.wandb_mode = 'offline'
""", num_layers=4)


def _midas_train(gin_file, workdir, env, kill_after=None):
  """`midas train` to the end, or SIGKILLed once `kill_after` (a regex) shows in its output. Returns the output."""
  cmd = [sys.executable, "-u", "-m", "midas_jax", "train", f"--gin_file={gin_file}", f"--workdir={workdir}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if kill_after and re.search(kill_after, line):
      proc.send_signal(signal.SIGKILL)
      rest, _ = proc.communicate(timeout=120)
      assert proc.returncode == -signal.SIGKILL, "".join(lines) + rest
      return "".join(lines) + rest
  proc.wait(timeout=300)
  output = "".join(lines)
  assert proc.returncode == 0 and not kill_after, output[-3000:]
  return output


def test_a_sigkilled_run_resumes_into_the_same_wandb_run(tmp_path, offline):
  """Killed after the grown state's save and one more, then resumed with the workdir's id file gone: the id
  comes from the checkpoint's metadata, and both starts log to one W&B run."""
  gin_file = tmp_path / "run.gin"
  gin_file.write_text(GIN)
  workdir = str(tmp_path / "run")
  # Not this process's wandb service (WANDB_SERVICE, set by the runs above): each run starts its own.
  env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  _midas_train(gin_file, workdir, env, kill_after=r"step 6 train")
  saved = max(available_steps(workdir))
  assert saved >= BOUNDARY
  run_id = load_model(workdir, step=saved).metadata["trackers"]["wandb_run_id"]
  os.remove(os.path.join(workdir, wandb_tracker.RUN_ID_FILE))
  output = _midas_train(gin_file, workdir, env)
  assert f"resuming from the checkpoint of step {saved}" in output

  # Two starts of one W&B run: wandb names each start's dir by the run id. The killed start's log may hold
  # nothing (wandb's service writes it in 32 KiB blocks and died with the run): what it holds is checked.
  killed, finished = offline_runs(offline, run_id)
  first, resumed = read_offline_run(killed, finished=False), read_offline_run(finished)
  assert first.get("id", run_id) == resumed["id"] == run_id
  assert json.load(open(os.path.join(workdir, wandb_tracker.RUN_ID_FILE)))["id"] == run_id  # written again
  assert load_model(workdir).metadata["trackers"] == {"wandb_run_id": run_id}
  assert all(step <= saved for step in first["history"])
  # The resumed start logs the steps after its save, and its summary still lists the growth before it.
  logged = sorted(s for s, row in resumed["history"].items() if "train/loss" in row)
  assert logged == list(range(saved + 1, 9))
  jsonl = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}
  assert all(resumed["history"][s]["train/loss"] == pytest.approx(jsonl[s], rel=1e-12) for s in logged)
  assert [g["step"] for g in resumed["summary"]["growths"]] == [BOUNDARY]
  assert resumed["config"]["trainer"]["trackers"] == ["tensorboard", "wandb"]
