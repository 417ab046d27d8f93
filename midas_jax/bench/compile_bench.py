"""`midas bench compile`: will the train step fit, per device, before anything is launched?

Three ways to answer, each labelled in the report:
  * compiled on this machine's devices (real, or simulated CPU devices): the train step is
    lowered and compiled ahead of time from abstract shapes (nothing is allocated), and XLA's
    memory analysis gives the argument, output and temporary bytes per device;
  * compiled for a TPU slice (e.g. `--topology=v5p-128`): jax describes the slice without the
    hardware when libtpu is installed (`pip install 'midas_jax[tpu]'`), and the TPU compiler
    itself reports the memory;
  * analytic, where no compiler for the target is at hand (a TPU slice without libtpu, GPUs):
    parameter and optimizer bytes from the shardings (exact), activations from a formula that
    follows the model's tensors and the remat policy (an estimate).
Parameter and optimizer bytes always come from the shardings, so the three agree on those; the
compiled paths also check them against XLA's argument size. ModelConfig.attention = 'auto' is
resolved for the target's platform (flash on a TPU slice even when compiled from a CPU host).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from midas_jax import flops, hardware, sharding, tpu_flags
from midas_jax.analysis import cost_model, dot_dtypes, hlo_loops, memory_model, targets
from midas_jax.configs import RunConfig
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError, require
from midas_jax.model import dummy_batch
from midas_jax.stacking.checks import schedule_for
from midas_jax.stacking.schedule import StageSchedule, flop_speedup, schedule_from_config
from midas_jax.train.build import StageBuild, model_and_layout
from midas_jax.train_state import StateLayout

GIB = hardware.GIB
# Custom-call targets of Pallas kernels (Mosaic on TPU, Triton on GPU).
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


def vocab_size_of(config: RunConfig) -> int:
  """The padded vocabulary: ModelConfig.vocab_size when set (no data or tokenizer needed), else the data's."""
  if config.model.vocab_size is not None:
    return config.model.vocab_size
  return config.model.with_vocab(make_vocabulary(config.data).vocab_size).vocab_size


def _parts(config: RunConfig, mesh, num_layers: Optional[int] = None, platform: Optional[str] = None):
  model_config = dataclasses.replace(config.model, vocab_size=vocab_size_of(config))
  if num_layers is not None:
    model_config = dataclasses.replace(model_config, num_layers=num_layers)
  return (model_config,) + model_and_layout(config, mesh, model_config, platform)


def _platform(target: targets.Target) -> str:
  return jax.default_backend() if target.platform == "local" else target.platform


def _leaf_bytes(abstract, shardings) -> int:
  return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
             for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def state_bytes(layout: StateLayout) -> Dict[str, int]:
  """Per-device bytes of the parameters and of the optimizer state (with the step counter), exact."""
  return {"params": _leaf_bytes(layout.abstract.params, layout.shardings.params),
          "optimizer": _leaf_bytes((layout.abstract.opt_state, layout.abstract.step),
                                   (layout.shardings.opt_state, layout.shardings.step))}


def _batch_spec(config: RunConfig, mesh) -> Dict[str, jax.ShapeDtypeStruct]:
  shapes = jax.eval_shape(lambda: dummy_batch(config.data.batch_size, config.data.seq_len))
  where = NamedSharding(mesh, sharding.batch_sharding(mesh).spec)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=where) for k, v in shapes.items()}


def batch_bytes(config: RunConfig, rows: int) -> int:
  """Per-device bytes of one device's rows of the batch (the step's other argument)."""
  shapes = jax.eval_shape(lambda: dummy_batch(rows, config.data.seq_len))
  return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in shapes.values())


