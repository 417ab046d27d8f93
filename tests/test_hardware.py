"""The accelerators' facts (midas_jax/hardware.py): slice names parsed once, the shapes and hosts of a
slice, the network per chip, and a module the launchers import from the checkout with nothing installed."""

import ast
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import hardware


def test_it_imports_only_the_standard_library():
  tree = ast.parse(open(hardware.__file__).read())
  imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
  assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_tpu_launchers_run_without_site_packages():
  """`python -S`: no installed package at all; hardware.py comes from this checkout."""
  for script, args in (("gke.py", ["manifest", "--image=img", "--accelerator=v5p-128"]),
                       ("tpu_pod.py", ["create", "--dry-run", "--name=n", "--zone=z", "--accelerator=v5litepod-8"])):
    proc = subprocess.run([sys.executable, "-S", os.path.join(REPO_ROOT, "launch", script), *args, "--",
                           "train", "--workdir=gs://bucket/run"], capture_output=True, text=True, timeout=60,
                          cwd="/", env={"PATH": ""})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name,parsed", [
    ("v5p-128", ("v5p-128", "v5p", 128, 1, 64)), ("2xv5p-128", ("v5p-128", "v5p", 128, 2, 64)),
    ("v5litepod-64", ("v5litepod-64", "v5e", 64, 1, 64)), ("v4-8", ("v4-8", "v4", 8, 1, 4)),
    ("v6e-256", ("v6e-256", "v6e", 256, 1, 256)),
])
def test_slice_names_as_gcloud_writes_them(name, parsed):
  s = hardware.parse_slice(name)
  assert (s.accelerator, s.tpu.name, s.count, s.slices, s.chips) == parsed


@pytest.mark.parametrize("name", ["v3-8", "gpu-8", "v5p", "v5p-", "V5P-128", "v5p-128x", "2xgpu-8", ""])
def test_other_names_are_no_slice(name):
  assert hardware.parse_slice(name) is None


def test_default_topologies_are_gcloud_s():
  three = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}
  two = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
  for tpu, table in ((hardware.TPUS["v5p"], three), (hardware.TPUS["v5e"], two)):
    assert {c: hardware.default_topology(tpu, c) for c in table} == table
    assert hardware.default_topology(tpu, 2) is None and hardware.default_topology(tpu, 1024) is None
  assert hardware.torus_shape(1024, 3) == (8, 8, 16) and hardware.torus_shape(1, 3) == (1, 1, 1)
  with pytest.raises(ValueError, match="not a power of 2"):
    hardware.torus_shape(12, 3)


def test_hosts_of_a_slice():
  assert hardware.slice_hosts(hardware.TPUS["v5p"], 64) == (16, 4)
  assert hardware.slice_hosts(hardware.TPUS["v4"], 4) == (1, 4)
  assert hardware.slice_hosts(hardware.TPUS["v5e"], 8) == (1, 8)  # a v5e host holds 8 chips
  assert hardware.slice_hosts(hardware.TPUS["v5e"], 16) == (4, 4)


@pytest.mark.parametrize("kind,chip,dcn", [
    ("TPU v5", "v5p", 50e9 / 8), ("TPU v5p", "v5p", 50e9 / 8), ("TPU v5 lite", "v5e", 25e9 / 8),
    ("TPU v4", "v4", None), ("TPU v6 lite", "v6e", None), ("NVIDIA H100 80GB HBM3", "h100", None), ("cpu", None, None),
])
def test_device_kinds_name_their_chip_and_its_network(kind, chip, dcn):
  assert hardware.chip_of(kind) == chip
  assert hardware.dcn_bytes_per_s(kind) == dcn
