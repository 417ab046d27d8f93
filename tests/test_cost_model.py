"""The TPU compiler's estimated step time (analysis/cost_model.py), read from real libtpu compiles.

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
from midas_jax import configs, flops, results, sharding
from midas_jax.analysis import compile_table, cost_model, dcn_cost, targets
from midas_jax.bench import compile_bench
from midas_jax.model.kernels import flash, flash_attention
from midas_jax.stacking.checks import schedule_for
from midas_jax.stacking.schedule import StageSchedule, flop_speedup

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
  the kernels' estimates a flash step's attention would cost 0 FLOPs and its MFU estimate be inflated."""
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


def test_the_estimate_is_the_compiler_price_over_the_chips_peak():
  config = _run(num_layers=4)
  prices = {2: {"optimal_seconds": 1.0, "flops": 10.0, "bytes accessed": 5.0},
            3: {"optimal_seconds": 1.5, "flops": 14.0, "bytes accessed": 6.0}}
  model = dataclasses.replace(config.model, vocab_size=512)
  out = cost_model.estimate(config, prices, (2, 4), chips=4, device_kind="TPU v5", model_config=model)
  step = out["steps"]["4"]
  assert step["seconds"] == 2.0  # 1.0 + (4 - 2) x 0.5
  seq_len = config.data.seq_len
  tokens = 8 * seq_len
  assert step["tokens_per_s_per_chip"] == tokens / 2.0 / 4
  assert step["mfu_estimate"] == pytest.approx(flops.train_flops_per_token(model, seq_len, 4) * tokens / (2.0 * V5P_PEAK * 4))
  assert cost_model.run_seconds(out, (10, 30), (2, 4)) == 10 * 1.0 + 30 * 2.0
  # These prices count far fewer FLOPs than the model has: the times are too low, and the report says so.
  assert out["undercounted"] < 0.01
  lines = "\n".join(compile_bench.estimated_lines(dict(out, stages=[{"depth": 4, "steps": 1}])))
  assert "these times are too low" in lines and "bound" not in lines
  counted_all = {d: dict(p, flops=flops.train_flops_per_token(model, seq_len, d) * tokens / 4) for d, p in prices.items()}
  assert "undercounted" not in cost_model.estimate(config, counted_all, (2,), 4, "TPU v5", model)
  negative = {2: dict(prices[2], optimal_seconds=-1.99), 3: prices[3]}
  unpriced = cost_model.estimate(config, negative, (4,), chips=4, device_kind="TPU v5", model_config=model)
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


def test_the_data_center_network_can_set_a_multi_slice_step():
  config = _run(num_layers=4)
  model = dataclasses.replace(config.model, vocab_size=512)
  v5p_dcn = 50e9 / 8  # bytes/s per chip
  prices = {2: {"optimal_seconds": 0.010, "flops": 1.0, "bytes accessed": 1.0, "dcn_bytes": 0.05 * v5p_dcn},
            3: {"optimal_seconds": 0.012, "flops": 1.0, "bytes accessed": 1.0, "dcn_bytes": 0.07 * v5p_dcn}}
  step = cost_model.estimate(config, prices, (2, 4), chips=4, device_kind="TPU v5", model_config=model)["steps"]
  # Depth 4: the chip's price 0.014 s, the network 0.09 s: the network binds; without overlap, the sum.
  assert step["4"]["dcn_seconds"] == pytest.approx(0.09)
  assert step["4"]["seconds"] == pytest.approx(0.09) and step["4"]["seconds_without_overlap"] == pytest.approx(0.104)
  assert step["2"]["seconds"] == pytest.approx(0.05)
  cheap = {d: dict(p, dcn_bytes=0.001 * v5p_dcn) for d, p in prices.items()}
  assert cost_model.estimate(config, cheap, (2,), 4, "TPU v5", model)["steps"]["2"]["seconds"] == 0.010
  unknown = cost_model.estimate(config, prices, (2,), 4, "TPU v4", model)
  assert "dcn_unpriced" in unknown and unknown["steps"]["2"]["seconds"] == 0.010


def test_midas_wall_clock_speedup_is_the_baselines_seconds_over_the_sum_over_stages():
  """Prices worked by hand: 1.0 s at 2 layers, 1.5 s at 3, so 0.5 s a layer over a 0.0 s base; a
  3-stage schedule of depths 2, 4, 6 with 10, 20, 30 steps against 60 steps at 6 layers."""
  config = _run(num_layers=6)
  model = dataclasses.replace(config.model, vocab_size=512)
  prices = {2: {"optimal_seconds": 1.0, "flops": 1.0, "bytes accessed": 1.0},
            3: {"optimal_seconds": 1.5, "flops": 1.0, "bytes accessed": 1.0}}
  est = cost_model.estimate(config, prices, (2, 4, 6), chips=4, device_kind="TPU v5", model_config=model)
  schedule = StageSchedule((10, 20, 30), 2, (2, 4, 6))
  out = cost_model.speedups(est, schedule, flop_speedup=1.25)
  # steps at 2, 4, 6 layers: 1.0, 2.0, 3.0 s; baseline 60 x 3.0 = 180 s; MIDAS 10 + 40 + 90 = 140 s.
  assert [s["seconds"] for s in out["stages"]] == [1.0, 2.0, 3.0]
  assert out["baseline_seconds"] == 180.0 and out["stacked_seconds"] == 140.0
  assert out["wall_clock"] == pytest.approx(180 / 140) and out["flops"] == 1.25


