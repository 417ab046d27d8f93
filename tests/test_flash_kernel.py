"""The streamed flash kernels (model/kernels/): values and gradients against the dense path on packed UL2
rows, the blocks they visit, the block-size settings, the remat policies keeping their output, and a
TPU compile at 32,768 positions (libtpu, ahead of time on this CPU host)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT, tiny_model, ul2_rows
from midas_jax.errors import ConfigError
from midas_jax.model import attention, describe_mask, dummy_batch, transformer
from midas_jax.model.kernels import block_tables, flash, flash_attention


def _mask(seed, rows, length):
  batch = ul2_rows(seed=seed, num_rows=rows, seq_len=length)
  return describe_mask(jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"]),
                       jnp.asarray(batch["prefix_mask"]))


def _values_and_gradients(attend, q, k, v, weights):
  """attend's output and the gradients of sum(output * weights) (in float32), from one program."""
  def loss(q, k, v):
    out = attend(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * weights), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return [np.asarray(x, np.float32) for x in (out, *grads)]


def _case(seed, length, heads, kv_heads, head_dim, dtype):
  mask = _mask(seed, 2, length)
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, n, head_dim)), dtype) for n in (heads, kv_heads, kv_heads))
  # The weights (the output's cotangent) are bfloat16 values, so a bfloat16 output's cotangent is exact.
  weights = jnp.asarray(rng.normal(size=(2, length, heads, head_dim)), jnp.bfloat16).astype(jnp.float32)
  return mask, (q, k, v), weights


@pytest.mark.parametrize("length,heads,kv_heads,blocks", [
    (64, 2, 2, (16, 16)),  # multi-head, equal blocks
    (72, 4, 1, (16, 32)),  # GQA groups of 4, key blocks larger than query blocks, a length the kernel pads (to 96)
])  # and the bfloat16 test below: GQA groups of 2, query blocks larger
def test_float32_values_and_gradients_equal_the_dense_path(length, heads, kv_heads, blocks):
  mask, qkv, weights = _case(length, length, heads, kv_heads, 32, jnp.float32)
  flash_out = _values_and_gradients(
      lambda q, k, v: flash_attention(q, k, v, mask.segment_ids, mask.causal_positions, *blocks), *qkv, weights)
  dense_out = _values_and_gradients(lambda q, k, v: attention.dense_attention(q, k, v, mask), *qkv, weights)
  for name, got, want in zip(("out", "dq", "dk", "dv"), flash_out, dense_out):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_bfloat16_values_and_gradients_are_within_rounding_of_the_float32_dense_path():
  """bfloat16 inputs against the float32 dense path on the same (bfloat16) values.

  bfloat16 keeps 8 significant bits: each rounding to it is off by at most 2^-9 of the value (round
  to nearest). Where the kernel rounds, to bfloat16 operands of a float32-accumulated matmul (the
  probabilities before P V; dS before dS K and dS^T Q) and its outputs, a result passes at most four
  such roundings, so its error is within about 4 * 2^-9 = 2^-7 of its largest term; sums of terms of
  both signs can cancel below that term, so the bound allowed is twice that, 2^-6 (1.6%) of the
  result's largest magnitude. The dense path run in bfloat16 (what the model runs without flash)
  rounds at the same places, so the kernel must also be no worse than twice its error.
  """
  mask, qkv, weights = _case(5, 96, 4, 2, 32, jnp.bfloat16)
  flash_out = _values_and_gradients(
      lambda q, k, v: flash_attention(q, k, v, mask.segment_ids, mask.causal_positions, 32, 16), *qkv, weights)
  # float32 operands: XLA's CPU backend cannot multiply bfloat16 into float32 (the same products either way).
  dense_bf16 = _values_and_gradients(lambda q, k, v: attention.dense_attention(q, k, v, mask, jnp.float32), *qkv,
                                     weights)
  wide = [x.astype(jnp.float32) for x in qkv]
  dense_f32 = _values_and_gradients(lambda q, k, v: attention.dense_attention(q, k, v, mask), *wide, weights)
  for name, got, xla, want in zip(("out", "dq", "dk", "dv"), flash_out, dense_bf16, dense_f32):
    scale = np.abs(want).max()
    error, xla_error = np.abs(got - want).max() / scale, np.abs(xla - want).max() / scale
    assert 0 < error <= 2 ** -6, (name, error)  # > 0: the kernel really ran in bfloat16
    assert error <= 2 * xla_error, (name, error, xla_error)


def _known_mask():
  """One row of 128 tokens, blocks of 16: example A = tokens 0-47 with a bidirectional prefix 0-15,
  example B = tokens 48-111 causal, then 16 padding tokens. Block boundaries fall on the examples'
  and the prefix's, so the block summaries are exact."""
  seg = np.r_[np.full(48, 1), np.full(64, 2), np.zeros(16)].astype(np.int32)
  pos = np.r_[np.arange(48), np.arange(64), np.zeros(16)].astype(np.int32)
  prefix = np.r_[np.ones(16), np.zeros(112)].astype(bool)
  return describe_mask(jnp.asarray(seg[None]), jnp.asarray(pos[None]), jnp.asarray(prefix[None]))


