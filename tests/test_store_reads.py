"""The store's reads on gs:// as a bucket serves them: counted and timed at the fault proxy (tests/fault_proxy.py)
in front of the GCS emulator, and `midas bench data --storage_latency_ms` on a store there.

A bucket answers each request after a round trip, so what a batch costs is the rounds of requests that
wait on one another, and how many requests each round holds. The proxy holds every request `DELAY` seconds,
so requests sent together arrive together and a request that waited on another arrives a round later.
"""

import dataclasses
import json
import time

import numpy as np
import pytest

from midas_jax import cli, exit_status, flops, fs, hosts, results
from midas_jax.bench import storage_latency, store_bench
from midas_jax.commands.common import load_run_config
from midas_jax.configs import DataConfig
from midas_jax.data.pipeline import tokenize_documents
from midas_jax.data.sources import text_files
from midas_jax.data.store import format as store_format
from midas_jax.data.store import writer
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.ul2.packing import FIELDS
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError, StorageUnavailableError
from midas_jax.fs import ranges as fs_ranges

VOCAB = ByteVocabulary(128)
DELAY = 0.5  # seconds the proxy holds each request: well above a busy machine's jitter and the proxy's
# own (a round's first request may take a kept-alive connection, the others wait ~0.15 s to connect)
ROWS = 4


@pytest.fixture(scope="module")
def stores(gcs, tmp_path_factory):
  """(a store on gs://, the same store on the local disk): built-in documents in shards of 128."""
  documents = {s: tokenize_documents(text_files.load_documents(DataConfig(), s), VOCAB)[:n]
               for s, n in (("train", 700), ("validation", 120))}
  local = str(tmp_path_factory.mktemp("store"))
  writer.write_store(local, documents, VOCAB, store_format.source_description(DataConfig()), documents_per_shard=128)
  remote = gcs.new_bucket() + "/store"
  for path in fs.glob(fs.join(local, "**", "*")):
    if fs.isfile(path):
      fs.copy(path, fs.join(remote, fs.relative(path, local)))
  return remote, local


def config(store, **kw):
  return DataConfig(**dict(dict(source="prepared", prepared_dir=store, seq_len=64, batch_size=ROWS), **kw))


@pytest.fixture
def proxy(fault_proxy, monkeypatch, stores):
  """The proxy with DELAY, recording when each request arrives and its path; this process's gs:// client goes
  through it."""
  fs.exists(stores[0])  # etils keeps its own client: made here, before the proxy, it stays direct
  arrivals, paths, decide = [], [], fault_proxy._decide  # pylint: disable=protected-access

  def recorded(method, path, *args, **kwargs):
    arrivals.append(time.monotonic())
    paths.append(path)
    return decide(method, path, *args, **kwargs)

  monkeypatch.setattr(fault_proxy, "_decide", recorded)
  # socketserver listens with a backlog of 5: a burst of new connections (a round of 20 reads) would see
  # some dropped and retried a second later, a round that is the proxy's, not the reader's. A bucket's
  # front end takes them all; so does the proxy after listening again with room (Linux honours it).
  fault_proxy._server.socket.listen(128)  # pylint: disable=protected-access
  fault_proxy.arrivals, fault_proxy.paths = arrivals, paths
  fault_proxy.delay_s = DELAY
  with fault_proxy.installed():
    yield fault_proxy


@pytest.fixture
def opened(proxy):
  """Pipelines to close, their reads ended, before the proxy stops (also when a test fails)."""
  pipelines = []
  yield lambda p: pipelines.append(p) or p
  for p in pipelines:
    p.close(wait=True)


def rounds(arrivals):
  """Requests per round: arrivals apart by more than 0.6 DELAY waited on each other (a DELAY at least)."""
  out = []
  for i, t in enumerate(arrivals):
    if i and t - arrivals[i - 1] <= 0.6 * DELAY:
      out[-1] += 1
    else:
      out.append(1)
  return out


