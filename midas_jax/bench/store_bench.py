"""`midas bench data` on a prepared store: ours on one core, the packing, and the memory the reader
takes, against training's consumption (measured, given, or one pod host's, computed).

A pod host's consumption is computed at the shallowest stage of the run's schedule: a stacked run's
first stage (4 of paper_1b's 24 layers) steps about 4.7 times faster than full depth, so that is
when its hosts must feed the most tokens per second. `--storage_latency_ms` adds a latency to every
request of a store on gs:// (storage_latency.py) and reports the requests each step cost.

The process's peak RSS is reported next to its RSS just before the store is opened, after every
import: the difference is what the reader and the batches hold, which must not grow with the
corpus (compare --synthetic_documents=1000000 with 10000000). A synthetic store is written by the
store's own writer in a child process, so that the writing never counts.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import resource
import tempfile
from typing import Dict, Optional

from midas_jax import flops, fs, hardware
from midas_jax.bench import storage_latency
from midas_jax.bench.pipeline_timing import TARGET_VS_TRAINING, measure_ours, measure_training, one_core
from midas_jax.configs import DataConfig, RunConfig
from midas_jax.data.store import synthetic
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError, require
from midas_jax.stacking.checks import schedule_for
from midas_jax.train.build import build_stage

TARGET_VS_HOST_CONSUMPTION = 2.0  # ours, against one pod host's consumption at the shallowest stage


def rss_bytes() -> int:
  """This process's resident memory now."""
  with open("/proc/self/statm") as f:  # the OS's own counters, not a run input
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def host_consumption(config: RunConfig, topology: str, mfu: float) -> Dict[str, object]:
  """The tokens per second one host of `topology` consumes training `config` at `mfu`, at the shallowest
  stage of its schedule (the fastest steps): step time = train FLOPs per step at that depth / (chips *
  chip peak * mfu), shared by hosts = chips / per host."""
  parsed = hardware.parse_slice(topology.strip().lower())
  one_slice = parsed is not None and parsed.name == parsed.accelerator  # written without `Nx`
  require(one_slice, "--consumption", f"unknown TPU slice {topology!r}", "use e.g. v4-64, v5p-128, v5litepod-64")
  chips = parsed.chips
  hosts, _ = hardware.slice_hosts(parsed.tpu, chips)  # a v5e-8 is one host of 8 chips
  peak = hardware.known_peak_flops(parsed.tpu.name)
  model = config.model.with_vocab(make_vocabulary(config.data).vocab_size)
  depths = schedule_for(config).depths
  depth = min(depths)
  data = config.data
  flops_per_token = flops.train_flops_per_token(model, data.seq_len, num_layers=depth)
  tokens_per_step = data.batch_size * data.seq_len
  step_seconds = flops_per_token * tokens_per_step / (chips * peak * mfu)
  per_host = tokens_per_step / step_seconds / hosts
  stage = (f"stage {depths.index(depth) + 1} of {len(depths)}, depth {depth} of {max(depths)}" if len(depths) > 1
           else f"depth {depth}")
  return {"topology": topology, "chips": chips, "hosts": hosts, "peak_flops_per_chip": peak, "mfu": mfu,
          "depth": depth, "full_depth": max(depths), "stage": stage,
          "train_flops_per_token": flops_per_token, "tokens_per_step": tokens_per_step, "step_seconds": step_seconds,
          "tokens_per_second": per_host, "source": "computed",
          "arithmetic": (f"{stage}: {flops_per_token:.3e} FLOP/token x {tokens_per_step:,} tokens/step / ({chips} "
                         f"chips x {peak:.3e} FLOP/s x {mfu:g} MFU) = {step_seconds:.3f} s/step; {tokens_per_step:,} "
                         f"tokens / {step_seconds:.3f} s / {hosts} hosts = {per_host:,.0f} tokens/s per host")}


def write_synthetic_store(config: RunConfig, documents: int, folder: Optional[str], mean_length: float = 64.0) -> str:
  """A synthetic store of `documents` documents in the run's vocabulary, written in a child process
  (so that this process's peak memory is the reader's); reused if already there."""
  folder = folder or os.path.join(tempfile.gettempdir(), f"midas_synthetic_{documents}_{mean_length:g}")
  if not fs.exists(fs.join(folder, "manifest.json")):
    child = multiprocessing.get_context("spawn").Process(target=_write_synthetic,
                                                         args=(config.data, documents, folder, mean_length))
    child.start()
    child.join()
    if child.exitcode != 0:
      raise RuntimeError(f"writing the synthetic store in {folder} failed (exit {child.exitcode})")
  return folder


def _write_synthetic(data: DataConfig, documents: int, folder: str, mean_length: float) -> None:
  synthetic.write(folder, documents, make_vocabulary(data), mean_length=mean_length)


