"""`midas data prepare`: every source into a store (Beam's DirectRunner end to end, the in-process
twin for the rest), resuming a prepare that died, and training on a store: falling loss, 2
processes reading what 1 reads, a resume mid-epoch that continues bitwise."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import gin
import numpy as np
import pytest

from conftest import REPO_ROOT
from midas_jax import cli, gin_config
from midas_jax.checkpoint import available_steps, checkpoint_dir, load_model
from midas_jax.configs import DataConfig
from midas_jax.data.pipeline import tokenize_documents
from midas_jax.data.sources import corpus, text_files
from midas_jax.data.store import prepare
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError
from midas_jax.train.run import train
from midas_jax.train.metrics import read_metrics

VOCAB = ByteVocabulary(128)
SPLITS = ("train", "validation")


def store_documents(store, config=None):
  """Every document of both splits of a store, as token arrays."""
  pipeline = PreparedPipeline(config or DataConfig(source="prepared", prepared_dir=store), VOCAB, store)
  out = {}
  for split in SPLITS:
    reader = pipeline.readers[split]
    _, first, size = reader.pieces(0, reader.tokens)
    stream = reader.read_tokens(0, reader.tokens)
    starts = size.cumsum() - size
    assert np.all(first == 0)
    out[split] = [stream[a:a + n] for a, n in zip(starts, size)]
  return out


def assert_same_documents(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def text_corpus(folder, sizes=(40, 35, 30)):
  """Built-in documents spread over .txt, .txt.gz and .jsonl files (no eval files)."""
  docs = [d.text for d in corpus.documents("train")[:sum(sizes)]]
  os.makedirs(folder, exist_ok=True)
  cut = np.cumsum((0,) + tuple(sizes))
  (folder / "a.txt").write_text("\n\n".join(docs[cut[0]:cut[1]]), encoding="utf-8")
  with gzip.open(folder / "b.txt.gz", "wt", encoding="utf-8") as f:
    f.write("\n\n".join(docs[cut[1]:cut[2]]))
  (folder / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[cut[2]:cut[3]]),
                                  encoding="utf-8")
  return (str(folder / "*"),)


def text_config(files, store, **kw):
  return DataConfig(source="prepared", prepared_dir=store, prepared_from="text", train_files=files, **kw)


def in_memory(config):
  """What the in-memory text source reads from the same settings."""
  text = DataConfig(source="text", train_files=config.train_files, eval_files=config.eval_files,
                    jsonl_field=config.jsonl_field)
  return {s: tokenize_documents(text_files.load_documents(text, s), VOCAB) for s in SPLITS}


# --- Beam, end to end -----------------------------------------------------------------------------

GIN = """
DataConfig.source = 'prepared'
DataConfig.prepared_dir = '{store}'
DataConfig.prepared_from = 'text'
DataConfig.train_files = ['{files}']
DataConfig.eval_files = ['{eval_files}']
DataConfig.vocab = 'byte'
DataConfig.seq_len = 32
DataConfig.batch_size = 8
ModelConfig.family = 'llama'
ModelConfig.d_model = 32
ModelConfig.num_layers = 2
ModelConfig.num_heads = 4
ModelConfig.num_kv_heads = 2
ModelConfig.d_ff = 64
ModelConfig.max_seq_len = 64
ModelConfig.dtype = 'float32'
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 2
TrainerConfig.num_steps = 8
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 0
TrainerConfig.eval_batches = 1
TrainerConfig.progress_bar = False
TrainerConfig.peak_flops_per_device = 1e11
CheckpointConfig.every = 4
CheckpointConfig.keep = 10
"""


@pytest.fixture(scope="module")
def beam_store(tmp_path_factory):
  """A text corpus prepared by `midas data prepare` on Beam's DirectRunner with 2 workers."""
  root = tmp_path_factory.mktemp("beam")
  files = text_corpus(root / "text", sizes=(3, 2, 2))
  (root / "valid.txt").write_text("\n\n".join(d.text for d in corpus.documents("validation")[:3]), encoding="utf-8")
  store = str(root / "store")
  gin_file = root / "data.gin"
  gin_file.write_text(GIN.format(store=store, files=files[0], eval_files=root / "valid.txt"))
  args = ["data", "prepare", f"--gin_file={gin_file}", "--num_workers=2", f"--out={store}"]
  assert cli.main(args) == 0
  gin.clear_config()  # the fixture's parse is done; the tests parse their own
  return {"root": root, "files": files, "eval_files": (str(root / "valid.txt"),), "store": store,
          "gin": str(gin_file), "args": args}