def segments(pipeline, step, split="train"):
  """(how many shard parts the windows of the step's rows have, the shards they touch), from the manifest's
  counts and the layout alone."""
  layout, reader = pipeline.layouts[split], pipeline.readers[split]
  ranges = [r for job in layout.ranges(layout.windows(step * ROWS + np.arange(ROWS))) for r in job]
  shards = set()
  for a, b in ranges:
    first = int(np.searchsorted(reader.token_starts, a, side="right")) - 1
    last = int(np.searchsorted(reader.token_starts, b - 1, side="right")) - 1
    shards.update((a, b, s) for s in range(first, last + 1))
  return len(shards), {s for _, _, s in shards}


def uncoalesced(pipeline):
  """The pipeline, its readers making one request per range (as before coalescing): rounds counted by range."""
  for reader in pipeline.readers.values():
    reader.merge_gap = None
  return pipeline


def test_a_batch_is_one_round_of_two_ranged_reads_per_window_and_no_metadata_requests(stores, proxy, opened):
  start = len(proxy.arrivals)
  pipeline = opened(uncoalesced(PreparedPipeline(config(stores[0], read_ahead=0), VOCAB)))
  # The manifest in one request, then the shard check: one listing per split (process 0's, this one's).
  assert rounds(proxy.arrivals[start:]) == [1, 1, 1]
  for step, cold in ((0, True), (1, None), (2, None)):
    pieces, shards = segments(pipeline, step)
    seen = set(pipeline.readers["train"]._index)  # pylint: disable=protected-access
    new = len(shards - seen)
    start = len(proxy.arrivals)
    pipeline.batch(step)
    # The coarse indices of shards not seen before (step 0: all it touches), then an offsets read and a
    # tokens read per window piece, all sent at once. No open, no metadata request, nothing in series.
    assert rounds(proxy.arrivals[start:]) == ([new] if new else []) + [2 * pieces], (step, new, pieces)
    assert all(path.startswith("/download/") and "alt=media" in path for path in proxy.paths[start:])
    if cold:
      assert new == len(shards) > 0
  local = PreparedPipeline(config(stores[1]), VOCAB)
  for f in FIELDS:
    np.testing.assert_array_equal(pipeline.batch(3)[f], local.batch(3)[f], err_msg=f)


def test_steps_are_read_ahead_at_once_and_each_is_the_step_read_alone(stores, proxy, opened):
  ahead = opened(uncoalesced(PreparedPipeline(config(stores[0], read_ahead=3), VOCAB)))
  start = len(proxy.arrivals)
  ahead.batch(0)
  time.sleep(1.5 * DELAY)  # the reads of steps 1, 2 and 3 end meanwhile, if they began with step 0's
  # Four steps' coarse indices, then four steps' offsets and tokens: two rounds, not eight.
  sent = rounds(proxy.arrivals[start:])
  assert len(sent) == 2 and sum(sent) >= sum(2 * segments(ahead, s)[0] for s in range(4)), sent
  for step in (1, 2, 3):  # read already: built without a round trip
    t0 = time.monotonic()
    ahead.batch(step)
    assert time.monotonic() - t0 < DELAY / 2, step
  # Reads started ahead, dropped after a jump, started again: every step is what it is read alone.
  alone = PreparedPipeline(config(stores[1]), VOCAB)
  for step, split, index, count in ((9, "train", 0, 1), (4, "train", 0, 1), (5, "train", 0, 1),
                                    (0, "validation", 0, 1), (1, "validation", 0, 1), (6, "train", 1, 2),
                                    (7, "train", 1, 2), (6, "train", 0, 2)):
    got, want = ahead.batch(step, split, index, count), alone.batch(step, split, index, count)
    for f in FIELDS:
      np.testing.assert_array_equal(got[f], want[f], err_msg=f"{f} at {step, split, index, count}")


def _broken_copy(local, tmp_path):
  broken = tmp_path / "broken"
  for path in fs.glob(fs.join(local, "**", "*")):
    if fs.isfile(path):
      fs.copy(path, str(broken / fs.relative(path, local)))
  tokens = broken / "train" / "shard-00001.tokens"
  tokens.write_bytes(tokens.read_bytes()[:-2])
  return str(broken)


