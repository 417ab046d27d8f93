"""The described UL2 mask and the fused attention kernels, run in Pallas interpret mode on CPU and
checked against the dense path (docs/architecture.md#the-mask-is-described-not-built)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model, tiny_run, ul2_rows
from midas_jax import configs
from midas_jax.errors import ConfigError
from midas_jax.model import attention, describe_mask, make_attention_mask, transformer
from midas_jax.model.kernels import block_tables, flash_attention
from midas_jax.train import build as build_lib


def _description(batch):
  return describe_mask(jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"]),
                       jnp.asarray(batch["prefix_mask"]))


def test_the_description_is_the_mask_on_packed_ul2_rows():
  batch = ul2_rows(seed=0, num_rows=6, seq_len=64)
  assert all(set(row[row > 0]) == {1, 2, 3} for row in batch["segment_ids"])  # three examples a row
  assert set(np.unique(batch["objective_ids"][batch["segment_ids"] > 0])) == {0, 1, 2}
  assert (batch["segment_ids"] == 0).any(axis=1).all()  # and padding
  expected = make_attention_mask(batch["segment_ids"], batch["positions"], batch["prefix_mask"])
  np.testing.assert_array_equal(attention.dense_mask(_description(batch)), expected)


def test_block_tables_skip_only_blocks_with_nothing_visible():
  batch = ul2_rows(seed=1, num_rows=4, seq_len=64)
  mask = _description(batch)
  dense = np.asarray(attention.dense_mask(mask))[:, 0]
  block = 8
  tables = block_tables.block_tables(mask.segment_ids, mask.causal_positions, block)
  visible = np.asarray(block_tables.visible(tables, tables))
  truth = dense.reshape(4, 8, block, 8, block).any(axis=(2, 4))
  assert not (truth & ~visible).any()  # never skips a block holding a visible pair
  assert (~visible).mean() > 0.5  # and skips most: everything above the diagonal, across examples
  # The kernels read the same test from flat tables, one scalar at a time.
  flat = np.asarray(block_tables.flat_table(tables))
  in_kernel = np.array([[[bool(block_tables.blocks_visible_in_kernel(flat, flat, r, i, j, 8, 8))
                          for j in range(8)] for i in range(8)] for r in range(4)])
  np.testing.assert_array_equal(in_kernel, visible)


def _dense_attention(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=attention.dense_mask(mask))


def _outputs_and_gradients(attend, q, k, v, weights):
  """attend's output and the gradients of sum(output * weights), from one compiled program."""
  def loss(q, k, v):
    out = attend(q, k, v)
    return jnp.sum(out * weights), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


def test_flash_equals_dense_attention_and_its_gradients_on_packed_ul2_rows():
  # Length 44 is not a multiple of the 16-token blocks (the kernel pads); 4 query heads share 2 kv heads.
  batch = ul2_rows(seed=2, num_rows=2, seq_len=44)
  mask = _description(batch)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 44, heads, 16)), jnp.float32) for heads in (4, 2, 2))
  weights = jnp.asarray(rng.normal(size=(2, 44, 4, 16)), jnp.float32)
  flash = lambda q, k, v: flash_attention(q, k, v, mask.segment_ids, mask.causal_positions, block_q=16, block_kv=16)
  (_, out), grads = _outputs_and_gradients(flash, q, k, v, weights)
  (_, ref_out), ref_grads = _outputs_and_gradients(lambda q, k, v: _dense_attention(q, k, v, mask), q, k, v,
                                                   weights)
  np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
  for name, g, ref in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_the_kernels_never_visit_a_block_no_query_of_theirs_may_see():
  """Two examples of 16 tokens each, blocks of 16: the second example's queries may see no key of the
  first block. Its keys and values are poisoned with NaN: a kernel that visited the block anyway (even
  to weight it by exactly 0) would carry the NaN into the second example's outputs and gradients, which
  must equal dense attention's on clean inputs."""
  positions = jnp.tile(jnp.arange(16, dtype=jnp.int32), 2)[None].repeat(2, 0)
  segments = jnp.repeat(jnp.array([1, 2], jnp.int32), 16)[None].repeat(2, 0)
  mask = describe_mask(segments, positions, jnp.zeros((2, 32), bool))
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 32, heads, 8)), jnp.float32) for heads in (4, 2, 2))
  weights = jnp.asarray(rng.normal(size=(2, 32, 4, 8)), jnp.float32)
  second = (segments == 2)[:, :, None, None]  # the rows compared; the first example's are NaN by design
  poisoned = [jnp.where(segments[:, :, None, None] == 1, jnp.nan, x) for x in (k, v)]

  def loss(attend):
    return lambda q, k, v: jnp.sum(jnp.where(second, attend(q, k, v), 0.0) * weights)

  flash = lambda q, k, v: flash_attention(q, k, v, mask.segment_ids, mask.causal_positions, block_q=16, block_kv=16)
  out = flash(q, *poisoned)
  grads = jax.grad(loss(flash), argnums=(0, 1, 2))(q, *poisoned)
  dense = lambda q, k, v: _dense_attention(q, k, v, mask)
  ref_out, ref_grads = dense(q, k, v), jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(out[:, 16:], ref_out[:, 16:], atol=1e-5, rtol=1e-5)
  for name, g, ref in zip("qkv", grads, ref_grads):  # dq of the second example; dk, dv of its keys and values
    np.testing.assert_allclose(g[:, 16:], ref[:, 16:], atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_the_gpu_kernels_lower_to_triton():
  """No GPU here: lowering for CUDA checks the Triton side of the shared kernel bodies."""
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  args = (shape(2, 256, 4, 64), shape(2, 256, 2, 64), shape(2, 256, 2, 64),
          shape(2, 256, dtype=jnp.int32), shape(2, 256, dtype=jnp.int32))
  grad = jax.grad(lambda q, k, v, s, c: jnp.sum(flash_attention(q, k, v, s, c).astype(jnp.float32)),
                  argnums=(0, 1, 2))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dQ, dK/dV


def test_auto_is_dot_product_on_cpu_flash_on_tpu_and_never_the_unrun_triton_kernels_on_gpu():
  assert attention.resolve("auto", "cpu") == "dot_product"
  assert attention.resolve("auto", "tpu") == "flash"
  assert attention.resolve("auto", "gpu") == "cudnn"  # cuDNN's kernel (tests/test_cudnn_attention.py)
  assert attention.resolve("auto", "gpu", "float32") == "dot_product"  # not the Triton kernels, never run
  assert attention.resolve("dot_product", "tpu") == "dot_product"
  build = build_lib.build_stage(tiny_run())
  # The Decoder resolves it for its platform (the mesh's); the configs, and so checkpoints, keep "auto".
  assert build.model.attention_implementation == "dot_product" and build.model.platform == "cpu"
  assert build.model.cfg.attention == build.model_config.attention == "auto"
  tpu = transformer.Decoder(build.model_config, platform="tpu")
  assert tpu.attention_implementation == "flash"


def test_bad_attention_settings_are_config_errors():
  with pytest.raises(ConfigError, match="ModelConfig.attention"):
    tiny_model(attention="splash")
  rules = tuple((name, "tensor" if name == "length" else axes) for name, axes in configs.DEFAULT_RULES)
  config = tiny_run(model=tiny_model(attention="flash"), mesh=configs.MeshConfig(rules=rules))
  exp = build_lib.build_stage(config)
  with pytest.raises(ConfigError, match="MeshConfig.rules"), exp.context():
    exp.jit_train_step().lower(exp.layout.abstract, exp.device_batch(0))
