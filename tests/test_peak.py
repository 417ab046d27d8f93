"""Matmul peak measurement and the known-accelerator table."""

import types

import jax
import numpy as np
import pytest

from midas_jax import device_peak as peak
from midas_jax import hardware
from midas_jax.errors import ConfigError

SIZE = 64
# The timed runs' durations, fed to the probe through its clock: their median (1.0 s) is not their mean.
DURATIONS = (0.5, 2.0, 0.25, 4.0, 1.0)


@pytest.fixture
def probe(monkeypatch):
  """device_peak with its clock given by DURATIONS, and every call of the functions it compiles recorded
  as (name, arguments, result)."""
  reads = [t for i, d in enumerate(DURATIONS) for t in (10.0 * i, 10.0 * i + d)]  # start and end of each run
  calls, jit = [], jax.jit

  def clock():
    assert reads, "the probe read its clock more than twice per timed run"
    return reads.pop(0)

  def spy(fun, **kwargs):
    compiled = jit(fun, **kwargs)

    def call(*args):
      out = compiled(*args)
      calls.append((fun.__name__, args, out))
      return out
    return call

  monkeypatch.setattr(peak, "time", types.SimpleNamespace(perf_counter=clock))
  monkeypatch.setattr(peak.jax, "jit", spy)
  return types.SimpleNamespace(calls=calls, reads=reads)


@pytest.mark.parametrize("dtype,accum,devices", [("float32", None, 1), ("bfloat16", "float32", 4),
                                                 ("float32", None, None)])
def test_the_probe_reports_one_devices_matmul_flops_over_the_median_run(probe, dtype, accum, devices):
  if devices is None:  # every local device (8 here), through the one-shot entry point
    flops, devices = peak.measure_matmul_peak(dtype, accum, size=SIZE, repeats=len(DURATIONS)), jax.local_device_count()
  else:
    flops = peak.matmul_peak_sampler(dtype, accum, size=SIZE, devices=jax.devices()[:devices])(len(DURATIONS))
  # One SIZE^3 matmul per device (2 FLOPs per multiply-add) over the median run, whatever the device count.
  assert flops == 2 * SIZE ** 3 / 1.0
  assert not probe.reads  # each timed run read the clock at its start and end
  matmuls = [(args, out) for name, args, out in probe.calls if name == "matmul"]
  assert len(matmuls) == 2 + len(DURATIONS)  # compile, settle, then one per timed run
  (a, b), out = matmuls[-1]
  for x in (a, b):  # each device holds one pair of operands: nothing is shared, nothing communicated
    assert x.shape == (devices, SIZE, SIZE) and x.dtype == np.dtype(dtype)
    assert len(x.sharding.device_set) == devices and x.sharding.shard_shape(x.shape) == (1, SIZE, SIZE)
  assert out.dtype == np.dtype(accum or dtype)
  want = np.einsum("bij,bjk->bik", np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,expected", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12),
    ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA GeForce RTX 4090", None), ("TPU v4 lite", None), ("cpu", None),
])
def test_known_peaks(kind, expected):
  assert hardware.known_peak_flops(kind) == expected
  assert hardware.known_peak_flops(types.SimpleNamespace(platform="gpu", device_kind=kind)) == expected


def test_cpu_device_has_no_known_peak():
  assert hardware.known_peak_flops(jax.devices("cpu")[0]) is None


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
