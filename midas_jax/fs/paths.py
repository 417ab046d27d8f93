"""Every file the project reads or writes goes through these functions (docs/architecture.md#paths-are-urls).

A path is either a local path (returned and handled as a plain path) or a URL whose scheme
etils.epath understands: `gs://bucket/dir` for Google Cloud Storage (and `s3://`, `az://`, `hf://`
where their packages are installed). orbax already writes through etils.epath, so a workdir URL is
handed to it as it is and its commit protocol, not renames through a fuse mount, makes a save
atomic. Anything else with `://` is refused by `check`, naming the setting that gave it, before a
run creates anything.

The helpers take `str` or path-like arguments and return plain strings where a caller composes
paths, so code reads the same for both kinds.

gs:// goes through fsspec's gcsfs, for our files and for orbax's (etils.epath would pick
TensorFlow's tf.io.gfile whenever TensorFlow is installed, which the data extra installs; gcsfs
is what also talks to a GCS emulator through STORAGE_EMULATOR_HOST). EPATH_USE_TF=true set
before the first import chooses tf.io.gfile anyway. orbax's array data goes through tensorstore's
own GCS driver either way (docs/pods.md#storage-on-gcs).
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob as glob_lib
import io
import json
import os
import posixpath
import re
import shutil
import tempfile
from typing import IO, Any, Iterator, List, Union

import fsspec
from etils import epath
from etils.epath import backend as epath_backend

from midas_jax.errors import ConfigError
from midas_jax.fs import storage_errors

os.environ.setdefault("EPATH_USE_TF", "false")  # read by epath on every call: gcsfs, not tf.io.gfile
# gcsfs's experimental zonal-bucket layer asks the storage control API (with credentials an
# emulator has no use for) about every bucket, and logs a warning each time it cannot.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

PathLike = Union[str, os.PathLike]
SCHEMES = ("gs", "s3", "az", "hf")  # what etils.epath, and so orbax, reads and writes
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_WILDCARDS = re.compile(r"[*?\[]")


def scheme(path: PathLike) -> str:
  """'gs' for gs://..., '' for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1).lower() if match else ""


def is_remote(path: PathLike) -> bool:
  return bool(scheme(path))


_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


def check(path: PathLike, setting: str) -> str:
  """The path as a string, local paths with `~` expanded; an unknown scheme is a ConfigError."""
  text = os.fspath(path)
  found = scheme(text)
  if found and found not in SCHEMES:
    raise ConfigError(setting, f"{text!r} has the scheme {found}://, which this project cannot read or write",
                      f"use a local path or one of {', '.join(s + '://' for s in SCHEMES)}")
  if not text:
    raise ConfigError(setting, "the path is empty", "give a local path or a gs:// URL")
  if found == "gs":
    bucket = text[len("gs://"):].split("/", 1)[0]
    if not _GCS_BUCKET.fullmatch(bucket):  # asking storage about it would only meet retries and DNS errors
      raise ConfigError(setting, f"{text!r} names the bucket {bucket!r}, which is not a GCS bucket name "
                        "(3 to 222 lowercase letters, digits, '-', '_' and '.')",
                        "give your bucket, e.g. gs://my-bucket/...; gs://YOUR_BUCKET in the paper configs is a "
                        "placeholder for it")
  return text if found else os.path.expanduser(text)


def absolute(path: PathLike, setting: str = "path") -> str:
  """A checked path; local ones made absolute (URLs are absolute already)."""
  text = check(path, setting)
  return text if is_remote(text) else os.path.abspath(text)


def as_epath(path: PathLike) -> epath.Path:
  return epath.Path(check(path, "path"))


def join(path: PathLike, *parts: str) -> str:
  text = os.fspath(path)
  if is_remote(text):
    return posixpath.join(text, *parts)
  return os.path.join(text, *parts)


def dirname(path: PathLike) -> str:
  text = os.fspath(path).rstrip("/") or "/"
  return posixpath.dirname(text) if is_remote(text) else os.path.dirname(os.path.abspath(text))


def basename(path: PathLike) -> str:
  """The last part of a path or URL (`gs://b/run/` -> `run`)."""
  text = os.fspath(path).rstrip("/")
  return posixpath.basename(text) if is_remote(text) else os.path.basename(os.path.normpath(text))


def relative(path: PathLike, start: PathLike) -> str:
  """`path` relative to the directory `start` (both local, or both under one URL)."""
  path, start = os.fspath(path), os.fspath(start)
  if is_remote(path) or is_remote(start):
    prefix = start.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else path
  return os.path.relpath(path, start)


