"""The train step's loss and gradients: chunked cross-entropy, gradient accumulation over
microbatches give the numbers of one pass over the whole sequence and batch, on an 8-device mesh.
(Microbatches through growth and an exact resume: tests/test_checkpoint.py; the flash kernel in the
sharded train step: tests/test_sharding.py.)"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model, tiny_run, ul2_rows
from midas_jax import configs, sharding
from midas_jax.errors import ConfigError
from midas_jax.train import build as build_lib, step as step_lib


def _relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _loss_inputs(rows=3, length=40, width=16, vocab=64, seed=0):
  rng = np.random.default_rng(seed)
  features = jnp.asarray(rng.normal(size=(rows, length, width)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(width, vocab)) / 4, jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32)
  weights = jnp.asarray(rng.random((rows, length)) < 0.7, jnp.float32)
  objectives = jnp.asarray(rng.integers(0, 3, (rows, length)), jnp.int32)
  return features, head, targets, weights, objectives


def _chunked(chunk, z_loss=1e-3):
  def loss(features, head, targets, weights, objectives):
    sums = step_lib.chunked_loss_sums(lambda x: jnp.einsum("btd,dv->btv", x, head), features, targets, weights,
                                      objectives, chunk)
    return step_lib.loss_and_metrics(sums, jnp.maximum(weights.sum(), 1e-9), z_loss)
  return loss


def test_chunked_loss_equals_the_whole_sequence_loss_and_its_gradients():
  inputs = _loss_inputs()
  def whole(features, head, targets, weights, objectives):
    return step_lib.weighted_cross_entropy(jnp.einsum("btd,dv->btv", features, head), targets, weights,
                                           objectives, z_loss=1e-3)
  grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(*inputs)
  (loss, aux), grads = grad(_chunked(16))  # 40 positions: chunks of 16, 16 and a padded 8
  (ref_loss, ref_aux), ref_grads = grad(whole)
  assert _relative(loss, ref_loss) <= 1e-6
  for key in ref_aux:
    assert _relative(aux[key], ref_aux[key]) <= 1e-6, key
  for g, ref in zip(grads, ref_grads):
    assert _relative(g, ref) <= 1e-6


def test_chunked_loss_holds_one_chunk_of_logits_in_the_compiled_backward_pass():
  inputs = _loss_inputs(rows=2, length=512, width=32, vocab=4096)
  temp = {chunk: jax.jit(jax.grad(lambda *a: _chunked(chunk)(*a)[0], argnums=(0, 1))).lower(*inputs).compile()
          .memory_analysis().temp_size_in_bytes for chunk in (0, 64)}
  whole_logits = 2 * 512 * 4096 * 4
  assert temp[0] >= whole_logits  # the unchunked gradient holds float32 logits [rows, T, vocab] at least once
  assert temp[64] < whole_logits / 2


MESH_RUN = tiny_run(model=tiny_model(vocab_size=512, num_layers=1), mesh=configs.MeshConfig(data=2, fsdp=2, tensor=2),
                    data=configs.DataConfig(seq_len=32, batch_size=16))


def _relative_errors(result, reference):
  """{metric or parameter path: relative error of result against reference}."""
  (aux, grads), (ref_aux, ref_grads) = result, reference
  errors = {key: _relative(aux[key], ref_aux[key]) for key in ref_aux}
  for (path, ref), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
    errors[jax.tree_util.keystr(path)] = _relative(g, ref)
  return errors


def test_microbatches_give_the_full_batch_loss_gradients_and_per_objective_sums():
  # One packed UL2 batch on a data 2 x fsdp 2 x tensor 2 mesh, the loss in 2 chunks of 16 positions:
  # 16 rows in one pass, and as 4 microbatches of 4. Random parameters: both must compute the same function.
  mesh = sharding.make_mesh(MESH_RUN.mesh)
  model, _, _, rules, layout = build_lib.model_and_layout(MESH_RUN, mesh, MESH_RUN.model)
  rng = np.random.default_rng(0)
  params = jax.device_put(jax.tree.map(lambda a: rng.normal(0, 0.2, a.shape).astype(np.float32),
                                       layout.abstract.params), layout.shardings.params)
  batch = sharding.shard_batch(ul2_rows(seed=3, num_rows=16, seq_len=32, vocab_size=512), mesh)
  loss_fn = step_lib.make_loss_fn(model, z_loss=1e-3, loss_chunk=16)

  def both(p, b):  # one program, one compile
    return {n: step_lib.accumulated_gradients(loss_fn, p, b, n, layout.shardings.params) for n in (1, 4)}
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
    both = jax.jit(both, in_shardings=(layout.shardings.params, sharding.batch_sharding(mesh)))
    results = jax.device_get(both(params, batch))
  aux = results[1][0]
  assert set(np.flatnonzero(aux["objective_weight_sum"])) == {0, 1, 2}  # every objective in the batch
  assert aux["tokens"] == aux["objective_weight_sum"].sum() > 0
  errors = _relative_errors(results[4], results[1])
  assert max(errors.values()) <= 1e-6, {k: e for k, e in errors.items() if e > 1e-6}


def test_microbatches_that_do_not_divide_are_config_errors():
  with pytest.raises(ConfigError, match="TrainerConfig.microbatches"):
    tiny_run(data=configs.DataConfig(seq_len=32, batch_size=8), trainer=configs.TrainerConfig(microbatches=3))
  with pytest.raises(ConfigError, match="TrainerConfig.microbatches"):
    configs.TrainerConfig(microbatches=0)
  # 16 rows over data x fsdp = 4 devices: 4 per device do not split into 8 microbatches.
  config = dataclasses.replace(MESH_RUN, trainer=configs.TrainerConfig(microbatches=8))
  with pytest.raises(ConfigError, match="TrainerConfig.microbatches"):
    build_lib.model_and_layout(config, sharding.make_mesh(config.mesh), config.model)