def test_the_shard_check_is_process_0s_one_listing_per_split_shared_with_the_others(stores, monkeypatch, tmp_path):
  local = stores[1]
  listed, sent = [], []
  real = fs_ranges.file_sizes
  monkeypatch.setattr(fs_ranges, "file_sizes", lambda d: listed.append(d) or real(d))
  monkeypatch.setattr(hosts, "from_process_0", lambda v: sent.append(v) or v)
  PreparedPipeline(config(local), VOCAB)
  assert listed == [fs.join(local, "train"), fs.join(local, "validation")] and sent == [-1]
  broken = _broken_copy(local, tmp_path)
  with pytest.raises(ConfigError, match=r"train/shard-00001 is damaged: .* has [\d,]+ bytes, the manifest says"):
    PreparedPipeline(config(broken), VOCAB)
  assert sent[-1] == 3  # the second shard's tokens file, the fourth file of the split
  # Another process lists nothing and stops on what process 0 found.
  listed.clear()
  monkeypatch.setattr(store_format.jax, "process_index", lambda: 1)
  monkeypatch.setattr(hosts, "from_process_0", lambda v: 3)  # what process 0 sent
  with pytest.raises(ConfigError, match="process 0 found .*train/shard-00001.tokens' missing or not at the size"):
    PreparedPipeline(config(broken), VOCAB)
  assert listed == []
  monkeypatch.setattr(hosts, "from_process_0", lambda v: -2)
  with pytest.raises(ConfigError, match="process 0 could not list the store"):
    PreparedPipeline(config(local), VOCAB)
  # Process 0 tells the others it could not list before it raises, so that none waits for it.
  monkeypatch.setattr(store_format.jax, "process_index", lambda: 0)
  monkeypatch.setattr(hosts, "from_process_0", lambda v: sent.append(v) or v)
  monkeypatch.setattr(fs_ranges, "file_sizes", lambda d: (_ for _ in ()).throw(PermissionError("403 for " + d)))
  with pytest.raises(PermissionError, match="403"):
    PreparedPipeline(config(local), VOCAB)
  assert sent[-1] == -2


# --- fewer requests: ranges close together are one ----------------------------------------------------

def test_coalesced_ranges_are_one_request_and_each_range_is_cut_out_with_its_own_bytes(tmp_path):
  a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
  fs.write_bytes(a, bytes(range(256)))
  fs.write_bytes(b, bytes(range(100, 200)))
  wanted = [(a, 250, 256), (a, 0, 4), (b, 0, 3), (a, 10, 12), (a, 2, 6), (a, 100, 101)]
  alone = fs_ranges.read_ranges(wanted)
  # Less than 8 bytes apart: a[0:12] holds four of them; a[100:101] and a[250:256] stay apart; b is another file.
  requests, places = fs_ranges.coalesce(wanted, 8)
  assert requests == [(a, 0, 12), (a, 100, 101), (a, 250, 256), (b, 0, 3)]
  assert fs_ranges.cut(wanted, places, fs_ranges.read_ranges(requests)) == alone
  # A gap of 0 merges only ranges that touch or overlap (0:4 and 2:6), as every gap does.
  requests, places = fs_ranges.coalesce(wanted, 0)
  assert requests == [(a, 0, 6), (a, 10, 12), (a, 100, 101), (a, 250, 256), (b, 0, 3)]
  assert fs_ranges.cut(wanted, places, fs_ranges.read_ranges(requests)) == alone
  assert fs_ranges.coalesce(wanted, 1 << 20)[0] == [(a, 0, 256), (b, 0, 3)]