def exists(path: PathLike) -> bool:
  return as_epath(path).exists()


def isdir(path: PathLike) -> bool:
  return as_epath(path).is_dir()


def isfile(path: PathLike) -> bool:
  return as_epath(path).is_file()


def makedirs(path: PathLike) -> None:
  """A local directory with its parents; on an object store nothing (a prefix needs no creating)."""
  if not is_remote(path):
    as_epath(path).mkdir(parents=True, exist_ok=True)


def make_output_dir(path: PathLike, setting: str) -> str:
  """Creates the output directory `path` with its parents, or finds it there; a local path that cannot
  be a directory (a file on it or on a parent, no permission) is a ConfigError naming `setting`."""
  text = absolute(path, setting)
  try:
    makedirs(text)
  except (FileExistsError, NotADirectoryError, PermissionError) as e:
    raise ConfigError(setting, f"cannot make the directory {text} ({e.strerror})",
                      "choose a path whose parents are directories you can write to") from None
  return text


def refresh(path: PathLike) -> None:
  """Forgets what the storage client remembers of listings at and under `path`, and of its parents.

  gcsfs answers listings, exists() and info() from the listings it made before, so files another process (another
  host, an earlier attempt) wrote or moved since stay unseen, or seem to be there after they are gone. Call it
  before a listing that must see what other processes did (which checkpoints exist, after one was set aside).
  """
  text = check(path, "path")
  if not is_remote(text):
    return  # local listings are never cached (nor are tf.io.gfile's, but glob lists through fsspec either way)
  store = epath_backend.fsspec_backend.fs(text)  # the filesystem epath, and so orbax, reads through
  store.invalidate_cache(text)
  root = fsspec.core.strip_protocol(text).rstrip("/")
  for key in [k for k in store.dircache if k == root or k.startswith(root + "/")]:
    store.dircache.pop(key, None)


def listdir(path: PathLike) -> List[str]:
  """Names (not paths) of a directory's entries, sorted."""
  return sorted(p.name for p in as_epath(path).iterdir())


def glob(pattern: PathLike) -> List[str]:
  """Files and directories matching `pattern` (`*`, `?`, `[..]`; `**` matches any number of directories), sorted."""
  text = check(pattern, "pattern")
  if not _WILDCARDS.search(text):
    return [text] if exists(text) else []
  if not is_remote(text):
    return sorted(glob_lib.glob(text, recursive=True))
  # fsspec's own glob (epath refuses `**` on object stores), through the filesystem epath and so orbax use, whose
  # listing cache `refresh` clears; it answers without the scheme.
  store = epath_backend.fsspec_backend.fs(text)
  return sorted(f"{scheme(text)}://{found}" for found in store.glob(text))


@contextlib.contextmanager
def open_file(path: PathLike, mode: str = "r", encoding: str = "utf-8") -> Iterator[IO[Any]]:
  if "b" in mode:
    with as_epath(path).open(mode) as f:
      yield f
  else:
    with as_epath(path).open(mode, encoding=encoding) as f:
      yield f


def read_text(path: PathLike) -> str:
  return as_epath(path).read_text(encoding="utf-8")


def read_bytes(path: PathLike) -> bytes:
  return as_epath(path).read_bytes()


def read_json(path: PathLike) -> Any:
  return json.loads(read_text(path))


