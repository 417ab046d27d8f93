"""The compilation cache on a bucket (MIDAS_JAX_CACHE_DIR=gs://...): what one run compiles, the next one reads.

On a pod jax writes cache entries from process 0 only, so the cache helps every host only when it is
storage they all see. The runs here are fresh processes on the GCS emulator (tests/gcs_emulator.py),
with jax's own log of cache hits and misses; the session's local cache (conftest.py) is overridden.
They run one process at a time: that another host finds process 0's entries is jax's part (on TPU the
key hashes the slice's topology, the same on every host; on CPU it hashes each process's own devices,
so two local processes never share an entry).
"""

import os
import re
import subprocess
import sys

import jax
import pytest

from conftest import REPO_ROOT, tiny_gin
from midas_jax import fs
from midas_jax.commands import common
from midas_jax.errors import ConfigError

GIN = tiny_gin("""
OptimizerConfig.warmup_steps = 1
TrainerConfig.num_steps = 2
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 2
TrainerConfig.eval_batches = 1
""")
HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")
WROTE = re.compile(r"Writing (\S+) to persistent compilation cache")
ENTRY = re.compile(r"^(.+)-[0-9a-f]{64}-cache$")  # jax's object name: program name, key, suffix


def cache_entries(cache):
  return sorted(name for name in fs.listdir(cache) if ENTRY.match(name))


def train(gin_file, workdir, env):
  """A fresh `midas train` process: (its jax cache hits, misses, programs written), by program name."""
  proc = subprocess.run([sys.executable, "-m", "midas_jax", "train", f"--gin_file={gin_file}", f"--workdir={workdir}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return [sorted(pattern.findall(proc.stderr)) for pattern in (HIT, MISS, WROTE)]


def test_a_fresh_run_reads_the_programs_the_first_run_wrote_to_the_bucket(gcs, tmp_path):
  bucket = gcs.new_bucket()
  cache = f"{bucket}/xla_cache"
  gin_file = tmp_path / "run.gin"
  gin_file.write_text(GIN)
  env = dict(os.environ, **gcs.environment(), PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             MIDAS_JAX_CACHE_DIR=cache,  # instead of the session's local folder (conftest.py)
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",  # a tiny model compiles in well under a second
             JAX_LOG_COMPILES="1", JAX_EXPLAIN_CACHE_MISSES="1")  # jax logs each hit, miss and write
  hits, misses, wrote = train(gin_file, tmp_path / "first", env)
  assert not hits and misses and wrote == misses  # an empty cache: every program compiled and written
  entries = cache_entries(cache)
  assert sorted(ENTRY.match(e).group(1) for e in entries) == wrote  # on the bucket, one object per program
  assert not os.path.exists(os.path.join(REPO_ROOT, "gs:"))  # not a local folder named after the URL

  # Another workdir, so the second run compiles the same programs rather than resuming the first.
  hits, misses, wrote = train(gin_file, tmp_path / "second", env)
  assert not misses and not wrote, (misses, wrote)  # nothing compiled: every program came from the bucket
  assert hits == sorted(ENTRY.match(e).group(1) for e in entries)  # each program read back once
  assert cache_entries(cache) == entries


@pytest.fixture
def jax_cache_settings():
  """The jax settings enable_compilation_cache changes, restored afterwards (the session's cache stays)."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_enable_xla_caches")
  saved = {name: getattr(jax.config, name) for name in names}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def test_a_cache_url_names_its_setting_and_keeps_xla_caches_local(monkeypatch, jax_cache_settings):
  del jax_cache_settings
  monkeypatch.setenv("MIDAS_JAX_CACHE_DIR", "ftp://host/cache")
  with pytest.raises(ConfigError, match="MIDAS_JAX_CACHE_DIR"):
    common.enable_compilation_cache()
  monkeypatch.setenv("MIDAS_JAX_CACHE_DIR", "gs://bucket/xla")
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)
  common.enable_compilation_cache()
  assert jax.config.jax_compilation_cache_dir == "gs://bucket/xla"
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25  # the user's jax setting is kept
  assert jax.config.jax_persistent_cache_enable_xla_caches == "none"  # no gs:// path handed to XLA's C++
  monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
  monkeypatch.setenv("MIDAS_JAX_CACHE_DIR", "~/xla")
  common.enable_compilation_cache()
  assert jax.config.jax_compilation_cache_dir == os.path.expanduser("~/xla")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
