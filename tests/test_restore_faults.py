"""Restores that tell a damaged save from storage that does not answer, on a real GCS server (fake-gcs-server,
tests/gcs_emulator.py) behind the fault proxy (tests/fault_proxy.py), with real orbax saves of a tiny run.

- 5% of requests answered 503: the run (saves included) ends bitwise equal to a clean one, and every save it
  lists while it runs restores at once (no half-written save is ever listed).
- An outage on the newest save's files at resume: the run stops with a storage error naming the step and the
  URL, sets nothing aside and trains nothing; once the outage ends the same command resumes from that save.
  An outage at start reads as the storage being unavailable, not as a directory the run cannot write to.
- An array file of the newest save emptied on the bucket: damage, set aside (by the store, no byte through the
  process) and the save before it used; with no save before it the run stops listing it, and starts from
  step 0 only when asked.
Then the classification itself, and the retries, on the clients' real exception types.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import gcsfs
import jax
import numpy as np
import pytest
import requests

from conftest import REPO_ROOT, tiny_gin
from midas_jax import cli, configs, fs
from midas_jax.checkpoint import available_steps, load_model
from midas_jax.checkpoint import damage
from midas_jax.checkpoint.damage import CorruptCheckpointError
from midas_jax.checkpoint.manager import RestoreError, patiently
from midas_jax.errors import ConfigError, FaultError, StorageUnavailableError
from midas_jax.fs import storage_errors
from midas_jax.train.metrics import read_metrics
from midas_jax.train.workdir import prepare_workdir

GIN = tiny_gin("""
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 2
TrainerConfig.num_steps = 6
TrainerConfig.log_every = 2
TrainerConfig.eval_every = 0
CheckpointConfig.every = 3
CheckpointConfig.keep = 5
""")
NUM_STEPS = 6


@pytest.fixture(scope="module")
def clean(gcs, tmp_path_factory):
  """(gin file, bucket, the workdir of the run trained to the end with no fault): saves at 3 and 6."""
  root = tmp_path_factory.mktemp("restore_faults")
  gin_file = root / "run.gin"
  gin_file.write_text(GIN)
  bucket = gcs.new_bucket()
  workdir = f"{bucket}/clean"
  assert cli.main(["train", f"--gin_file={gin_file}", f"--workdir={workdir}"]) == 0
  assert available_steps(workdir) == [3, 6]
  return str(gin_file), bucket, workdir


def losses(workdir):
  return [(r["step"], r["loss"]) for r in read_metrics(workdir, "train")]


def assert_same_params(a, b):
  for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def copy_run(src, dst, saves):
  """The run at `src` as a crash would have left it with only `saves` committed, at `dst` on the same bucket."""
  store = gcsfs.GCSFileSystem()  # outside fault_proxy.installed(): straight to the emulator
  store.copy(src, dst, recursive=True)
  for step in available_steps(dst):
    if step not in saves:
      fs.rmtree(fs.join(dst, "checkpoints", str(step)))
  assert available_steps(dst) == sorted(saves)
  return dst


def train(gin_file, workdir, *flags):
  return cli.main(["train", f"--gin_file={gin_file}", f"--workdir={workdir}", *flags])


def set_aside_dirs(workdir, step):
  return [n for n in fs.listdir(fs.join(workdir, "checkpoints")) if n.startswith(f"corrupt-{step}-")]


# ------------------------------------------------------------------------------------------------ runs


def test_a_run_through_503s_ends_bitwise_equal_and_lists_only_whole_saves(clean, fault_proxy):
  gin_file, bucket, reference = clean
  workdir = f"{bucket}/flaky"
  fault_proxy.error_rate = 0.05
  env = dict(os.environ, **fault_proxy.environment(), JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONUNBUFFERED="1")
  proc = subprocess.Popen([sys.executable, "-m", "midas_jax", "train", f"--gin_file={gin_file}",
                           f"--workdir={workdir}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
  seen = set()
  while proc.poll() is None:  # this process reads the bucket directly, without faults
    for step in set(available_steps(workdir)) - seen:  # a save listed is whole: it restores now, as it should
      assert_same_params(load_model(workdir, step).params, load_model(reference, step).params)
      seen.add(step)
    time.sleep(0.2)
  output = proc.stdout.read().decode()
  assert proc.returncode == 0, output[-3000:]
  assert losses(workdir) == losses(reference) and losses(workdir)[-1][0] == NUM_STEPS
  assert_same_params(load_model(workdir).params, load_model(reference).params)
  assert available_steps(workdir) == [3, 6] and seen <= {3, 6}
  # The faults reached the checkpoint writes too (uploads of array data and of orbax's files), which retried.
  writes = [path for method, path, injected in fault_proxy.log
            if injected and method in ("POST", "PUT") and "flaky/checkpoints/" in path]
  assert writes, f"no checkpoint write met a 503 ({fault_proxy.injected} of {fault_proxy.requests} injected)"


def test_an_outage_stops_the_run_as_unavailable_at_start_and_at_resume_and_sets_nothing_aside(
    clean, fault_proxy, capsys):
  """Both at once, so that the clients' own retries (about 30 s for gcsfs) are waited out once: a new run's
  workdir check, and a resume whose newest save's files answer 503 once the saves are listed."""
  gin_file, bucket, reference = clean
  workdir, fresh = copy_run(reference, f"{bucket}/outage", {3}), f"{bucket}/new_run"
  fault_proxy.only = r"/outage/checkpoints/3/(metadata|params|state)/|new_run/"
  fault_proxy.outage(90)
  patience = ["--gin.CheckpointConfig.restore_retries=1", "--gin.CheckpointConfig.restore_timeout_s=1"]
  at_start = {}
  with fault_proxy.installed():
    check = threading.Thread(target=lambda: at_start.update(error=raised_by(prepare_workdir, fresh)))
    check.start()
    code = train(gin_file, workdir, *patience)
    check.join()
  out, err = capsys.readouterr()
  assert code == 75, err[-3000:]  # EX_TEMPFAIL: run it again later
  message = err[err.index("midas: stopped:"):]
  assert f"reading the metadata of {workdir}/checkpoints/3: the storage is unavailable: HTTP 503" in message, message
  assert "The save of step 3 was left as it is" in message and "restore_timeout_s" in message, message
  assert "run the same command again" in message, message
  assert not re.search(r"^step \d+ train", out, re.M)  # nothing trained: not from step 0, not from anywhere
  assert available_steps(workdir) == [3] and not set_aside_dirs(workdir, 3)  # nothing set aside
  # The new run's check says the storage is unavailable, not that the directory cannot be written.
  start_error = at_start["error"]
  assert isinstance(start_error, StorageUnavailableError), start_error
  assert f"--workdir: writing to {fresh}: the storage is unavailable: HTTP 503" in str(start_error)
  assert "usually transient: run the same command again" in str(start_error)
  assert "status.cloud.google.com" in str(start_error) and "choose a directory" not in str(start_error)
  assert "Traceback" not in err and "out of retries" not in err  # the clients' own logged tracebacks are quiet

  fault_proxy.clear()
  with fault_proxy.installed():
    assert train(gin_file, workdir, *patience) == 0
  out, err = capsys.readouterr()
  assert "resuming from the checkpoint of step 3" in out, (out + err)[-3000:]
  assert losses(workdir) == losses(reference)
  assert available_steps(workdir) == [3, 6] and not set_aside_dirs(workdir, 3)