def test_beam_prepares_what_the_in_process_writer_and_the_text_source_give(beam_store, capsys):
  config = text_config(beam_store["files"], beam_store["store"], eval_files=beam_store["eval_files"])
  same = str(beam_store["root"] / "in_process")
  prepare.prepare(config, same, in_process=True)
  manifests = [json.load(open(os.path.join(p, "manifest.json"))) for p in (beam_store["store"], same)]
  for split in SPLITS:
    assert manifests[0]["splits"][split] == manifests[1]["splits"][split]  # shard by shard, sha256 too
  docs, expected = store_documents(beam_store["store"]), in_memory(config)
  for split in SPLITS:
    assert_same_documents(docs[split], expected[split])
  assert cli.main(beam_store["args"]) == 0  # a finished store: reported, not redone
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["already_prepared"] is True


def test_too_few_documents_to_hold_out_and_worker_errors_are_config_errors(tmp_path):
  files = text_corpus(tmp_path / "text", sizes=(10, 5, 5))
  with pytest.raises(ConfigError, match="DataConfig.eval_files") as e:
    prepare.prepare(text_config(files, str(tmp_path / "store")), str(tmp_path / "store"), in_process=True)
  assert "every 50th" in e.value.problem
  # What Beam raises in the driver when a worker's part fails on bad input:
  beam_error = RuntimeError("Traceback (most recent call last):\n  File ...\nmidas_jax.errors.ConfigError: "
                            "DataConfig.train_files: 'x.jsonl' line 3 is not JSON (Expecting value)\n"
                            "  fix: fix or remove that line [while running 'Write']")
  found = prepare._worker_config_error(beam_error)  # pylint: disable=protected-access
  assert (found.setting, found.problem) == ("DataConfig.train_files", "'x.jsonl' line 3 is not JSON (Expecting value)")


def test_an_out_path_under_a_file_is_refused_naming_the_flag(tmp_path, capsys):
  (tmp_path / "afile").write_text("not a directory")
  args = ["data", "prepare", f"--gin_file={os.path.join(REPO_ROOT, 'gin', 'experiments', 'cpu_demo.gin')}",
          f"--out={tmp_path / 'afile' / 'store'}"]
  assert cli.main(args) == 2
  err = capsys.readouterr().err
  assert "--out: cannot make the directory" in err and "Not a directory" in err and "Traceback" not in err


# --- the in-process twin: sources and resuming ----------------------------------------------------

def test_a_prepare_that_died_is_finished_by_running_it_again(tmp_path):
  files = text_corpus(tmp_path / "text")
  config = text_config(files, str(tmp_path / "store"))
  store = config.prepared_dir
  prepare.prepare(config, store, in_process=True)
  before = json.load(open(os.path.join(store, "manifest.json")))
  kept = os.path.join(store, "train", "shard-00000.tokens")
  kept_time = os.stat(kept).st_mtime_ns
  # The run died while writing part 1: its record, its tokens and the manifest are gone, a
  # temporary file is left.
  os.remove(os.path.join(store, "manifest.json"))
  os.remove(os.path.join(store, "parts", "part-00001.json"))
  os.rename(os.path.join(store, "train", "shard-00001.tokens"), os.path.join(store, "train", "shard-00001.tokens.tmp-x"))
  with pytest.raises(ConfigError, match="did not finish"):
    PreparedPipeline(config, VOCAB)
  summary = prepare.prepare(config, store, in_process=True)
  assert summary["already_prepared"] is False
  after = json.load(open(os.path.join(store, "manifest.json")))
  assert after["splits"] == before["splits"]
  assert os.stat(kept).st_mtime_ns == kept_time  # finished parts are not redone
  assert not [f for f in os.listdir(os.path.join(store, "train")) if ".tmp-" in f]
  expected = in_memory(config)
  for split in SPLITS:  # the 50th, 100th, ... document across the files is held out, as in memory
    assert_same_documents(store_documents(store)[split], expected[split])
  os.remove(os.path.join(store, "manifest.json"))
  os.rename(os.path.join(store, "..", "text", "c.jsonl"), os.path.join(store, "..", "text", "b2.jsonl"))
  with pytest.raises(ConfigError, match="the files or --num_shards changed"):  # part 2 would read another file
    prepare.prepare(config, store, in_process=True)
  os.rename(os.path.join(store, "..", "text", "b2.jsonl"), os.path.join(store, "..", "text", "c.jsonl"))
  prepare.prepare(config, store, in_process=True)
  other = text_config(files, store, jsonl_field="body")
  with pytest.raises(ConfigError, match="--out"):
    prepare.prepare(other, store, in_process=True)
  os.remove(os.path.join(store, "manifest.json"))
  with pytest.raises(ConfigError, match="--out"):  # part records of another prepare
    prepare.prepare(other, store, in_process=True)


