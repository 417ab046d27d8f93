"""`midas data prepare`: the run's source, tokenized by its vocabulary, into a store, by Apache Beam.

The pipeline is embarrassingly parallel: the driver cuts the source into parts (origins.py), Beam
spreads them over its workers, and each worker reads its part, tokenizes it and writes its shards
and its part record (writer.py). When the pipeline has finished, the driver collects the part
records into the manifest, after checking that both splits have documents. Token data never goes
through Beam's shuffle, only part descriptions do, so the same pipeline runs on the DirectRunner
(`--num_workers` processes), Dataflow, Flink or Spark (`--runner` and the pipeline options after
`--`) without change. A bad input found by a worker (a line that is not JSON, say) fails the
pipeline; its ConfigError is raised again in the driver, without Beam's traceback.

Re-running the same command finishes a prepare that died part-way: a part whose record exists and
whose shards are intact is not read again. `prepare_in_process` runs the same steps without Beam
(tests, small sources).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from midas_jax import fs
from midas_jax.configs import DataConfig
from midas_jax.data.sources.splits import SPLITS
from midas_jax.data.store import format as store_format
from midas_jax.data.store import origins, writer
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError, require

DIRECT_RUNNERS = ("DirectRunner", "direct")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a worker needs: the run's data config, where the store goes, the parts, the header."""

  config: DataConfig
  store: str
  parts: List[origins.Part]
  header: Dict[str, object]

  @property
  def identity(self) -> Dict[str, str]:
    return writer.identity(self.header)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.header["dtype"])


def make_plan(config: DataConfig, out: str, num_shards: int = 0) -> Plan:
  store = fs.absolute(out, "--out")
  vocab = make_vocabulary(config)
  parts = origins.plan(config, num_shards)
  require(len(parts) > 0, "DataConfig.prepared_from", "the source has no parts to read", "check its settings")
  return Plan(config, store, parts, writer.store_header(vocab, store_format.source_description(config), len(parts)))


def existing_store(plan: Plan) -> Optional[Dict[str, object]]:
  """The manifest of a store this plan already wrote, None where there is none; another store there
  is a ConfigError (nothing is overwritten)."""
  if not fs.exists(fs.join(plan.store, store_format.MANIFEST)):
    return None
  manifest = store_format.read_manifest(plan.store, "--out")
  theirs = {"source_fingerprint": manifest["source_fingerprint"],
            "vocabulary_fingerprint": manifest["vocabulary"]["fingerprint"]}
  require(theirs == plan.identity, "--out",
          f"{plan.store!r} already holds a store of other settings or another vocabulary",
          "choose a new --out folder, or delete that one")
  return manifest


# ----------------------------------------------------------------------------- per part (on workers)

_VOCABULARIES: Dict[tuple, object] = {}  # per worker process: loaded once


def _vocabulary(config: DataConfig):
  key = (config.vocab, config.spm_model, config.extra_ids)
  if key not in _VOCABULARIES:
    _VOCABULARIES[key] = make_vocabulary(config)
  return _VOCABULARIES[key]


def count_part(part: origins.Part, plan: Plan) -> tuple:
  """(part index, its documents), for the holdout numbering; read from its record when finished."""
  record = writer.finished_part(plan.store, part.index, plan.identity, plan.dtype, part.describe())
  if record is not None:
    return part.index, sum(s["documents"] for s in record["shards"].values())
  return part.index, origins.count(part, plan.config)


def write_part(part: origins.Part, plan: Plan, counts: Dict[int, int]) -> int:
  """Reads, tokenizes and writes one part, unless a previous prepare finished it; returns the
  number of documents it wrote now."""
  if writer.finished_part(plan.store, part.index, plan.identity, plan.dtype, part.describe()) is not None:
    return 0
  first = sum(n for i, n in counts.items() if i < part.index)
  documents = origins.token_documents(part, plan.config, _vocabulary(plan.config), first)
  record = writer.write_part(plan.store, part.index, documents, plan.dtype, plan.identity, part.describe())
  return sum(s["documents"] for s in record["shards"].values())