def raised_by(function, *args):
  try:
    function(*args)
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


def test_an_emptied_array_file_is_damage_set_aside_by_the_store(clean, fault_proxy, capsys):
  gin_file, bucket, reference = clean
  workdir = copy_run(reference, f"{bucket}/emptied", {3, 6})
  emptied = empty_arrays(workdir, 6)
  with fault_proxy.installed():
    assert train(gin_file, workdir) == 0
  out, err = capsys.readouterr()
  assert "resuming from the checkpoint of step 3" in out, (out + err)[-3000:]
  assert re.search(r"step 6 is damaged \((OUT_OF_RANGE|DATA_LOSS): ", err), err[-3000:]
  (moved,) = set_aside_dirs(workdir, 6)
  aside = fs.join(workdir, "checkpoints", moved)
  record = fs.read_json(fs.join(aside, damage.MARKER))
  assert record["step"] == 6 and re.match("OUT_OF_RANGE|DATA_LOSS", record["reason"])
  for path in emptied:  # moved as it was, the emptied files still empty
    assert fs.size(path.replace("/checkpoints/6/", f"/checkpoints/{moved}/")) == 0
  # Set aside by the store (moveTo, or rewriteTo and a delete): nothing was uploaded into it or read from it here;
  # what the run uploaded for it is its marker, into the save before the move.
  requests_to = [(m, p) for m, p, _ in fault_proxy.log if moved in p]
  assert any(re.search(r"/(moveTo|rewriteTo)/", p) for _, p in requests_to), requests_to[:5]
  assert not any(p.startswith("/upload/") or "alt=media" in p for _, p in requests_to)
  assert any(p.startswith("/upload/") and f"emptied/checkpoints/6/{damage.MARKER}" in p for _, p, _ in fault_proxy.log)
  assert losses(workdir) == losses(reference)
  assert available_steps(workdir) == [3, 6]  # step 6 saved again, whole
  assert_same_params(load_model(workdir).params, load_model(reference).params)


