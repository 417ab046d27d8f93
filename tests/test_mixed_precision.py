"""Which dtypes the train step's matmuls run in (docs/model.md#which-ops-run-in-which-dtype), read from
the program handed to XLA, before any backend pass widens a dtype the CPU cannot run natively."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from conftest import layer_config, tiny_model, tiny_run, ul2_rows
from midas_jax import configs
from midas_jax.bench import dot_dtypes
from midas_jax.model import attention, describe_mask, transformer
from midas_jax.model.matmul import dot_to_float32
from midas_jax.train import build as build_lib

BF16, F32 = "bfloat16", "float32"


def _train_step_dots(dtype, attention_impl="dot_product", remat="full"):
  """The matmuls of one lowered train step: untied head, chunked loss, GQA, every remat recomputation."""
  run = tiny_run(model=tiny_model(dtype=dtype, remat_policy=remat, tie_embeddings=False, attention=attention_impl),
                 trainer=configs.TrainerConfig(num_steps=2, log_every=1, eval_every=0, progress_bar=False,
                                               loss_chunk=16))
  exp = build_lib.build_stage(run)
  with exp.context():
    text = exp.jit_train_step().lower(exp.layout.abstract, exp.device_batch(0)).as_text()
  return dot_dtypes.stablehlo_dots(text)


@pytest.mark.parametrize("attention_impl,remat", [("dot_product", "full"), ("flash", "minimal")])
def test_every_matmul_of_the_bfloat16_step_has_bfloat16_operands(attention_impl, remat):
  dots = _train_step_dots(BF16, attention_impl, remat)
  table = dot_dtypes.flops_by_dtypes(dots)
  wide = [d.text for d in dots if d.dtypes[:2] != (BF16, BF16)]
  assert not wide, "float32-operand matmuls in the bfloat16 step:\n" + "\n".join(wide)
  # Every one accumulates in float32, in the program itself: the results are rounded after the dot.
  assert set(table) == {(BF16, BF16, F32)}


def test_the_float32_step_stays_float32():
  dots = _train_step_dots(F32)
  assert len(dots) > 20 and {d.dtypes for d in dots} == {(F32, F32, F32)}


def _saved_for_backward(dtype, policy, capsys):
  """The sizes of what one remat'd layer keeps for its backward pass, as jax reports them (sizes, not
  shapes: a dot_general's own output may be a transposition of the einsum's)."""
  cfg = layer_config(tiny_model(dtype=dtype, remat_policy=policy).with_vocab(64))
  block = transformer.block_class(cfg)(cfg)
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  mask = describe_mask(jnp.ones((2, 16), jnp.int32), positions, jnp.zeros((2, 16), bool))
  x = jnp.ones((2, 16, 32), jnp.dtype(dtype))
  params = block.init(jax.random.PRNGKey(0), x, positions, mask)
  capsys.readouterr()
  print_saved_residuals(lambda p, x: block.apply(p, x, positions, mask)[0].astype(jnp.float32).sum(), params, x)
  lines = capsys.readouterr().out.splitlines()
  shapes = [re.match(r"\w+\[([\d,]*)\]", line)[1] for line in lines if line.strip()]
  return sorted(math.prod(int(d) for d in shape.split(",") if d) for shape in shapes)


@pytest.mark.parametrize("policy", ["minimal", "save_dots"])
def test_remat_policies_save_the_same_matmuls_in_both_dtypes(policy, capsys):
  # The mixed-precision matmuls are custom VJPs, which a dot policy cannot see into: their names stand in.
  saved = _saved_for_backward(F32, policy, capsys)
  assert len(saved) > len(_saved_for_backward(F32, "full", capsys))  # the policy saves matmul outputs
  assert _saved_for_backward(BF16, policy, capsys) == saved


def test_dot_to_float32_gradients_multiply_the_rounded_cotangent_and_come_back_unrounded():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(4, 8, 32)), jnp.float32)
  out, backward = jax.vjp(lambda a, b: dot_to_float32("btd,dv->btv", a, b, jnp.bfloat16), x, w)
  xb, wb, gb = (a.astype(jnp.bfloat16) for a in (x, w, g))
  accumulate = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)
  # Forward: the float32 result of bfloat16 operands, not rounded to bfloat16.
  np.testing.assert_array_equal(out, accumulate("btd,dv->btv", xb, wb))
  assert out.dtype == jnp.float32 and not np.array_equal(out, out.astype(jnp.bfloat16).astype(jnp.float32))
  # Backward: bfloat16 operands (the cotangent rounded), float32 accumulation, float32 gradients as the
  # inputs were: a float32 weight's gradient is never rounded to bfloat16.
  dx, dw = backward(g)
  assert dx.dtype == dw.dtype == jnp.float32
  np.testing.assert_array_equal(dx, accumulate("btv,dv->btd", gb, wb))
  np.testing.assert_array_equal(dw, accumulate("btd,btv->dv", xb, gb))
  # A bfloat16 input gets a bfloat16 gradient.
  _, backward = jax.vjp(lambda a: dot_to_float32("btd,dv->btv", a, w, jnp.bfloat16), xb)
  assert backward(g)[0].dtype == jnp.bfloat16
  # And in float32 it is the plain einsum, gradients and all.
  exact = jax.grad(lambda a: dot_to_float32("btd,dv->btv", a, w, jnp.float32).sum())(x)
  np.testing.assert_array_equal(exact, jax.grad(lambda a: jnp.einsum("btd,dv->btv", a, w).sum())(x))


def test_dense_attention_is_jax_reference_in_float32_and_close_in_bfloat16():
  batch = ul2_rows(seed=3, num_rows=2, seq_len=40)
  mask = describe_mask(jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"]),
                       jnp.asarray(batch["prefix_mask"]))
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 40, heads, 16)), jnp.float32) for heads in (4, 2, 2))
  reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=attention.dense_mask(mask))
  ours = lambda q, k, v: attention.dense_attention(q, k, v, mask)
  grads = lambda f, *a: jax.jit(jax.grad(lambda *b: jnp.sum(f(*b).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(*a)
  np.testing.assert_array_equal(jax.jit(ours)(q, k, v), jax.jit(reference)(q, k, v))
  for got, want in zip(grads(ours, q, k, v), grads(reference, q, k, v)):
    np.testing.assert_array_equal(got, want)
  half = [a.astype(jnp.bfloat16) for a in (q, k, v)]
  out = jax.jit(ours)(*half)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), jax.jit(reference)(q, k, v), atol=0.05)


# As CPU and GPU modules print them (operand shapes inline) and as TPU modules do (operands by name).
HLO = """
%fused_computation.1 (param_0: bf16[64,512], param_1: bf16[512,2048]) -> f32[64,2048] {
  %dot.3 = f32[64,2048]{1,0} dot(bf16[64,512]{1,0} %param_0, bf16[512,2048]{1,0} %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %p.2 = bf16[8,128,64]{2,1,0:T(8,128)(2,1)} parameter(2)
  %p.3 = bf16[256,64]{1,0:T(8,128)(2,1)} parameter(3)
  %convolution.7 = bf16[8,128,256]{2,1,0:T(8,128)(2,1)} convolution(%p.2, %p.3), window={size=1}, dim_labels=0bf_oi->0bf
  %dot.9 = f32[4,16,16]{2,1,0} dot(f32[4,16,8]{2,1,0} %a, f32[4,8,16]{2,1,0} %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_name="x"}
}
"""


def test_optimized_hlo_matmuls_are_read_with_their_flops():
  dots = dot_dtypes.hlo_dots(HLO)
  assert [d.dtypes for d in dots] == [(BF16, BF16, F32), (BF16, BF16, BF16), (F32, F32, F32)]
  assert [d.flops for d in dots] == [2 * 64 * 2048 * 512, 2 * 8 * 128 * 256 * 64, 2 * 4 * 16 * 16 * 8]
  assert dot_dtypes.operand_share(dots, BF16) == pytest.approx(sum(d.flops for d in dots[:2]) / sum(d.flops for d in dots))
