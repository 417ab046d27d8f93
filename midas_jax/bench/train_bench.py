"""`midas bench train`: steady-state training throughput and MFU against a same-run matmul peak.

Batches are built before timing, so the figure is the step itself; the data pipeline's own cost per
batch is measured separately and reported beside it. The matmul peak is sampled right before every
timed step, so on a machine whose cores are shared the peak sees the same load as the steps. Each
reported ratio is the reported achieved rate (model FLOPs over the median step) over the reported
peak (the median sample), so the printed figures check against each other. The MFU denominator is
TrainerConfig.peak_flops_per_device when set (as in training), else the vendor's bf16 peak of a
known accelerator, else the measured peak of the dtypes the model computes in. Compile time is
excluded: the warmup steps compile, and the timed steps run the compiled program.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Dict

import jax

from midas_jax import flops, hardware
from midas_jax.configs import RunConfig
from midas_jax.device_peak import matmul_peak_sampler
from midas_jax.train.build import build_stage

PEAK_REPEATS = 3  # timed matmuls per peak sample (2048^3 each)


def _load() -> float:
  return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _cpu_seconds() -> float:
  t = os.times()
  return t.user + t.system


def run(config: RunConfig, steps: int = 10, warmup: int = 2, peak_size: int = 2048) -> Dict[str, object]:
  """peak_size: the matmul size of the peak probe (smaller is cheaper and reads lower)."""
  build = build_stage(config)
  mcfg, data = build.model_config, config.data
  t0 = time.perf_counter()
  host_batches = [build.host_batch(s) for s in range(warmup + steps)]
  data_seconds = (time.perf_counter() - t0) / (warmup + steps)
  del host_batches
  batches = [build.device_batch(s) for s in range(warmup + steps)]

  samplers = {"float32": matmul_peak_sampler("float32", size=peak_size),
              "bfloat16_f32_accum": matmul_peak_sampler("bfloat16", "float32", size=peak_size)}
  load_before = _load()
  state = build.init_state()
  with build.context():
    step_fn = build.jit_train_step()
    t0 = time.perf_counter()
    for b in batches[:warmup]:
      state, metrics = step_fn(state, b)
    jax.block_until_ready((state, metrics))
    warmup_seconds = time.perf_counter() - t0
    times, cpu_seconds, samples = [], 0.0, {name: [] for name in samplers}
    for b in batches[warmup:]:
      for name, sample in samplers.items():
        samples[name].append(sample(PEAK_REPEATS))
      c0, t0 = _cpu_seconds(), time.perf_counter()
      state, metrics = step_fn(state, b)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - t0)
      cpu_seconds += _cpu_seconds() - c0
  step_seconds = statistics.median(times)

  n_dev = jax.device_count()
  tokens = data.batch_size * data.seq_len
  model_flops = flops.train_flops_per_token(mcfg, data.seq_len) * tokens
  achieved = model_flops / step_seconds / n_dev
  peaks = {name: statistics.median(v) for name, v in samples.items()}
  compute_key = "float32" if mcfg.dtype == "float32" else "bfloat16_f32_accum"
  denominator = compute_key
  known = hardware.known_peak_flops(jax.devices()[0])
  if known is not None:
    peaks["vendor_bf16"], denominator = known, "vendor_bf16"
  override = config.trainer.peak_flops_per_device
  if override is not None:
    peaks["override"], denominator = float(override), "override"
  ratios = {name: achieved / peak for name, peak in peaks.items()}
  counts = flops.param_counts(mcfg)
  return {
      "device": jax.devices()[0].device_kind,
      "num_devices": n_dev,
      "params": counts["total"],
      "compute_dtype": mcfg.dtype,
      "batch_size": data.batch_size,
      "seq_len": data.seq_len,
      "step_seconds_median": step_seconds,
      "step_seconds_min": min(times),
      "warmup_seconds": warmup_seconds,
      "tokens_per_second": tokens / step_seconds,
      # Throughput against the same run's float32 matmul ceiling: the figure that compares across
      # machines and frameworks (docs/benchmarks.md#against-maxtext).
      "tokens_per_second_per_float32_peak_gflops": tokens / step_seconds / (peaks["float32"] / 1e9),
      "model_flops_per_step": model_flops,
      "achieved_flops_per_device": achieved,
      "peak_flops_per_device": peaks,
      "compute_peak": compute_key,
      "peak_ratios": ratios,
      "mfu_denominator": denominator,
      "mfu": ratios[denominator],
      "load_average": [load_before, _load()],
      # Under 100%, other processes held some of the cores during the steps: compare runs only
      # at a similar share (the peak sampled beside the steps absorbs part of the difference, not all).
      "cpu_share_of_steps": cpu_seconds / sum(times) / (os.cpu_count() or 1),
      "data_seconds_per_batch": data_seconds,
      "data_fraction_of_step": data_seconds / step_seconds,
  }


def format_report(r: Dict[str, object]) -> str:
  peaks, ratios = r["peak_flops_per_device"], r["peak_ratios"]
  lines = [
      f"device          {r['device']} x{r['num_devices']}",
      f"model           {r['params'] / 1e6:.1f}M params, compute {r['compute_dtype']}, "
      f"batch {r['batch_size']} x {r['seq_len']}",
      f"step            {r['step_seconds_median'] * 1e3:.0f} ms median ({r['step_seconds_min'] * 1e3:.0f} ms min), "
      f"first steps incl. compile {r['warmup_seconds']:.1f} s",
      f"throughput      {r['tokens_per_second']:,.0f} tokens/s, "
      f"{r['achieved_flops_per_device'] / 1e9:,.2f} GFLOP/s per device (model FLOPs: 6 per weight per token, "
      "attention over the causal triangle)",
      f"per ceiling     {r['tokens_per_second_per_float32_peak_gflops']:.3f} tokens/s per GFLOP/s of the "
      "float32 matmul peak below",
  ]
  for name, value in peaks.items():
    how = {"vendor_bf16": "(vendor)", "override": "(TrainerConfig.peak_flops_per_device)"}.get(name, "(median)")
    lines.append(f"peak {name:<18} {value / 1e9:,.2f} GFLOP/s per device {how} -> ratio {ratios[name]:.2%}")
  lines.append(f"MFU             {r['mfu']:.2%} of the {r['mfu_denominator']} peak "
               "(compile excluded: the warmup steps compile)")
  before, after = r["load_average"]
  lines.append(f"machine load    {before:.1f} before, {after:.1f} after (1-min load average; "
               f"{os.cpu_count()} cpus); this process used {r['cpu_share_of_steps']:.0%} of them "
               f"during the timed steps")
  lines.append(f"data pipeline   {r['data_seconds_per_batch'] * 1e3:.1f} ms per batch "
               f"({r['data_fraction_of_step']:.1%} of a step)")
  return "\n".join(lines)
