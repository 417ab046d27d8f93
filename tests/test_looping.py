"""Looped models: a tied block applied several times, in training and at evaluation."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import layer_config, tiny_model, tiny_run
from midas_jax import configs
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, describe_mask, dummy_batch, layer_order
from midas_jax.model.layers import Block, Norm
from midas_jax.train.run import train
from midas_jax.train.metrics import read_metrics


def test_loop_order_and_middle_block():
  assert layer_order.loop_order(5, 1, 2, 3).tolist() == [0, 1, 2, 1, 2, 1, 2, 3, 4]
  assert [layer_order.middle_block(n * 2, 2) for n in range(1, 7)] == [0, 0, 2, 2, 4, 4]  # block ceil(n/2)
  with pytest.raises(ConfigError, match="ModelConfig.loop_repeats"):
    tiny_model(num_layers=2, loop_start=1, loop_size=2, loop_repeats=2)


def _per_layer_forward(cfg, params, batch, order):
  mask = describe_mask(batch["segment_ids"], batch["positions"], batch["prefix_mask"])
  x = Decoder(cfg).apply({"params": params}, batch["inputs"], batch["positions"], method=Decoder.embed)
  for i in order:
    x, _ = Block(layer_config(cfg)).apply({"params": jax.tree.map(lambda p: p[i], params["layers"])}, x, batch["positions"], mask)
  x = Norm(cfg).apply({"params": params["final_norm"]}, x)
  return jnp.einsum("btd,vd->btv", x, params["embedding"])


def test_looped_forward_repeats_the_tied_block_and_its_gradient_sums():
  base = tiny_model(num_layers=3).with_vocab(300)
  looped = layer_order.loop_middle_block(base, block_size=1, repeats=3)  # 3 blocks of 1: middle is layer 1
  assert layer_order.order_for(looped).tolist() == [0, 1, 1, 1, 2]
  batch = dummy_batch(2, 16)
  batch["inputs"] = jax.random.randint(jax.random.key(1), (2, 16), 3, 250)
  params = Decoder(base).init(jax.random.key(0), batch)["params"]
  params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
  np.testing.assert_allclose(Decoder(looped).apply({"params": params}, batch),
                             _per_layer_forward(base, params, batch, [0, 1, 1, 1, 2]), atol=1e-5)
  grads = jax.grad(lambda p: jnp.mean(Decoder(looped).apply({"params": p}, batch) ** 2))(params)
  expected = jax.grad(lambda p: jnp.mean(_per_layer_forward(base, p, batch, [0, 1, 1, 1, 2]) ** 2))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, expected)


# Per token of the tiny llama (d 32, 4 heads of 8, 2 kv heads, d_ff 64, vocab 512) at seq 32, by hand:
# a layer application is 6 * (9216 matmul weights + 2 * (32 / 2) * 4 * 8 attention: scores and values over
# the causal half of the 32 keys, 1024), the head 6 * 32 * 512.
LAYER_FLOPS, HEAD_FLOPS = 6 * (9216 + 2 * (32 // 2) * 4 * 8), 6 * 32 * 512
TOKENS_PER_STEP = 8 * 32
PEAK = 1e11 * 8  # TrainerConfig.peak_flops_per_device over the 8 simulated devices


def assert_flops_by_hand(rows, applications_at_step):
  """Each logged cumulative_flops is the sum of every step's layer applications by hand, and MFU
  is the logged step's FLOPs over its logged time and the peak."""
  for row in rows:
    spent = sum(TOKENS_PER_STEP * (applications_at_step(s) * LAYER_FLOPS + HEAD_FLOPS) for s in range(row["step"]))
    assert row["cumulative_flops"] == spent, row
    if "mfu" in row:
      step_flops = TOKENS_PER_STEP * (applications_at_step(row["step"] - 1) * LAYER_FLOPS + HEAD_FLOPS)
      assert row["mfu"] == pytest.approx(step_flops / row["step_seconds"] / PEAK, rel=1e-9), row


def test_training_a_looped_model_and_growing_it(tmp_path):
  """Stage 1 trains a looped model of 2 layers with layer 1 applied twice (0, 1, 1); MIDAS growth
  then makes it 4 layers, still looping layer 1 (0, 1, 1, 2, 3): 3, then 5 layer applications are
  counted in the FLOPs, while 4 unique layers are stored."""
  model = tiny_model(num_layers=4, loop_start=1, loop_size=1, loop_repeats=2)
  config = dataclasses.replace(
      tiny_run(model=model, trainer=configs.TrainerConfig(num_steps=6, log_every=1, eval_every=0,
                                                          progress_bar=False, peak_flops_per_device=1e11)),
      stacking=configs.StackingConfig(num_stages=2, stage_steps=(3, 3)))
  result = train(config, str(tmp_path))
  assert [g["step"] for g in result.growths] == [3]
  rows = read_metrics(str(tmp_path), "train")
  assert rows[-1]["loss"] < rows[0]["loss"]
  assert [r["depth"] for r in rows] == [2, 2, 2, 4, 4, 4]
  saved = json.loads((tmp_path / "config.json").read_text())["model"]
  assert saved["num_layers"] == 4 and saved["vocab_size"] == 512
  # 282,624 and 405,504 per token; without the loop counted, 221,184 and 344,064.
  assert (3 * LAYER_FLOPS + HEAD_FLOPS, 5 * LAYER_FLOPS + HEAD_FLOPS) == (282_624, 405_504)
  assert_flops_by_hand(rows, lambda step: 3 if step < 3 else 5)
  assert {r["depth"] for r in rows if "mfu" in r} == {2, 4}  # MFU checked in both stages
