"""`midas bench train`: steady-state training throughput and MFU against a same-run matmul peak.

Batches are built before timing, so the figure is the step itself; the data pipeline's own cost per
batch is measured separately and reported beside it.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict

import jax

from midas_jax import flops
from midas_jax.bench.peak import known_peak_flops, measure_matmul_peak
from midas_jax.configs import RunConfig
from midas_jax.train.experiment import build_experiment


def run(config: RunConfig, steps: int = 10, warmup: int = 2) -> Dict[str, object]:
  experiment = build_experiment(config)
  mcfg, data = experiment.model_config, config.data
  t0 = time.perf_counter()
  host_batches = [experiment.pipeline.batch(s) for s in range(warmup + steps)]
  data_seconds = (time.perf_counter() - t0) / (warmup + steps)
  batches = [experiment.device_batch(s) for s in range(warmup + steps)]

  state = experiment.init_state()
  with experiment.context():
    step_fn = experiment.jit_train_step()
    t0 = time.perf_counter()
    for b in batches[:warmup]:
      state, metrics = step_fn(state, b)
    jax.block_until_ready(metrics["loss"])
    warmup_seconds = time.perf_counter() - t0
    times = []
    for b in batches[warmup:]:
      t0 = time.perf_counter()
      state, metrics = step_fn(state, b)
      jax.block_until_ready(metrics["loss"])
      times.append(time.perf_counter() - t0)
  step_seconds = statistics.median(times)
  del host_batches

  n_dev = jax.device_count()
  tokens = data.batch_size * data.seq_len
  model_flops = flops.train_flops_per_token(mcfg, data.seq_len) * tokens
  achieved = model_flops / step_seconds / n_dev  # per device
  peaks = {"float32": measure_matmul_peak("float32"),
           "bfloat16_f32_accum": measure_matmul_peak("bfloat16", "float32")}
  known = known_peak_flops(jax.devices()[0])
  if known is not None:
    peaks["vendor_bf16"] = known
  compute_key = "float32" if mcfg.dtype == "float32" else "bfloat16_f32_accum"
  denominator = known if known is not None else peaks[compute_key]
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
      "model_flops_per_step": model_flops,
      "achieved_flops_per_device": achieved,
      "peak_flops_per_device": peaks,
      "mfu_denominator": "vendor_bf16" if known is not None else compute_key,
      "mfu": achieved / denominator,
      "data_seconds_per_batch": data_seconds,
      "data_fraction_of_step": data_seconds / step_seconds,
  }


def format_report(r: Dict[str, object]) -> str:
  peaks = r["peak_flops_per_device"]
  lines = [
      f"device          {r['device']} x{r['num_devices']}",
      f"model           {r['params'] / 1e6:.1f}M params, compute {r['compute_dtype']}, "
      f"batch {r['batch_size']} x {r['seq_len']}",
      f"step            {r['step_seconds_median'] * 1e3:.0f} ms median ({r['step_seconds_min'] * 1e3:.0f} ms min), "
      f"first steps incl. compile {r['warmup_seconds']:.1f} s",
      f"throughput      {r['tokens_per_second']:,.0f} tokens/s, "
      f"{r['achieved_flops_per_device'] / 1e9:.1f} GFLOP/s per device (model FLOPs)",
  ]
  for name, value in peaks.items():
    lines.append(f"peak {name:<18} {value / 1e9:.1f} GFLOP/s per device "
                 f"-> ratio {r['achieved_flops_per_device'] / value:.1%}")
  lines.append(f"MFU             {r['mfu']:.1%} of the {r['mfu_denominator']} peak")
  lines.append(f"data pipeline   {r['data_seconds_per_batch'] * 1e3:.1f} ms per batch "
               f"({r['data_fraction_of_step']:.1%} of a step)")
  return "\n".join(lines)
