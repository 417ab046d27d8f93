"""launch/Dockerfile builds: its COPY and RUN steps replayed into a scratch folder, with no docker daemon.

COPY takes the files from the repository (less what launch/Dockerfile.dockerignore leaves out) into a
scratch root, WORKDIR and ENV are followed, and each RUN step runs there. A RUN step is `pip install`,
which would fetch gigabytes: it runs as `pip install --dry-run --no-index --no-deps --no-build-isolation`
with this venv's pip, which still reads every requirements and constraints file it names and builds
the package's metadata from setup.py (so a file the install needs and the image lacks fails here),
after a check that each file the step names is in the scratch tree.
"""

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet

from conftest import REPO_ROOT
from test_pod_launch import setup_py

DOCKERFILE = os.path.join(REPO_ROOT, "launch", "Dockerfile")
REPLAYED = ("FROM", "WORKDIR", "COPY", "RUN", "ENV")


def instructions(text):
  """(INSTRUCTION, arguments) of each step: comments dropped, continued lines joined."""
  steps, pending = [], ""
  for line in text.splitlines():
    if not pending and (not line.strip() or line.lstrip().startswith("#")):
      continue
    pending += line.rstrip()
    if pending.endswith("\\"):
      pending = pending[:-1] + " "
      continue
    word, _, rest = pending.strip().partition(" ")
    steps.append((word.upper(), rest.strip()))
    pending = ""
  return steps


def ignored_patterns(dockerfile):
  """The Dockerfile's own ignore file (BuildKit reads <Dockerfile>.dockerignore), else the context's."""
  for path in (dockerfile + ".dockerignore", os.path.join(REPO_ROOT, ".dockerignore")):
    if os.path.exists(path):
      with open(path) as f:
        return [l.strip().rstrip("/") for l in f if l.strip() and not l.startswith("#")]
  return []


def is_ignored(relative, patterns):
  parts = relative.split("/")
  return any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(relative, p.replace("**/", "")) or
             any(fnmatch.fnmatch(part, p.replace("**/", "")) for part in parts) for p in patterns)


def copy(sources, dest, patterns):
  """COPY: a file to dest (or into it, when a folder), a folder's contents into dest."""
  many = len(sources) > 1 or dest.endswith("/")
  for source in sources:
    origin = os.path.join(REPO_ROOT, source)
    assert os.path.exists(origin) and not is_ignored(source, patterns), f"COPY {source}: not in the build context"
    if os.path.isdir(origin):
      for folder, dirs, files in os.walk(origin):
        rel = os.path.relpath(folder, REPO_ROOT)
        dirs[:] = [d for d in dirs if not is_ignored(f"{rel}/{d}", patterns)]
        for name in files:
          if not is_ignored(f"{rel}/{name}", patterns):
            target = os.path.join(dest, os.path.relpath(os.path.join(folder, name), origin))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(folder, name), target)
    else:
      target = os.path.join(dest, os.path.basename(source)) if many else dest
      os.makedirs(os.path.dirname(target.rstrip("/")), exist_ok=True)
      shutil.copy2(origin, target)


def named_files(argv):
  """The paths a `pip install` step reads: -c/-r files and the project folder of -e or a bare path."""
  paths = []
  for i, arg in enumerate(argv):
    if arg in ("-c", "-r", "--constraint", "--requirement", "-e", "--editable") and i + 1 < len(argv):
      paths.append(argv[i + 1])
    elif arg.startswith(("-c", "-r")) and len(arg) > 2 and not arg.startswith("--"):
      paths.append(arg[2:])
    elif not arg.startswith("-") and (arg.startswith(".") or "/" in arg) and argv[i - 1] not in ("-c", "-r", "-e"):
      paths.append(arg)
  return [re.sub(r"\[.*\]$", "", p) for p in paths]


def replay(dockerfile, root):
  """Replays the Dockerfile into `root`; returns (the base image, what each RUN step printed)."""
  with open(dockerfile) as f:
    steps = instructions(f.read())
  patterns, workdir, env, base, printed = ignored_patterns(dockerfile), "/", {}, None, []
  for word, rest in steps:
    assert word in REPLAYED, f"{word}: the replay knows {REPLAYED}; teach it this step"
    if word == "FROM":
      base = rest.split()[0]
    elif word == "WORKDIR":
      workdir = os.path.join(workdir, rest)
      os.makedirs(root + workdir, exist_ok=True)
    elif word == "ENV":
      key, _, value = rest.replace("=", " ", 1).partition(" ")
      env[key] = value.strip()
    elif word == "COPY":
      args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
      args = [a for a in args if not a.startswith("--")]
      dest = args[-1] if args[-1].startswith("/") else os.path.join(workdir, args[-1])
      copy(args[:-1], root + dest + ("/" if args[-1].endswith("/") else ""), patterns)
    else:  # RUN
      argv = shlex.split(rest)
      assert argv[:2] == ["pip", "install"], f"RUN {rest}: the replay runs `pip install` steps only"
      here = root + workdir
      for path in named_files(argv[2:]):
        assert os.path.exists(os.path.join(here, path)), f"RUN {rest}: {path} is not in the image (no COPY brings it)"
      proc = subprocess.run([sys.executable, "-m", "pip", *argv[1:], "--dry-run", "--no-index", "--no-deps",
                             "--no-build-isolation", "--disable-pip-version-check"], cwd=here,
                            env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
      assert proc.returncode == 0, f"RUN {rest}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
      printed.append(proc.stdout)
  return base, printed


def test_the_image_builds_from_what_it_copies(tmp_path):
  base, printed = replay(DOCKERFILE, str(tmp_path))
  assert any("Would install midas_jax-" in out for out in printed), printed  # its metadata built from the copy
  version = re.match(r"python:(\d+\.\d+)", base)
  assert version, base  # a Python image whose version the package accepts
  assert version.group(1) in SpecifierSet(setup_py()[2])


@pytest.mark.parametrize("dropped,message", [
    ("COPY requirements", "requirements/constraints.txt is not in the image"),  # a file the step names
    ("COPY gin", "package directory 'gin' does not exist"),  # a file setup.py needs: pip's metadata build fails
])
def test_the_replay_fails_when_the_image_lacks_a_file_the_install_reads(tmp_path, dropped, message):
  broken = tmp_path / "Dockerfile"
  with open(DOCKERFILE) as f:
    lines = f.read().splitlines()
  assert any(l.startswith(dropped) for l in lines)
  broken.write_text("\n".join(l for l in lines if not l.startswith(dropped)) + "\n")
  with pytest.raises(AssertionError, match=re.escape(message)):
    replay(str(broken), str(tmp_path / "root"))
