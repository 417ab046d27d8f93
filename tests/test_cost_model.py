"""The TPU compiler's predicted step time (analysis/cost_model.py), read from real libtpu compiles.

libtpu is in the test extra (Linux x86_64); jax describes a v5p slice without the hardware, so every
program here is compiled for a TPU on this CPU. The checks: the cost model prices a plain matmul
within its roofline, the train step gets a positive price (nothing in it is an instruction the cost
model cannot price), a loop's body is priced once (so pricing unrolls), and the depth-1-and-2
extrapolation from depths 2 and 3 meets the unrolled program at a greater depth.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import tiny_model, tiny_run
from midas_jax import configs, flops, sharding
from midas_jax.analysis import cost_model, dcn_cost, targets
from midas_jax.bench import compile_bench
from midas_jax.model.kernels import flash, flash_attention

V5P_PEAK = 459e12  # bf16 FLOP/s per v5p chip (hardware.py)
V5P_HBM_BYTES_PER_S = 2.765e12


@pytest.fixture(scope="module")
def v5p_8():
  devices, why = targets.tpu_devices(targets.parse_target("v5p-8"))
  assert devices is not None, f"libtpu (the test extra) should describe a v5p slice here: {why}"
  return devices


def _run(num_layers=2, microbatches=1, batch_size=8):
  # Layers large enough to outweigh the embeddings, the head and the optimizer, as in a real model.
  return tiny_run(model=tiny_model(num_layers=num_layers, d_model=256, num_heads=2, num_kv_heads=2, d_ff=1024,
                                   vocab_size=512, dtype="bfloat16", attention="dot_product", max_seq_len=256),
                  mesh=configs.MeshConfig(data=1, fsdp=-1),
                  data=configs.DataConfig(seq_len=256, batch_size=batch_size),
                  trainer=dataclasses.replace(tiny_run().trainer, microbatches=microbatches, loss_chunk=0))


@pytest.fixture(scope="module")
def price(v5p_8):
  """price(config): the cost model's totals of its train step for v5p-8, each config compiled once."""
  seen = {}

  def price_of(config):
    if config not in seen:
      seen[config] = cost_model.price(compile_bench.compiled_train_step(
          config, v5p_8, unroll_microbatches=config.trainer.microbatches > 1,
          compiler_options=cost_model.PRICING_OPTIONS))
    return seen[config]
  return price_of


def _unrolled(config):
  return dataclasses.replace(config, model=dataclasses.replace(config.model, unroll_layers=True))


def test_a_matmul_is_priced_within_its_roofline(v5p_8):
  mesh = Mesh(np.array(v5p_8), ("x",))
  n = 4096
  a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None)))
  priced = cost_model.price(jax.jit(lambda x, y: x @ y).lower(a, a).compile())
  per_chip_flops = 2 * n ** 3 / len(v5p_8)
  assert priced["flops"] == per_chip_flops
  compute, memory = per_chip_flops / V5P_PEAK, priced["bytes accessed"] / V5P_HBM_BYTES_PER_S
  # Never faster than the chip's peak; measured: the compute and memory times added (119 us = 75 + 45).
  assert max(compute, memory) <= priced["optimal_seconds"] <= 1.1 * (compute + memory)


def test_the_flash_kernels_are_priced_by_the_blocks_a_causal_mask_visits(v5p_8):
  """A Pallas call is opaque to XLA's cost model, priced at nothing unless it states its cost: without
  the kernels' estimates a flash step's attention would cost 0 FLOPs and its MFU bound be inflated."""
  mesh = Mesh(np.array(v5p_8[:1]), ("x",))
  t, h, d = 2048, 4, 128
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, P()))
  args = (shape(1, t, h, d),) * 3 + (shape(1, t, dtype=jnp.int32),) * 2
  grads = jax.grad(lambda q, k, v, s, c: jnp.sum(flash_attention(q, k, v, s, c).astype(jnp.float32)),
                   argnums=(0, 1, 2))
  priced = cost_model.price(jax.jit(grads).lower(*args).compile())
  # Four blocks of 512 a side: 10 of the 16 pairs are partly visible under a causal mask.
  assert flash.causal_block_pairs(t, 512, 512) == 10
  kernels = sum(flash.cost_estimate(k, 1, h, h, t, d, 512, 512, 2).flops for k in ("forward", "dq", "dkv"))
  assert kernels == 18 * 10 * 512 * 512 * d * h
  # Measured: 24.161 GFLOP priced, 24.159 of them the kernels' (the rest: the softmax's delta, the sum).
  assert kernels <= priced["flops"] <= 1.01 * kernels
  assert priced["optimal_seconds"] >= kernels / V5P_PEAK


