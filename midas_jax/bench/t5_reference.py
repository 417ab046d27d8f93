"""t5's span corruption over TensorFlow, timed as t5 users run it: the reference `midas bench data`
compares ours with (data_bench.py). t5, seqio and TensorFlow are imported only when it runs."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Dict, Optional, Tuple

import gin
import numpy as np

from midas_jax.bench.pipeline_timing import timed
from midas_jax.errors import ConfigError

T5_DENOISER = (3.0, 0.15)  # (mean span length, noise density): t5's span_corruption default


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
      with gin.unlock_config():
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

  m = timed(produce_raw, seconds, warmup_seconds)

  # The Task's EOS, then packing into rows of inputs_length + targets_length (<= seq_len).
  ds = seqio.preprocessors.append_eos_after_trim(span_corrupted, features, lengths)
  packed = seqio.PrefixLMFeatureConverter(pack=True)(ds, lengths).batch(batch_size)
  packed_it = packed.with_options(options).as_numpy_iterator()

  def produce_packed():
    seg = next(packed_it)["decoder_segment_ids"]
    return seg.shape[0], seg.size, int(np.count_nonzero(seg))

  p = timed(produce_packed, seconds, warmup_seconds)
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
