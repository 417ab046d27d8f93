"""Layer and block weight similarity: identical layers are 1, and growth's copies show where they were made."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import tiny_model
from midas_jax.evals import similarity
from midas_jax.model import Decoder, dummy_batch
from midas_jax.stacking import operators

BLOCK = 2


def init_params(num_layers, family="llama"):
  """The Decoder's real parameter tree (traced, not compiled), every leaf drawn independently from N(0, 1)."""
  cfg = tiny_model(family=family, num_layers=num_layers,
                   **({"num_kv_heads": None} if family == "gpt2" else {})).with_vocab(64)
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(cfg).init(jax.random.key(0), dummy_batch(1, 8))["params"]))
  rng = np.random.default_rng(num_layers)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), shapes)


def gather_layers(params, provenance):
  """What growth does to parameters: every per-layer leaf taken along its layers axis by provenance."""
  out = dict(params)
  out["layers"] = jax.tree.map(lambda x: np.take(x, np.asarray(provenance), axis=0), params["layers"])
  return out


def train_a_little(params, seed, scale=0.5):
  """Stands in for training between growths: every layer's weights move by independent noise."""
  rng = np.random.default_rng(seed)
  out = dict(params)
  out["layers"] = jax.tree.map(lambda x: x + scale * x.std() * rng.standard_normal(x.shape).astype(x.dtype),
                               params["layers"])
  return out


def grow_run(operator, stages):
  """A params tree right after the last of stages-1 growths of `operator`, trained a little in between."""
  params = init_params(BLOCK)
  for stage in range(2, stages + 1):
    params = train_a_little(params, seed=stage)
    prov = operators.provenance_for(operator, params["layers"]["attn"]["query"].shape[0], BLOCK)
    params = gather_layers(params, prov)
  return params, prov


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_identical_layers_have_similarity_one_and_independent_ones_near_zero(family):
  params = init_params(4, family)
  names = list(similarity.layer_weights(params))
  if family == "llama":
    assert names == ["attn/key", "attn/out", "attn/query", "attn/value", "mlp/down", "mlp/gate", "mlp/up"]
  else:  # biases and norm scales are not weight matrices
    assert names == ["attn/key", "attn/out", "attn/query", "attn/value", "mlp/fc", "mlp/proj"]
  fresh = similarity.similarity(params)
  off = fresh["mean"][~np.eye(4, dtype=bool)]
  assert np.abs(off).max() < 0.2 and np.allclose(np.diag(fresh["mean"]), 1.0)
  same = gather_layers(params, [0, 0, 0, 0])
  result = similarity.similarity(same)
  np.testing.assert_allclose(result["mean"], np.ones((4, 4)), atol=1e-6)
  for m in result["per_matrix"].values():
    np.testing.assert_allclose(m, np.ones((4, 4)), atol=1e-6)


def test_cosine_matrix_is_scale_invariant_and_signed():
  v = np.random.default_rng(0).standard_normal((3, 5, 4))
  stack = np.stack([v[0], 3.0 * v[0], -v[0], np.zeros_like(v[0])])
  m = similarity.cosine_matrix(stack)
  np.testing.assert_allclose(m[0, :3], [1.0, 1.0, -1.0], atol=1e-12)
  assert m[3].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_midas_growth_shows_its_middle_copy_as_the_one_identical_block_pair():
  params, prov = grow_run("midas", stages=4)  # blocks: 1 -> 2 -> 3 -> 4; the last growth copies block 2 of 3
  blocks = similarity.similarity(params, BLOCK)["mean"]
  assert blocks.shape == (4, 4)
  pairs = similarity.copied_block_pairs(prov, BLOCK)
  assert pairs == [(1, 2)]  # the middle block (1-indexed ceil(3/2) = 2) and its copy right after it
  np.testing.assert_allclose(blocks[1, 2], 1.0, atol=1e-6)
  others = [blocks[i, j] for i in range(4) for j in range(i + 1, 4) if (i, j) != (1, 2)]
  assert max(others) < 0.95
  # Every block descends from the first; copies drift apart with each stage of training since the copy:
  # block 1 was copied from block 0 one stage ago, block 3 two stages ago.
  assert blocks[0, 1] > blocks[0, 3] + 0.1 and blocks[0, 3] > 0.3


