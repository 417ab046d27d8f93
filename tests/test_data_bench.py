"""`midas bench data`: a short run reports every figure, and the CLI prints the report."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from conftest import tiny_run
from midas_jax import cli
from midas_jax.bench import data_bench
from midas_jax.data.pipeline import Pipeline
from midas_jax.data.store.pipeline import PreparedPipeline
from test_cli import DEMO, TINY_BINDINGS

T5_INSTALLED = all(importlib.util.find_spec(p) is not None for p in ("tensorflow", "seqio", "t5"))


def _positive(d, keys):
  for k in keys:
    assert d[k] > 0, (k, d[k])


def spy_batches(monkeypatch, cls):
  """Every batch cls.batch builds, in order: (pipeline, step, segment_ids' shape, its non-padding tokens)."""
  built, original = [], cls.batch

  def batch(self, step, *args, **kwargs):
    out = original(self, step, *args, **kwargs)
    built.append((self, step, out["segment_ids"].shape, int(np.count_nonzero(out["segment_ids"]))))
    return out

  monkeypatch.setattr(cls, "batch", batch)
  return built


def assert_counts_are_the_batches_built(figures, built, pipeline, rows, seq_len):
  """A measurement's rates times its seconds against the batches it built: its run of steps 0, 1, ... on
  `pipeline` (the last one), of which the last n were counted (n batches of `rows` rows), after an untimed one."""
  calls = [c for c in built if c[0] is pipeline]
  run = calls[max(i for i, c in enumerate(calls) if c[1] == 0):]
  assert [c[1] for c in run] == list(range(len(run)))
  counted_rows = figures["rows_per_second"] * figures["seconds"]
  n = round(counted_rows / rows)
  assert 0 < n < len(run) and counted_rows == pytest.approx(n * rows, rel=1e-9), (counted_rows, rows, len(run))
  timed = run[-n:]
  assert {c[2] for c in timed} == {(rows, seq_len)}
  slots, real = n * rows * seq_len, sum(c[3] for c in timed)
  assert figures["tokens_per_second"] * figures["seconds"] == pytest.approx(slots, rel=1e-9)
  assert figures["real_tokens_per_second"] * figures["seconds"] == pytest.approx(real, rel=1e-9)
  assert figures["packing_efficiency"] == pytest.approx(real / slots, rel=1e-9)


def test_short_run_reports_all_fields(no_compile_cache, monkeypatch):
  affinity_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
  built = spy_batches(monkeypatch, Pipeline)
  r = data_bench.run(tiny_run(), seconds=0.5, train_steps=2)
  if affinity_before is not None:
    assert os.sched_getaffinity(0) == affinity_before  # the one-core pin is undone
    assert r["cpu"] in affinity_before
  for name in ("ours_mixture", "ours_span"):
    _positive(r[name], ("tokens_per_second", "real_tokens_per_second", "rows_per_second",
                        "packing_efficiency", "real_tokens_per_cpu_second"))
    assert r[name]["packing_efficiency"] <= 1.0
    assert r[name]["cores_used"] < 1.5  # pinned: one core, allowing for timer granularity
  # The config's pipeline (first used by the train steps), then the span-only one made for the bench;
  # tiny_run's batch is 8 x 32.
  pipelines = list({id(c[0]): c[0] for c in built}.values())
  assert len(pipelines) == 2 and (r["batch_size"], r["seq_len"]) == (8, 32)
  for name, pipeline in zip(("ours_mixture", "ours_span"), pipelines):
    assert_counts_are_the_batches_built(r[name], built, pipeline, 8, 32)
  assert r["training"]["source"] == "measured" and r["training"]["steps"] == 2
  _positive(r["training"], ("tokens_per_second", "step_seconds"))
  train = r["training"]
  assert train["tokens_per_second"] * train["step_seconds"] == pytest.approx(8 * 32, rel=1e-9)
  assert r["ratios"]["ours_vs_training"] > 0
  t5 = r["t5"]
  # Installed (the README's test command installs it), the reference must run: a broken install
  # raises (test below) rather than reporting "unavailable".
  assert t5["available"] == T5_INSTALLED, t5.get("reason")
  if t5["available"]:
    _positive(t5, ("tokens_per_second", "examples_per_second", "tokens_per_cpu_second"))
    assert t5["inputs_length"] + t5["targets_length"] <= r["seq_len"]
    _positive(t5["packed"], ("real_tokens_per_second", "packing_efficiency"))
    assert t5["cores_used"] < 1.5
    _positive(r["ratios"], ("ours_vs_tf", "ours_vs_tf_packed", "ours_vs_tf_per_cpu_second"))
  else:
    assert "ours_vs_tf" not in r["ratios"] and "not installed" in t5["reason"]
  text = data_bench.format_report(r)
  assert "ours, mixture" in text and "ours / training" in text and "ours / TF" in text


def test_cli_prints_the_report(capsys, tmp_path):
  out = tmp_path / "data.json"
  # A given training rate skips the train steps: this test is about the CLI, not the model.
  rc = cli.main(["bench", "data", f"--gin_file={DEMO}", "--seconds=0.3", "--train_tokens_per_second=1000",
                 f"--json={out}", *TINY_BINDINGS])
  assert rc == 0
  text = capsys.readouterr().out
  assert "slots/s" in text and "packing" in text and "(given)" in text and "ours / training" in text
  report = json.loads(out.read_text())
  assert report["training"]["tokens_per_second"] == 1000.0
  assert report["ratios"]["ours_vs_training"] == report["ours_mixture"]["tokens_per_second"] / 1000.0


@pytest.mark.skipif(not T5_INSTALLED, reason="needs an environment that installed the t5 reference")
def test_a_broken_t5_install_fails_naming_the_package(capsys, monkeypatch):
  # t5 stays installed, but its preprocessors cannot be imported (None in sys.modules stops an import).
  monkeypatch.setitem(sys.modules, "t5.data.preprocessors", None)
  rc = cli.main(["bench", "data", f"--gin_file={DEMO}", "--seconds=0.1", "--train_tokens_per_second=1000",
                 *TINY_BINDINGS])
  err = capsys.readouterr().err
  assert rc == 2, err
  assert "midas: error: t5: is installed, but `import t5.data.preprocessors` fails" in err
  assert "pip install --no-deps t5==0.9.4" in err and "Traceback" not in err


def test_a_synthetic_store_reports_its_memory_and_one_pod_hosts_consumption(capsys, tmp_path, monkeypatch):
  out = tmp_path / "store.json"
  built = spy_batches(monkeypatch, PreparedPipeline)
  rc = cli.main(["bench", "data", "--gin_file=gin/experiments/paper_1b_baseline.gin", "--gin.DataConfig.vocab='byte'",
                 "--synthetic_documents=3000", f"--synthetic_dir={tmp_path / 'store'}", "--consumption=v5p-128",
                 "--seconds=0.3", f"--json={out}"])
  assert rc == 0
  text = capsys.readouterr().out
  assert "peak RSS" in text and "one host of v5p-128" in text and "ours / training" in text
  r = json.loads(out.read_text())
  assert r["num_documents"] == 3000 and r["rows_per_host"] == 256 // 16
  assert 0 < r["rss_growth_bytes"] < r["peak_rss_bytes"] and r["ours_mixture"]["packing_efficiency"] > 0.95
  assert len({id(c[0]) for c in built}) == 1  # one host's rows: 16 of 256, of 2048 tokens
  assert_counts_are_the_batches_built(r["ours_mixture"], built, built[0][0], 16, 2048)
  c = r["training"]
  assert (c["chips"], c["hosts"], c["peak_flops_per_chip"]) == (64, 16, 459e12)
  # paper_1b: 256 x 2048 tokens per step at 40% of 64 chips' peak, shared by 16 hosts.
  step = c["train_flops_per_token"] * 256 * 2048 / (64 * 459e12 * 0.4)
  assert c["tokens_per_second"] == 256 * 2048 / step / 16 and 80_000 < c["tokens_per_second"] < 120_000


def test_the_span_only_pipeline_is_the_runs_own_with_its_vocabulary(tmp_path):
  """With a SentencePiece model in Llama's layout the vocabulary's special ids are not the byte layout's: the
  span-only pipeline ours-vs-t5 times must carry the run's sentinels, mode ids and start token."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  from midas_jax import configs  # pylint: disable=import-outside-toplevel
  from midas_jax.data.factory import load_data  # pylint: disable=import-outside-toplevel
  from midas_jax.data.sources import corpus  # pylint: disable=import-outside-toplevel
  text = tmp_path / "t.txt"
  text.write_text("\n".join(d.text for d in corpus.documents("validation")[:200]), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.Train(input=str(text), model_prefix=str(tmp_path / "m"), vocab_size=400,
                                          model_type="bpe", byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
  run = tiny_run(data=configs.DataConfig(vocab="sentencepiece", spm_model=str(tmp_path / "m.model"), extra_ids=104,
                                         seq_len=64, batch_size=4))
  vocab, pipeline = load_data(run)
  span = data_bench.span_pipeline(run, pipeline, vocab)
  ours, theirs = pipeline.describe(), span.describe()
  assert theirs["special_tokens"] == ours["special_tokens"] and theirs["vocabulary"] == ours["vocabulary"]
  assert [e.denoiser.kind for e in span.entries] == ["span"]  # span corruption alone, t5's denoiser
  rows = span.batch(0)
  starts = rows["inputs"][rows["segment_ids"] > 0][:1]
  assert starts.tolist() == [vocab.start_id]  # each example starts with the vocabulary's own start token
  # What the benchmark built before: the same documents without the vocabulary, which starts every example
  # with id 0 (the byte layout's pad), here the model's <unk>.
  assert vocab.start_id != 0
  unaware = Pipeline(run.data, pipeline.documents, vocab.vocab_size, mix=data_bench.span_only(run.objectives))
  assert unaware.batch(0)["inputs"][0, 0] == 0 and unaware.describe().get("vocabulary") is None