def _visited(lists):
  """{(owned block, visited block): needs mask} from VisitLists of one row."""
  codes, counts = np.asarray(lists.codes)[0], np.asarray(lists.counts)[0]
  return {(i, int(c) // 2): bool(c % 2) for i in range(len(counts)) for c in codes[i, :counts[i]]}


def test_the_visit_lists_hold_exactly_the_visible_block_pairs_and_mask_only_the_partly_visible():
  mask = _known_mask()
  dense = np.asarray(attention.dense_mask(mask))[0, 0].reshape(8, 16, 8, 16)
  some, every = dense.any(axis=(1, 3)), dense.all(axis=(1, 3))  # [q block, k block]
  query_lists, key_lists = block_tables.flash_visits(mask.segment_ids, mask.causal_positions, 16, 16)
  expected = {(i, j): not every[i, j] for i in range(8) for j in range(8) if some[i, j]}
  assert _visited(query_lists) == expected
  assert _visited(key_lists) == {(j, i): masked for (i, j), masked in expected.items()}
  # The known mask: A's prefix block sees itself unmasked; A's later blocks see its prefix unmasked and
  # themselves masked (causal); the padding blocks see only their own (masked: one segment a token).
  assert expected[(0, 0)] is False and expected[(1, 0)] is False and expected[(1, 1)] is True
  assert sum(not m for m in expected.values()) == 4 + 6  # A: prefix block, 3 later pairs; B: 6 below the diagonal
  assert len(expected) == 6 + 10 + 1  # A: 6 pairs, B: 10, padding: 1 (of 64)
  codes, counts = np.asarray(query_lists.codes)[0], np.asarray(query_lists.counts)[0]
  for row, count in zip(codes, counts):  # visible first, increasing; the rest repeat the last (no new copy)
    assert (np.diff(row[:count] // 2) > 0).all() and (row[count:] // 2 == row[count - 1] // 2).all()


def test_the_kernels_visit_only_the_listed_blocks():
  """Copy j of the batch has the values (for the backward: the queries) of block j poisoned with NaN. A
  kernel that fetched and multiplied a block carries its NaN into the owned block's result even where the
  mask weights it by 0 (0 * NaN = NaN); one that skipped it stays finite. So the NaN pattern of the
  outputs is the set of block pairs each kernel visited."""
  mask = _known_mask()
  seg, cpos = (jnp.repeat(x, 8, axis=0) for x in (mask.segment_ids, mask.causal_positions))
  query_lists, key_lists = block_tables.flash_visits(mask.segment_ids, mask.causal_positions, 16, 16)
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(8, 128, n, 16)), jnp.float32) for n in (2, 1, 1))
  poison = (jnp.arange(128)[None, :] // 16 == jnp.arange(8)[:, None])[:, :, None, None]  # copy j: block j
  attend = lambda q, k, v: flash_attention(q, k, v, seg, cpos, 16, 16)
  block_nan = lambda x: np.isnan(np.asarray(x)).reshape(8, 8, -1).any(-1)  # [copy j, owned block]
  pairs = lambda x: {(owned, copy) for copy, owned in zip(*np.nonzero(block_nan(x)))}
  out, dq = jax.jit(lambda q: _out_and_dq(attend, q, k, jnp.where(poison, jnp.nan, v)))(q)
  assert pairs(out) == set(_visited(query_lists)) and pairs(dq) == set(_visited(query_lists))
  dk, dv = jax.jit(jax.grad(lambda k, v: jnp.sum(attend(jnp.where(poison, jnp.nan, q), k, v)), argnums=(0, 1)))(k, v)
  assert pairs(dk) == set(_visited(key_lists)) and pairs(dv) == set(_visited(key_lists))


def _out_and_dq(attend, q, k, v):
  out, vjp = jax.vjp(lambda q: attend(q, k, v), q)
  return out, vjp(jnp.ones_like(out))[0]


def test_block_sizes_per_platform_and_their_settings():
  assert flash.block_sizes("tpu", 32768) == (512, 512)
  assert flash.block_sizes("tpu", 300) == (384, 384)  # capped by the length padded to the TPU's 128 lanes
  assert flash.block_sizes("tpu", 8192, 64, 1024) == (128, 1024)  # rounded up to the tile
  assert flash.block_sizes("interpret", 44) == (48, 48) and flash.block_sizes("gpu", 4096) == (128, 128)
  assert flash.padded_length(300, 384, 256) == 768
  with pytest.raises(ConfigError, match="ModelConfig.flash_block_q"):
    tiny_model(flash_block_q=100)
  with pytest.raises(ConfigError, match="ModelConfig.flash_block_kv"):
    tiny_model(flash_block_kv=-128)
  mask = _mask(0, 1, 64)
  x = jnp.zeros((1, 64, 2, 8))
  with pytest.raises(ConfigError, match="ModelConfig.flash_block_q"):
    flash_attention(x, x, x, mask.segment_ids, mask.causal_positions, block_q=12)
  # The settings reach the kernels: the interpreter's grid is (batch, heads, query blocks, key steps).
  cfg = tiny_model(attention="flash", num_layers=1, vocab_size=256, flash_block_q=128, flash_block_kv=256)
  model = transformer.Decoder(cfg)
  batch = dummy_batch(2, 256)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch))
  text = str(jax.make_jaxpr(lambda p: model.apply(p, batch))(params))
  assert f"grid=(2, {cfg.num_heads}, 2, 1)" in text