def test_with_no_usable_save_the_run_stops_listing_it_and_starts_over_only_when_asked(clean, capsys):
  gin_file, bucket, reference = clean
  workdir = copy_run(reference, f"{bucket}/nothing_left", {6})
  empty_arrays(workdir, 6)
  for attempt in range(2):  # the set-aside save still counts when the same command runs again
    assert train(gin_file, workdir) == 2
    out, err = capsys.readouterr()
    assert "CheckpointConfig.on_no_usable_save" in err and "none can be used" in err, err[-3000:]
    (moved,) = set_aside_dirs(workdir, 6)
    assert re.search(rf"{moved}: (OUT_OF_RANGE|DATA_LOSS)", err) and "start_fresh" in err, (attempt, err)
    assert not re.search(r"^step \d+ train", out, re.M)
    assert available_steps(workdir) == []
  assert train(gin_file, workdir, "--gin.CheckpointConfig.on_no_usable_save='start_fresh'") == 0
  out, err = capsys.readouterr()
  assert "starting from step 0" in out + err and "resuming" not in out
  assert losses(workdir) == losses(reference) and available_steps(workdir) == [3, 6]


def test_a_listing_sees_the_saves_another_process_committed_since(clean):
  _, bucket, reference = clean
  workdir = copy_run(reference, f"{bucket}/listed", {3})
  assert available_steps(workdir) == [3]  # this process has listed the folder once
  other = gcsfs.GCSFileSystem(skip_instance_cache=True)  # another host's client, with its own listing cache
  other.copy(f"{workdir}/checkpoints/3", f"{workdir}/checkpoints/9", recursive=True)
  assert available_steps(workdir) == [3, 9]


def empty_arrays(workdir, step):
  """Empties every array data file of the params item of a save, on the bucket; returns their URLs."""
  files = [p for p in fs.glob(fs.join(workdir, "checkpoints", str(step), "params", "**", "d", "*")) if fs.isfile(p)]
  assert files
  for path in files:
    fs.write_bytes(path, b"")
  return files


# ----------------------------------------------------------------------------------- classification


def _raised(error, cause):
  """`error` raised from `cause`, as a library wraps a client's error."""
  try:
    raise error from cause
  except Exception as e:  # pylint: disable=broad-except
    return e


TS_503 = ("ABORTED: All 32 retry attempts failed: service unavailable [http_response_body='{}'] "
          "[http_response_code='503']")


@pytest.mark.parametrize("error, kind", [
    (gcsfs.retry.HttpError({"code": 503, "message": "backendError"}), storage_errors.UNAVAILABLE),
    (gcsfs.retry.HttpError({"code": 429, "message": "rateLimitExceeded"}), storage_errors.UNAVAILABLE),
    (gcsfs.retry.HttpError({"code": 408, "message": "timeout"}), storage_errors.UNAVAILABLE),
    (gcsfs.retry.HttpError({"code": 401, "message": "Invalid Credentials"}), storage_errors.CREDENTIALS),
    (OSError("Forbidden: b/run/x\nno storage.objects.create access"), storage_errors.DENIED),  # gcsfs's 403
    (requests.exceptions.ProxyError(), storage_errors.UNAVAILABLE),  # gcsfs's 502
    (requests.exceptions.ConnectionError("reset"), storage_errors.UNAVAILABLE),
    (ConnectionResetError(104, "Connection reset by peer"), storage_errors.UNAVAILABLE),
    (TimeoutError("timed out"), storage_errors.UNAVAILABLE),
    (ValueError(TS_503), storage_errors.UNAVAILABLE),  # tensorstore, as it words a 503 it gave up on
    (ValueError("UNAVAILABLE: Connection refused"), storage_errors.UNAVAILABLE),
    (ValueError("PERMISSION_DENIED: [http_response_code='403']"), storage_errors.DENIED),
    (_raised(KeyError("wrapped"), gcsfs.retry.HttpError({"code": 500, "message": "x"})), storage_errors.UNAVAILABLE),
    (ValueError("OUT_OF_RANGE: Error reading Byte range [0, 24892) of local file"), None),
    (ValueError("DATA_LOSS: Error decoding"), None),
    (FileNotFoundError("gs://b/run/checkpoints/4/metadata/metadata"), None),
    (gcsfs.retry.HttpError({"code": 404, "message": "not found"}), None),
    (KeyError("params"), None),
    (MemoryError(), None),
])
def test_storage_errors_are_told_from_everything_else(error, kind):
  fault = storage_errors.classify(error)
  assert (fault.kind if fault else None) == kind, fault
  if kind is not None:  # a storage error is never evidence of damage, whatever it wraps
    assert damage.evidence(_raised(ValueError("DATA_LOSS: x"), error)) is None


