"""`midas data ...`: prepare a token store, sample what the model trains on, write the corpus, train a
SentencePiece model.

  midas data prepare --gin_file=F [--gin.KEY=VALUE ...] [--out=PATH] [--runner=DirectRunner]
                     [--num_workers=N] [--num_shards=N] [-- BEAM_PIPELINE_OPTIONS ...]
  midas data sample --gin_file=F --steps=N --out=FILE.jsonl
  midas data write-corpus --out=DIR
  midas data train-spm --files=GLOB [--files=GLOB ...] --vocab_size=N --out=PREFIX
"""

from __future__ import annotations

import argparse
import json
from typing import List

import jax

from midas_jax import distributed, fs
from midas_jax.commands.common import CommandGroup, add_gin_flags, load_run_config
from midas_jax.data.factory import load_data
from midas_jax.data.samples import sample_records
from midas_jax.data.sources import corpus
from midas_jax.data.store import prepare
from midas_jax.data.vocab import vocabulary
from midas_jax.errors import ConfigError
from midas_jax.stacking.checks import schedule_for


def add_commands(root: CommandGroup) -> None:
  data = root.group("data", help="data utilities: prepare a token store, sample, corpus, SentencePiece")
  p = data.command("prepare", _prepare, help="tokenize the run's source into a sharded token store (Apache Beam)",
                   epilog="Flags after `--` go to Beam, e.g. -- --project=P --region=R --temp_location=gs://B/tmp "
                          "for Dataflow.")
  add_gin_flags(p)
  p.add_argument("--out", default=None, help="the store's folder, local or gs:// (default DataConfig.prepared_dir)")
  p.add_argument("--runner", default="DirectRunner",
                 help="Beam runner: DirectRunner (local), DataflowRunner, FlinkRunner, SparkRunner, ...")
  p.add_argument("--num_workers", type=int, default=1,
                 help="DirectRunner: worker processes; other runners: Beam's --num_workers")
  p.add_argument("--num_shards", type=int, default=0,
                 help="parts per split for TFDS and seqio sources (0: the source's own files)")
  p.add_argument("pipeline_options", nargs=argparse.REMAINDER, help="Beam pipeline options, after `--`")

  p = data.command("sample", _sample, help="write the decoded examples of the first N steps as JSONL")
  add_gin_flags(p)
  p.add_argument("--steps", type=int, default=1)
  p.add_argument("--split", default="train", choices=("train", "validation"))
  p.add_argument("--out", required=True, help="output .jsonl file (with several processes: one per process)")
  distributed.add_flags(p)

  p = data.command("write-corpus", _write_corpus, help="write the built-in corpus as text files")
  p.add_argument("--out", required=True)
  p.add_argument("--seed", type=int, default=0)

  p = data.command("train-spm", _train_spm, help="train a SentencePiece model on local text files")
  p.add_argument("--files", action="append", required=True, help="glob; repeatable")
  p.add_argument("--vocab_size", type=int, default=8000)
  p.add_argument("--out", required=True, help="model prefix: writes PREFIX.model")


def _prepare(args, bindings: List[str]) -> int:
  data = load_run_config(args.gin_file, bindings)[0].data
  if data.source == "mixture":
    raise ConfigError("DataConfig.source", "a mixture is prepared source by source",
                      "run `midas data prepare` once per prepared source, with that source's settings and --out")
  out = args.out or data.prepared_dir
  if not out:
    raise ConfigError("--out", "no output folder given", "pass --out=PATH or set DataConfig.prepared_dir")
  extra = [a for a in args.pipeline_options if a != "--"]
  summary = prepare.prepare(data, fs.check(out, "--out"), runner=args.runner, num_workers=args.num_workers,
                            num_shards=args.num_shards, extra=extra)
  print(json.dumps(summary))
  return 0


def _sample(args, bindings: List[str]) -> int:
  distributed.initialize(args)
  config = load_run_config(args.gin_file, bindings)[0]
  starts = schedule_for(config).starts if config.stacking.stage_mixtures is not None else None
  vocabulary, pipeline = load_data(config, stage_starts=starts)  # each record names a mixture's source
  index, count = jax.process_index(), jax.process_count()
  out = args.out
  if count > 1:  # each process writes the rows it builds
    stem, dot, ext = out.rpartition(".")
    out = f"{stem}.process-{index}-of-{count}.{ext}" if dot else f"{out}.process-{index}-of-{count}"
  records = sample_records(pipeline, vocabulary, args.steps, args.split, index, count)
  lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
  fs.write_text(fs.check(out, "--out"), "".join(lines))
  print(f"wrote {len(lines)} examples from {args.steps} steps to {out}")
  return 0


def _write_corpus(args, bindings: List[str]) -> int:
  del bindings
  for split, path in corpus.write_text_files(args.out, seed=args.seed).items():
    print(f"{split}: {path}")
  return 0


def _train_spm(args, bindings: List[str]) -> int:
  del bindings
  files = sorted({f for pattern in args.files for f in fs.glob(fs.check(pattern, "--files"))})
  if not files:
    raise ConfigError("--files", f"no file matches {args.files}", "pass a glob that matches text files")
  print(vocabulary.train_sentencepiece(files, args.out, vocab_size=args.vocab_size))
  return 0
