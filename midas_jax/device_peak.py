"""The compute ceiling for MFU: a known accelerator peak (hardware.py), or a matmul measured on this machine.

Known peaks are the vendors' dense bf16 figures, the usual MFU denominator. CPUs (and chips not in
the table) have none, so there the ceiling is measured, in the same process as the benchmark that
uses it: the same cores may be slower on another day or under another load.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax import hardware
from midas_jax.errors import require


def matmul_peak_sampler(dtype: str = "float32", accum_dtype: Optional[str] = None,
                        size: int = 2048, devices: Optional[Sequence[Any]] = None) -> Callable[[int], float]:
  """A compiled, warmed-up matmul probe: sample(repeats) -> FLOP/s per device, the median of
  `repeats` timed runs of size x size operands of `dtype`, accumulated and returned in `accum_dtype`
  (None: in `dtype`), on `devices` (None: every local device).

  Every device multiplies its own pair at once (one sharded batched matmul), and the result is
  divided by the device count, so on a host split into N devices the figure is each device's share
  of the machine, not one device's speed with the rest idle. Each time includes dispatch, as a
  training step's does. Sampling between the steps of a benchmark lets the peak see the same
  machine load as the steps do (the cores may be shared).
  """
  require(size > 0, "matmul_peak_sampler", f"size={size}", "pass a positive size")
  devices = list(jax.local_devices() if devices is None else devices)
  require(len(devices) > 0, "matmul_peak_sampler", "no devices given", "pass devices=None for all local ones")
  n = len(devices)
  in_dtype = jnp.dtype(dtype)
  out_dtype = jnp.dtype(accum_dtype) if accum_dtype is not None else in_dtype
  mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("devices"))

  @functools.partial(jax.jit, out_shardings=(sharding, sharding))
  def operands(key):
    ka, kb = jax.random.split(key)
    shape = (n, size, size)
    return (jax.random.normal(ka, shape, jnp.float32).astype(in_dtype),
            jax.random.normal(kb, shape, jnp.float32).astype(in_dtype))

  @functools.partial(jax.jit, out_shardings=sharding)
  def matmul(a, b):
    # Batch dim 0 is the device axis: each device does exactly one size^3 matmul, no communication.
    dims = (((2,), (1,)), ((0,), (0,)))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)

  a, b = operands(jax.random.key(0))
  for _ in range(2):  # compile, then one run to settle caches and thread pools
    matmul(a, b).block_until_ready()

  def sample(repeats: int) -> float:
    require(repeats > 0, "matmul_peak_sampler", f"repeats={repeats}", "pass positive repeats")
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      matmul(a, b).block_until_ready()
      times.append(time.perf_counter() - start)
    return 2.0 * size ** 3 / statistics.median(times)

  return sample


def measure_matmul_peak(dtype: str = "float32", accum_dtype: Optional[str] = None,
                        size: int = 2048, repeats: int = 10) -> float:
  """Measured matmul FLOP/s per local device, the median of `repeats` runs after a warm-up (see
  matmul_peak_sampler)."""
  require(size > 0 and repeats > 0, "measure_matmul_peak", f"size={size}, repeats={repeats}",
          "pass positive size and repeats")
  return matmul_peak_sampler(dtype, accum_dtype, size)(repeats)


@functools.lru_cache(maxsize=None)
def _measured(dtype: str, accum_dtype: Optional[str]) -> float:
  # About a second on a 2-core CPU; measured once per process and dtype pair.
  return measure_matmul_peak(dtype, accum_dtype, size=1024, repeats=5)


def peak_flops_with_source(override: Optional[float] = None, dtype: str = "bfloat16",
                           accum_dtype: Optional[str] = "float32") -> Tuple[float, str]:
  """(FLOP/s per device, where it came from), for the MFU denominator and the log that explains it.

  override (TrainerConfig.peak_flops_per_device) wins; else the known bf16 peak of the first local
  device; else a matmul of `dtype` inputs accumulated in `accum_dtype` measured now. The default
  pair, bf16 inputs with f32 accumulation, is what a bf16 model's matmuls do, and on CPUs with
  bf16 instructions it is also the fastest path, so MFU against it is not flattered.
  """
  if override is not None:
    require(override > 0, "TrainerConfig.peak_flops_per_device", f"must be > 0, got {override!r}",
            "set the chip's peak FLOP/s, or None to look it up or measure it")
    return float(override), "override"
  device = jax.local_devices()[0]
  known = hardware.known_peak_flops(device)
  if known is not None:
    return known, f"known bf16 dense peak of {device.device_kind}"
  accum = f" with {accum_dtype} accumulation" if accum_dtype else ""
  source = (f"measured {dtype}{accum} 1024x1024 matmul, per device of "
            f"{jax.local_device_count()} {device.platform} device(s)")
  return _measured(dtype, accum_dtype), source


def peak_flops_per_device(override: Optional[float] = None, dtype: str = "bfloat16",
                          accum_dtype: Optional[str] = "float32") -> float:
  """FLOP/s per device for MFU: override, else a known peak, else measured (see
  peak_flops_with_source)."""
  return peak_flops_with_source(override, dtype, accum_dtype)[0]
