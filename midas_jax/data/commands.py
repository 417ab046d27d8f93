"""`midas data ...` and `midas bench data`, registered through cli.COMMAND_MODULES (nothing heavy
imported here).

  midas data prepare --gin_file=F [--gin.KEY=VALUE ...] [--out=PATH] [--runner=DirectRunner]
                     [--num_workers=N] [--num_shards=N] [-- BEAM_PIPELINE_OPTIONS ...]
  midas data sample --gin_file=F --steps=N --out=FILE.jsonl
  midas data write-corpus --out=DIR
  midas data train-spm --files=GLOB [--files=GLOB ...] --vocab_size=N --out=PREFIX
  midas bench data --gin_file=F [--seconds=S] [--train_tokens_per_second=X] [--consumption=v5p-128]
                   [--synthetic_documents=N] [--json=OUT]
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List


def _gin_flags(parser) -> None:
  parser.add_argument("--gin_file", action="append", default=[],
                      help="gin config file; repeatable, later files override earlier ones")


def _config(args, bindings):
  from midas_jax import cli  # pylint: disable=import-outside-toplevel
  return cli._load_run_config(args.gin_file, bindings)[0]  # pylint: disable=protected-access


def _prepare(args, bindings: List[str]) -> int:
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  from midas_jax.data.store import prepare  # pylint: disable=import-outside-toplevel
  from midas_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  data = _config(args, bindings).data
  out = args.out or data.prepared_dir
  if not out:
    raise ConfigError("--out", "no output folder given", "pass --out=PATH or set DataConfig.prepared_dir")
  extra = [a for a in args.pipeline_options if a != "--"]
  summary = prepare.prepare(data, fs.check(out, "--out"), runner=args.runner, num_workers=args.num_workers,
                            num_shards=args.num_shards, extra=extra)
  print(json.dumps(summary))
  return 0


def _sample(args, bindings: List[str]) -> int:
  from midas_jax import distributed, fs  # pylint: disable=import-outside-toplevel
  distributed.initialize(args)
  import jax  # pylint: disable=import-outside-toplevel
  from midas_jax.data.samples import sample_records  # pylint: disable=import-outside-toplevel
  from midas_jax.train.experiment import load_data  # pylint: disable=import-outside-toplevel
  vocab, pipeline = load_data(_config(args, bindings))
  index, count = jax.process_index(), jax.process_count()
  out = args.out
  if count > 1:  # each process writes the rows it builds
    stem, dot, ext = out.rpartition(".")
    out = f"{stem}.process-{index}-of-{count}.{ext}" if dot else f"{out}.process-{index}-of-{count}"
  records = sample_records(pipeline, vocab, args.steps, args.split, index, count)
  lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
  fs.write_text(fs.check(out, "--out"), "".join(lines))
  print(f"wrote {len(lines)} examples from {args.steps} steps to {out}")
  return 0


def _write_corpus(args, bindings: List[str]) -> int:
  del bindings
  from midas_jax.data import corpus  # pylint: disable=import-outside-toplevel
  for split, path in corpus.write_text_files(args.out, seed=args.seed).items():
    print(f"{split}: {path}")
  return 0


def _train_spm(args, bindings: List[str]) -> int:
  del bindings
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  from midas_jax.data import vocab  # pylint: disable=import-outside-toplevel
  from midas_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  files = sorted({f for pattern in args.files for f in fs.glob(fs.check(pattern, "--files"))})
  if not files:
    raise ConfigError("--files", f"no file matches {args.files}", "pass a glob that matches text files")
  print(vocab.train_sentencepiece(files, args.out, vocab_size=args.vocab_size))
  return 0


def _bench_data(args, bindings: List[str]) -> int:
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  from midas_jax.bench import data_bench  # pylint: disable=import-outside-toplevel
  report = data_bench.run(_config(args, bindings), seconds=args.seconds,
                          train_tokens_per_second=args.train_tokens_per_second, train_steps=args.train_steps,
                          consumption=args.consumption, mfu=args.mfu,
                          synthetic_documents=args.synthetic_documents, synthetic_dir=args.synthetic_dir,
                          synthetic_mean_length=args.synthetic_mean_length)
  print(data_bench.format_report(report))
  if args.json:
    fs.write_json(fs.check(args.json, "--json"), report)
  return 0


def register(sub, bench_sub) -> Dict[str, object]:
  from midas_jax import distributed  # pylint: disable=import-outside-toplevel
  data = sub.add_parser("data", help="data utilities: prepare a token store, sample, corpus, SentencePiece")
  data_sub = data.add_subparsers(dest="data", required=True)

  prep = data_sub.add_parser("prepare", help="tokenize the run's source into a sharded token store (Apache Beam)",
                             epilog="Flags after `--` go to Beam, e.g. -- --project=P --region=R "
                                    "--temp_location=gs://B/tmp for Dataflow.")
  _gin_flags(prep)
  prep.add_argument("--out", default=None, help="the store's folder, local or gs:// (default DataConfig.prepared_dir)")
  prep.add_argument("--runner", default="DirectRunner",
                    help="Beam runner: DirectRunner (local), DataflowRunner, FlinkRunner, SparkRunner, ...")
  prep.add_argument("--num_workers", type=int, default=1,
                    help="DirectRunner: worker processes; other runners: Beam's --num_workers")
  prep.add_argument("--num_shards", type=int, default=0,
                    help="parts per split for TFDS and seqio sources (0: the source's own files)")
  prep.add_argument("pipeline_options", nargs=argparse.REMAINDER, help="Beam pipeline options, after `--`")

  sample = data_sub.add_parser("sample", help="write the decoded examples of the first N steps as JSONL")
  _gin_flags(sample)
  sample.add_argument("--steps", type=int, default=1)
  sample.add_argument("--split", default="train", choices=("train", "validation"))
  sample.add_argument("--out", required=True, help="output .jsonl file (with several processes: one per process)")
  distributed.add_flags(sample)

  corpus = data_sub.add_parser("write-corpus", help="write the built-in corpus as text files")
  corpus.add_argument("--out", required=True)
  corpus.add_argument("--seed", type=int, default=0)

  spm = data_sub.add_parser("train-spm", help="train a SentencePiece model on local text files")
  spm.add_argument("--files", action="append", required=True, help="glob; repeatable")
  spm.add_argument("--vocab_size", type=int, default=8000)
  spm.add_argument("--out", required=True, help="model prefix: writes PREFIX.model")

  bench = bench_sub.add_parser("data", help="input pipeline tokens/s on one core vs t5/TF and training; "
                                            "peak memory on a prepared store")
  _gin_flags(bench)
  bench.add_argument("--seconds", type=float, default=5.0, help="timed seconds per measurement")
  bench.add_argument("--train_tokens_per_second", type=float, default=None,
                     help="training consumption to compare with, instead of timing train steps")
  bench.add_argument("--consumption", default=None,
                     help="compare with one host's consumption on a TPU slice (e.g. v5p-128) at --mfu, computed "
                          "from the config, instead of timing train steps")
  bench.add_argument("--mfu", type=float, default=0.4, help="the MFU --consumption assumes")
  bench.add_argument("--train_steps", type=int, default=5, help="timed train steps (after 2 warmup)")
  bench.add_argument("--synthetic_documents", type=int, default=None,
                     help="bench a synthetic prepared store of this many documents (written first, in a child "
                          "process, so the peak memory is the reader's)")
  bench.add_argument("--synthetic_dir", default=None, help="where the synthetic store goes (default: a temp folder)")
  bench.add_argument("--synthetic_mean_length", type=float, default=64.0,
                     help="mean document length of the synthetic store, in tokens (C4 with T5's model: about 430)")
  bench.add_argument("--json", default=None, help="also write the results to this JSON file")

  data_commands = {"prepare": _prepare, "sample": _sample, "write-corpus": _write_corpus, "train-spm": _train_spm}
  return {"data": lambda args, bindings: data_commands[args.data](args, bindings), "bench data": _bench_data}
