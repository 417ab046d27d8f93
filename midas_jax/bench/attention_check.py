"""`midas bench attention`: each attention path against the dense path, forward and all gradients, on
the device this runs on (launch/gpu_check.sh runs it on a GPU; docs/benchmarks.md#gpu-day-one).

The unit tests compare the fused paths with the dense one on the CPU, where the flash kernels run in
the Pallas interpreter and cuDNN's call goes through XLA. Only a GPU runs what they stand for: the
Triton build of the flash kernels and cuDNN's own kernel. This check runs every path the model can
take there, through attention.attend() as the model calls it, on packed UL2 rows (three to six
examples a row, causal, prefix LM and span corruption, then padding), and measures each output and
each gradient (dq, dk, dv of sum(out * w)) against one reference: the dense path in float32 at the
highest matmul precision, on the same values (bfloat16 inputs widened). Paths:

  dot_product  the dense path in the case's dtype (its own rounding: the yardstick for the others);
  flash        the flash kernels (Triton on a GPU, Mosaic on a TPU, the interpreter elsewhere);
  cudnn        jax.nn.dot_product_attention(implementation='cudnn') with the dense mask (a GPU, 16-bit);
  xla          the same call with implementation='xla': tells the call's layout and mask apart from
               cuDNN's kernel when cudnn is off.

A path that raises is recorded as failed with its error, and the rest still run. A path within
BOUNDS of the reference passes. float32: 2^-9 of the reference's largest magnitude, since a GPU
multiplies float32 in TF32 by default (10 stored bits, each rounding within 2^-11) and a result
passes a few roundings; bfloat16: 2^-6, the bound tests/test_flash_kernel.py derives (four roundings
of 2^-9, doubled for cancellation).
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax.data.ul2 import objectives, packing
from midas_jax.errors import require
from midas_jax.model import attention, describe_mask
from midas_jax.model.kernels import cudnn

PATHS = ("dot_product", "flash", "cudnn", "xla")
DTYPES = ("float32", "bfloat16")
BOUNDS = {"float32": 2.0 ** -9, "bfloat16": 2.0 ** -6}  # relative to the reference's largest magnitude
RESULTS = ("out", "dq", "dk", "dv")
# The paper 1B's attention (16 heads of 128 over 2,048 positions, models/paper_1b.gin), and grouped
# heads (4 query heads a kv head) at half the length: batch, length, heads, kv_heads, head_dim.
DEFAULT_SHAPES = ((2, 2048, 16, 16, 128), (2, 1024, 16, 4, 128))
VOCAB = 512  # token ids only shape the examples (span corruption's sentinels); the check reads no tokens


def packed_ul2_rows(seed: int, rows: int, length: int) -> Dict[str, np.ndarray]:
  """Rows packed as the pipeline packs them: 3 to 6 examples each (the three objectives in turn, from a
  random one), random lengths, then 1 to length/8 padding tokens."""
  require(length >= 48, "bench attention --shape", f"length {length} is below 48",
          "use at least 48 positions (three examples of 16)")
  rng = np.random.default_rng(seed)
  special = objectives.special_tokens(VOCAB, extra_ids=128)
  denoisers = (objectives.Denoiser("causal", "causal"), objectives.Denoiser("prefix", "prefix", noise_density=0.5),
               objectives.Denoiser("span", "span"))
  packed = []
  for _ in range(rows):
    budget = length - int(rng.integers(1, max(2, length // 8)))
    count = int(rng.integers(3, 7))
    sizes = np.diff(np.r_[0, np.sort(rng.choice(np.arange(16, budget - 15), count - 1, replace=False)), budget])
    if sizes.min() < 8:  # cuts too close together: three equal examples instead
      sizes = np.full(3, budget // 3)
    first = int(rng.integers(3))
    examples = [objectives.make_example(rng.integers(3, VOCAB - 128, int(n)), denoisers[(first + i) % 3], rng,
                                        special) for i, n in enumerate(sizes)]
    examples = [_trimmed(e, int(n)) for e, n in zip(examples, sizes)]  # span corruption adds sentinels
    packed.append(packing.pack_row(examples, length))
  return packing.stack_rows(packed)


def _trimmed(example: packing.Example, size: int) -> packing.Example:
  if len(example.tokens) <= size:
    return example
  return packing.Example(example.tokens[:size], min(example.prefix_len, size - 1), example.objective_id)


def _values_and_gradients(attend: Callable, q, k, v, weights) -> Tuple[Callable, Callable]:
  """(compiled program, runner): attend's output and the gradients of sum(out * weights), in float32."""
  def loss(q, k, v):
    out = attend(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * weights), out

  program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  return lambda: program(q, k, v)


def _as_arrays(result) -> List[np.ndarray]:
  (_, out), grads = result
  return [np.asarray(x, np.float32) for x in (out, *grads)]


def _path_function(path: str, mask, platform: str, dtype: str) -> Optional[Callable]:
  """What attend() runs for `path` (None: the path cannot run here, see _skip_reason)."""
  if path == "xla":
    return lambda q, k, v: cudnn.cudnn_attention(q, k, v, attention.dense_mask(mask), implementation="xla")
  # On a CPU, XLA cannot multiply bfloat16 into float32: the same values as float32 operands (model/dot_support.py).
  operands = jnp.float32 if (path == "dot_product" and platform == "cpu" and dtype != "float32") else None
  return lambda q, k, v: attention.attend(q, k, v, mask, path, operands)