def compiled_train_step(config: RunConfig, devices: Sequence[Any], unroll_microbatches: bool = False,
                        compiler_options: Optional[Dict[str, Any]] = None):
  """The train step compiled ahead of time for `devices` from abstract shapes, allocating nothing;
  `compiler_options` are XLA/libtpu options for this one compile."""
  mesh = sharding.make_mesh(config.mesh, devices)
  model_config, model, tx, schedule, rules, layout = _parts(config, mesh)
  build = StageBuild(config=config, model_config=model_config, vocab=None, pipeline=None, mesh=mesh,
                     rules=rules, model=model, tx=tx, lr_schedule=schedule, layout=layout)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       layout.abstract, layout.shardings)
  with build.context():
    step = build.jit_train_step(unroll_microbatches=True) if unroll_microbatches else build.jit_train_step()
    return step.lower(state, _batch_spec(config, mesh)).compile(compiler_options=compiler_options)


def compile_train_step(config: RunConfig, devices: Sequence[Any]) -> Dict[str, Any]:
  """XLA's memory analysis of the train step compiled for `devices`, allocating nothing, and the
  compiled program's matmuls by dtype (what the backend runs, after any pass that changed one)."""
  compiled = compiled_train_step(config, devices)
  stats = compiled.memory_analysis()
  names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
           "generated_code_size_in_bytes")
  memory = {n.replace("_size_in_bytes", ""): int(getattr(stats, n)) for n in names}
  # Proof the fused attention made it into the program: its Pallas kernels are custom calls.
  text = compiled.as_text() or ""
  memory["kernel_calls"] = sum(text.count(f"custom_call_target=\"{t}\"") for t in KERNEL_TARGETS)
  memory["matmuls"] = dot_dtypes.summary(dot_dtypes.hlo_dots(text))  # outside the kernels: custom calls are opaque
  # JSON keys are strings: {loops deep: reductions}; one in a loop runs once per trip.
  memory["reductions_by_depth"] = {str(k): v for k, v in
                                   hlo_loops.reductions_by_depth(hlo_loops.collectives(text)).items()}
  return memory


def _growth_peak(config: RunConfig, schedule: StageSchedule, mesh, final_state: Dict[str, int],
                 platform: str) -> Optional[int]:
  """State bytes while the last growth runs: the old and the new layers' state side by side."""
  if schedule.num_stages == 1:
    return None
  depth_before, depth = schedule.depths[-2], schedule.depths[-1]
  before = sum(state_bytes(_parts(config, mesh, depth_before, platform)[-1]).values())
  after = sum(final_state.values())
  per_layer = (after - before) / (depth - depth_before)
  shared = after - per_layer * depth  # embeddings, final norm, step count
  return int(before + after - shared)


