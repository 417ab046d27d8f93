"""The package installs where people run it: ranges in setup.py, exact pins in requirements/constraints.txt, and
the built wheel installs with those pins into a fresh venv and runs, offline.

The fresh venv reuses this venv's packages instead of downloading them: a .pth line in its site-packages names this
venv's site-packages, so pip (run by the fresh venv's python, with --no-index) resolves every requirement of the
wheel against what is installed here and fails if a pin or a range does not match it. Only the path is added, not
this venv's own .pth files, so the checkout's editable install stays invisible and `import midas_jax` finds the
wheel's copy.
"""

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
from packaging.requirements import Requirement

from conftest import REPO_ROOT

CONSTRAINTS = os.path.join(REPO_ROOT, "requirements", "constraints.txt")
PLATFORM_EXTRAS = ("tpu", "cuda12", "cuda13")  # what a TPU VM or a GPU machine adds; not installed by the tests


def setup_lists():
  """(CORE, EXTRAS) as setup.py states them, read without running it."""
  found = {}
  for node in ast.walk(ast.parse(open(os.path.join(REPO_ROOT, "setup.py")).read())):
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in ("CORE",
                                                                                                      "EXTRAS"):
      found[node.targets[0].id] = ast.literal_eval(node.value)
  return found["CORE"], found["EXTRAS"]


def pins():
  """Package name (normalized) -> its pinned version, from the constraints file."""
  out = {}
  for line in open(CONSTRAINTS):
    line = line.split("#", 1)[0].strip()
    if line:
      req = Requirement(line)
      (spec,) = req.specifier
      assert spec.operator == "==", line
      out[canonical(req.name)] = spec.version
  return out


def canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def test_setup_states_ranges_and_the_constraints_pin_a_version_inside_each():
  core, extras = setup_lists()
  pinned = pins()
  tested = core + [r for name, reqs in extras.items() if name not in PLATFORM_EXTRAS for r in reqs]
  for text in tested + [r for name in PLATFORM_EXTRAS for r in extras[name]]:
    operators = {spec.operator for spec in Requirement(text).specifier}
    assert operators and not operators & {"==", "==="}, f"{text}: a range here, the exact pin in constraints.txt"
  for text in tested:
    req = Requirement(text)
    assert canonical(req.name) in pinned, f"{req.name} has no pin in requirements/constraints.txt"
    assert req.specifier.contains(pinned[canonical(req.name)], prereleases=True), (text, pinned[canonical(req.name)])
  assert {"wandb", "eval"} <= set(extras) and pinned["wandb"] == "0.31.0" and pinned["lm-eval"] == "0.4.13"


GPU_IMAGE_JAX = "0.11.2"  # what the H100/H200 image ships (its CUDA 13 plugin too); the run there uses it


def test_jax_ranges_take_the_gpu_images_jax_and_every_platform_extra_the_same_releases():
  core, extras = setup_lists()
  ranges = {canonical(r.name): r.specifier for r in map(Requirement, core)}
  for name in ("jax", "jaxlib"):
    assert ranges[name].contains(GPU_IMAGE_JAX) and ranges[name].contains(pins()[name]), (name, ranges[name])
  for extra in PLATFORM_EXTRAS:
    (req,) = map(Requirement, extras[extra])
    assert req.name == "jax" and req.extras == {extra} and req.specifier == ranges["jax"], extras[extra]


def test_the_readme_test_command_is_what_ci_runs_and_installs_every_extra_with_the_constraints():
  readme = open(os.path.join(REPO_ROOT, "README.md")).read()
  commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv && ")]
  assert len(commands) == 2, commands
  demo, tests = commands
  assert "-c requirements/constraints.txt" in demo and tests.endswith(".venv/bin/python -m pytest")
  ci = open(os.path.join(REPO_ROOT, ".ci", "run")).read().splitlines()
  assert ci[-1] == tests  # verbatim
  _, extras = setup_lists()
  install = re.search(r'pip install -q -c requirements/constraints\.txt -e "\.\[([\w,]+)\]"', tests)
  assert install and set(install.group(1).split(",")) == set(extras) - set(PLATFORM_EXTRAS), tests
  makefile = open(os.path.join(REPO_ROOT, "Makefile")).read()
  assert f'-c requirements/constraints.txt -e ".[{install.group(1)}]"' in makefile


