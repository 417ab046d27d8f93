"""Whether a program's mixed-precision matmuls run on its backend, and the form they take where not.

model/matmul.py asks for bfloat16 x bfloat16 -> float32 dots (docs/architecture.md#matmuls-carry-the-dtype-policy).
TPU and GPU compilers run them whatever the shapes. XLA's CPU compiler keeps such a dot in bfloat16
when it expects a library (YNNPACK on this project's CPUs) to take it, and widens it to float32
otherwise; where the library then declines the dot (a layout that fusion produced, a CPU without
native bfloat16), the dot is left to XLA's own dot runtime, which has no bfloat16 x bfloat16 ->
float32 kernel, and the program stops when it runs: "UNIMPLEMENTED: Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32". Whether a given program meets this depends on its shapes, on
how XLA fused it, on the CPU and on the XLA version, so it is not guessed from any of them: each
program that trains (train/build.py checks a stage's train and eval steps) is compiled and run once
on zeros before it trains, and a program that only reads its inputs (the evaluation suites) is run
again if it stops (`retry_widened`). One the CPU cannot run is built again with float32 operands
(ModelConfig.matmul_operands = "float32"): the same products of the same bfloat16 values, float32
accumulation as before, at float32 speed. A multi-process job never runs that check on its sharded
program (a program stopped part-way leaves data in the cross-process transport for the next
collective to meet): each process runs one device's share of it locally, and all agree
(train/build.py, docs/model.md#on-a-cpu-that-cannot-run-them).

Test hook, not a setting: MIDAS_TEST_FORCE_FLOAT32_DOTS in the environment makes the check report
a program the backend cannot run, without compiling it, so that a test takes the float32 path on
any CPU: "all" in every process, or a comma-separated list of process indices ("1": process 1
only, whose verdict the others must follow; tests/test_multihost_fallback.py). Users pick float32
operands with ModelConfig.matmul_operands.

ModelConfig.matmul_operands: "auto" (that rule), "compute" (bfloat16 operands always; a program the
CPU cannot run is a ConfigError before training), "float32" (float32 operands always).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence, TypeVar

import jax
import jax.numpy as jnp

from midas_jax.configs import ModelConfig
from midas_jax.errors import ConfigError

NARROW = ("bfloat16", "float16")  # compute dtypes whose matmuls accumulate in float32
FORCE_FLOAT32_ENV = "MIDAS_TEST_FORCE_FLOAT32_DOTS"  # the test hook of the module docstring
T = TypeVar("T")


def needs_check(cfg: ModelConfig, platform: Optional[str]) -> bool:
  """Whether the programs of `cfg` on `platform` must be run once before they are trusted."""
  return (cfg.matmul_operands != "float32" and cfg.dtype in NARROW
          and (platform or jax.default_backend()) == "cpu")


def _unrunnable(error: Exception) -> bool:
  return isinstance(error, jax.errors.JaxRuntimeError) and "UNIMPLEMENTED" in str(error)


def compiled_if_runs(compile_program: Callable[[], Any], args: Sequence[jax.ShapeDtypeStruct]) -> Optional[Any]:
  """Compiles a program for abstract `args` and runs it once on zeros of them: the compiled program
  when it finishes (to be used, not compiled again), None when the backend stops with UNIMPLEMENTED
  (a matmul it cannot run) or when the test hook says so."""
  if forced_unrunnable():
    return None
  compiled = compile_program()
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), args)
  try:
    jax.block_until_ready(compiled(*zeros))
  except jax.errors.JaxRuntimeError as e:
    if not _unrunnable(e):
      raise
    return None
  return compiled


def forced_unrunnable() -> bool:
  """Whether the test hook (MIDAS_TEST_FORCE_FLOAT32_DOTS, module docstring) fails this process's checks."""
  value = os.environ.get(FORCE_FLOAT32_ENV, "").strip()
  if value in ("", "all"):
    return value == "all"
  return str(jax.process_index()) in {v.strip() for v in value.split(",")}


def retry_widened(run: Callable[[ModelConfig], T], cfg: ModelConfig, platform: Optional[str] = None) -> T:
  """run(cfg); where the backend stops it with UNIMPLEMENTED and `cfg` needs the check, run(widened
  cfg) once more. Only for programs whose inputs survive a failed run (nothing donated)."""
  try:
    return run(cfg)
  except jax.errors.JaxRuntimeError as e:
    if not (_unrunnable(e) and needs_check(cfg, platform)):
      raise
  return run(widened(cfg))


def widened(cfg: ModelConfig) -> ModelConfig:
  """The config whose matmuls multiply float32 operands; refused if the user asked for the compute dtype."""
  if cfg.matmul_operands == "compute":
    raise ConfigError("ModelConfig.matmul_operands",
                      f"this CPU cannot run the program's {cfg.dtype} x {cfg.dtype} -> float32 matmuls (a run of it "
                      "on zeros stopped with XLA's UNIMPLEMENTED)",
                      "use 'auto' (float32 operands where the CPU needs them) or 'float32'")
  return dataclasses.replace(cfg, matmul_operands="float32")