def run(config: RunConfig, topology: Optional[str] = None, method: str = "auto",
        hbm_gib: Optional[float] = None, estimate_step: bool = True) -> Dict[str, Any]:
  """The per-device memory report. method: "auto" (compile where possible), "compile" or "analytic";
  estimate_step: for a TPU target, also the cost model's estimated step time (two more compiles,
  analysis/cost_model.py)."""
  require(method in ("auto", "compile", "analytic"), "--method", f"unknown method {method!r}",
          "use auto, compile or analytic")
  schedule = schedule_for(config)  # a stacked config's growth, checked before anything compiles
  target = targets.parse_target(topology)
  require(target.num_slices == config.mesh.num_slices, "MeshConfig.dcn_data",
          f"{target.name} has {target.num_slices} slice(s) but the mesh spans dcn_data x dcn_fsdp = "
          f"{config.mesh.num_slices}", "use a mesh file for that many slices (e.g. gin/meshes/tpu_2x_v5p_128.gin)")
  shape = sharding.resolve_mesh_shape(config.mesh, target.num_devices)
  abstract_mesh = AbstractMesh(shape, sharding.MESH_AXES)
  platform = _platform(target)
  model_config, model, _, _, _, layout = _parts(config, abstract_mesh, platform=platform)
  states = state_bytes(layout)
  trainer = config.trainer
  rows = config.data.batch_size // (shape[0] * shape[1])
  micro_rows = rows // trainer.microbatches
  kernel = model.attention_implementation
  act = memory_model.activation_bytes(model_config, micro_rows, config.data.seq_len, tensor=shape[2],
                                      attention=kernel, loss_chunk=trainer.loss_chunk)
  # fsdp gathers each layer's weights (in the compute dtype) before use; two layers are in flight.
  layer_params = flops.param_counts(model_config)["per_layer"]
  gathered = 2 * layer_params * jnp.dtype(model_config.dtype).itemsize // shape[2] if shape[1] > 1 else 0
  # Accumulating over microbatches keeps a float32 gradient sum beside each microbatch's gradient.
  gradients = states["params"] * (2 if trainer.microbatches > 1 else 1)
  analytic = dict(states, gradients=gradients, gathered_weights=gathered, activations=sum(act.values()))
  analytic["total"] = sum(analytic.values())
  report: Dict[str, Any] = {
      "target": target.name, "platform": target.platform, "devices": target.num_devices,
      "mesh": dict(zip(sharding.MESH_AXES, shape)),
      "model": {"params": flops.param_counts(model_config)["total"], "layers": model_config.num_layers,
                "d_model": model_config.d_model, "remat_policy": model_config.remat_policy,
                "dtype": model_config.dtype, "param_dtype": model_config.param_dtype, "attention": kernel},
      "batch": {"global": config.data.batch_size, "rows_per_device": rows, "seq_len": config.data.seq_len,
                "bytes_per_device": batch_bytes(config, rows), "microbatches": trainer.microbatches,
                "loss_chunk": trainer.loss_chunk},
      "analytic": analytic, "activation_parts": act,
      "growth_peak_state": _growth_peak(config, schedule, abstract_mesh, states, platform),
      "hbm": int(hbm_gib * GIB) if hbm_gib else target.hbm_bytes,
  }
  devices, why = None, ""
  if method != "analytic":
    if target.platform == "local":
      devices = jax.devices()
      limit = (devices[0].memory_stats() or {}).get("bytes_limit")  # a GPU's; CPUs report none
      report["hbm"] = report["hbm"] or limit
    elif target.platform == "tpu":
      # Compiled as the run would be: with its libtpu flags (read when libtpu starts, here).
      report["tpu_flags"] = tpu_flags.apply(config.mesh.tpu_flags, target.num_slices, model_config.remat_policy,
                                            accelerator=target.name.split("x", 1)[-1])["added"]
      devices, why = targets.tpu_devices(target)
    else:
      why = "jax cannot compile for GPUs without them"
    if devices is None and method == "compile":
      raise ConfigError("--method", f"cannot compile for {target.name}: {why}",
                        "install libtpu (pip install 'midas_jax[tpu]') for TPU slices, or use --method=analytic")
  if devices is not None:
    report.update(method="compiled", device_kind=devices[0].device_kind)
    try:
      memory = compile_train_step(config, devices)
    except Exception as e:  # pylint: disable=broad-except
      # The TPU compiler refuses a program that does not fit its HBM, saying by how much.
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      report.update(compiled=None, compile_error=str(e).splitlines()[0], total=analytic["total"], fits=False)
      report["max_global_batch"] = memory_model.max_global_batch(
          analytic, micro_rows, report["hbm"], shape[0] * shape[1], trainer.microbatches, platform=platform)
      return report
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    report.update(compiled=memory, total=memory["peak"])
    if target.platform == "tpu" and estimate_step:
      report["estimated"] = _estimated(config, devices, schedule, model_config, target.num_devices)
  else:
    report.update(method="analytic", note=why or "analytic estimate requested")
    report["total"] = analytic["total"]
  hbm = report["hbm"]
  report["fits"] = memory_model.fits(report["total"], hbm, platform)  # a GPU keeps its headroom
  report["max_global_batch"] = memory_model.max_global_batch(analytic, micro_rows, hbm, shape[0] * shape[1],
                                                             trainer.microbatches, platform=platform)
  return report


def _price_on(devices):
  """price_at(config): the cost model's totals of config's train step compiled for `devices` to be priced."""
  return lambda c: cost_model.price(compiled_train_step(c, devices, unroll_microbatches=c.trainer.microbatches > 1,
                                                        compiler_options=cost_model.PRICING_OPTIONS),
                                    slices=c.mesh.num_slices)


