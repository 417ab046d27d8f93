"""`midas bench store`: the read requests a slice sends its store's bucket each second, before and after the
reader coalesces the ranges of a batch (data/store/reader.py), for the paper configs on their slices.

A bucket takes only so many requests a second before it scales up: GCS's "Request rate and access distribution
guidelines" (https://cloud.google.com/storage/docs/request-rate) give a bucket an initial capacity of about
5,000 object reads a second, raised over minutes as the load grows, with 429s and 503s meanwhile. Every host of
a slice reads its own rows of every step from the same bucket, so the bucket sees

  requests per step per host x hosts / seconds per step,

fastest at the shallowest stage of a stacked run (store_bench.host_consumption: the step time at that depth
from the config's FLOPs, the slice's chips and an MFU). The requests per step are the reader's own counts,
measured on a synthetic store of the config's batch shapes, one host's rows (batch / hosts of them) of
consecutive steps, every shard's coarse index read before counting (a long run holds them after its first
steps): measured at small scale and multiplied out. Two
stores, as coalescing depends on how close a host's rows lie: one shard (a small corpus: the rows of a step
share its files) and many small shards (as C4's 1,024: the rows of a step lie in different files).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from midas_jax import fs, results
from midas_jax.bench.store_bench import host_consumption
from midas_jax.configs import RunConfig
from midas_jax.data.store import synthetic
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import require

GCS_INITIAL_READS_PER_S = 5000  # per bucket, before it scales (the request-rate guidelines above)
PAPER_SLICES = ("paper_1b_midas_prop1@v5p-128", "paper_2b_midas_prop1@v5p-128", "paper_8b_midas_prop1@v4-64",
                "paper_8b_midas_prop1@v5p-128")
STORES = (("one shard", 1 << 20), ("shards of 100 documents", 100))  # (name, documents per shard)


def parse_target(target: str) -> Tuple[str, str]:
  """"paper_1b_midas_prop1@v5p-128" (or a .gin path before the @) -> (gin file, slice); the command loads
  the file (with DataConfig.vocab='byte': the counts do not depend on the vocabulary)."""
  name, at, topology = target.partition("@")
  require(bool(at and name and topology), "--targets", f"{target!r} is not CONFIG@SLICE",
          "e.g. paper_1b_midas_prop1@v5p-128 (a gin/experiments name or a .gin path)")
  path = name if name.endswith(".gin") else os.path.join("gin", "experiments", name + ".gin")
  return path, topology


def write_store(folder: str, documents: int, mean_length: float, per_shard: int, vocab) -> str:
  """A synthetic store (reused if its manifest is there), written in this process: nothing here is timed."""
  if not fs.exists(fs.join(folder, "manifest.json")):
    synthetic.write(folder, documents, vocab, mean_length=mean_length, documents_per_shard=per_shard)
  return folder


def requests_per_step(config: RunConfig, store: str, hosts: int, steps: int, merge_gap: Optional[int]
                      ) -> Dict[str, float]:
  """One host's requests per step reading `config`'s rows from `store` (merge_gap None: no coalescing)."""
  data = dataclasses.replace(config.data, source="prepared", prepared_dir=store, prepared_from="", mixture=())
  pipeline = PreparedPipeline(data, make_vocabulary(data))
  reader = pipeline.readers["train"]
  reader.merge_gap = merge_gap
  reader.load_every_index()  # once a run, in its first steps: not what a step costs
  ranges, requests = reader.ranges, reader.requests
  for step in range(steps):
    pipeline.batch(step, "train", 0, hosts)
  pipeline.close()
  return {"ranges": (reader.ranges - ranges) / steps, "requests": (reader.requests - requests) / steps}


def run(targets: Sequence[Tuple[str, RunConfig, str]], documents: int = 100_000, mean_length: float = 430.0,
        steps: int = 16, mfu: float = 0.4, merge_gap: int = 256 * 1024, folder: Optional[str] = None
        ) -> Dict[str, object]:
  """Per target (name, config, slice) and store: one host's requests per step before and after coalescing,
  and the bucket's requests per second at the slice's host count."""
  require(steps >= 1, "--steps", "must be >= 1", "e.g. 16")
  folder = folder or os.path.join(tempfile.gettempdir(), f"midas_store_requests_{documents}_{mean_length:g}")
  rows: List[Dict[str, object]] = []
  for config_name, config, topology in targets:
    host = host_consumption(config, topology, mfu)
    hosts, seconds = host["hosts"], host["step_seconds"]
    for name, per_shard in STORES:
      store = write_store(fs.join(folder, f"per_shard_{per_shard}"), documents, mean_length, per_shard,
                          make_vocabulary(config.data))
      before = requests_per_step(config, store, hosts, steps, None)
      after = requests_per_step(config, store, hosts, steps, merge_gap)
      require(before["requests"] == before["ranges"] == after["ranges"], "--targets",
              "coalescing changed the ranges read", "report this: the reader's plan is wrong")
      rows.append({"config": config_name, "slice": topology, "hosts": hosts,
                   "stage": host["stage"], "step_seconds": seconds, "rows_per_host": config.data.batch_size // hosts,
                   "store": name, "documents_per_shard": min(per_shard, documents),
                   "requests_per_step_before": before["requests"], "requests_per_step_after": after["requests"],
                   "bucket_reads_per_s_before": before["requests"] * hosts / seconds,
                   "bucket_reads_per_s_after": after["requests"] * hosts / seconds})
  return {"documents": documents, "mean_length": mean_length, "steps": steps, "mfu": mfu, "merge_gap": merge_gap,
          "gcs_initial_reads_per_s": GCS_INITIAL_READS_PER_S, "rows": rows}


def results_table(report: Dict[str, object]) -> Dict[str, object]:
  """The docs table (docs/results/store_requests.json): one row per target and store."""
  limit = report["gcs_initial_reads_per_s"]
  rows = [[f"`{r['config']}`", f"`{r['slice']}`", r["hosts"], r["stage"].split(",")[0], round(r["step_seconds"], 4),
           r["rows_per_host"], r["store"], round(r["requests_per_step_before"], 2),
           round(r["requests_per_step_after"], 2), round(r["bucket_reads_per_s_before"]),
           round(r["bucket_reads_per_s_after"]),
           f"{r['bucket_reads_per_s_before'] / limit:.2f}x / {r['bucket_reads_per_s_after'] / limit:.2f}x"]
          for r in report["rows"]]
  return results.table(
      ["config", "slice", "hosts", "stage", "s/step", "rows/host", "store", "requests/step/host before",
       "after", "reads/s per bucket before", "after", f"vs ~{limit:,}/s before / after"],
      rows, [None, None, "d", None, ".3f", "d", None, ".1f", ".1f", ",.0f", ",.0f", None])


def format_report(report: Dict[str, object]) -> str:
  limit = report["gcs_initial_reads_per_s"]
  lines = [f"one host's rows of {report['steps']} steps from a synthetic store of {report['documents']:,} documents "
           f"(mean {report['mean_length']:g} tokens), ranges less than {report['merge_gap']:,} bytes apart merged; "
           f"steps at {report['mfu']:g} MFU; GCS takes about {limit:,} reads/s per bucket before it scales"]
  for r in report["rows"]:
    lines.append(f"{r['config']} on {r['slice']} ({r['hosts']} hosts, {r['stage']}, {r['step_seconds']:.3f} s/step, "
                 f"{r['rows_per_host']} rows a host), {r['store']}: {r['requests_per_step_before']:.1f} -> "
                 f"{r['requests_per_step_after']:.1f} requests/step/host, {r['bucket_reads_per_s_before']:,.0f} -> "
                 f"{r['bucket_reads_per_s_after']:,.0f} reads/s per bucket")
  return "\n".join(lines)