def test_a_coalesced_store_reads_the_same_batches_with_fewer_requests(stores, monkeypatch):
  """On the local store (6 shards of 128 documents): each read's ranges of one file less than
  read_merge_gap_bytes apart are one request, and the batches are those of a request per range."""
  sent = []
  real = fs_ranges.fetch
  monkeypatch.setattr(fs_ranges, "fetch", lambda requests, limit: sent.append(list(requests)) or real(requests, limit))
  steps = [(s, "train") for s in range(6)] + [(s, "validation") for s in range(2)]
  merged = PreparedPipeline(config(stores[1], batch_size=16), VOCAB)
  got = [merged.batch(step, split) for step, split in steps]
  calls = list(sent)
  one_each = uncoalesced(PreparedPipeline(config(stores[1], batch_size=16), VOCAB))
  for (step, split), batch in zip(steps, got):
    want = one_each.batch(step, split)
    for f in FIELDS:
      np.testing.assert_array_equal(batch[f], want[f], err_msg=f"{f} at {step, split}")
  ours, theirs = merged.readers["train"], one_each.readers["train"]
  assert ours.ranges == theirs.ranges == theirs.requests  # the same ranges asked for; theirs one request each
  assert 0 < ours.requests < theirs.requests / 2, (ours.requests, theirs.requests)
  # The count is the requests made (what fetch was given), and no two of one call lie in one file less than
  # the gap apart.
  assert sum(r.requests for r in merged.readers.values()) == sum(map(len, calls))
  for call in calls:
    for (path, _, stop), (other, start, _) in zip(call, call[1:]):
      assert path != other or start - stop >= DataConfig.read_merge_gap_bytes, call


# --- transient faults: tried again; an outage past the timeout stops with 75; a 403 is not -------------