def _estimated(config: RunConfig, devices, schedule: StageSchedule, model_config, chips: int,
               price_at=None) -> Dict[str, Any]:
  """The TPU compiler's estimated step at every stage depth, the whole run's seconds, and for a stacked
  config each paper MIDAS schedule's estimated wall-clock and FLOP speedups (analysis/cost_model.py).
  price_at: how one config is priced (default: compiled for `devices`)."""
  prices = cost_model.priced_depths(config, price_at or _price_on(devices))
  schedules = paper_schedules(config, schedule) or ({"own": schedule} if schedule.num_stages > 1 else {})
  depths = sorted({d for s in schedules.values() for d in s.depths} | set(schedule.depths))
  out = cost_model.estimate(config, prices, depths, chips, devices[0].device_kind, model_config)
  out["run_seconds"] = cost_model.run_seconds(out, schedule.stage_steps, schedule.depths)
  out["stages"] = [{"depth": d, "steps": n} for d, n in zip(schedule.depths, schedule.stage_steps)]
  if "steps" in out and schedule.num_stages > 1:
    out["midas"] = {name: cost_model.speedups(out, s, flop_speedup(model_config, config.data.seq_len, s))
                    for name, s in schedules.items()}
    out["operator"] = config.stacking.operator
  return out


# The MIDAS paper's schedules: Prop-alpha stage lengths (gin/schedules/prop1.gin, prop2, prop3), the
# only difference between gin/experiments/paper_*_midas_prop{1,2,3}.gin.
PAPER_ALPHAS = {"prop1": 1.0, "prop2": 2.0, "prop3": 3.0}


def paper_schedules(config: RunConfig, schedule: StageSchedule) -> Dict[str, StageSchedule]:
  """A stacked config's schedule under each paper Prop-alpha (same stages, block and steps): one
  pricing serves all three, since a step's price depends on its depth, not on the stage lengths.
  Empty for a config that does not grow, or one with explicit stage_steps (priced as its own, "own")."""
  st = config.stacking
  if schedule.num_stages == 1 or st.stage_steps is not None:
    return {}
  return {name: schedule_from_config(dataclasses.replace(st, alpha=alpha), config.trainer.num_steps,
                                     config.model.num_layers) for name, alpha in PAPER_ALPHAS.items()}


# What else in the environment reaches libtpu or jax's start, kept with each estimate as the command
# found it (jax sets more of these itself when it starts): what differs between two runs whose
# estimates differ.
ESTIMATE_ENVIRONMENT = ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "XLA_FLAGS", "TPU_ACCELERATOR_TYPE",
                        "TPU_WORKER_HOSTNAMES")


def estimate(config: RunConfig, topology: str) -> Dict[str, Any]:
  """The pricing compiles alone (no memory compile): the estimated step at each stage depth for a TPU
  target, the flags it was compiled under, and MIDAS's speedups. What `midas bench estimate` repeats
  to measure how much the same compile's estimate moves between processes."""
  environment = {k: os.environ[k] for k in ESTIMATE_ENVIRONMENT if os.environ.get(k)}
  schedule = schedule_for(config)
  target = targets.parse_target(topology)
  require(target.platform == "tpu", "--topology", f"{target.name} is not a TPU slice",
          "estimates come from libtpu's cost model: name a TPU slice (e.g. v5p-128)")
  require(target.num_slices == config.mesh.num_slices, "MeshConfig.dcn_data",
          f"{target.name} has {target.num_slices} slice(s) but the mesh spans {config.mesh.num_slices}",
          "use a mesh file for that many slices (e.g. gin/meshes/tpu_2x_v5p_128.gin)")
  model_config = dataclasses.replace(config.model, vocab_size=vocab_size_of(config))
  flags = tpu_flags.apply(config.mesh.tpu_flags, target.num_slices, model_config.remat_policy,
                          accelerator=target.name.split("x", 1)[-1])
  devices, why = targets.tpu_devices(target)
  require(devices is not None, "--topology", f"cannot compile for {target.name}: {why}",
          "install libtpu (pip install 'midas_jax[tpu]')")
  shape = sharding.resolve_mesh_shape(config.mesh, target.num_devices)
  return {"target": target.name, "devices": target.num_devices, "device_kind": devices[0].device_kind,
          "mesh": dict(zip(sharding.MESH_AXES, shape)), "tpu_flags": flags["added"],
          "libtpu_init_args": os.environ.get(tpu_flags.ENV, ""),
          "environment": environment,
          "model": {"params": flops.param_counts(model_config)["total"], "layers": model_config.num_layers,
                    "d_model": model_config.d_model,
                    "attention": _parts(config, AbstractMesh(shape, sharding.MESH_AXES), platform="tpu")[1]
                                 .attention_implementation},
          "batch": {"global": config.data.batch_size, "seq_len": config.data.seq_len,
                    "microbatches": config.trainer.microbatches},
          "estimated": _estimated(config, devices, schedule, model_config, target.num_devices)}


