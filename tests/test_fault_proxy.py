"""The fault proxy (tests/fault_proxy.py) itself: it forwards what it is sent, and injects what it is told."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

WRITE_AND_READ = r'''
import sys, gcsfs
fs = gcsfs.GCSFileSystem()
data = bytes(range(256)) * (6 * 4096 + 7)  # 6 MB and a bit: more than one block, a resumable upload
with fs.open(sys.argv[1], "wb", block_size=5 * 2 ** 20) as f:
  f.write(data)
assert fs.cat(sys.argv[1]) == data and fs.info(sys.argv[1])["size"] == len(data)
print("ok")
'''


def _get(url):
  with urllib.request.urlopen(url, timeout=30) as response:
    return response.status, json.loads(response.read())


def test_requests_pass_through_and_links_point_back_at_the_proxy(gcs, fault_proxy):
  bucket = gcs.new_bucket()[len("gs://"):]
  status, listing = _get(f"{fault_proxy.url}/storage/v1/b/{bucket}")
  assert status == 200 and listing["name"] == bucket
  assert fault_proxy.requests == 1 and fault_proxy.injected == 0


def test_a_resumable_upload_through_injected_503s_arrives_whole(gcs, fault_proxy):
  url = gcs.new_bucket() + "/big.bin"
  fault_proxy.error_rate = 0.5  # seed 0 draws 0.84, 0.76, 0.42, ...: the third request fails
  env = {**__import__("os").environ, **fault_proxy.environment()}
  out = subprocess.run([sys.executable, "-c", WRITE_AND_READ, url], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
  # The upload's start, its two chunks (at the Location the proxy rewrote to its own) and the reads all came
  # through the proxy, some of them only at a retry.
  assert fault_proxy.injected > 0 and fault_proxy.requests - fault_proxy.injected >= 4


def test_an_outage_answers_every_request_503_until_it_ends(gcs, fault_proxy):
  bucket = gcs.new_bucket()[len("gs://"):]
  fault_proxy.outage(1.0)
  with pytest.raises(urllib.error.HTTPError) as e:
    _get(f"{fault_proxy.url}/storage/v1/b/{bucket}")
  assert e.value.code == 503
  time.sleep(1.1)
  assert _get(f"{fault_proxy.url}/storage/v1/b/{bucket}")[0] == 200
  assert (fault_proxy.requests, fault_proxy.injected) == (2, 1)


def test_latency_is_added_to_every_request(gcs, fault_proxy):
  bucket = gcs.new_bucket()[len("gs://"):]
  fault_proxy.delay_s = 0.3
  start = time.monotonic()
  for _ in range(3):
    _get(f"{fault_proxy.url}/storage/v1/b/{bucket}")
  assert time.monotonic() - start >= 0.9  # a lower bound only: the delay is a floor, never a ceiling