def test_parquet_files_with_a_text_column(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  texts = [d.text for d in corpus.documents("train")[:60]]
  pq.write_table(pa.table({"id": list(range(40)), "content": texts[:40]}), tmp_path / "a.parquet")
  pq.write_table(pa.table({"id": list(range(20)), "content": texts[40:] + [None] * 0}), tmp_path / "b.parquet")
  config = text_config((str(tmp_path / "*.parquet"),), str(tmp_path / "store"), jsonl_field="content",
                       eval_files=(str(tmp_path / "b.parquet"),))
  prepare.prepare(config, config.prepared_dir, in_process=True)
  docs = store_documents(config.prepared_dir)
  assert_same_documents(docs["train"], tokenize_documents(texts, VOCAB))
  assert_same_documents(docs["validation"], tokenize_documents(texts[40:], VOCAB))
  with pytest.raises(ConfigError, match="DataConfig.jsonl_field") as e:
    prepare.prepare(text_config((str(tmp_path / "a.parquet"),), str(tmp_path / "s2")), str(tmp_path / "s2"),
                    in_process=True)
  assert "'content'" in e.value.problem or "content" in e.value.problem


@pytest.fixture(scope="module")
def tiny_tfds(tmp_path_factory):
  """A TFDS data set built here, offline: 'midas_tiny_text' with a text feature and two splits."""
  tfds = pytest.importorskip("tensorflow_datasets")
  texts = {"train": [d.text for d in corpus.documents("train")[:50]],
           "validation": [d.text for d in corpus.documents("validation")[:10]]}

  class MidasTinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"text": tfds.features.Text(), "id": np.int64}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(split) for split in texts}

    def _generate_examples(self, split):
      for i, text in enumerate(texts[split]):
        yield i, {"text": text, "id": i}

  data_dir = str(tmp_path_factory.mktemp("tfds"))
  builder = MidasTinyText(data_dir=data_dir)
  builder.download_and_prepare()
  return {"data_dir": data_dir, "builder": builder, "tfds": tfds}


def test_a_tfds_data_set_is_read_in_even_slices_in_order(tiny_tfds, tmp_path):
  tfds = tiny_tfds["tfds"]
  config = DataConfig(source="prepared", prepared_dir=str(tmp_path / "store"), prepared_from="tfds",
                      tfds_name="midas_tiny_text", tfds_data_dir=tiny_tfds["data_dir"])
  summary = prepare.prepare(config, config.prepared_dir, num_shards=3, in_process=True)
  assert summary["parts"] == 6 and summary["documents"] == 60
  docs = store_documents(config.prepared_dir, config)
  for split in SPLITS:  # the split as TFDS stores it, in its order
    ds = tiny_tfds["builder"].as_dataset(split=split, shuffle_files=False)
    texts = [ex["text"].decode() for ex in tfds.as_numpy(ds)]
    assert_same_documents(docs[split], tokenize_documents(texts, VOCAB))
  bad = DataConfig(source="prepared", prepared_dir=str(tmp_path / "s2"), prepared_from="tfds",
                   tfds_name="midas_tiny_text", tfds_data_dir=tiny_tfds["data_dir"], tfds_eval_split="test")
  with pytest.raises(ConfigError, match="DataConfig.tfds_eval_split"):
    prepare.prepare(bad, bad.prepared_dir, in_process=True)


def test_a_seqio_task_is_read_with_its_own_tokenization(tmp_path):
  pytest.importorskip("seqio")
  from midas_jax.data.sources import seqio_tasks  # pylint: disable=import-outside-toplevel
  files = text_corpus(tmp_path / "text", sizes=(40, 30, 30))
  seqio_tasks.register_text_task("midas_store_text", files, vocab=VOCAB)
  config = DataConfig(source="prepared", prepared_dir=str(tmp_path / "store"), prepared_from="seqio",
                      seqio_task="midas_store_text")
  prepare.prepare(config, config.prepared_dir, in_process=True)
  docs, expected = store_documents(config.prepared_dir), in_memory(DataConfig(source="text", train_files=files))
  for split in SPLITS:
    assert_same_documents(docs[split], expected[split])


# --- training on a store --------------------------------------------------------------------------

def _env():
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  return env


def _records(path):
  with open(path) as f:
    return sorted((json.loads(line) for line in f), key=lambda r: (r["step"], r["row"], r["segment"]))