def estimated_lines(estimated: Optional[Dict[str, Any]]) -> List[str]:
  """The TPU compiler's estimated step, per stage depth: its cost model's sum over instructions, not a
  measurement and not a bound (a real step can overlap what it sums, or run kernels below peak)."""
  if not estimated:
    return []
  if "unpriced" in estimated:
    return [f"estimated       none: {estimated['unpriced']}"]
  lines = ["estimated       the TPU compiler's cost model (its instructions' costs summed, collectives included: an "
           "estimate, not a measured time; analysis/cost_model.py):"]
  for stage in estimated["stages"]:
    s = estimated["steps"][str(stage["depth"])]
    mfu = "-" if s["mfu_estimate"] is None else f"{s['mfu_estimate']:.1%}"
    lines.append(f"  {stage['depth']:>3} layers    {s['seconds'] * 1e3:,.1f} ms a step, "
                 f"{s['tokens_per_s_per_chip']:,.0f} tokens/s per chip, MFU {mfu} "
                 f"({stage['steps']:,} steps)")
  deepest = estimated["steps"][str(max(st["depth"] for st in estimated["stages"]))]
  if deepest.get("dcn_bytes_per_chip"):
    lines.append(f"  across slices {deepest['dcn_bytes_per_chip'] / 2 ** 20:,.1f} MiB a chip a step over the data-center "
                 f"network: {deepest['dcn_seconds'] * 1e3:,.1f} ms at its bandwidth (analysis/dcn_cost.py), "
                 f"{deepest['seconds_without_overlap'] * 1e3:,.1f} ms a step if it does not overlap the compute")
  if estimated.get("dcn_unpriced"):
    lines.append(f"  caution       {estimated['dcn_unpriced']}")
  if len(estimated["stages"]) > 1:
    lines.append(f"  whole run     {estimated['run_seconds'] / 3600:,.2f} h of estimated steps")
  for name, m in estimated.get("midas", {}).items():
    lines.append(f"  {estimated.get('operator', 'midas')} {name}   {m['wall_clock']:.2f}x estimated wall-clock speedup "
                 "over the full-depth baseline "
                 f"({m['baseline_seconds'] / 3600:,.2f} h against {m['stacked_seconds'] / 3600:,.2f} h), "
                 f"{m['flops']:.2f}x in FLOPs")
  if "undercounted" in estimated:
    lines.append(f"  caution       the cost model counted {estimated['undercounted']:.0%} of the model's FLOPs for this "
                 "target: these times are too low")
  return lines