def test_a_loop_body_is_priced_once_so_the_step_is_priced_unrolled(price):
  config = _run(num_layers=5)
  scanned, unrolled = price(config), price(_unrolled(config))
  assert scanned["optimal_seconds"] > 0 and unrolled["optimal_seconds"] > 0  # the mask has no scatter (-1 s)
  assert unrolled["flops"] > 3 * scanned["flops"] > 0  # five layers priced, not one
  # Measured 1.59x at this size (the embeddings, head and optimizer are priced once either way); a loop
  # body priced once in both would give about 1.
  assert unrolled["optimal_seconds"] > 1.4 * scanned["optimal_seconds"]


def test_depths_two_and_three_extrapolate_to_the_unrolled_step(price):
  config = _run(num_layers=5)
  prices = cost_model.priced_depths(config, price)
  assert prices[3]["optimal_seconds"] > prices[2]["optimal_seconds"] > 0
  unrolled = price(_unrolled(config))
  extrapolated = cost_model.extrapolate(prices, 5)
  # Measured at d_model 512 and seq_len 512: 1.721 ms extrapolated, 1.739 ms unrolled (1.0%); FLOPs within 0.03%.
  assert extrapolated["optimal_seconds"] == pytest.approx(unrolled["optimal_seconds"], rel=0.03)
  assert extrapolated["flops"] == pytest.approx(unrolled["flops"], rel=0.005)


def test_microbatches_are_priced_unrolled(price):
  one, four = price(_run(num_layers=1, batch_size=16)), price(_run(num_layers=1, microbatches=4, batch_size=16))
  # The same rows in four passes: about the same FLOPs, not a quarter of them (a loop priced once).
  assert four["flops"] == pytest.approx(one["flops"], rel=0.25)


def test_sliced_prefetches_are_left_out_of_the_pricing_compile():
  # On a v5e, memory space assignment prefetches a large embedding into VMEM in asynchronous slices,
  # which the cost model prices at -1 s each; the pricing compiles turn them off.
  devices, why = targets.tpu_devices(targets.parse_target("v5litepod-8"))
  assert devices is not None, why
  config = _run(num_layers=1)
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, d_model=256, d_ff=512,
                                                                 vocab_size=32128, unroll_layers=True))
  default = compile_bench.compiled_train_step(config, devices)
  assert "slice-start" in default.as_text() and cost_model.price(default)["optimal_seconds"] < 0
  priced = compile_bench.compiled_train_step(config, devices, compiler_options=cost_model.PRICING_OPTIONS)
  assert "slice-start" not in priced.as_text()
  assert cost_model.price(priced)["optimal_seconds"] > 0
  assert cost_model.price(priced)["flops"] == cost_model.price(default)["flops"]  # the same program's work


def test_the_prediction_is_the_compiler_price_over_the_chips_peak():
  config = _run(num_layers=4)
  prices = {2: {"optimal_seconds": 1.0, "flops": 10.0, "bytes accessed": 5.0},
            3: {"optimal_seconds": 1.5, "flops": 14.0, "bytes accessed": 6.0}}
  model = dataclasses.replace(config.model, vocab_size=512)
  out = cost_model.prediction(config, prices, (2, 4), chips=4, device_kind="TPU v5", model_config=model)
  step = out["steps"]["4"]
  assert step["seconds"] == 2.0  # 1.0 + (4 - 2) x 0.5
  seq_len = config.data.seq_len
  tokens = 8 * seq_len
  assert step["tokens_per_s_per_chip"] == tokens / 2.0 / 4
  assert step["mfu_bound"] == pytest.approx(flops.train_flops_per_token(model, seq_len, 4) * tokens / (2.0 * V5P_PEAK * 4))
  assert cost_model.run_seconds(out, (10, 30), (2, 4)) == 10 * 1.0 + 30 * 2.0
  # These prices count far fewer FLOPs than the model has: no bound, and the report says so.
  assert out["undercounted"] < 0.01
  assert "not a lower bound" in "\n".join(compile_bench._predicted_lines(dict(out, stages=[{"depth": 4, "steps": 1}])))
  counted_all = {d: dict(p, flops=flops.train_flops_per_token(model, seq_len, d) * tokens / 4) for d, p in prices.items()}
  assert "undercounted" not in cost_model.prediction(config, counted_all, (2,), 4, "TPU v5", model)
  negative = {2: dict(prices[2], optimal_seconds=-1.99), 3: prices[3]}
  unpriced = cost_model.prediction(config, negative, (4,), chips=4, device_kind="TPU v5", model_config=model)
  assert "unpriced" in unpriced and cost_model.run_seconds(unpriced, (1,), (4,)) is None


