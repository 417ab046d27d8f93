"""`midas bench data`: input-pipeline throughput on one core, against t5's TensorFlow path and
against what training consumes.

Three figures on the run config's documents (the built-in corpus by default):
  ours        Pipeline.batch, in this thread, for the config's UL2 mixture and for span corruption
              alone (T5's default denoiser, mu=3, r=0.15, span_rate=1);
  t5 / TF     t5.data.preprocessors.span_corruption as t5 users run it (select_random_chunk,
              reduce_concat_tokens, split_tokens, denoise) over a tf.data dataset of the same token
              documents, sized so that inputs + targets (EOS included) fit the same seq_len; and
              again followed by seqio's PrefixLMFeatureConverter(pack=True), as ours ends in rows;
  training    the tokens per second a few train steps of the config consume (all cores), or a
              figure given with --train_tokens_per_second.
On a prepared store (DataConfig.source = 'prepared', or --synthetic_documents=N) store_bench.py
measures instead: there is no in-memory corpus for t5 to read. --consumption=v5p-128 compares with
what one host of that TPU slice consumes at --mfu (store_bench.host_consumption).
"ours" and "t5" are measured on ONE core: every thread of the process is pinned to a single CPU
(sched_setaffinity on each task in /proc/self/task, restored afterwards; threads started meanwhile
inherit the pin), and TF also gets intra/inter-op and tf.data thread pools of 1.

Units: "slots" are row positions (batch * seq_len, what the trainer consumes); "real" tokens are the
non-padding ones. ours/TF (the headline) compares real tokens of span corruption alone; t5's count is
the inputs + targets that span_corruption emits, before the Task's EOS and before any feature
converter, which flatters TF: ours also packs rows. ours/TF+pack puts both sides at packed rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import statistics
import time
from typing import Callable, Dict, Iterator, Optional, Tuple

import numpy as np

from midas_jax.configs import DataConfig, RunConfig
from midas_jax.data.pipeline import Pipeline
from midas_jax.errors import ConfigError

T5_DENOISER = (3.0, 0.15)  # (mean span length, noise density): t5's span_corruption default
TARGET_VS_TRAINING = 5.0
TARGET_VS_TF = 10.0


# ----------------------------------------------------------------------------- one core

@contextlib.contextmanager
def one_core() -> Iterator[Optional[int]]:
  """Pins every thread of this process to one CPU (the lowest allowed) for the block.

  Pinning all tasks, not just this thread, matters for TF: its pools may already exist, and a pool
  thread that stayed free would let tf.data use a second core. Yields None where affinity is not
  supported (then the figures are for however many cores the OS gives).
  """
  if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
    yield None
    return
  main_mask = os.sched_getaffinity(0)
  cpu = min(main_mask)
  before = {}
  for tid in _threads():
    try:
      before[tid] = os.sched_getaffinity(tid)
      os.sched_setaffinity(tid, {cpu})
    except OSError:  # the thread ended meanwhile
      pass
  try:
    yield cpu
  finally:
    for tid in _threads():  # includes threads started inside the block, which inherited the pin
      try:
        os.sched_setaffinity(tid, before.get(tid, main_mask))
      except OSError:
        pass


def _threads():
  return [int(t) for t in os.listdir("/proc/self/task")]


def _timed(produce: Callable[[], Tuple[int, int, int]], seconds: float, warmup_seconds: float) -> Dict[str, float]:
  """Calls produce() (-> items, slots, real tokens) for warmup_seconds, then counts for ~seconds."""
  t_end = time.perf_counter() + warmup_seconds
  produce()  # at least once, so the first call's one-off costs are never timed
  while time.perf_counter() < t_end:
    produce()
  items = slots = real = 0
  t0, cpu0 = time.perf_counter(), time.process_time()
  while True:
    n, s, r = produce()
    items, slots, real = items + n, slots + s, real + r
    elapsed = time.perf_counter() - t0
    if elapsed >= seconds:
      break
  # CPU seconds of all threads per wall second: <= 1 confirms one core (other threads included).
  cpu_seconds = time.process_time() - cpu0
  return {"seconds": elapsed, "items": items, "slots": slots, "real_tokens": real,
          "cores_used": cpu_seconds / elapsed, "cpu_seconds": cpu_seconds}


# ----------------------------------------------------------------------------- ours

def span_only(data: DataConfig) -> DataConfig:
  """The config's data with span corruption alone, t5's default denoiser and no mode token."""
  return dataclasses.replace(data, causal_rate=0.0, prefix_rate=0.0, span_rate=1.0,
                             span_denoisers=(T5_DENOISER,), mode_tokens=False)


def measure_ours(pipeline: Pipeline, seconds: float, warmup_seconds: float, process_count: int = 1) -> Dict[str, float]:
  """Process 0's rows of consecutive steps, as one of process_count hosts builds them."""
  step = iter(range(1 << 62))
  shape = (pipeline.config.batch_size // process_count, pipeline.config.seq_len)

  def produce():
    batch = pipeline.batch(next(step), "train", 0, process_count)
    return shape[0], shape[0] * shape[1], int(np.count_nonzero(batch["segment_ids"]))

  m = _timed(produce, seconds, warmup_seconds)
  return {"tokens_per_second": m["slots"] / m["seconds"],
          "real_tokens_per_second": m["real_tokens"] / m["seconds"],
          "rows_per_second": m["items"] / m["seconds"],
          "packing_efficiency": m["real_tokens"] / m["slots"],
          "seconds": m["seconds"], "cores_used": m["cores_used"],
          "real_tokens_per_cpu_second": m["real_tokens"] / m["cpu_seconds"]}


# ----------------------------------------------------------------------------- t5 / TF

def t5_lengths(seq_len: int, mean: float, density: float) -> Tuple[int, int]:
  """(inputs_length, targets_length) for span_corruption: the longest inputs whose targets, per
  t5's own random_spans_helper (EOS counted on both), still fit seq_len together. t5's decoder-only
  recipe then packs inputs + targets into one seq_len row."""
  from t5.data import preprocessors  # pylint: disable=import-outside-toplevel
  best = None
  for inputs_length in range(2, seq_len):
    _, targets_length = preprocessors.random_spans_helper(
        inputs_length=inputs_length, noise_density=density, mean_noise_span_length=mean,
        extra_tokens_per_span_inputs=1, extra_tokens_per_span_targets=1)
    if inputs_length + targets_length <= seq_len:
      best = (inputs_length, targets_length)
  if best is None:
    raise ValueError(f"seq_len={seq_len} is too short for t5's span_corruption")
  return best


def _tf_single_threaded() -> bool:
  """Intra/inter-op pools of one thread. Must precede any TF op; False if TF already started."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return True
  except RuntimeError:  # the context exists (e.g. an earlier test ran TF): rely on the pin alone
    return (tf.config.threading.get_intra_op_parallelism_threads() == 1 and
            tf.config.threading.get_inter_op_parallelism_threads() == 1)


def _gin_unlocked():
  try:
    import gin  # pylint: disable=import-outside-toplevel
  except ImportError:
    return contextlib.nullcontext()
  return gin.unlock_config()


# The t5 reference: each module it imports and the package that provides it, in import order.
T5_REFERENCE = (("tensorflow", "tensorflow"), ("seqio", "seqio"), ("t5.data.preprocessors", "t5"))
T5_INSTALL = "pip install -r requirements/t5-reference.txt && pip install --no-deps t5==0.9.4"


def import_t5_reference() -> Optional[str]:
  """Imports the t5 reference (TF's op pools set to one thread as soon as TF is in, before seqio or
  t5 can start them); returns None when it imports, else which of its packages are not installed.

  Not installed, the comparison is skipped and the report says why. Installed but failing to
  import is a broken environment: that raises ConfigError naming the package, so a comparison
  meant to run never turns silently into "unavailable".
  """
  missing = [package for module, package in T5_REFERENCE if importlib.util.find_spec(module.split(".")[0]) is None]
  if missing:
    return f"not installed: {', '.join(missing)} ({T5_INSTALL})"
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  for module, package in T5_REFERENCE:
    try:
      # t5 registers gin configurables on import, which gin refuses once the CLI has parsed its config.
      with _gin_unlocked():
        importlib.import_module(module)
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigError(package, f"is installed, but `import {module}` fails ({type(e).__name__}: {e}), so "
                        "the t5 reference of `midas bench data` cannot run",
                        f"repair the install ({T5_INSTALL}), or uninstall {package} to skip the comparison") from e
    if module == "tensorflow":
      _tf_single_threaded()
  return None


def measure_t5(documents, vocab, seq_len: int, batch_size: int, seed: int, seconds: float,
               warmup_seconds: float) -> Dict[str, object]:
  """t5's span_corruption over the token documents, timed twice: counting the inputs + targets it
  emits (the headline), and through seqio's PrefixLMFeatureConverter(pack=True) into rows, which is
  what a t5 decoder-only user feeds the model and what ours also does."""
  missing = import_t5_reference()
  if missing:
    return {"available": False, "reason": missing}
  import seqio  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from t5.data import preprocessors  # pylint: disable=import-outside-toplevel
  threads_set = _tf_single_threaded()  # True if import_t5_reference set the pools to one thread

  mean, density = T5_DENOISER
  inputs_length, targets_length = t5_lengths(seq_len, mean, density)
  lengths = {"inputs": inputs_length, "targets": targets_length}
  seqio_vocab = vocab.to_seqio()
  features = {k: seqio.Feature(seqio_vocab, add_eos=True) for k in ("inputs", "targets")}
  # A ragged tensor source, not a Python generator, so TF's side carries no per-document Python.
  flat = np.concatenate(documents).astype(np.int32)
  ragged = tf.RaggedTensor.from_row_lengths(flat, np.asarray([len(d) for d in documents], np.int64))
  options = tf.data.Options()
  options.threading.private_threadpool_size = 1
  options.threading.max_intra_op_parallelism = 1

  # Traced once (autograph tracing takes seconds); each iterator below runs it afresh.
  ds = tf.data.Dataset.from_tensor_slices({"targets": ragged}).repeat()
  with seqio.map_seed_manager(seed):
    span_corrupted = preprocessors.span_corruption(ds, lengths, features, mean_noise_span_length=mean,
                                                   noise_density=density)

  # Count in TF and hand over a batch of counts: a Python call per example would bill TF for ours.
  raw = span_corrupted.map(lambda ex: tf.size(ex["inputs"]) + tf.size(ex["targets"])).batch(64)
  raw_it = raw.with_options(options).as_numpy_iterator()

  def produce_raw():
    counts = next(raw_it)
    total = int(counts.sum())
    return len(counts), total, total

  m = _timed(produce_raw, seconds, warmup_seconds)

  # The Task's EOS, then packing into rows of inputs_length + targets_length (<= seq_len).
  ds = seqio.preprocessors.append_eos_after_trim(span_corrupted, features, lengths)
  packed = seqio.PrefixLMFeatureConverter(pack=True)(ds, lengths).batch(batch_size)
  packed_it = packed.with_options(options).as_numpy_iterator()

  def produce_packed():
    seg = next(packed_it)["decoder_segment_ids"]
    return seg.shape[0], seg.size, int(np.count_nonzero(seg))

  p = _timed(produce_packed, seconds, warmup_seconds)
  return {"available": True, "tokens_per_second": m["real_tokens"] / m["seconds"],
          "examples_per_second": m["items"] / m["seconds"],
          "tokens_per_example": m["real_tokens"] / m["items"],
          "inputs_length": inputs_length, "targets_length": targets_length,
          "threads_set_to_one": threads_set, "seconds": m["seconds"], "cores_used": m["cores_used"],
          "tokens_per_cpu_second": m["real_tokens"] / m["cpu_seconds"],
          "packed": {"tokens_per_second": p["slots"] / p["seconds"],
                     "real_tokens_per_second": p["real_tokens"] / p["seconds"],
                     "packing_efficiency": p["real_tokens"] / p["slots"],
                     "row_length": inputs_length + targets_length,
                     "seconds": p["seconds"], "cores_used": p["cores_used"],
                     "real_tokens_per_cpu_second": p["real_tokens"] / p["cpu_seconds"]}}


# ----------------------------------------------------------------------------- training

def measure_training(experiment, steps: int = 5, warmup: int = 2) -> Dict[str, float]:
  """Slots per second that `steps` train steps of the config consume (median step, all cores)."""
  import jax  # pylint: disable=import-outside-toplevel
  data = experiment.config.data
  batches = [experiment.device_batch(s) for s in range(warmup + steps)]
  state = experiment.init_state()
  times = []
  with experiment.context():
    step_fn = experiment.jit_train_step()
    for i, b in enumerate(batches):
      t0 = time.perf_counter()
      state, metrics = step_fn(state, b)
      jax.block_until_ready(metrics["loss"])
      if i >= warmup:
        times.append(time.perf_counter() - t0)
  step_seconds = statistics.median(times)
  return {"tokens_per_second": data.batch_size * data.seq_len / step_seconds,
          "step_seconds": step_seconds, "steps": steps, "source": "measured"}


# ----------------------------------------------------------------------------- run

def run(config: RunConfig, seconds: float = 5.0, train_tokens_per_second: Optional[float] = None,
        train_steps: int = 5, consumption: Optional[str] = None, mfu: float = 0.4,
        synthetic_documents: Optional[int] = None, synthetic_dir: Optional[str] = None,
        synthetic_mean_length: float = 64.0) -> Dict[str, object]:
  """consumption: a TPU slice (e.g. v5p-128) whose per-host consumption at `mfu` ours is compared
  with; synthetic_documents: bench a synthetic store of that many documents (in synthetic_dir)."""
  from midas_jax.bench import store_bench  # pylint: disable=import-outside-toplevel
  training = None
  if train_tokens_per_second is not None:
    training = {"tokens_per_second": float(train_tokens_per_second), "source": "given"}
  elif consumption:
    training = store_bench.host_consumption(config, consumption, mfu)
  if synthetic_documents:
    folder = store_bench.write_synthetic_store(config, synthetic_documents, synthetic_dir, synthetic_mean_length)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, source="prepared", prepared_dir=folder,
                                                                   prepared_from=""))
  if config.data.source == "prepared":
    return store_bench.run(config, seconds, training, train_steps)
  # Imported here: experiment pulls in JAX and the model, which the module's users may not need.
  from midas_jax.train.experiment import build_experiment, load_data  # pylint: disable=import-outside-toplevel
  import_t5_reference()  # a broken t5 install fails here, before anything is measured
  if training is not None:
    vocab, pipeline = load_data(config)
  else:
    experiment = build_experiment(config)
    vocab, pipeline = experiment.vocab, experiment.pipeline
    training = measure_training(experiment, steps=train_steps)  # before the pin: all cores
  documents = pipeline.documents
  span_pipeline = Pipeline(span_only(config.data), documents, vocab.vocab_size)
  warmup_seconds = min(1.0, max(0.1, seconds / 4))

  with one_core() as cpu:
    ours = measure_ours(pipeline, seconds, warmup_seconds)
    ours_span = measure_ours(span_pipeline, seconds, warmup_seconds)
    t5 = measure_t5(documents["train"], vocab, config.data.seq_len, config.data.batch_size, config.data.seed,
                    seconds, warmup_seconds)

  ratios = {"ours_vs_training": ours["tokens_per_second"] / training["tokens_per_second"]}
  if t5["available"]:
    ratios["ours_vs_tf"] = ours_span["real_tokens_per_second"] / t5["tokens_per_second"]
    ratios["ours_vs_tf_packed"] = ours_span["real_tokens_per_second"] / t5["packed"]["real_tokens_per_second"]
    # The same per CPU-second of this process: steadier when other processes share the pinned core.
    ratios["ours_vs_tf_per_cpu_second"] = (ours_span["real_tokens_per_cpu_second"] /
                                           t5["tokens_per_cpu_second"])
  return {
      "cpu": cpu,
      "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
      "seq_len": config.data.seq_len,
      "batch_size": config.data.batch_size,
      "num_documents": len(documents["train"]),
      "mixture": [dict(e.denoiser.to_json(), probability=e.probability) for e in pipeline.entries],
      "ours_mixture": ours,
      "ours_span": ours_span,
      "t5": t5,
      "training": training,
      "ratios": ratios,
      "targets": {"ours_vs_training": TARGET_VS_TRAINING, "ours_vs_tf": TARGET_VS_TF},
  }


def format_report(r: Dict[str, object]) -> str:
  if "store" in r:
    from midas_jax.bench import store_bench  # pylint: disable=import-outside-toplevel
    return store_bench.format_report(r)

  def verdict(key):
    value = r["ratios"].get(key)
    if value is None:
      return "n/a (t5 unavailable)"
    target = r["targets"][key]
    return f"{value:.1f}x (target >= {target:g}x: {'met' if value >= target else 'NOT met'})"

  mix = ", ".join(f"{e['name']} {e['probability']:.2f}" for e in r["mixture"])
  ours, span, t5, train = r["ours_mixture"], r["ours_span"], r["t5"], r["training"]
  core = f"CPU {r['cpu']}" if r["cpu"] is not None else "unpinned (no sched_setaffinity)"
  lines = [
      f"data            {r['num_documents']:,} train documents, batch {r['batch_size']} x {r['seq_len']}",
      f"one core        {core} of {r['cpus_available']} available",
      f"mixture         {mix}",
      f"ours, mixture   {ours['tokens_per_second']:,.0f} slots/s, {ours['real_tokens_per_second']:,.0f} "
      f"real tokens/s ({ours['rows_per_second']:,.0f} rows/s), packing {ours['packing_efficiency']:.1%}, "
      f"{ours['cores_used']:.2f} cores busy",
      f"ours, span only {span['tokens_per_second']:,.0f} slots/s, {span['real_tokens_per_second']:,.0f} "
      f"real tokens/s, packing {span['packing_efficiency']:.1%}, {span['cores_used']:.2f} cores busy "
      f"(mu={T5_DENOISER[0]:g}, r={T5_DENOISER[1]:g})",
  ]
  if t5["available"]:
    threads = "intra/inter-op 1" if t5["threads_set_to_one"] else "TF pools already started, pin only"
    lines.append(f"t5 / TF, span   {t5['tokens_per_second']:,.0f} tokens/s ({t5['examples_per_second']:,.0f} "
                 f"examples/s of {t5['tokens_per_example']:.0f} tokens; inputs {t5['inputs_length']}, "
                 f"targets {t5['targets_length']}; {threads}; {t5['cores_used']:.2f} cores busy)")
    pk = t5["packed"]
    lines.append(f"  + seqio pack  {pk['real_tokens_per_second']:,.0f} real tokens/s in rows of {pk['row_length']} "
                 f"(PrefixLMFeatureConverter(pack=True)), packing {pk['packing_efficiency']:.1%}, "
                 f"{pk['cores_used']:.2f} cores busy")
  else:
    lines.append(f"t5 / TF, span   unavailable: {t5['reason']}")
  if train["source"] == "measured":
    lines.append(f"training        {train['tokens_per_second']:,.0f} tokens/s consumed "
                 f"({train['step_seconds'] * 1e3:.0f} ms median step over {train['steps']}, all cores)")
  else:
    lines.append(f"training        {train['tokens_per_second']:,.0f} tokens/s consumed (given)")
  lines.append(f"ours / training {verdict('ours_vs_training')}")
  lines.append(f"ours / TF       {verdict('ours_vs_tf')} (real tokens, span corruption alone)")
  if "ours_vs_tf_per_cpu_second" in r["ratios"]:
    lines.append(f"  per CPU-sec   {r['ratios']['ours_vs_tf_per_cpu_second']:.1f}x (discounts time the pinned core "
                 "spent on other processes)")
  if "ours_vs_tf_packed" in r["ratios"]:
    lines.append(f"ours / TF+pack  {r['ratios']['ours_vs_tf_packed']:.1f}x (both ending in packed rows)")
  return "\n".join(lines)