def test_one_pricing_gives_each_paper_midas_schedule(v5p_8, price):
  """A 6-layer model growing 2 layers a stage, priced once (depths 2 and 3) on a v5p-8: Prop-1, 2 and 3
  from the same prices, each stage's step the price extrapolated to its depth, the FLOP speedup
  flops.py's, and the table rendering one row per schedule with no "bound" in it."""
  base = _run(num_layers=6)
  config = dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, num_steps=60),
                               stacking=configs.StackingConfig(num_stages=3, block_size=2, operator="midas"))
  model = dataclasses.replace(config.model, vocab_size=512)
  schedule = schedule_for(config)
  # A depth's program is the same whatever the schedule: priced as the extrapolation test priced it.
  same_program = lambda c: price(dataclasses.replace(c, trainer=base.trainer, stacking=base.stacking))
  est = compile_bench._estimated(config, v5p_8, schedule, model, chips=4, price_at=same_program)
  assert set(est["midas"]) == {"prop1", "prop2", "prop3"}
  one = est["midas"]["prop1"]
  assert [(s["depth"], s["steps"]) for s in one["stages"]] == [(2, 10), (4, 20), (6, 30)]  # Prop-1: 1:2:3
  per_layer = est["prices"]["3"]["optimal_seconds"] - est["prices"]["2"]["optimal_seconds"]
  assert one["stages"][2]["seconds"] == pytest.approx(est["prices"]["2"]["optimal_seconds"] + 4 * per_layer)
  assert one["wall_clock"] == pytest.approx(60 * one["stages"][2]["seconds"] / sum(
      s["steps"] * s["seconds"] for s in one["stages"]))
  assert one["flops"] == pytest.approx(flop_speedup(model, config.data.seq_len, schedule))
  assert 1.0 < one["wall_clock"] < 60 * 6 / (10 * 2 + 20 * 4 + 30 * 6)  # a fixed cost per step: below layers alone
  assert est["midas"]["prop3"]["wall_clock"] < est["midas"]["prop2"]["wall_clock"] < one["wall_clock"]
  report = {"target": "v5p-8", "model": {"params": 3e8, "attention": "dot_product"}, "tpu_flags": [],
            "batch": {"global": 8, "seq_len": 256, "microbatches": 1}, "estimated": est}
  rows = compile_table.midas_rows([report])
  assert [r[6] for r in rows] == ["midas prop1", "midas prop2", "midas prop3"]
  assert rows[0][10] == one["wall_clock"] and rows[0][11] == one["flops"]
  text = results.markdown(results.table(compile_table.MIDAS_COLUMNS, rows, compile_table.MIDAS_FORMATS))
  assert "bound" not in text.lower() and "estimated" in text


def test_the_spread_is_the_lowest_and_highest_of_repeated_estimates():
  def report(seconds_2, seconds_3):
    steps = {"4": {"seconds": seconds_2 + 2 * (seconds_3 - seconds_2)}}
    return {"target": "v5p-128", "model": {"params": 1e9, "attention": "flash"}, "tpu_flags": ["a", "b"],
            "batch": {"global": 256, "seq_len": 2048, "microbatches": 1},
            "estimated": {"steps": steps, "prices": {"2": {"optimal_seconds": seconds_2},
                                                      "3": {"optimal_seconds": seconds_3}}}}
  rows = compile_table.spread_rows([report(0.10, 0.12), report(0.10, 0.13), report(0.09, 0.12)])
  assert len(rows) == 1
  row = rows[0]
  assert row[5] == 3 and row[6] == "2 flags"
  assert row[7] == pytest.approx(140.0) and row[8] == pytest.approx(160.0)  # 0.12+0.02x2=0.14..0.10+0.03x2=0.16 s
  assert row[9] == pytest.approx(160 / 140 - 1)
  assert (row[10], row[11], row[12], row[13]) == pytest.approx((90.0, 100.0, 120.0, 130.0))
  # A run compiled in another setting (jax's CPU backend alone; a VMEM limit the user set) is a row of its own.
  other = dict(report(0.11, 0.14), environment={"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
  vmem = dict(report(0.09, 0.11), libtpu_init_args="--xla_tpu_scoped_vmem_limit_kib=98304 a b")
  rows = compile_table.spread_rows([report(0.10, 0.12), other, report(0.10, 0.13), vmem])
  assert [(r[5], r[6]) for r in rows] == [(2, "2 flags"), (1, "2 flags, JAX_PLATFORMS=cpu"),
                                          (1, "3 flags, scoped VMEM 98304 KiB")]
  assert rows[1][7] == rows[1][8] == pytest.approx(170.0) and rows[1][9] == 0.0