def finish(plan: Plan) -> Dict[str, object]:
  """The manifest from the part records, once every part has one and both splits have documents."""
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    records = list(pool.map(lambda p: writer.finished_part(plan.store, p.index, plan.identity, plan.dtype,
                                                           p.describe()), plan.parts))
  missing = [p.index for p, r in zip(plan.parts, records) if r is None]
  require(not missing, "--out", f"parts {missing[:8]} of {len(plan.parts)} were not written",
          "run the same command again to finish the prepare")
  for split in SPLITS:
    documents = sum(r["shards"][split]["documents"] for r in records if split in r["shards"])
    held_out = plan.config.origin == "text" and not plan.config.eval_files
    require(documents > 0, "DataConfig.eval_files" if split == "validation" else "DataConfig.prepared_from",
            f"the source gave no {split} documents" +
            (f" (every {store_format.HOLDOUT_EVERY}th training document is held out: there are fewer)"
             if held_out and split == "validation" else ""),
            "set DataConfig.eval_files to validation files" if split == "validation" else "check the source")
  return writer.write_manifest(plan.store, records, plan.header)


# ----------------------------------------------------------------------------- runners

def pipeline_arguments(runner: str, num_workers: int, extra: Sequence[str]) -> List[str]:
  """Beam's flags: the DirectRunner gets num_workers processes; other runners get the flags as given."""
  args = [f"--runner={runner}"]
  if runner in DIRECT_RUNNERS:
    mode = "multi_processing" if num_workers > 1 else "in_memory"
    args += [f"--direct_num_workers={num_workers}", f"--direct_running_mode={mode}"]
  elif num_workers:
    args.append(f"--num_workers={num_workers}")
  return args + list(extra)


def run_beam(plan: Plan, runner: str = "DirectRunner", num_workers: int = 1, extra: Sequence[str] = ()) -> None:
  try:
    import apache_beam as beam  # pylint: disable=import-outside-toplevel
    from apache_beam.options.pipeline_options import (
      PipelineOptions)  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError("--runner", f"`midas data prepare` needs Apache Beam ({e})", "pip install 'midas_jax[data]'") from e
  try:
    options = PipelineOptions(pipeline_arguments(runner, num_workers, extra))
  except SystemExit as e:  # Beam's argparse rejected a flag
    raise ConfigError("pipeline options", f"Beam refused {list(extra)}", "check the flags after `--`") from e
  try:
    with beam.Pipeline(options=options) as p:
      _parts_pipeline(beam, p, plan)
  except Exception as e:  # pylint: disable=broad-except
    found = _worker_config_error(e)
    if found is None:
      raise
    raise found from None


def _parts_pipeline(beam, p, plan: Plan) -> None:
  parts = p | "Parts" >> beam.Create(plan.parts) | "Spread" >> beam.Reshuffle()
  counts = parts | "Holdout" >> beam.Filter(lambda part: part.holdout) | "Count" >> beam.Map(count_part, plan)
  _ = parts | "Write" >> beam.Map(write_part, plan, beam.pvalue.AsDict(counts))


def run_in_process(plan: Plan) -> None:
  counts = dict(count_part(p, plan) for p in plan.parts if p.holdout)
  for part in plan.parts:
    write_part(part, plan, counts)


_CONFIG_ERROR = re.compile(r"ConfigError: ([^\n]+?): ([^\n]+)\n\s+fix: ([^\n]+)")


def _worker_config_error(error: Exception) -> Optional[ConfigError]:
  """The ConfigError a worker raised, out of the error Beam raises in the driver for it."""
  found = _CONFIG_ERROR.search(str(error))
  return ConfigError(*found.groups()) if found else None


def prepare(config: DataConfig, out: str, runner: str = "DirectRunner", num_workers: int = 1, num_shards: int = 0,
            extra: Sequence[str] = (), in_process: bool = False) -> Dict[str, object]:
  """Prepares (or finishes preparing) the store at `out`; returns a summary with its throughput."""
  require(num_workers >= 1, "--num_workers", f"must be >= 1, got {num_workers}", "use 1 or more")
  start = time.time()
  plan = make_plan(config, out, num_shards)
  already = existing_store(plan) is not None
  if not already:
    fs.make_output_dir(plan.store, "--out")
    run_in_process(plan) if in_process else run_beam(plan, runner, num_workers, extra)
    finish(plan)
  manifest = store_format.read_manifest(plan.store, "--out")
  seconds = time.time() - start
  documents = sum(s["documents"] for s in manifest["splits"].values())
  return {"store": plan.store, "already_prepared": already, "runner": "in-process" if in_process else runner,
          "num_workers": num_workers, "parts": len(plan.parts), "documents": documents,
          "tokens": sum(s["tokens"] for s in manifest["splits"].values()),
          "splits": {k: {"documents": v["documents"], "tokens": v["tokens"], "shards": len(v["shards"])}
                     for k, v in manifest["splits"].items()},
          "seconds": round(seconds, 2), "documents_per_second": round(documents / max(seconds, 1e-9), 1)}
