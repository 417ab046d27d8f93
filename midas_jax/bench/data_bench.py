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
what one host of that TPU slice consumes at --mfu at the run's shallowest stage
(store_bench.host_consumption); --storage_latency_ms=50 adds 50 ms to every request of a store on gs://.
"ours" and "t5" are measured on ONE core: every thread of the process is pinned to a single CPU
(sched_setaffinity on each task in /proc/self/task, restored afterwards; threads started meanwhile
inherit the pin), and TF also gets intra/inter-op and tf.data thread pools of 1.

Units: "slots" are row positions (batch * seq_len, what the trainer consumes); "real" tokens are the
non-padding ones. ours/TF (the headline) compares real tokens of span corruption alone; t5's count is
the inputs + targets that span_corruption emits, before the Task's EOS and before any feature
converter, which flatters TF: ours also packs rows. ours/TF+pack puts both sides at packed rows.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional

from midas_jax.bench import store_bench
from midas_jax.bench.pipeline_timing import TARGET_VS_TRAINING, measure_ours, measure_training, one_core
from midas_jax.bench.t5_reference import T5_DENOISER, import_t5_reference, measure_t5
from midas_jax.configs import ObjectivesConfig, RunConfig
from midas_jax.data.factory import load_data
from midas_jax.data.pipeline import Pipeline
from midas_jax.data.vocab.vocabulary import Vocabulary
from midas_jax.errors import require
from midas_jax.train.build import build_stage

TARGET_VS_TF = 10.0


# ----------------------------------------------------------------------------- ours

def span_only(mix: ObjectivesConfig) -> ObjectivesConfig:
  """The config's mixture as span corruption alone, t5's default denoiser and no mode token."""
  return dataclasses.replace(mix, causal_rate=0.0, prefix_rate=0.0, span_rate=1.0,
                             span_denoisers=(T5_DENOISER,), mode_tokens=False)


def span_pipeline(config: RunConfig, pipeline: Pipeline, vocab: Vocabulary) -> Pipeline:
  """The run's pipeline on span corruption alone: the same documents and the same vocabulary (its
  sentinels, mode ids and start token), so ours against t5 measures the pipeline training uses."""
  return Pipeline(config.data, pipeline.documents, vocab.vocab_size, vocab, mix=span_only(config.objectives))


# ----------------------------------------------------------------------------- run

def run(config: RunConfig, seconds: float = 5.0, train_tokens_per_second: Optional[float] = None,
        train_steps: int = 5, consumption: Optional[str] = None, mfu: float = 0.4,
        synthetic_documents: Optional[int] = None, synthetic_dir: Optional[str] = None,
        synthetic_mean_length: float = 64.0, storage_latency_ms: float = 0.0) -> Dict[str, object]:
  """consumption: a TPU slice (e.g. v5p-128) whose per-host consumption at `mfu` ours is compared
  with; synthetic_documents: bench a synthetic store of that many documents (in synthetic_dir);
  storage_latency_ms: added to every request of a store on gs:// (store_bench.py)."""
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
    return store_bench.run(config, seconds, training, train_steps, storage_latency_ms)
  require(not storage_latency_ms, "--storage_latency_ms", "applies to a prepared store, and this run reads "
          f"DataConfig.source={config.data.source!r}", "set DataConfig.source='prepared' (a store on gs://)")
  import_t5_reference()  # a broken t5 install fails here, before anything is measured
  if training is not None:
    vocab, pipeline = load_data(config)
  else:
    build = build_stage(config)
    vocab, pipeline = build.vocab, build.pipeline
    training = measure_training(build, steps=train_steps)  # before the pin: all cores
  documents = pipeline.documents
  span = span_pipeline(config, pipeline, vocab)
  warmup_seconds = min(1.0, max(0.1, seconds / 4))

  with one_core() as cpu:
    ours = measure_ours(pipeline, seconds, warmup_seconds)
    ours_span = measure_ours(span, seconds, warmup_seconds)
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