def _sliced_run(slices: int):
  """The same per-chip work as one slice of 8 chips (data 2 x fsdp 4) or two slices of 4 (data over DCN)."""
  return tiny_run(model=tiny_model(num_layers=2, d_model=256, num_heads=2, num_kv_heads=2, d_ff=512, vocab_size=512,
                                   dtype="bfloat16", attention="dot_product", max_seq_len=256, unroll_layers=True),
                  mesh=configs.MeshConfig(data=2 if slices == 1 else 1, fsdp=4, dcn_data=slices),
                  data=configs.DataConfig(seq_len=256, batch_size=16),
                  trainer=dataclasses.replace(tiny_run().trainer, loss_chunk=0))


def test_a_two_slice_step_is_priced_with_the_compilers_cross_slice_calls_at_zero():
  """A multi-slice program holds custom calls the compiler adds for its DCN collectives, which the cost
  model counts at -1 s each; priced at 0, the step costs about what the same per-chip work does on one
  slice, and the gradient it sends across slices is each chip's shard of the parameters."""
  programs = {}
  for slices, target in ((2, "2xv5p-8"), (1, "v5p-16")):
    devices, why = targets.tpu_devices(targets.parse_target(target))
    assert devices is not None, why
    programs[slices] = compile_bench.compiled_train_step(_sliced_run(slices), devices,
                                                         compiler_options=cost_model.PRICING_OPTIONS)
  two, one = programs[2], programs[1]
  calls = [c for c in cost_model.UNPRICED_CALLS if f'custom_call_target="{c}"' in two.as_text()]
  assert calls == ["SliceId", "ZeroCrop"] and not any(c in one.as_text() for c in calls)
  raw = two.cost_analysis()["optimal_seconds"]
  assert -2.0 < raw < -1.99  # two calls at -1 s each, beside a step of about 0.1 ms
  priced, alone = cost_model.price(two, slices=2), cost_model.price(one, slices=1)
  assert priced["unpriced_calls"] == 2 and priced["optimal_seconds"] == pytest.approx(raw + 2)
  # Measured: 0.125 ms against 0.113 ms on one slice (the cross-slice sends priced at on-chip speed).
  assert priced["optimal_seconds"] == pytest.approx(alone["optimal_seconds"], rel=0.25)
  assert priced["flops"] == pytest.approx(alone["flops"], rel=0.01)
  # Across two slices each chip all-reduces its fsdp shard of the float32 gradient, and a few metrics. The
  # tied embedding's gradient crosses twice (its lookup's and its head's parts are reduced apart): measured
  # 1,581,568 bytes sent against 1,443,072 of parameters a chip, 32,768 x 4 of them the embedding's shard.
  mesh = sharding.make_mesh(_sliced_run(2).mesh, targets.tpu_devices(targets.parse_target("2xv5p-8"))[0])
  params = compile_bench.state_bytes(compile_bench._parts(_sliced_run(2), mesh)[-1])["params"]
  embedding_shard = 512 * 256 // 4 * 4
  sent = dcn_cost.bytes_sent(two.as_text(), 2)
  assert set(sent) == {"all-reduce"}
  assert params + embedding_shard <= sent["all-reduce"] <= params + embedding_shard + 16 * 1024
  assert alone["dcn_bytes"] == 0


def test_the_data_center_network_bounds_a_multi_slice_step():
  config = _run(num_layers=4)
  model = dataclasses.replace(config.model, vocab_size=512)
  v5p_dcn = 50e9 / 8  # bytes/s per chip
  prices = {2: {"optimal_seconds": 0.010, "flops": 1.0, "bytes accessed": 1.0, "dcn_bytes": 0.05 * v5p_dcn},
            3: {"optimal_seconds": 0.012, "flops": 1.0, "bytes accessed": 1.0, "dcn_bytes": 0.07 * v5p_dcn}}
  step = cost_model.prediction(config, prices, (2, 4), chips=4, device_kind="TPU v5", model_config=model)["steps"]
  # Depth 4: the chip's price 0.014 s, the network 0.09 s: the network binds; without overlap, the sum.
  assert step["4"]["dcn_seconds"] == pytest.approx(0.09)
  assert step["4"]["seconds"] == pytest.approx(0.09) and step["4"]["seconds_without_overlap"] == pytest.approx(0.104)
  assert step["2"]["seconds"] == pytest.approx(0.05)
  cheap = {d: dict(p, dcn_bytes=0.001 * v5p_dcn) for d, p in prices.items()}
  assert cost_model.prediction(config, cheap, (2,), 4, "TPU v5", model)["steps"]["2"]["seconds"] == 0.010
  unknown = cost_model.prediction(config, prices, (2,), 4, "TPU v4", model)
  assert "dcn_unpriced" in unknown and unknown["steps"]["2"]["seconds"] == 0.010
