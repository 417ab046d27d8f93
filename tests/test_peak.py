"""Matmul peak measurement and the known-accelerator table."""

import os
import subprocess
import sys
import types

import jax
import pytest

from midas_jax import device_peak as peak
from midas_jax.errors import ConfigError


@pytest.mark.parametrize("dtype,accum", [("float32", None), ("bfloat16", "float32")])
def test_measured_peak_is_plausible(dtype, accum):
  flops = peak.measure_matmul_peak(dtype, accum, size=256, repeats=3)
  assert 1e8 < flops < 1e13


def test_measured_peak_is_a_per_device_share_with_many_devices():
  # A fresh process, since the host device count is fixed when jax starts.
  code = ("from midas_jax.device_peak import measure_matmul_peak; import jax; "
          "assert jax.local_device_count() == 4; print(measure_matmul_peak(size=256, repeats=3))")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  assert 1e7 < float(out.stdout.strip()) < 1e13


@pytest.mark.parametrize("kind,expected", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12),
    ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA GeForce RTX 4090", None), ("TPU v4 lite", None), ("cpu", None),
])
def test_known_peaks(kind, expected):
  assert peak.known_peak_flops(kind) == expected
  assert peak.known_peak_flops(types.SimpleNamespace(platform="gpu", device_kind=kind)) == expected


def test_cpu_device_has_no_known_peak():
  assert peak.known_peak_flops(jax.devices("cpu")[0]) is None


def test_peak_per_device_order(monkeypatch):
  assert peak.peak_flops_per_device(override=123e12) == 123e12
  with pytest.raises(ConfigError, match="peak_flops_per_device"):
    peak.peak_flops_per_device(override=0)
  tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  monkeypatch.setattr(peak.jax, "local_devices", lambda: [tpu])
  assert peak.peak_flops_with_source() == (197e12, "known bf16 dense peak of TPU v5 lite")


def test_peak_per_device_measures_on_cpu(monkeypatch):
  monkeypatch.setattr(peak, "_measured", lambda dtype, accum: 4.2e11 if (dtype, accum) == ("bfloat16", "float32") else 0)
  flops, source = peak.peak_flops_with_source()
  assert flops == 4.2e11 and source.startswith("measured bfloat16 with float32 accumulation")
