"""Test setup: 8 simulated CPU devices for the whole session, and a tiny run config.

XLA_FLAGS must be set before jax is first imported, hence here. Single-device tests pass
devices=jax.devices()[:1] explicitly.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the test extra) compiles TPU programs ahead of time here; with no TPU to share, every test process
# may load it at once (otherwise a second one gets a libtpu without its cost model).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from midas_jax import configs  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_model(**overrides) -> configs.ModelConfig:
  base = dict(family="llama", d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64,
              max_seq_len=128, dtype="float32")
  base.update(overrides)
  return configs.ModelConfig(**base)


def random_decoder(vocab_size: int, seed: int = 5):
  """(config, params) of a tiny decoder with N(0, 1) weights (peaked, varied predictions), filled without
  compiling an init: for scorers that only need some fixed model."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from midas_jax.model import Decoder, dummy_batch  # pylint: disable=import-outside-toplevel
  cfg = tiny_model(max_seq_len=128).with_vocab(vocab_size)
  shapes = nn.unbox(jax.eval_shape(Decoder(cfg).init, jax.random.key(seed), dummy_batch(1, 8))["params"])
  rng = np.random.default_rng(seed)
  return cfg, jax.tree.map(lambda x: rng.normal(0.0, 1.0, x.shape).astype(x.dtype), shapes)


def tiny_gin(bindings: str = "", num_layers: int = 2) -> str:
  """A gin file for the subprocess tests: tiny_model()'s shape at max_seq_len 64 on rows of 32 tokens, 8 a
  batch, no progress bar, then `bindings` (one per line)."""
  return f"""
ModelConfig.family = 'llama'
ModelConfig.d_model = 32
ModelConfig.num_layers = {num_layers}
ModelConfig.num_heads = 4
ModelConfig.num_kv_heads = 2
ModelConfig.d_ff = 64
ModelConfig.max_seq_len = 64
ModelConfig.dtype = 'float32'
DataConfig.seq_len = 32
DataConfig.batch_size = 8
TrainerConfig.progress_bar = False
TrainerConfig.peak_flops_per_device = 1e11
""" + bindings


def layer_config(cfg: configs.ModelConfig) -> configs.ModelConfig:
  """The config one layer (a Block, outside a Decoder) runs with on CPU: the Decoder resolves
  attention='auto' for its platform and hands that to its layers; on CPU it is dot_product."""
  return dataclasses.replace(cfg, attention="dot_product" if cfg.attention == "auto" else cfg.attention)


def tiny_run(model=None, mesh=None, optimizer=None, data=None, trainer=None) -> configs.RunConfig:
  return configs.RunConfig(
      model=model or tiny_model(),
      mesh=mesh or configs.MeshConfig(),
      optimizer=optimizer or configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=2),
      data=data or configs.DataConfig(seq_len=32, batch_size=8),
      trainer=trainer or configs.TrainerConfig(num_steps=4, log_every=2, eval_every=2, eval_batches=1,
                                               progress_bar=False, peak_flops_per_device=1e11),
  )