def _kernel_calls(cfg, platform="tpu"):
  """{kernel name: count} in jax.grad of a one-layer model, lowered for `platform`."""
  model = transformer.Decoder(cfg, platform=platform)
  batch = dummy_batch(2, 256)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch))
  grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, batch))))
  text = grad.trace(params).lower(lowering_platforms=(platform,)).as_text()
  return {name: text.count(f'"{name}"') for name in flash.KERNEL_NAMES}


@pytest.mark.parametrize("policy,forwards", [("none", 1), ("minimal", 1), ("save_dots", 1), ("full", 2)])
def test_remat_policies_that_keep_projections_keep_the_kernel_output(policy, forwards):
  """The forward kernel's output and logsumexp are named 'projection': 'minimal' and 'save_dots' keep
  them, so the backward pass runs the forward kernel no second time; 'full' saves nothing and does."""
  cfg = tiny_model(attention="flash", num_layers=1, remat_policy=policy, vocab_size=256, dtype="bfloat16")
  assert _kernel_calls(cfg) == {"ul2_flash_forward": forwards, "ul2_flash_dq": 1, "ul2_flash_dkv": 1}


def _tpu_chip():
  from midas_jax.analysis import targets  # pylint: disable=import-outside-toplevel
  devices, why = targets.tpu_devices(targets.parse_target("v5p-2"))
  if devices is None:
    pytest.skip(why)
  return devices[0]


@pytest.mark.parametrize("kv_heads", [16, 2])  # paper_1b's attention (16 heads of 128), and GQA groups of 8
def test_the_kernels_compile_for_a_tpu_at_32k_positions_in_bounded_vmem(kv_heads):
  """The forward and backward kernels at paper_1b's per-device shape at 32,768 positions, compiled by
  libtpu for a v5p chip (a whole-sequence K/V design needs 134 MiB of VMEM for GQA here, and is refused)."""
  chip = _tpu_chip()
  where = jax.sharding.SingleDeviceSharding(chip)
  t, heads, d = 32768, 16, 128
  spec = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=where)
  args = (spec(1, t, heads, d), spec(1, t, kv_heads, d), spec(1, t, kv_heads, d),
          spec(1, t, dtype=jnp.int32), spec(1, t, dtype=jnp.int32))
  loss = lambda q, k, v, s, c: jnp.sum(flash_attention(q, k, v, s, c).astype(jnp.float32))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile()  # raises if VMEM overflows
  text = compiled.as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 3  # Mosaic kernels: forward, dQ, dK/dV
  assert all(name in text for name in flash.KERNEL_NAMES)
  # What each kernel holds depends on the blocks alone: within the compiler's default scoped VMEM limit.
  assert max(flash.vmem_estimates(512, 512, d, heads // kv_heads, 2).values()) < flash.DEFAULT_SCOPED_VMEM


@pytest.mark.slow  # minutes on 2 cores; the kernel compile above covers the kernels at this length
def test_the_paper_1b_train_step_compiles_for_a_v5p_slice_at_32k_positions(monkeypatch):
  """paper_1b's layers (2 of its 24: a scanned stack compiles one layer's program) at 32,768 positions,
  one row per chip of a v5p-8, under its remat policy 'minimal': compiled by libtpu with the flash
  kernels, and the backward pass does not run the forward kernel again (3 kernels, not 4)."""
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  from midas_jax.bench import compile_bench  # pylint: disable=import-outside-toplevel
  _tpu_chip()
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")  # a compile for the slice sets its flags here: restored after
  # The model and mesh of gin/experiments/paper_1b_baseline.gin (its data needs no tokenizer here: the
  # model fixes the vocabulary).
  gin_config.parse([os.path.join(REPO_ROOT, "gin", *path) for path in (("models", "paper_1b.gin"),
                                                                       ("meshes", "fsdp.gin"))],
                   ["DataConfig.seq_len = 32768", "ModelConfig.max_seq_len = 32768", "DataConfig.batch_size = 4",
                    "ModelConfig.num_layers = 2", "ModelConfig.attention = 'flash'"])
  config = gin_config.run_config_from_gin()
  assert config.model.remat_policy == "minimal"
  report = compile_bench.run(config, topology="v5p-8", method="compile", estimate_step=False)  # memory, not speed
  assert report["method"] == "compiled" and not report.get("compile_error") and report["fits"]
  assert report["compiled"]["kernel_calls"] == 3