@pytest.fixture
def faulted(stores, fault_proxy, monkeypatch):
  """A pipeline on the gs:// store through the proxy, faults on its tokens reads only, with gcsfs's own
  backoff (about 30 s over 6 tries) made instant: each of the reader's tries is 6 requests answered at once.
  The reader's pauses are recorded on a clock of the test's, which they advance."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  import gcsfs.retry  # pylint: disable=import-outside-toplevel

  async def instant(_seconds):
    await asyncio.sleep(0)

  monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=instant))
  fs.exists(stores[0])  # etils keeps its own client: made here, before the proxy, it stays direct
  with fault_proxy.installed():
    pipeline = PreparedPipeline(config(stores[0], read_ahead=0, read_retry_timeout_s=60), VOCAB)
    reader = pipeline.readers["train"]
    reader.load_every_index()  # before the faults: they are on the tokens reads
    now, pauses = [0.0], []
    reader.clock = lambda: now[0]
    reader.sleep = lambda s: pauses.append(s) or now.__setitem__(0, now[0] + s)
    fault_proxy.only = r"/train/shard-\d+\.tokens"
    yield pipeline, reader, pauses, fault_proxy
    pipeline.close(wait=True)


def test_429s_past_the_clients_retries_are_tried_again_and_read_the_same_bytes(stores, faulted):
  pipeline, reader, pauses, proxy = faulted
  proxy.status = 429
  proxy.outage(600)
  reader.sleep = lambda s: pauses.append(s) or proxy.clear()  # the outage ends during the reader's pause
  got = pipeline.batch(0)
  want = PreparedPipeline(config(stores[1]), VOCAB).batch(0)
  for f in FIELDS:
    np.testing.assert_array_equal(got[f], want[f], err_msg=f)
  assert len(pauses) == 1 and 0.5 <= pauses[0] <= 1.0 and reader.retries >= 1
  assert proxy.injected >= 6  # gcsfs's own tries of a request, each answered 429, before the reader's


def test_an_outage_longer_than_the_timeout_stops_with_storage_unavailable(stores, faulted):
  pipeline, reader, pauses, proxy = faulted
  proxy.outage(600)
  with pytest.raises(StorageUnavailableError) as e:
    pipeline.batch(0)
  said = str(e.value)
  assert e.value.exit_status == exit_status.STORAGE_UNAVAILABLE.status
  assert f"reading the prepared store {stores[0]}: the storage is unavailable: HTTP 503" in said
  assert f"Gave up after {len(pauses) + 1} tries" in said and "DataConfig.read_retry_timeout_s = 60" in said
  assert "fix: this is usually transient: run the same command again" in said
  # Pauses that double from 1 s (with jitter: half to all of it), up to 32 s, and end within the 60 s.
  assert len(pauses) >= 4 and sum(pauses) <= 60
  for k, pause in enumerate(pauses):
    assert 0.5 * min(2 ** k, 32) <= pause <= min(2 ** k, 32), pauses
  assert proxy.injected >= 6 * (len(pauses) + 1)


def test_a_403_is_not_tried_again(faulted):
  pipeline, reader, pauses, proxy = faulted
  proxy.status = 403
  proxy.outage(600)
  with pytest.raises(OSError, match="Forbidden"):
    pipeline.batch(0)
  assert pauses == [] and reader.retries == 0


def test_read_settings_are_checked():
  with pytest.raises(ConfigError) as e:
    DataConfig(read_merge_gap_bytes=-1)
  assert e.value.setting == "DataConfig.read_merge_gap_bytes"
  with pytest.raises(ConfigError) as e:
    DataConfig(read_retry_timeout_s=float("inf"))
  assert e.value.setting == "DataConfig.read_retry_timeout_s"


# --- the benchmark ----------------------------------------------------------------------------------

# paper_1b by hand (flops.py): per layer q, k, v, o 4 x 2048 x 2048 and SwiGLU 3 x 2048 x 4096 weights,
# causal attention 2 x 1024 x 16 heads x 128; the tied head 2048 x 32128.
PER_LAYER = 4 * 2048 * 2048 + 3 * 2048 * 4096 + 2 * 1024 * 16 * 128  # 46,137,344
HEAD = 2048 * 32128  # 65,798,144


def test_a_stacked_run_is_fed_at_its_shallowest_stage():
  bindings = ["DataConfig.vocab='byte'"]
  stacked = load_run_config(["gin/experiments/paper_1b_midas_prop1.gin"], bindings)[0]
  baseline = load_run_config(["gin/experiments/paper_1b_baseline.gin"], bindings)[0]
  first, full = (store_bench.host_consumption(c, "v5p-128", 0.4) for c in (stacked, baseline))
  assert first["train_flops_per_token"] == 6 * (4 * PER_LAYER + HEAD) == 1_502_085_120
  assert full["train_flops_per_token"] == 6 * (24 * PER_LAYER + HEAD) == 7_038_566_400
  assert first["train_flops_per_token"] == flops.train_flops_per_token(
      stacked.model.with_vocab(VOCAB.vocab_size), 2048, num_layers=4)
  ratio = first["tokens_per_second"] / full["tokens_per_second"]
  assert ratio == pytest.approx(7_038_566_400 / 1_502_085_120, rel=1e-12) and round(ratio, 2) == 4.69
  # one of 16 hosts of 64 chips at 459 TFLOP/s and 40% MFU
  assert first["tokens_per_second"] == pytest.approx(64 * 459e12 * 0.4 / 1_502_085_120 / 16, rel=1e-12)
  # hosts as the launchers count them (hardware.slice_hosts): a v5e slice of 8 chips is one host, of 16 four
  assert [store_bench.host_consumption(stacked, s, 0.4)["hosts"] for s in ("v5litepod-8", "v5litepod-16")] == [1, 4]
  assert (first["depth"], full["depth"]) == (4, 24)
  assert first["arithmetic"].startswith("stage 1 of 6, depth 4 of 24: 1.502e+09 FLOP/token")
  assert full["arithmetic"].startswith("depth 24: 7.039e+09 FLOP/token")


def test_bench_data_under_storage_latency_counts_every_request_as_a_ranged_read(gcs, tmp_path, capsys):
  out = tmp_path / "store.json"
  rc = cli.main(["bench", "data", "--gin_file=gin/experiments/paper_1b_midas_prop1.gin",
                 "--gin.DataConfig.vocab='byte'", "--synthetic_documents=2000",
                 f"--synthetic_dir={gcs.new_bucket()}/synthetic", "--consumption=v5p-128", "--seconds=0.3",
                 "--storage_latency_ms=150", f"--json={out}"])
  assert rc == 0
  text = capsys.readouterr().out
  assert "150 ms added to every request" in text and "one host of v5p-128 at stage 1 of 6, depth 4 of 24" in text
  r = json.loads(out.read_text())
  st = r["storage"]
  assert st["remote"] and st["steps"] >= 2 and st["mean_request_ms"] >= 150
  # Every HTTP request the measurement made was one of the reader's requests (none opens a file or asks for
  # its metadata). Uncoalesced they were an offsets and a tokens read per row (32 a step); in this small
  # store's one shard the 16 rows lie close enough that they merge into a few (reader.py).
  assert st["http_requests"] == st["ranged_reads"] and st["steps_read"] >= st["steps"]
  assert 2 <= st["http_requests_per_step"] <= r["rows_per_host"]
  assert r["training"]["depth"] == 4 and r["targets"]["ours_vs_training"] == 2.0


def test_bench_store_multiplies_one_hosts_counted_requests_out_to_the_bucket(tmp_path, capsys):
  out, table = tmp_path / "store.json", tmp_path / "results" / "store_requests.json"
  rc = cli.main(["bench", "store", "--targets", "paper_1b_midas_prop1@v5p-128", "--documents=2000", "--steps=2",
                 f"--synthetic_dir={tmp_path / 'stores'}", f"--json={out}", f"--results={table}"])
  assert rc == 0 and "paper_1b_midas_prop1 on v5p-128 (16 hosts, stage 1 of 6" in capsys.readouterr().out
  r = json.loads(out.read_text())
  one, many = r["rows"]
  assert (one["store"], many["store"], one["hosts"], one["rows_per_host"]) == ("one shard", "shards of 100 documents",
                                                                               16, 16)
  # stage 1's FLOPs per token x 256 x 2048 tokens a step over 64 chips at 459 TFLOP/s and 40% MFU
  assert one["step_seconds"] == pytest.approx(1_502_085_120 * 524_288 / (64 * 459e12 * 0.4), rel=1e-12)
  for row in (one, many):
    # Before: an offsets and a tokens read per row, more where a row crosses into the next shard.
    assert 32 <= row["requests_per_step_before"] <= 48
    assert row["requests_per_step_after"] <= row["requests_per_step_before"]
    for when in ("before", "after"):
      assert row[f"bucket_reads_per_s_{when}"] == pytest.approx(row[f"requests_per_step_{when}"] * 16 /
                                                                row["step_seconds"], rel=1e-12)
  assert one["requests_per_step_after"] < one["requests_per_step_before"] / 2  # 2,000 documents: one small shard
  written = results.read(table)
  assert written["provenance"]["command"].startswith("midas bench store --targets=paper_1b_midas_prop1@v5p-128")
  assert "| `paper_1b_midas_prop1` | `v5p-128` | 16 | stage 1 of 6 |" in results.markdown(
      written["tables"]["requests_per_bucket"])


def test_storage_latency_needs_a_store_on_gcs(stores):
  run = load_run_config(["gin/experiments/cpu_demo.gin"], [])[0]
  run = dataclasses.replace(run, data=config(stores[1]))
  with pytest.raises(ConfigError) as e:
    store_bench.run(run, 0.1, {"tokens_per_second": 1.0, "source": "given"}, storage_latency_ms=5)
  assert e.value.setting == "--storage_latency_ms" and "local" in e.value.problem


def test_added_latency_holds_every_request_and_ends_with_its_block(gcs):
  url = gcs.new_bucket() + "/x.bin"
  fs.write_bytes(url, bytes(range(256)))
  with storage_latency.added(1.0) as counted:
    t0 = time.monotonic()
    assert fs_ranges.read_ranges([(url, 0, 4), (url, 10, 12), (url, 250, 256)]) == [
        bytes(range(4)), bytes([10, 11]), bytes(range(250, 256))]
    took = time.monotonic() - t0
  # At once: one wait of 1 s, not three in a row (3 s).
  assert counted.count == 3 and counted.seconds >= 3 * 1.0 and 1.0 <= took < 2.0
  t0 = time.monotonic()
  fs_ranges.read_ranges([(url, 0, 4)])
  assert time.monotonic() - t0 < 1.0 and counted.count == 3  # after the block: as before, uncounted