def test_two_processes_read_the_global_batches_one_process_reads(beam_store, tmp_path):
  one = tmp_path / "one.jsonl"
  assert cli.main(["data", "sample", f"--gin_file={beam_store['gin']}", "--steps=3", f"--out={one}"]) == 0
  launcher = os.path.join(REPO_ROOT, "launch", "local.py")
  proc = subprocess.run([sys.executable, launcher, "--num_processes=2", "--devices_per_process=4", "--",
                         "data", "sample", f"--gin_file={beam_store['gin']}", "--steps=3",
                         f"--out={tmp_path / 'two.jsonl'}"], env=_env(), cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  parts = [_records(tmp_path / f"two.process-{i}-of-2.jsonl") for i in range(2)]
  assert {r["row"] for r in parts[0]} == set(range(4)) and {r["row"] for r in parts[1]} == set(range(4, 8))
  single = _records(one)
  assert sorted(parts[0] + parts[1], key=lambda r: (r["step"], r["row"], r["segment"])) == single
  assert all(r["document"] >= 0 and r["length"] > 0 for r in single)


def test_training_on_a_store_falls_and_resumes_mid_epoch_bitwise(beam_store, tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  gin_config.parse([beam_store["gin"]], [])
  config = gin_config.run_config_from_gin()
  gin.clear_config()
  run = str(tmp_path / "run")
  train(config, run, devices=jax.devices()[:1])
  first = {r["step"]: r for r in read_metrics(run, "train")}
  assert first[8]["loss"] < first[1]["loss"] - 0.3
  rows = PreparedPipeline(config.data, VOCAB).layouts["train"].rows
  assert first[8]["epoch"] == pytest.approx(8 * 8 / rows) and first[8]["epoch"] > 1  # into the second epoch
  assert first[4]["epoch"] < 1
  final = load_model(run)
  for step in available_steps(run):  # back to step 4, mid-way through the first epoch
    if step > 4:
      shutil.rmtree(os.path.join(checkpoint_dir(run), str(step)))
  result = train(config, run, devices=jax.devices()[:1])
  assert result.start_step == 4
  resumed = load_model(run)
  assert resumed.step == 8
  for a, b in zip(_leaves(final.params), _leaves(resumed.params)):
    np.testing.assert_array_equal(a, b)
  again = {r["step"]: r for r in read_metrics(run, "train")}
  assert [again[s]["loss"] for s in range(5, 9)] == [first[s]["loss"] for s in range(5, 9)]


def _leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_store_on_gcs_is_written_finished_and_read_like_a_local_one(gcs, tmp_path):
  """Text files on gs://, the store on gs://: the same documents and batches as on a local disk."""
  from midas_jax import fs  # pylint: disable=import-outside-toplevel
  bucket = gcs.new_bucket()
  local_files = text_corpus(tmp_path / "text")
  for name in os.listdir(tmp_path / "text"):
    fs.copy(str(tmp_path / "text" / name), f"{bucket}/text/{name}")
  remote = text_config((f"{bucket}/text/*",), f"{bucket}/store")
  local = text_config(local_files, str(tmp_path / "store"))
  prepare.prepare(local, local.prepared_dir, in_process=True)
  prepare.prepare(remote, remote.prepared_dir, in_process=True)
  # Died writing part 1: no manifest, no part record, its train tokens not yet in place, its other
  # files stale. Only a redone part gives the tokens back; a manifest rebuilt over what is there cannot.
  for name in ("manifest.json", "parts/part-00001.json", "train/shard-00001.tokens"):
    fs.remove(f"{bucket}/store/{name}")
  prepare.prepare(remote, remote.prepared_dir, in_process=True)
  assert fs.exists(f"{bucket}/store/train/shard-00001.tokens")
  manifests = [fs.read_json(fs.join(c.prepared_dir, "manifest.json")) for c in (local, remote)]
  where = ("source", "source_fingerprint", "created")  # the files' paths, their hash, the time
  assert manifests[1]["source"]["train_files"] == [f"{bucket}/text/*"]
  assert ({k: v for k, v in manifests[1].items() if k not in where} ==
          {k: v for k, v in manifests[0].items() if k not in where})  # shard by shard, sha256 too
  docs = store_documents(remote.prepared_dir)
  for split, want in store_documents(local.prepared_dir).items():
    assert_same_documents(docs[split], want)
  here, there = PreparedPipeline(local, VOCAB), PreparedPipeline(remote, VOCAB)
  for step, split in ((0, "train"), (5, "train"), (1, "validation")):
    a, b = here.batch(step, split), there.batch(step, split)
    assert all(np.array_equal(a[f], b[f]) for f in a)
  fs.write_bytes(f"{bucket}/store/train/shard-00002.offsets", b"\0" * 8)
  with pytest.raises(ConfigError, match="train/shard-00002 is damaged"):
    PreparedPipeline(remote, VOCAB)