@pytest.mark.parametrize("error, found", [
    (ValueError("OUT_OF_RANGE: Error reading Byte range [0, 24892) of local file"), True),  # emptied, truncated
    (ValueError("DATA_LOSS: Error opening \"zarr\" driver"), True),
    (ValueError("NOT_FOUND: Metadata at \"embedding/.zarray\" does not exist"), True),
    (KeyError('Item "params" was not found in the checkpoint. Available items: [\'state\']'), True),
    (json.JSONDecodeError("Expecting value", "", 0), True),
    (FileNotFoundError("gs://b/run/checkpoints/4/metadata/metadata"), True),
    (ValueError("Requested shape: (2, 96, 32) is not compatible with the stored shape: (2, 64, 32)."), True),
    (ValueError(TS_503), False),
    (gcsfs.retry.HttpError({"code": 503, "message": "x"}), False),
    (MemoryError(), False),
    (TypeError("unsupported operand"), False),
    (KeyError("opt_state"), False),
])
def test_only_evidence_counts_as_damage(error, found):
  assert (damage.evidence(error) is not None) == found


def test_out_of_memory_is_told_apart():
  assert damage.out_of_memory(MemoryError())
  assert damage.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 98.0G"))
  assert not damage.out_of_memory(ValueError(TS_503.replace("ABORTED", "RESOURCE_EXHAUSTED")))


def test_the_start_check_keeps_the_permission_message_for_a_403():
  forbidden = OSError("Forbidden: b/run/.write_test\nno storage.objects.create access")
  assert storage_errors.unavailable(forbidden, "gs://b/run", "writing to") is None  # the caller's message stands
  outage = storage_errors.unavailable(gcsfs.retry.HttpError({"code": 503, "message": "x"}), "gs://b/run", "writing")
  assert isinstance(outage, StorageUnavailableError) and "gs://b/run" in str(outage)


# ----------------------------------------------------------------------------------------- retries


class Flaky:
  """A read that raises the given errors in turn, then returns "ok"; counts its calls."""

  def __init__(self, *errors):
    self.errors, self.calls = list(errors), 0

  def __call__(self):
    self.calls += 1
    if self.errors:
      raise self.errors.pop(0)
    return "ok"


def _503():
  return gcsfs.retry.HttpError({"code": 503, "message": "backendError"})


def test_storage_errors_are_retried_with_backoff_then_stop_naming_the_step_and_url(capsys):
  patient = configs.CheckpointConfig(restore_retries=2, restore_timeout_s=30)
  read = Flaky(_503(), _503())
  start = time.monotonic()
  assert patiently(read, "gs://b/run/checkpoints/4", "reading", patient, step=4) == "ok"
  assert read.calls == 3 and 3 <= time.monotonic() - start < 10  # waited 1 s, then 2 s
  assert "trying again in 1 s (retry 1 of 2)" in capsys.readouterr().out
  with pytest.raises(StorageUnavailableError) as stopped:
    patiently(Flaky(_503(), _503(), _503()), "gs://b/run/checkpoints/4", "reading", patient, step=4)
  message = str(stopped.value)
  assert "gs://b/run/checkpoints/4" in message and "step 4" in message and "HTTP 503" in message
  assert "after 3 tries" in message and "left as it is" in message
  short = configs.CheckpointConfig(restore_retries=5, restore_timeout_s=1.5)  # the time runs out first
  with pytest.raises(StorageUnavailableError, match="after 2 tries"):
    patiently(Flaky(*[_503() for _ in range(5)]), "gs://b/x", "reading", short, step=4)


def test_errors_that_are_not_storage_errors_are_never_retried():
  url, patient = "gs://b/run/checkpoints/4", configs.CheckpointConfig(restore_retries=3)
  cases = [(ValueError("DATA_LOSS: Error decoding"), CorruptCheckpointError),
           (RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4G"), FaultError),
           (TypeError("something nobody expected"), RestoreError),
           (OSError("Forbidden: b/run\nno access"), ConfigError)]
  for error, kind in cases:
    read = Flaky(error)
    with pytest.raises(kind) as raised:
      patiently(read, url, "reading", patient, step=4)
    assert read.calls == 1, error
    if kind is not CorruptCheckpointError:
      assert url in str(raised.value)


def test_the_new_settings_are_checked():
  with pytest.raises(ConfigError, match="CheckpointConfig.restore_retries"):
    configs.CheckpointConfig(restore_retries=-1)
  with pytest.raises(ConfigError, match="CheckpointConfig.restore_timeout_s"):
    configs.CheckpointConfig(restore_timeout_s=0)
  with pytest.raises(ConfigError, match="CheckpointConfig.on_no_usable_save.*start_fresh"):
    configs.CheckpointConfig(on_no_usable_save="ignore")