def to_host(tree):
  """The tree's arrays copied to host numpy arrays (unsharded)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  return jax.tree.map(np.asarray, tree)


def trained_stage(config: configs.RunConfig, steps: int = 2):
  """(the stage built for config, its state after `steps` train steps): optimizer moments non-zero, so a
  growth has real moments to carry."""
  from midas_jax.train.build import build_stage  # pylint: disable=import-outside-toplevel
  exp = build_stage(config)
  state = exp.init_state()
  with exp.context():
    step = exp.jit_train_step()
    for s in range(steps):
      state, _ = step(state, exp.device_batch(s))
  return exp, state


# tests/test_kill_resume.py kills runs at random times drawn from this seed: a fresh one every
# session, so CI explores new kill points; the report header prints it, and MIDAS_KILL_SEED=<seed>
# replays a failure's kills (the same trigger lines and delays). Drawn once by the pytest process
# and put in the environment, so that its worker processes (pytest-xdist) kill with the same seed.
os.environ.setdefault("MIDAS_KILL_SEED", str(random.SystemRandom().randrange(2 ** 31)))
KILL_SEED = int(os.environ["MIDAS_KILL_SEED"])


def pytest_report_header(config):
  del config
  return f"kill seed: {KILL_SEED} (replay the random SIGKILLs with MIDAS_KILL_SEED={KILL_SEED})"


def ul2_rows(seed: int, num_rows: int, seq_len: int, vocab_size: int = 300):
  """Packed rows in which every row holds a causal, a prefix-LM and a span-corruption example of
  random lengths, then padding: the batch format of the pipeline, mixed within each row."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from midas_jax.data.ul2 import objectives, packing  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  special = objectives.special_tokens(vocab_size, extra_ids=128)
  denoisers = [objectives.Denoiser("causal", "causal"), objectives.Denoiser("prefix", "prefix", noise_density=0.5),
               objectives.Denoiser("span", "span")]
  rows = []
  for _ in range(num_rows):
    budget = seq_len - rng.integers(1, seq_len // 6)  # leave some padding at the end
    cuts = np.sort(rng.choice(np.arange(6, budget - 6), 2, replace=False))
    sizes = np.diff([0, *cuts, budget])
    order = rng.permutation(3)
    examples = [objectives.make_example(rng.integers(3, vocab_size - 128, n), denoisers[k], rng, special)
                for k, n in zip(order, sizes)]
    # span corruption adds sentinels: trim the last example until the padding is back
    while sum(len(e.tokens) for e in examples) > budget:
      last = examples[-1]
      examples[-1] = packing.Example(last.tokens[:-1], min(last.prefix_len, len(last.tokens) - 2), last.objective_id)
    rows.append(packing.pack_row(examples, seq_len))
  return packing.stack_rows(rows)


def replace(cfg, **kw):
  return dataclasses.replace(cfg, **kw)


@pytest.fixture
def repo_root():
  return REPO_ROOT


def pytest_configure(config):
  # Identical programs compiled by several tests (each run re-jits its step) are compiled once.
  import jax  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  cache = tempfile.mkdtemp(prefix="midas_jax_test_cache_")
  os.environ["MIDAS_JAX_CACHE_DIR"] = cache  # what the CLI's enable_compilation_cache() reads
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="session")
def gcs():
  """A GCS emulator for the session (tests/gcs_emulator.py); `gcs.new_bucket()` gives a gs:// URL."""
  from gcs_emulator import Emulator  # pylint: disable=import-outside-toplevel
  emulator = Emulator().start()
  yield emulator
  emulator.stop()

@pytest.fixture
def fault_proxy(gcs):
  """A fault-injecting HTTP proxy in front of the session's emulator (tests/fault_proxy.py), no faults set."""
  from fault_proxy import FaultProxy  # pylint: disable=import-outside-toplevel
  proxy = FaultProxy(gcs).start()
  yield proxy
  proxy.stop()


@pytest.fixture
def no_compile_cache(monkeypatch):
  """For benchmark tests: compiles are timed cold, as `midas bench` times them (it never enables the
  persistent cache), not served from the session's cache by an earlier test's identical program."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("MIDAS_JAX_CACHE_DIR", "off")  # what commands.common.enable_compilation_cache reads
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # jax decides once whether the cache is used; ask it again
  yield
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _clear_gin_bindings():
  """gin bindings are process-global: a test that parses gin files must not configure the next one."""
  yield
  import gin  # pylint: disable=import-outside-toplevel
  gin.clear_config()


# The longest test files start first, so that the two workers (pytest.ini: -n 2 --dist loadfile)
# do not end with one of them running a long file alone. Order within a file is kept.
LONGEST_FIRST = ("test_kill_resume.py", "test_notebook.py", "test_multihost.py", "test_gcs.py", "test_pod.py",
                 "test_peer_failures.py",
                 "test_evals_cli.py", "test_stacking_train.py", "test_convert.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