def _skip_reason(path: str, platform: str, dtype: str, head_dim: int) -> Optional[str]:
  if path != "cudnn":
    return None
  if platform != "gpu":
    return f"cuDNN runs on an NVIDIA GPU, this is {platform}"
  return cudnn.unsupported_reason(dtype, head_dim)


def check_case(shape: Sequence[int], dtype: str, paths: Sequence[str] = PATHS, seed: int = 0,
               repeats: int = 3) -> Dict[str, object]:
  """Every path at one shape (batch, length, heads, kv_heads, head_dim) and dtype: its error against the
  reference per result, its verdict, and its median seconds for the whole program over `repeats` runs."""
  batch, length, heads, kv_heads, head_dim = shape
  require(heads % kv_heads == 0, "bench attention --shape", f"{heads} heads over {kv_heads} kv heads",
          "give a kv_heads that divides heads")
  rows = packed_ul2_rows(seed, batch, length)
  mask = describe_mask(*(jnp.asarray(rows[f]) for f in ("segment_ids", "positions", "prefix_mask")))
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, n, head_dim)), dtype) for n in (heads, kv_heads, kv_heads))
  # bfloat16 values: a bfloat16 output's cotangent is exact, and every path sees the same one.
  weights = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.bfloat16).astype(jnp.float32)
  platform = jax.default_backend()
  with jax.default_matmul_precision("highest"):
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    reference = _as_arrays(_values_and_gradients(lambda q, k, v: attention.dense_attention(q, k, v, mask),
                                                 *wide, weights)())
  scales = [float(np.abs(r).max()) for r in reference]
  results = {}
  for path in paths:
    skip = _skip_reason(path, platform, dtype, head_dim)
    if skip:
      results[path] = {"status": "skipped", "reason": skip}
      continue
    try:
      run = _values_and_gradients(_path_function(path, mask, platform, dtype), q, k, v, weights)
      got = _as_arrays(jax.block_until_ready(run()))  # compiles
      seconds = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        seconds.append(time.perf_counter() - start)
    except Exception as error:  # pylint: disable=broad-except
      results[path] = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}
      continue
    errors = {name: float(np.abs(g - r).max()) for name, g, r in zip(RESULTS, got, reference)}
    relative = {name: errors[name] / scale if scale else errors[name] for name, scale in zip(RESULTS, scales)}
    finite = all(np.isfinite(g).all() for g in got)
    within = finite and max(relative.values()) <= BOUNDS[dtype]
    results[path] = {"status": "ok" if within else "outside_bound", "max_abs_error": errors,
                     "relative_error": relative, "finite": bool(finite), "bound": BOUNDS[dtype],
                     "seconds_median": statistics.median(seconds) if seconds else None}
  return {"shape": dict(zip(("batch", "length", "heads", "kv_heads", "head_dim"), shape)), "dtype": dtype,
          "reference": "dense path, float32, highest matmul precision, on the same values",
          "reference_max_abs": dict(zip(RESULTS, scales)), "paths": results}


def run(shapes: Sequence[Sequence[int]] = DEFAULT_SHAPES, dtypes: Sequence[str] = DTYPES,
        paths: Sequence[str] = PATHS, repeats: int = 3) -> Dict[str, object]:
  """Every case (shape x dtype); `failed` lists each path that raised or fell outside its bound."""
  for dtype in dtypes:
    require(dtype in BOUNDS, "bench attention --dtypes", f"unknown dtype {dtype!r}", f"use {DTYPES}")
  for path in paths:
    require(path in PATHS, "bench attention --paths", f"unknown path {path!r}", f"use {PATHS}")
  device = jax.devices()[0]
  cases = [check_case(tuple(shape), dtype, paths, seed=i, repeats=repeats)
           for i, shape in enumerate(shapes) for dtype in dtypes]
  failed = [f"{c['dtype']} {tuple(c['shape'].values())} {path}: {r['status']}"
            for c in cases for path, r in c["paths"].items() if r["status"] in ("failed", "outside_bound")]
  return {"device": device.device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
          "bounds": BOUNDS, "cases": cases, "failed": failed}


def format_report(report: Dict[str, object]) -> str:
  lines = [f"device  {report['device']} ({report['platform']}), jax {report['jax']}; errors relative to the "
           "reference's largest magnitude (out, dq, dk, dv)"]
  for case in report["cases"]:
    s = case["shape"]
    lines.append(f"{case['dtype']:<9} batch {s['batch']} x {s['length']}, {s['heads']} heads over {s['kv_heads']} "
                 f"kv heads of {s['head_dim']} (bound {BOUNDS[case['dtype']]:.1e})")
    for path, r in case["paths"].items():
      if r["status"] in ("skipped", "failed"):
        lines.append(f"  {path:<12} {r['status']}: {r.get('reason') or r.get('error', '').splitlines()[0]}")
        continue
      rel = " ".join(f"{r['relative_error'][n]:.1e}" for n in RESULTS)
      lines.append(f"  {path:<12} {r['status']:<13} {rel}  {r['seconds_median'] * 1e3:8.2f} ms fwd+bwd")
  lines.append("failed: " + ("; ".join(report["failed"]) if report["failed"] else "none"))
  return "\n".join(lines)


def parse_shape(text: str) -> Tuple[int, ...]:
  """'2,2048,16,16,128' -> (batch, length, heads, kv_heads, head_dim)."""
  try:
    shape = tuple(int(x) for x in text.split(","))
  except ValueError:
    shape = ()
  require(len(shape) == 5 and min(shape) > 0, "bench attention --shape", f"{text!r} is not five positive integers",
          "write BATCH,LENGTH,HEADS,KV_HEADS,HEAD_DIM, e.g. 2,2048,16,16,128")
  return shape