def build_wheel(out_dir) -> str:
  """The wheel of a copy of what it ships (setuptools writes build/ and egg-info beside the sources it builds)."""
  src = os.path.join(out_dir, "src")
  for name in ("midas_jax", "gin"):
    shutil.copytree(os.path.join(REPO_ROOT, name), os.path.join(src, name),
                    ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("setup.py", "README.md"):
    shutil.copy(os.path.join(REPO_ROOT, name), src)
  wheels = os.path.join(out_dir, "wheels")
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", wheels, src], check=True, capture_output=True, text=True, timeout=120)
  (wheel,) = os.listdir(wheels)
  return os.path.join(wheels, wheel)


def fresh_venv(path) -> str:
  """A venv without pip that sees this venv's installed packages (see the module docstring); its python."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=60)
  python = os.path.join(path, "bin", "python")
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                        capture_output=True, text=True).stdout.strip()
  ours = sysconfig.get_paths()
  with open(os.path.join(site, "reuse_test_venv.pth"), "w") as f:
    f.write("\n".join(sorted({ours["purelib"], ours["platlib"]})) + "\n")
  return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  return build_wheel(str(tmp_path_factory.mktemp("wheel")))


def offline_env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "COLAB_")) and k != "PYTHONPATH"}
  return dict(env, PIP_CONFIG_FILE=os.devnull, **extra)  # no index, no find-links but those given


def run_offline(*args, env, cwd):
  proc = subprocess.run(list(args), capture_output=True, text=True, env=env, cwd=str(cwd), timeout=300)
  return proc.returncode, proc.stdout + proc.stderr


def test_the_wheel_installs_offline_with_the_constraints_into_a_fresh_venv_and_runs(tmp_path, wheel):
  python = fresh_venv(str(tmp_path / "venv"))
  pip = [python, "-m", "pip", "install", "-q", "--no-index"]
  run = functools.partial(run_offline, env=offline_env(), cwd=tmp_path)

  # The wheel itself (this venv's editable copy would otherwise count as installed), then its requirements and
  # every extra the tests use, under the pins: resolved against what is installed, nothing downloaded.
  code, out = run(*pip, "--no-deps", wheel)
  assert code == 0, out
  extras = ",".join(name for name in setup_lists()[1] if name not in PLATFORM_EXTRAS)
  code, out = run(*pip, "--find-links", os.path.dirname(wheel), "-c", CONSTRAINTS, f"midas_jax[{extras}]")
  assert code == 0, out
  # The check can fail: a pin that is not the installed version cannot be met offline.
  bad = tmp_path / "bad_constraints.txt"
  bad.write_text(re.sub(r"(?m)^jax==\S+", "jax==0.10.1", open(CONSTRAINTS).read()))
  code, out = run(*pip, "--find-links", os.path.dirname(wheel), "-c", str(bad), "midas_jax")
  assert code != 0 and "jax" in out

  code, out = run(python, "-c", "import os, midas_jax; print(midas_jax.__file__); print(os.path.isfile(os.path.join("
                  "os.path.dirname(midas_jax.__file__), 'gin_configs', 'experiments', 'midas_cpu.gin')))")
  assert code == 0, out
  where, has_gin = out.split()[-2:]
  assert where.startswith(str(tmp_path / "venv")) and has_gin == "True", out  # the wheel's copy, configs included
  code, out = run(os.path.join(str(tmp_path / "venv"), "bin", "midas"), "--help")
  assert code == 0 and "usage: midas" in out, out


def test_the_notebooks_first_cell_installs_the_package_where_there_is_no_checkout(tmp_path, wheel):
  # As on Colab opened from GitHub: midas_jax not importable, the working directory no checkout. MIDAS_SOURCE names
  # the wheel (a file:// URL) and pip finds nothing but it, so the cell's install resolves against what is here.
  notebook = json.load(open(os.path.join(REPO_ROOT, "notebooks", "midas_colab.ipynb")))
  cell = next("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
  assert 'MIDAS_SOURCE = "git+https://' in cell
  cell = re.sub(r'(?m)^MIDAS_SOURCE = .*$', f'MIDAS_SOURCE = "file://{wheel}"', cell)
  python = fresh_venv(str(tmp_path / "venv"))
  (tmp_path / "content").mkdir()
  env = offline_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=os.path.dirname(wheel), JAX_PLATFORMS="cpu")
  code, out = run_offline(python, "-c", cell, env=env, cwd=tmp_path / "content")
  assert code == 0, out
  assert f"installing midas_jax[convert] @ file://{wheel}" in out, out
  assert f"midas_jax from {tmp_path / 'venv'}" in out and "devices: [CpuDevice" in out, out
  code, out = run_offline(python, "-c", cell, env=env, cwd=tmp_path / "content")  # again: installed, nothing to do
  assert code == 0 and "installing" not in out and "midas_jax from" in out, out