def _gib(n: Optional[float]) -> str:
  """Bytes in the largest binary unit that keeps the number >= 1."""
  if n is None:
    return "-"
  for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def format_report(r: Dict[str, Any]) -> str:
  mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
  m, b, a = r["model"], r["batch"], r["analytic"]
  lines = [f"target          {r['target']} ({r['devices']} devices{', ' + r['device_kind'] if 'device_kind' in r else ''}), mesh {mesh}",
           f"model           {m['params'] / 1e9:.2f}B params, {m['layers']} layers, d_model {m['d_model']}, "
           f"{m['dtype']} compute, {m['param_dtype']} params, remat {m['remat_policy']}, "
           f"{m['attention']} attention",
           f"batch           {b['global']} x {b['seq_len']} ({b['rows_per_device']} rows per device"
           f"{', in %d microbatches' % b['microbatches'] if b['microbatches'] > 1 else ''}; "
           f"loss in chunks of {b['loss_chunk'] or b['seq_len']} positions)"]
  if "tpu_flags" in r:
    lines.append(f"libtpu flags    {len(r['tpu_flags'])} set for {r['target']} (MeshConfig.tpu_flags; "
                 "docs/pods.md#tpu-compiler-flags)")
  lines += ["per device      (parameters and optimizer exact, from the shardings)",
            f"  parameters    {_gib(a['params'])}",
            f"  optimizer     {_gib(a['optimizer'])}"]
  if r.get("compile_error"):
    lines.append(f"compiled        {r['target']}: the compiler refused it: {r['compile_error']}")
  elif r["method"] == "compiled":
    c = r["compiled"]
    lines += [f"compiled        {r['target']}: arguments {_gib(c['argument'])}, outputs {_gib(c['output'])} "
              f"(aliased {_gib(c['alias'])}), temporaries {_gib(c['temp'])} "
              f"(activations, gradients, gathered weights); {c['kernel_calls']} Pallas kernel calls",
              f"  peak          {_gib(c['peak'])} (arguments + outputs - aliased + temporaries)"]
  else:
    lines.append(f"analytic        {r['note']}")
  lines += [f"  analytic      gradients {_gib(a['gradients'])}, gathered weights {_gib(a['gathered_weights'])}, "
            f"activations {_gib(a['activations'])} (saved {_gib(r['activation_parts']['saved'])}, "
            f"one layer's working set {_gib(r['activation_parts']['working'])}, "
            f"logits {_gib(r['activation_parts']['logits'])}) -> total {_gib(a['total'])}"]
  if r["growth_peak_state"] is not None:
    lines.append(f"  last growth   old and new state side by side: {_gib(r['growth_peak_state'])}")
  if r.get("compiled"):  # refused or analytic: no program to read
    mm = r["compiled"]["matmuls"]
    lines.append(f"matmuls         {mm['count']} in the optimized program, each counted once: "
                 f"{mm['bfloat16_operand_share']:.1%} of their FLOPs on bfloat16 operands")
    lines += [f"  {row['lhs']} x {row['rhs']} -> {row['result']:<9} {row['count']:>4} matmuls, "
              f"{row['flop_share']:.1%} of FLOPs" for row in mm["by_dtypes"]]
    depths = r["compiled"].get("reductions_by_depth", {})
    if depths:
      place = {"0": "outside loops", "1": "in a loop"}
      where = ", ".join(f"{n} {place.get(d, f'{d} loops deep')}" for d, n in depths.items())
      lines.append(f"reductions      all-reduce and reduce-scatter in the optimized program: {where} (one in a "
                   "loop runs once per trip" + ("; the outermost loop is the microbatches'" if b["microbatches"] > 1
                                                else "") + ")")
  lines += estimated_lines(r.get("estimated"))
  verdict = "unknown (no memory size for this target; pass --hbm_gib)" if r["fits"] is None else (
      f"{'fits' if r['fits'] else 'does NOT fit'} in {_gib(r['hbm'])} per device "
      + (f"(of which {memory_model.GPU_USABLE_FRACTION:.0%} may be planned) " if r.get("platform") == "gpu" else "") +
      f"({'the compiler refused it; analytic' if r.get('compile_error') else r['method']}: {_gib(r['total'])})")
  lines.append(f"verdict         {verdict}")
  if r["max_global_batch"] is not None:
    at = f" at {b['microbatches']} microbatches" if b["microbatches"] > 1 else ""
    lines.append(f"largest batch   {r['max_global_batch']} rows of {b['seq_len']} fit by the analytic count{at} "
                 "(set DataConfig.batch_size)")
  return "\n".join(lines)