def write_bytes(path: PathLike, data: bytes) -> None:
  """Writes a whole file so that a reader never sees part of it.

  Locally through a temporary file and a rename; an object store's single upload is atomic
  already (an object appears whole when its upload completes).
  """
  text = check(path, "path")
  if is_remote(text):
    epath.Path(text).write_bytes(data)
    return
  directory = os.path.dirname(os.path.abspath(text))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(text) + ".")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, text)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_text(path: PathLike, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def write_json(path: PathLike, obj: Any, indent: int = 2) -> None:
  write_text(path, json.dumps(obj, indent=indent))


def tree_size(path: PathLike) -> int:
  """Bytes of every file under a directory (or of one file)."""
  p = as_epath(path)
  if not p.is_dir():
    return p.stat().length if p.exists() else 0
  return sum(size(f) for f in glob(join(path, "**", "*")) if isfile(f))


def write_figure(path: PathLike, figure: Any, **savefig_kwargs: Any) -> None:
  """A matplotlib figure saved to any path (rendered in memory, then written whole)."""
  buffer = io.BytesIO()
  extension = os.fspath(path).rsplit(".", 1)[-1].lower()
  figure.savefig(buffer, format=extension if extension in ("png", "pdf", "svg", "jpg") else "png",
                 **savefig_kwargs)
  write_bytes(path, buffer.getvalue())


def remove(path: PathLike) -> None:
  """Deletes a file; a missing one is not an error."""
  p = as_epath(path)
  if p.exists():
    p.unlink()


def rmtree(path: PathLike) -> None:
  p = as_epath(path)
  if not p.exists():
    return
  if is_remote(path):
    p.rmtree()
  else:
    shutil.rmtree(os.fspath(p))


def rename(src: PathLike, dst: PathLike) -> None:
  """Moves a file or directory (on object stores: object by object, so not atomic).

  Within one store the store moves the bytes (GCS: a move or rewrite of each object, server side); no byte
  passes through this process, which matters for a checkpoint of many GB. Between stores they are copied.
  """
  src, dst = check(src, "path"), check(dst, "path")
  if not (is_remote(src) or is_remote(dst)):
    shutil.move(src, dst)
    return
  if scheme(src) == scheme(dst):
    # Through epath's own filesystem, whose listing cache the move keeps current (another gcsfs instance's
    # cache would still list the moved objects). gcsfs: each object's moveTo, or rewriteTo and a delete.
    with storage_errors.quiet_clients():  # gcsfs logs a traceback when it falls back from moveTo to a rewrite
      epath.Path(src).replace(dst)
    return
  if not isdir(src):
    copy(src, dst)
  else:
    files = [p for p in glob(join(src, "**", "*")) if isfile(p)]
    if not files:  # never delete what was not copied
      raise FileNotFoundError(f"{src} holds no file to move")
    for path in files:
      copy(path, join(dst, path[len(src.rstrip("/")) + 1:]))
  rmtree(src)


def append_text(path: PathLike, text: str) -> None:
  """Adds `text` at the end of a file (created if missing).

  Object stores cannot append: the object is read and written back whole, which is fine for the
  small, rarely written files this is for (a study's cells.jsonl). A run's metrics use
  fs.Appender, which keeps what it wrote instead of reading it back.
  """
  if not is_remote(path):
    directory = os.path.dirname(os.path.abspath(check(path, "path")))
    os.makedirs(directory, exist_ok=True)
    with open(check(path, "path"), "a", encoding="utf-8") as f:
      f.write(text)
    return
  write_text(path, (read_text(path) if exists(path) else "") + text)


def copy(src: PathLike, dst: PathLike) -> None:
  """Copies one file, between any two kinds of path."""
  write_bytes(dst, read_bytes(src))


def size(path: PathLike) -> int:
  return as_epath(path).stat().length


def matches(name: str, pattern: str) -> bool:
  return fnmatch.fnmatchcase(name, pattern)


@contextlib.contextmanager
def local_copy(path: PathLike) -> Iterator[str]:
  """A local file with `path`'s bytes, for libraries that only open local files (SentencePiece)."""
  text = check(path, "path")
  if not is_remote(text):
    yield text
    return
  with tempfile.TemporaryDirectory(prefix="midas_fs_") as tmp:
    local = os.path.join(tmp, posixpath.basename(text.rstrip("/")) or "file")
    with open(local, "wb") as f:
      f.write(read_bytes(text))
    yield local


@contextlib.contextmanager
def local_tree(path: PathLike) -> Iterator[str]:
  """A local directory holding the files under `path`, for readers of local directories only
  (transformers' from_pretrained); on a local `path` it is `path` itself."""
  text = check(path, "path")
  if not is_remote(text):
    yield text
    return
  with tempfile.TemporaryDirectory(prefix="midas_fs_") as tmp:
    for remote in glob(join(text, "**", "*")):
      if isfile(remote):
        local = os.path.join(tmp, *relative(remote, text).split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as f:
          f.write(read_bytes(remote))
    yield tmp


@contextlib.contextmanager
def staged_dir(path: PathLike) -> Iterator[str]:
  """A local directory whose contents land in `path` when the block ends without error.

  For writers that only write local files (a tokenizer's save_pretrained, a plot library); on a
  local `path` it is `path` itself.
  """
  text = check(path, "path")
  if not is_remote(text):
    os.makedirs(text, exist_ok=True)
    yield text
    return
  with tempfile.TemporaryDirectory(prefix="midas_fs_") as tmp:
    yield tmp
    for root, _, files in os.walk(tmp):
      for name in files:
        local = os.path.join(root, name)
        copy(local, join(text, os.path.relpath(local, tmp).replace(os.sep, "/")))
