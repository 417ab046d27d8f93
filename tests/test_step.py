"""The train step's loss and gradients: chunked cross-entropy and gradient accumulation over
microbatches give today's numbers, through growth and resume, on the 8-device mesh."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model, tiny_run
from midas_jax import configs, sharding
from midas_jax.checkpoint import available_steps, load_model
from midas_jax.errors import ConfigError
from midas_jax.train import loop, step as step_lib
from midas_jax.train.experiment import build_experiment
from midas_jax.train.metrics import read_metrics


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


def _experiment(microbatches, batch_size=16, **mesh):
  config = tiny_run(model=tiny_model(num_heads=4, num_kv_heads=2),
                    mesh=configs.MeshConfig(**(mesh or dict(data=1, fsdp=-1))),
                    data=configs.DataConfig(seq_len=32, batch_size=batch_size),
                    trainer=configs.TrainerConfig(num_steps=4, microbatches=microbatches, loss_chunk=16,
                                                  progress_bar=False))
  return build_experiment(config)


def test_microbatches_give_the_full_batch_loss_gradients_and_per_objective_sums():
  exp = _experiment(4, batch_size=32)  # 32 rows on 8 devices: 4 per device, or 4 microbatches of one each
  loss_fn = step_lib.make_loss_fn(exp.model, z_loss=1e-3, loss_chunk=16)
  results = {}
  with exp.context():
    params, batch = exp.init_state().params, exp.device_batch(0)
    for n in (1, 4):
      grads_of = jax.jit(lambda p, b, n=n: step_lib.accumulated_gradients(loss_fn, p, b, n,
                                                                          exp.layout.shardings.params),
                         in_shardings=(exp.layout.shardings.params, sharding.batch_sharding(exp.mesh)))
      results[n] = jax.device_get(grads_of(params, batch))
  (aux1, grads1), (aux4, grads4) = results[1], results[4]
  assert set(np.flatnonzero(aux1["objective_weight_sum"])) == {0, 1, 2}  # every objective in the batch
  for key in aux1:
    assert _relative(aux4[key], aux1[key]) <= 1e-6, key
  for g4, g1 in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads1)):
    assert _relative(g4, g1) <= 1e-6


def _stacked(microbatches):
  return configs.RunConfig(
      model=tiny_model(num_layers=4), mesh=configs.MeshConfig(),
      optimizer=configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=2),
      data=configs.DataConfig(seq_len=32, batch_size=16),
      trainer=configs.TrainerConfig(num_steps=4, log_every=1, eval_every=0, eval_batches=1, progress_bar=False,
                                    peak_flops_per_device=1e11, microbatches=microbatches),
      stacking=configs.StackingConfig(num_stages=2, stage_steps=(2, 2)),
      checkpoint=configs.CheckpointConfig(every=1, keep=10))


def test_microbatches_through_growth_and_an_exact_resume_on_eight_devices(tmp_path):
  config = _stacked(microbatches=2)  # 16 rows on 8 devices: 2 microbatches of one row per device
  reference = str(tmp_path / "reference")
  loop.train(config, reference)
  rows = read_metrics(reference, "train")
  assert [r["depth"] for r in rows] == [2, 2, 4, 4] and all(np.isfinite(r["loss"]) for r in rows)
  crashed = str(tmp_path / "crashed")
  shutil.copytree(reference, crashed)
  for step in available_steps(crashed):
    if step != 1:
      shutil.rmtree(os.path.join(crashed, "checkpoints", str(step)))
  assert loop.train(config, crashed).start_step == 1  # resumes before the growth at step 2
  for a, b in zip(jax.tree.leaves(load_model(crashed).params), jax.tree.leaves(load_model(reference).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [r["loss"] for r in read_metrics(crashed, "train")] == [r["loss"] for r in rows]


def test_microbatches_that_do_not_divide_are_config_errors():
  with pytest.raises(ConfigError, match="TrainerConfig.microbatches"):
    tiny_run(data=configs.DataConfig(seq_len=32, batch_size=8), trainer=configs.TrainerConfig(microbatches=3))
  with pytest.raises(ConfigError, match="TrainerConfig.microbatches"):
    _experiment(microbatches=4)  # 16 rows over 8 devices: 2 per device do not split into 4
  with pytest.raises(ConfigError, match="TrainerConfig.microbatches"):
    configs.TrainerConfig(microbatches=0)