def test_gradstack_growth_shows_its_top_blocks_as_the_identical_pair():
  params, prov = grow_run("gradstack", stages=4)
  blocks = similarity.similarity(params, BLOCK)["mean"]
  assert similarity.copied_block_pairs(prov, BLOCK) == [(2, 3)]
  np.testing.assert_allclose(blocks[2, 3], 1.0, atol=1e-6)
  assert max(blocks[i, j] for i in range(4) for j in range(i + 1, 4) if (i, j) != (2, 3)) < 0.95


def test_last_growth_is_replayed_from_the_operator():
  prov = similarity.last_growth_provenance("midas", num_stages=4, block_size=BLOCK, stage=4)
  np.testing.assert_array_equal(prov, operators.midas(3, BLOCK))
  assert similarity.last_growth_provenance("midas", 4, BLOCK, stage=1) is None
  fresh = operators.fresh_block(2, BLOCK)  # a fresh block on top is no copy
  assert similarity.copied_block_pairs(fresh, BLOCK) == []


def test_block_size_must_divide_the_depth():
  from midas_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match="block_size"):
    similarity.similarity(init_params(4), block_size=3)


@pytest.fixture(scope="module")
def midas_run(tmp_path_factory):
  """A tiny MIDAS run: 2 blocks of 2 layers, grown at step 2; saves at 2 (the growth) and 4."""
  from midas_jax import configs  # pylint: disable=import-outside-toplevel
  from midas_jax.train.run import train  # pylint: disable=import-outside-toplevel
  config = configs.RunConfig(
      model=tiny_model(num_layers=4),
      optimizer=configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=2),
      data=configs.DataConfig(seq_len=32, batch_size=8),
      trainer=configs.TrainerConfig(num_steps=4, log_every=2, eval_every=0, progress_bar=False,
                                    peak_flops_per_device=1e11),
      stacking=configs.StackingConfig(num_stages=2, block_size=2, stage_steps=(2, 2), operator="midas"),
      checkpoint=configs.CheckpointConfig(every=2, keep=10))
  workdir = str(tmp_path_factory.mktemp("midas_run"))
  train(config, workdir, devices=jax.devices()[:1])  # one device: the suites, not sharding, are tested here
  return workdir


def test_suites_on_a_midas_run_through_the_cli(midas_run, capsys):
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from midas_jax import cli  # pylint: disable=import-outside-toplevel
  from midas_jax.checkpoint import available_steps, load_model  # pylint: disable=import-outside-toplevel
  assert cli.main(["eval", f"--workdir={midas_run}", "--suite=similarity,embeddings,delta_l",
                   "--opt=max_documents=8"]) == 0
  capsys.readouterr()
  out = os.path.join(midas_run, "eval")
  steps = available_steps(midas_run)
  assert steps == [2, 4]

  sim = json.load(open(os.path.join(out, "similarity.json")))["results"]
  assert sim["depth"] == 4 and sim["block_size"] == 2 and sim["operator"] == "midas"
  assert sim["last_growth"]["block_pairs"] == [[0, 1]]  # one block grown into [B1, copy of B1]
  assert 0.5 < sim["last_growth"]["similarity"][0] < 1.0  # two steps of training since the copy
  # Right after the growth (the save at the boundary step) the copy is exact.
  at_growth = similarity.run_suite(load_model(midas_run, step=2), midas_run, out, {})
  assert at_growth["stage"] == 2 and at_growth["last_growth"]["similarity"] == [1.0]
  np.testing.assert_allclose(np.asarray(at_growth["layers"]["mean"])[[0, 1], [2, 3]], 1.0, atol=1e-6)
  assert os.path.getsize(os.path.join(out, "similarity_blocks.png")) > 1000

  emb = json.load(open(os.path.join(out, "embeddings.json")))["results"]
  assert emb["steps"] == steps and len(emb["points"]) == len(steps)
  assert set(emb["group_similarity"]["4"]) >= {"digits/digits", "digits/lower", "lower/lower"}
  assert os.path.getsize(os.path.join(out, "embeddings.png")) > 1000

  dl = json.load(open(os.path.join(out, "delta_l.json")))["results"]
  assert dl["steps"] == steps and dl["documents"] == {"a": 8, "b": 8}
  for la, lb, d in zip(dl["loss_a"], dl["loss_b"], dl["delta_l"]):
    assert la > 0 and lb > 0 and d == pytest.approx((la - lb) / lb, abs=1e-4)
  assert dl["loss_b"][-1] < dl["loss_b"][0]  # training lowers the held-out story loss
  assert os.path.getsize(os.path.join(out, "delta_l.png")) > 1000