def run(config: RunConfig, seconds: float, training: Optional[Dict[str, object]],
        train_steps: int = 5, storage_latency_ms: float = 0.0) -> Dict[str, object]:
  """Ours on a prepared store, on one core, with the memory it took; storage_latency_ms: added to every
  request of a store on gs://."""
  store = fs.check(config.data.prepared_dir, "DataConfig.prepared_dir")
  if storage_latency_ms and not fs.is_remote(store):
    raise ConfigError("--storage_latency_ms", f"adds latency to requests of a store on gs://; {store!r} is local",
                      "put the store on a bucket (or a GCS emulator), or leave --storage_latency_ms 0")
  if training is None:
    training = measure_training(build_stage(config), steps=train_steps)  # before the pin: all cores
  vocab = make_vocabulary(config.data)
  before = rss_bytes()
  with storage_latency.added(storage_latency_ms / 1e3) as requests:
    pipeline = PreparedPipeline(config.data, vocab)
    hosts = training.get("hosts", 1)  # as one host of the slice does: its own rows
    start, reads, steps = dataclasses.replace(requests), _reads(pipeline), pipeline.steps_read
    with one_core() as cpu:
      ours = measure_ours(pipeline, seconds, min(1.0, max(0.1, seconds / 4)), hosts)
    pipeline.close(wait=True)  # the reads started ahead end here, each counted on both sides
    spent = storage_latency.Requests(requests.count - start.count, requests.seconds - start.seconds)
  peak = peak_rss_bytes()
  counts = pipeline.counts
  train = pipeline.layouts["train"]
  rows_per_host = config.data.batch_size // hosts
  storage = {"remote": fs.is_remote(store), "added_latency_ms": storage_latency_ms, "steps": ours["batches"],
             "steps_read": pipeline.steps_read - steps, "ranged_reads": _reads(pipeline) - reads,
             "http_requests": spent.count,
             "mean_request_ms": 1e3 * spent.seconds / spent.count if spent.count else None}
  storage["http_requests_per_step"] = spent.count / max(1, storage["steps_read"])
  return {
      "cpu": cpu, "store": pipeline.store, "seq_len": config.data.seq_len, "batch_size": config.data.batch_size,
      "rows_per_host": rows_per_host,
      "num_documents": train.documents, "num_tokens": train.tokens, "rows_per_epoch": train.rows,
      "window_tokens": train.window.tolist(),
      "mixture": [dict(e.denoiser.to_json(), probability=e.probability) for e in pipeline.entries],
      "ours_mixture": ours, "storage": storage,
      "demoted_token_fraction": counts["demoted_tokens"] / max(1, counts["tokens"]),
      "rss_before_store_bytes": before, "peak_rss_bytes": peak, "rss_growth_bytes": peak - before,
      "training": training,
      "ratios": {"ours_vs_training": ours["tokens_per_second"] / training["tokens_per_second"],
                 # The same per CPU-second of this process: steadier when others share the pinned core.
                 "ours_vs_training_per_cpu_second": (ours["real_tokens_per_cpu_second"] /
                                                     training["tokens_per_second"])},
      "targets": {"ours_vs_training": TARGET_VS_HOST_CONSUMPTION if training["source"] == "computed"
                  else TARGET_VS_TRAINING},
  }


def _reads(pipeline: PreparedPipeline) -> int:
  return sum(r.requests for r in pipeline.readers.values())


def format_report(r: Dict[str, object]) -> str:
  ours, train = r["ours_mixture"], r["training"]
  mib = lambda b: f"{b / 2 ** 20:,.0f} MiB"
  value, target = r["ratios"]["ours_vs_training"], r["targets"]["ours_vs_training"]
  lines = [
      f"store           {r['store']}: {r['num_documents']:,} train documents, {r['num_tokens']:,} tokens, "
      f"{r['rows_per_epoch']:,} rows per epoch (windows {r['window_tokens']} tokens)",
      f"batch           {r['batch_size']} x {r['seq_len']}, of which one host builds {r['rows_per_host']} rows, "
      f"on one core: CPU {r['cpu']}",
      f"ours, mixture   {ours['tokens_per_second']:,.0f} slots/s, {ours['real_tokens_per_second']:,.0f} real "
      f"tokens/s, packing {ours['packing_efficiency']:.1%}, {r['demoted_token_fraction']:.2%} of tokens made "
      f"causal for room, {ours['cores_used']:.2f} cores busy ({ours['real_tokens_per_cpu_second']:,.0f} real "
      "tokens per CPU-second)",
      f"memory          peak RSS {mib(r['peak_rss_bytes'])}; {mib(r['rss_before_store_bytes'])} before the store "
      f"was opened, so the reader added {mib(r['rss_growth_bytes'])}",
  ]
  st = r["storage"]
  if st["remote"]:
    latency = f"{st['added_latency_ms']:g} ms added to every request" if st["added_latency_ms"] else "no latency added"
    mean = f", {st['mean_request_ms']:.1f} ms each" if st["mean_request_ms"] is not None else ""
    lines.append(f"storage         {latency}: {st['http_requests']:,} HTTP requests for the {st['steps_read']} steps "
                 f"read ({st['http_requests_per_step']:.1f} per step of {r['rows_per_host']} rows{mean})")
  if train["source"] == "computed":
    lines.append(f"consumption     one host of {train['topology']} at {train['arithmetic']}")
  else:
    lines.append(f"training        {train['tokens_per_second']:,.0f} tokens/s consumed ({train['source']})")
  lines.append(f"ours / training {value:.1f}x (target >= {target:g}x: {'met' if value >= target else 'NOT met'}); "
               f"{r['ratios']['ours_vs_training_per_cpu_second']:.1f}x per CPU-second")
  return "\n".join(lines)
