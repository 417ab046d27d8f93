"""Damage, outage and a host out of memory told apart by type and status code, on errors the libraries
themselves raise (never a message written here): tensorstore reading a real orbax save with a file
truncated or garbled, orbax restoring one with an item or its metadata gone, tensorstore and gcsfs reading
through the GCS emulator and the fault proxy answering 503, 429, 403 or 401, and jax running out of memory
on the CPU. Each error gets the same verdict when a library wraps it (a cause, an exception group).

The versions these were read from: orbax-checkpoint 0.12.8, tensorstore 0.1.86, gcsfs 2026.10.1, jax 0.10.2.
An upgrade that rewords or retypes one of them fails here, not on a slice.
"""

import glob
import os
import shutil

import fsspec.asyn
import gcsfs
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from midas_jax.checkpoint import damage
from midas_jax.checkpoint.manager import make_manager
from midas_jax.configs import CheckpointConfig
from midas_jax.exception_chain import links, status_code
from midas_jax.fs import storage_errors

STEP = 3
PARAMS = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.float32)}
STATE = {"step": np.array(STEP, np.int32)}
FEW_RETRIES = {"gcs_request_retries": {"max_retries": 2, "initial_delay": "10ms", "max_delay": "20ms"}}


def verdict(error):
  """What the restore path makes of `error`: a storage fault's kind, "damage", "out of memory", or None."""
  fault = storage_errors.classify(error)
  found = damage.evidence(error)
  assert fault is None or found is None, (fault, found)  # a storage error is never evidence
  if fault is not None:
    return fault.kind
  if found is not None:
    return "damage"
  return "out of memory" if damage.out_of_memory(error) else None


def wrapped(error):
  """`error` as libraries pass it on: raised from, inside an exception group beside another error, nested."""
  try:
    raise RuntimeError("restore failed") from error
  except RuntimeError as e:
    from_ = e
  return [from_, ExceptionGroup("shards", [ValueError("another shard"), error]),
          BaseExceptionGroup("outer", [KeyboardInterrupt(), ExceptionGroup("inner", [from_])])]


def assert_verdict(error, expected):
  assert verdict(error) == expected, (type(error), error)
  for outer in wrapped(error):
    assert verdict(outer) == expected, outer


# ------------------------------------------------------------------------------- a real orbax save


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("damage_types") / "checkpoints")
  manager = make_manager(root, CheckpointConfig(async_save=False))
  on_device = lambda tree: jax.tree.map(jnp.asarray, tree)  # jax arrays, as a run saves them
  manager.save(STEP, args=ocp.args.Composite(params=ocp.args.StandardSave(on_device(PARAMS)),
                                             state=ocp.args.StandardSave(on_device(STATE)),
                                             metadata=ocp.args.JsonSave({"step": STEP})))
  manager.wait_until_finished()
  manager.close()
  return root


@pytest.fixture
def save(pristine, tmp_path):
  """A copy of the pristine save, to damage; its step directory."""
  root = str(tmp_path / "checkpoints")
  shutil.copytree(pristine, root)
  return root


def restore_error(root):
  """The error orbax raises restoring every item of the save under `root` (as the manager restores)."""
  abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  manager = make_manager(root, read_only=True)
  try:
    manager.restore(STEP, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract(PARAMS)),
                                                  state=ocp.args.StandardRestore(abstract(STATE)),
                                                  metadata=ocp.args.JsonRestore()))
  except Exception as e:  # pylint: disable=broad-except
    return e
  finally:
    manager.close()
  raise AssertionError(f"the save under {root} restored: the damage did not reach a read")


def item(root, *parts):
  return os.path.join(root, str(STEP), *parts)


def node_file(root):
  """The b-tree node file of the params item's OCDBT database (its top-level data file)."""
  (path,) = [p for p in glob.glob(item(root, "params", "d", "*")) if os.path.isfile(p)]
  return path


def value_file(root):
  """The largest data file of the params item: it holds the (zstd-compressed) chunk of `w`."""
  return max(glob.glob(item(root, "params", "ocdbt.process_0", "d", "*")), key=os.path.getsize)


def flip(path, start, stop):
  data = bytearray(open(path, "rb").read())
  for i in range(int(len(data) * start), int(len(data) * stop)):
    data[i] ^= 0x5A
  open(path, "wb").write(bytes(data))


def test_the_pristine_save_restores_and_its_copies_tell_each_damage(save):
  with pytest.raises(AssertionError, match="restored"):  # the cases below fail on the damage, not on the copy
    restore_error(save)


