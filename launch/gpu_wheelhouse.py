"""The wheels launch/gpu_check.sh installs on a GPU machine that can fetch nothing: build them here, install
there only what is missing (docs/benchmarks.md#gpu-day-one).

    python launch/gpu_wheelhouse.py [DIR]                 # here: download them into DIR (launch/wheelhouse)
    python launch/gpu_wheelhouse.py --install DIR --target SITE   # there: install what is missing into SITE

The GPU image (Python 3.12, jax 0.11 with its CUDA 13 plugin, flax, optax, orbax-checkpoint, tensorstore,
numpy, protobuf, sentencepiece, tokenizers, tqdm, matplotlib, scipy, pyarrow, fsspec, pytest and
pytest-xdist) lacks two of the packages that the train, bench, study and attention paths import:
gin-config (every config) and tensorboardX (the default tracker, TrainerConfig.trackers). Both are pure
Python, and what they need (numpy, packaging, protobuf) is in the image, so each is one small wheel,
downloaded without its dependencies at the version requirements/constraints.txt pins. jax and its CUDA
wheels are never carried (hundreds of MiB, over what a device call may carry): the run uses the image's.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Dict, List, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(REPO_ROOT, "requirements", "constraints.txt")
DEFAULT_DIR = os.path.join(REPO_ROOT, "launch", "wheelhouse")  # git-ignored; the device call carries it
# Distributions the GPU image lacks that this project imports on the paths gpu_check.sh runs.
MISSING_ON_THE_GPU_IMAGE = ("gin-config", "tensorboardX")
TARGET_PYTHON = "3.12"  # the GPU image's
CARRY_LIMIT_BYTES = 64 * 1024 ** 2  # what one device call may carry in all, the working tree included


def _normal(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions(names: Sequence[str] = MISSING_ON_THE_GPU_IMAGE, constraints: str = CONSTRAINTS) -> Dict[str, str]:
  """{name: version} from the constraints file's `name==version` lines."""
  pins = {}
  with open(constraints, encoding="utf-8") as f:
    for line in f:
      m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
      if m:
        pins[_normal(m.group(1))] = m.group(2)
  unpinned = [n for n in names if _normal(n) not in pins]
  if unpinned:
    raise SystemExit(f"{constraints} pins no version of {', '.join(unpinned)}: add `NAME==VERSION` lines for them")
  return {n: pins[_normal(n)] for n in names}


def build(folder: str, names: Sequence[str] = MISSING_ON_THE_GPU_IMAGE) -> int:
  """Downloads the pinned wheels (no dependencies, pure-Python wheels for CPython 3.12) into `folder`;
  returns their total bytes."""
  os.makedirs(folder, exist_ok=True)
  pins = pinned_versions(names)
  subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                  "--python-version", TARGET_PYTHON, "--implementation", "cp", "--dest", folder]
                 + [f"{name}=={version}" for name, version in pins.items()], check=True)
  return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".whl"))


def missing(names: Sequence[str] = MISSING_ON_THE_GPU_IMAGE) -> List[str]:
  """The distributions of `names` that this Python does not have."""
  absent = []
  for name in names:
    try:
      importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      absent.append(name)
  return absent


def install(folder: str, target: str, names: Sequence[str] = MISSING_ON_THE_GPU_IMAGE) -> int:
  """Installs, from `folder` alone and without dependencies, those of `names` this Python lacks, into
  `target` (put it on PYTHONPATH). Returns 0, or 1 naming what could not be installed."""
  absent = missing(names)
  if not absent:
    print(f"wheels: nothing missing ({', '.join(names)} installed)")
    return 0
  print(f"wheels: missing {', '.join(absent)}; installing from {folder} into {target}")
  if not os.path.isdir(folder):
    print(f"wheels: no folder {folder}: build it here with `python launch/gpu_wheelhouse.py` and name it in "
          "the device call's carry")
    return 1
  done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                         "--disable-pip-version-check", "--find-links", folder, "--target", target] + absent,
                        check=False)
  return 0 if done.returncode == 0 else 1


def main(argv: Sequence[str] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("folder", nargs="?", default=DEFAULT_DIR, help="the wheelhouse (default: launch/wheelhouse)")
  parser.add_argument("--install", action="store_true", help="install what is missing from the folder instead")
  parser.add_argument("--target", default=None, help="with --install: the folder to install into (required)")
  args = parser.parse_args(argv)
  if args.install:
    if not args.target:
      parser.error("--install needs --target=SITE (a folder put on PYTHONPATH)")
    return install(args.folder, args.target)
  size = build(args.folder)
  print(f"{args.folder}: {', '.join(f'{n}=={v}' for n, v in pinned_versions().items())}, {size / 1024:.0f} KiB "
        f"({size / CARRY_LIMIT_BYTES:.2%} of the 64 MiB a device call carries)")
  return 0 if size < CARRY_LIMIT_BYTES // 8 else 1


if __name__ == "__main__":
  sys.exit(main())
