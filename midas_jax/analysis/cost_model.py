"""The train step's speed as the TPU compiler estimates it, from XLA's cost model.

A compiled program's `cost_analysis()` gives `optimal_seconds`: the compiler's estimate of its run
time, each instruction's cost from its FLOPs and bytes against the target chip's peaks, collectives
included, summed. It is an estimate, neither a measurement nor a bound: a real step can be faster
(a collective overlapping the compute the sum counts after it) or slower (a kernel below its peak,
collectives waiting on the network, pipeline bubbles). It does read the program that would run,
after fusion and layout, with every FLOP remat recomputes.

Two things the cost model does not do, and how the price is made whole:
  * it prices a loop's body once, whatever its trip count. The layer loop and the microbatch loop
    are unrolled for pricing (ModelConfig.unroll_layers; the microbatches by `unroll` of the step);
  * unrolling a 48-layer model makes a long compile, so the step is priced at depths 2 and 3 and
    extrapolated: step(L) = step(2) + (L - 2) x (step(3) - step(2)), which holds for a sum over
    instructions when each added layer adds the same ones. Measured on a 512-wide model for v5p: each
    layer from the second on adds the same within 6% (the first adds 15% less: depth 1 is not used),
    and the extrapolation meets the unrolled program at depths 4 and 5 within 1% (tests/test_cost_model.py).
An instruction it cannot price counts -1 s: a SparseCore call does (the model's mask no longer
scatters for that reason), and so does each asynchronous slice of a sliced prefetch, which memory
space assignment makes on v4 and v5e for large operands (a 1B step on a v5e-256 priced -29 s). The
pricing compiles turn sliced prefetch off (PRICING_OPTIONS); the step that runs keeps it, and a
roofline prices the same bytes moved either way. A multi-slice program has two more: custom calls the
compiler adds for its cross-slice collectives, the slice's own index (SliceId) and the zero padding of a
fused cross-slice all-reduce's buffer (ZeroCrop), -1 s each where each is a scalar or a few KiB of work;
price() counts them at 0 (UNPRICED_CALLS). A negative price is still reported as unpriced, never as a time.

What the cost model prices far too cheaply is the data-center network between slices (dcn_cost.py):
the estimate adds the bytes each chip sends across slices at the network's bandwidth: the step is the
longer of the two where they overlap fully, and their sum where they do not overlap.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, Optional, Sequence

from midas_jax import flops, hardware
from midas_jax.analysis import dcn_cost
from midas_jax.configs import RunConfig

PRICED = ("optimal_seconds", "flops", "bytes accessed")


# Custom calls of a multi-slice program that the cost model counts at -1 s each (libtpu 0.0.42, seen on
# 2xv5p-8 and 2xv5p-128; tests/test_cost_model.py): the slice's index, and the zero padding of a fused
# cross-slice all-reduce's buffer. price() counts them at 0 s.
UNPRICED_CALLS = ("SliceId", "ZeroCrop")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def price(compiled, slices: int = 1) -> Dict[str, float]:
  """The cost model's totals of one compiled program (the keys of PRICED), with 'unpriced_calls' (the
  UNPRICED_CALLS it holds, added back at 0 s each) and 'dcn_bytes' (what one chip sends across `slices`
  slices, dcn_cost.py). optimal_seconds is -1.0 where libtpu gave none (a libtpu loaded while
  another process holds it has no cost model)."""
  costs = compiled.cost_analysis() or {}
  if isinstance(costs, (list, tuple)):  # older jax returned one dict per program
    costs = costs[0]
  out = {k: float(costs.get(k, -1.0 if k == "optimal_seconds" else 0.0)) for k in PRICED}
  text = compiled.as_text()
  calls = sum(target in UNPRICED_CALLS for target in _CUSTOM_CALL.findall(text))
  if "optimal_seconds" in costs:
    out["optimal_seconds"] += calls
  out["unpriced_calls"] = float(calls)
  out["dcn_bytes"] = sum(dcn_cost.bytes_sent(text, slices).values())
  return out


# For the pricing compiles only: no sliced prefetches (slice-start/slice-done), which the cost model
# prices at -1 s each.
PRICING_OPTIONS = {"xla_tpu_sliced_prefetch_max_slices": 0}

# A program does at least the model's FLOPs (remat adds more). Where the cost model counts fewer (libtpu
# 0.0.42 on v4 counts 0.25-0.70 of them), its seconds are too low and the report says so.
COUNTED_AT_LEAST = 0.9

PRICE_DEPTHS = (2, 3)  # the two depths every step is priced at (the first layer adds less than the others)


def extrapolate(prices: Dict[int, Dict[str, float]], depth: int) -> Dict[str, float]:
  """Per key: the price at `depth` layers, linear through the prices at the two PRICE_DEPTHS."""
  lo, hi = PRICE_DEPTHS
  return {k: prices[lo][k] + (depth - lo) * (prices[hi][k] - prices[lo][k]) / (hi - lo) for k in prices[lo]}


def priced_depths(config: RunConfig, price_at) -> Dict[int, Dict[str, float]]:
  """{depth: price} at the PRICE_DEPTHS: price_at(config) compiles and prices one config."""
  out = {}
  for depth in PRICE_DEPTHS:
    model = dataclasses.replace(config.model, num_layers=depth, unroll_layers=True,
                                loop_start=0, loop_size=0, loop_repeats=1)
    out[depth] = price_at(dataclasses.replace(config, model=model))
  return out


def estimate(config: RunConfig, prices: Dict[int, Dict[str, float]], depths: Sequence[int], chips: int,
             device_kind: str, model_config) -> Dict[str, Any]:
  """The estimated step at each depth: seconds, tokens/s per chip, and the MFU estimate (model FLOPs
  over the chips' bf16 peak for the estimated seconds). `model_config` has the run's vocabulary."""
  peak = hardware.known_peak_flops(device_kind)
  tokens = config.data.batch_size * config.data.seq_len
  if any(p["optimal_seconds"] <= 0 for p in prices.values()):
    return {"unpriced": "the cost model priced no time, or counted an instruction it cannot price as -1 s (if "
                        "another process holds libtpu, set ALLOW_MULTIPLE_LIBTPU_LOAD=1 to compile ahead of time)",
            "prices": {str(d): p for d, p in prices.items()}}
  bandwidth = hardware.dcn_bytes_per_s(device_kind)
  steps = {}
  for depth in sorted(set(depths)):
    priced = extrapolate(prices, depth)
    dcn_bytes = priced.get("dcn_bytes", 0.0)
    dcn_seconds = dcn_bytes / bandwidth if bandwidth and dcn_bytes else 0.0
    seconds = max(priced["optimal_seconds"], dcn_seconds)  # the network and the chip overlapping fully
    model_flops = flops.train_flops_per_token(model_config, config.data.seq_len, depth) * tokens
    steps[str(depth)] = {
        "seconds": seconds, "tokens_per_s_per_chip": tokens / seconds / chips,
        "mfu_estimate": None if peak is None else model_flops / (seconds * peak * chips),
        "compiler_seconds": priced["optimal_seconds"], "dcn_bytes_per_chip": dcn_bytes,
        "dcn_seconds": dcn_seconds, "seconds_without_overlap": priced["optimal_seconds"] + dcn_seconds,
        "compiler_flops_per_chip": priced["flops"], "model_flops_per_chip": model_flops / chips,
        "bytes_per_chip": priced["bytes accessed"]}
  out = {"steps": steps, "peak_flops_per_chip": peak, "prices": {str(d): p for d, p in prices.items()}}
  if any(p.get("dcn_bytes") for p in prices.values()) and not bandwidth:
    out["dcn_unpriced"] = f"no DCN bandwidth known for {device_kind!r} (hardware.py): the network is left out"
  deepest = steps[str(max(depths))]  # at small depths the embedding and head weigh more, counted differently
  counted = deepest["compiler_flops_per_chip"] / deepest["model_flops_per_chip"]
  if counted < COUNTED_AT_LEAST:
    out["undercounted"] = counted
  return out


def run_seconds(estimate_: Dict[str, Any], stage_steps: Sequence[int], depths: Sequence[int]) -> Optional[float]:
  """A whole (stacked) run's estimated seconds: each stage's steps at its depth's estimated step."""
  if "steps" not in estimate_:
    return None
  return sum(n * estimate_["steps"][str(d)]["seconds"] for n, d in zip(stage_steps, depths))


def speedups(estimate_: Dict[str, Any], schedule, flop_speedup: float) -> Dict[str, Any]:
  """A stacked schedule against the full-depth baseline of the same steps: the estimated wall-clock
  speedup (the baseline's steps x its step's estimate over the sum over stages of steps x the
  estimate at that stage's depth) beside the FLOP speedup (stacking.schedule.flop_speedup), and
  each stage's estimated step."""
  baseline = schedule.num_steps * estimate_["steps"][str(schedule.depths[-1])]["seconds"]
  stacked = run_seconds(estimate_, schedule.stage_steps, schedule.depths)
  return {"stages": [{"depth": d, "steps": n, "seconds": estimate_["steps"][str(d)]["seconds"]}
                     for d, n in zip(schedule.depths, schedule.stage_steps)],
          "baseline_seconds": baseline, "stacked_seconds": stacked, "wall_clock": baseline / stacked,
          "flops": flop_speedup}