@pytest.mark.parametrize("harm, code, tensorstore_raised", [
    # the file's index says more bytes than it holds: tensorstore OUT_OF_RANGE
    (lambda root: open(node_file(root), "r+b").truncate(os.path.getsize(node_file(root)) // 2), "OUT_OF_RANGE", True),
    (lambda root: open(node_file(root), "wb").close(), "OUT_OF_RANGE", True),  # emptied
    (lambda root: open(item(root, "params", "manifest.ocdbt"), "wb").write(b"\0" * 40), "DATA_LOSS", True),
    (lambda root: os.remove(node_file(root)), "NOT_FOUND", True),
    (lambda root: os.remove(item(root, "params", "manifest.ocdbt")), "NOT_FOUND", True),
    # a compressed value that does not decompress: tensorstore FAILED_PRECONDITION, from a local file
    (lambda root: flip(value_file(root), 0.9, 1.0), "FAILED_PRECONDITION", True),
    # a b-tree node that does not decompress: INVALID_ARGUMENT, whose code tensorstore drops
    (lambda root: flip(node_file(root), 0.5, 1.0), None, True),
    (lambda root: shutil.rmtree(item(root, "state")), None, False),  # orbax: an item missing (KeyError)
    (lambda root: os.remove(item(root, "params", "_METADATA")), None, False),  # orbax: FileNotFoundError
    (lambda root: open(item(root, "params", "_METADATA"), "w").write("{not json"), None, False),  # JSONDecodeError
    (lambda root: os.remove(item(root, "metadata", "metadata")), None, False),
    (lambda root: open(item(root, "metadata", "metadata"), "w").write("{not json"), None, False),
    (lambda root: shutil.rmtree(item(root)), None, False),  # the step gone since it was listed: FileNotFoundError
], ids=["truncated", "emptied", "manifest-garbled", "node-missing", "manifest-missing", "value-garbled",
        "node-garbled", "item-missing", "array-metadata-missing", "array-metadata-garbled", "metadata-missing",
        "metadata-garbled", "step-missing"])
def test_a_damaged_save_is_damage_by_the_libraries_own_error(save, harm, code, tensorstore_raised):
  harm(save)
  error = restore_error(save)
  assert_verdict(error, "damage")
  codes = [status_code(e) for e in links(error) if isinstance(e, ValueError)]
  assert (code in codes) if code else not any(codes), codes  # read from the code where tensorstore gives one
  if not tensorstore_raised:  # orbax's (or the standard library's) own type, with no status code
    assert not any(codes), codes


def test_an_array_stored_with_another_shape_is_damage(save):
  wrong = dict(PARAMS, w=np.zeros((32, 64), np.float32))
  manager = make_manager(save, read_only=True)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), wrong)
  with pytest.raises(Exception) as raised:  # pylint: disable=broad-except
    manager.restore(STEP, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  manager.close()
  assert_verdict(raised.value, "damage")


# ------------------------------------------------------------------ the store through the fault proxy


@pytest.fixture(scope="module")
def proxy(gcs):
  """One fault proxy for the module (stopping one takes half a second), cleared for each test."""
  from fault_proxy import FaultProxy  # pylint: disable=import-outside-toplevel
  started = FaultProxy(gcs).start()
  yield started
  started.stop()


@pytest.fixture
def fault_proxy(proxy):
  proxy.clear()
  yield proxy
  proxy.clear()


@pytest.fixture
def stored(gcs):
  """(bucket name, object name) of an object on the emulator."""
  bucket = gcs.new_bucket()
  gcsfs.GCSFileSystem().pipe(f"{bucket}/run/x", b"hello")
  return bucket[len("gs://"):], "run/x"


def tensorstore_error(bucket, name):
  """tensorstore's error reading `name` (with few retries, so that a fault ends in a fraction of a second)."""
  store = ts.KvStore.open({"driver": "gcs", "bucket": bucket, "context": FEW_RETRIES}).result()
  try:
    store.read(name).result()
  except Exception as e:  # pylint: disable=broad-except
    return e
  raise AssertionError("the read succeeded")


def gcsfs_error(bucket, name):
  """gcsfs's error for a GET of `name`: its request without the retry loop around it, which re-raises the
  same exception after about 30 s of retries (test_restore_faults.py's outage test waits that out once)."""
  store = gcsfs.GCSFileSystem()
  try:
    fsspec.asyn.sync(store.loop, gcsfs.GCSFileSystem._request.__wrapped__, store, "GET", "b/{}/o/{}", bucket, name)
  except Exception as e:  # pylint: disable=broad-except
    return e
  raise AssertionError("the read succeeded")


@pytest.mark.parametrize("status, kind", [(503, storage_errors.UNAVAILABLE), (429, storage_errors.UNAVAILABLE),
                                          (403, storage_errors.DENIED), (401, storage_errors.CREDENTIALS)])
def test_the_store_answering_an_error_is_a_storage_fault_by_its_status(stored, fault_proxy, status, kind):
  fault_proxy.status = status
  fault_proxy.outage(60)
  injected = fault_proxy.injected
  with fault_proxy.installed():
    by_tensorstore, by_gcsfs = tensorstore_error(*stored), gcsfs_error(*stored)
  assert fault_proxy.injected - injected >= 2  # both reads were answered by the proxy's fault
  assert storage_errors.http_status(by_tensorstore) == status, by_tensorstore
  assert_verdict(by_tensorstore, kind)
  assert_verdict(by_gcsfs, kind)
  # A storage fault wrapped beside damage is still the storage's: nothing is set aside on it.
  assert verdict(ExceptionGroup("restore", [ValueError("DATA_LOSS: a shard"), by_tensorstore])) == kind


def test_a_store_that_does_not_answer_is_unavailable(stored, gcs):
  """tensorstore and gcsfs pointed at a port nobody listens on: their connection errors, by class and code."""
  from gcs_emulator import _free_port  # pylint: disable=import-outside-toplevel
  closed = f"http://127.0.0.1:{_free_port()}"
  saved = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
  os.environ.update({k: closed for k in saved})
  gcsfs.GCSFileSystem.clear_instance_cache()
  try:
    by_tensorstore, by_gcsfs = tensorstore_error(*stored), gcsfs_error(*stored)
  finally:
    os.environ.update(saved)
    gcsfs.GCSFileSystem.clear_instance_cache()
  assert_verdict(by_tensorstore, storage_errors.UNAVAILABLE)
  assert_verdict(by_gcsfs, storage_errors.UNAVAILABLE)


# --------------------------------------------------------------------------------------- memory


def test_jax_running_out_of_memory_is_neither_damage_nor_storage():
  with pytest.raises(Exception) as raised:  # pylint: disable=broad-except
    jnp.zeros((1 << 48,), jnp.uint8).block_until_ready()  # 256 TiB: more than the address space
  assert status_code(raised.value) == "RESOURCE_EXHAUSTED" and isinstance(raised.value, RuntimeError)
  assert_verdict(raised.value, "out of memory")
