"""Which dtypes the train step's matmuls run in (docs/model.md#which-ops-run-in-which-dtype), read from
the program handed to XLA, before any backend pass widens a dtype the CPU cannot run natively."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from conftest import layer_config, tiny_model, tiny_run, ul2_rows
from midas_jax import configs
from midas_jax.analysis import dot_dtypes
from midas_jax.errors import ConfigError
from midas_jax.model import attention, describe_mask, dot_support, matmul, transformer
from midas_jax.model.matmul import dot_to_float32
from midas_jax.data.factory import load_data
from midas_jax.stacking.checks import schedule_for
from midas_jax.train import build as build_lib
from midas_jax.train.stages import StageController

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


# ----------------------------------------------------------------------------- programs the CPU cannot run

def test_a_run_stopped_by_unimplemented_reads_as_a_program_the_backend_cannot_run():
  arg = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))

  def program(error):
    def run(x):
      if error:
        raise error
      return x + 1
    return lambda: run

  assert dot_support.compiled_if_runs(program(None), (arg,)) is not None
  unimplemented = jax.errors.JaxRuntimeError("UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: "
                                             "BF16 x BF16 = F32")
  assert dot_support.compiled_if_runs(program(unimplemented), (arg,)) is None
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):  # any other failure is not ours
    dot_support.compiled_if_runs(program(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")), (arg,))


def _attention_backward(x, query, mlp_in, mlp_out, operands):
  """Attention and an MLP, forward and backward, written with the model's matmuls. On this project's
  CPUs XLA leaves one bfloat16 backward matmul of it (after the softmax backward's fusion) to a
  runtime without a bfloat16 x bfloat16 -> float32 kernel."""
  def loss(x, query, mlp_in, mlp_out):
    bf16 = x.dtype
    q = matmul.dot("btd,dhk->bthk", x, query, bf16, operands=operands)
    scores = matmul.dot_to_float32("btnd,bsnd->bnts", q, q, bf16, name=matmul.ATTENTION, operands=operands)
    probs = jax.nn.softmax(scores, axis=-1).astype(bf16)
    y = matmul.dot("bnts,bsnd->btnd", probs, q, bf16, name=matmul.ATTENTION, operands=operands).reshape(x.shape)
    y = matmul.dot("btf,fd->btd", jax.nn.silu(matmul.dot("btd,df->btf", y, mlp_in, bf16, operands=operands)),
                   mlp_out, bf16, operands=operands)
    return y.astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2, 3))(x, query, mlp_in, mlp_out)


@pytest.mark.parametrize("operands", [None, jnp.float32])
def test_the_float32_operand_form_runs_where_the_bfloat16_one_may_not(operands):
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes = [((3, 20, 48), jnp.bfloat16), ((48, 4, 12), jnp.float32), ((48, 64), jnp.float32), ((64, 48), jnp.float32)]
  args = [jax.ShapeDtypeStruct(s, d, sharding=cpu) for s, d in shapes]
  program = jax.jit(lambda *a: _attention_backward(*a, operands=operands))
  runs = dot_support.compiled_if_runs(lambda: program.lower(*args).compile(), args) is not None
  if operands is None:
    print(f"this CPU runs the bfloat16 form: {runs}")  # False on the Sapphire Rapids machines this was written on
  else:
    assert runs  # the float32 form runs on every CPU


def _compute_and_widened_builds(monkeypatch, matmul_operands="auto"):
  run = tiny_run(model=tiny_model(dtype=BF16, matmul_operands=matmul_operands),
                 trainer=configs.TrainerConfig(num_steps=2, log_every=1, eval_every=0, progress_bar=False))
  compute = build_lib.build_stage(run, devices=jax.devices()[:1])
  monkeypatch.setattr(dot_support, "compiled_if_runs", lambda compile_program, args: None)  # a CPU that cannot
  return compute, build_lib.build_stage(run, devices=jax.devices()[:1])


def test_a_step_the_cpu_cannot_run_in_bfloat16_is_built_with_float32_operands(monkeypatch, capsys):
  compute, widened = _compute_and_widened_builds(monkeypatch)
  assert (compute.model_config.matmul_operands, widened.model_config.matmul_operands) == ("auto", "float32")
  assert capsys.readouterr().out.count("matmul operands: float32") == 1  # the widened build says so, once
  losses = []
  for build in (compute, widened):
    with build.context():
      state, batch = build.init_state(), build.device_batch(0)
      text = build.jit_train_step().lower(build.layout.abstract, batch).as_text()
      losses.append(float(build.jit_train_step()(state, batch)[1]["loss"]))
    dots = dot_dtypes.stablehlo_dots(text)
    operands = {d.dtypes[:2] for d in dots}
    assert operands == ({(BF16, BF16)} if build is compute else {(F32, F32)}), operands
  # The same products of the same bfloat16 values, accumulated in float32 in both: only the summation
  # order (a library's against XLA's) differs.
  assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_a_stage_trains_with_the_programs_its_check_compiled_and_ran(monkeypatch):
  run = tiny_run(model=tiny_model(dtype=BF16),
                 trainer=configs.TrainerConfig(num_steps=2, log_every=1, eval_every=0, progress_bar=False))
  checked = []

  def spy(compile_program, args):
    checked.append(compiled_if_runs(compile_program, args))
    return checked[-1]

  compiled_if_runs = dot_support.compiled_if_runs
  monkeypatch.setattr(dot_support, "compiled_if_runs", spy)
  stage = StageController(run, schedule_for(run), load_data(run), jax.devices()[:1]).stage(1)
  if None in checked:  # a CPU that cannot run the bfloat16 form: the stage is built with float32 operands
    assert stage.build.model_config.matmul_operands == "float32" and stage.build.checked is None
  else:  # the checked train and eval programs are the stage's: nothing is compiled twice
    assert len(checked) == 2 and (stage.train_step, stage.eval_step) == tuple(checked)


def test_bfloat16_operands_asked_for_but_not_runnable_are_refused_before_training(monkeypatch):
  with pytest.raises(ConfigError, match="ModelConfig.matmul_operands") as e:
    _compute_and_widened_builds(monkeypatch, matmul_operands="compute")
  assert "'auto'" in e.value.fix and "'float32'" in e.value.fix


# Run in a fresh process per XLA flag setting (XLA reads its flags once): a train step and an eval of the
# bfloat16 model at widths and head dimensions libraries do not favour, odd batches included.
PROPERTY = r'''
import os, sys
sys.path.insert(0, {tests!r})
import jax
jax.config.update("jax_compilation_cache_dir", os.environ["MIDAS_JAX_CACHE_DIR"])  # the session's: a build's
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # checked programs are not compiled twice
from hypothesis import example, given, settings, strategies as st
from conftest import tiny_model, tiny_run
from midas_jax import configs
from midas_jax.train.build import build_stage

@settings(max_examples=4, deadline=None, derandomize=True)
@given(head_dim=st.sampled_from([12, 20, 24, 16]), heads=st.sampled_from([1, 2, 3, 4]),
       rows=st.sampled_from([1, 3, 5]), seq_len=st.sampled_from([24, 40]), family=st.sampled_from(["llama", "gpt2"]))
@example(head_dim=12, heads=4, rows=3, seq_len=24, family="llama")   # d_model 48
@example(head_dim=20, heads=4, rows=5, seq_len=24, family="llama")   # d_model 80
@example(head_dim=24, heads=4, rows=3, seq_len=40, family="gpt2")    # d_model 96
def check(head_dim, heads, rows, seq_len, family):
  model = tiny_model(family=family, d_model=head_dim * heads, num_heads=heads, num_kv_heads=None, d_ff=64,
                     dtype="bfloat16")
  run = tiny_run(model=model, data=configs.DataConfig(seq_len=seq_len, batch_size=rows))
  build = build_stage(run, devices=jax.devices()[:1])
  with build.context():
    state, metrics = build.jit_train_step()(build.init_state(), build.device_batch(0))
    losses = [float(metrics["loss"]), build.evaluate(build.jit_eval_step(), state.params)["loss"]]
  assert all(loss == loss and 0 < loss < 20 for loss in losses), losses
  print("ok", family, head_dim * heads, heads, rows, seq_len, build.model_config.matmul_operands, flush=True)

check()
'''


# The default CPU libraries run in the suite; the oneDNN-free variant checks the same property on XLA's
# other dot path (about 95 s) and runs with -m slow.
@pytest.mark.parametrize("xla_flags", ["", pytest.param("--xla_cpu_use_onednn=false", marks=pytest.mark.slow)])
def test_the_bfloat16_step_runs_at_any_width_and_head_dimension(xla_flags, tmp_path):
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", PROPERTY.format(tests=os.path.dirname(__file__))], env=env,
                        capture_output=True, text=True, timeout=900, cwd=tmp_path)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert proc.stdout.count("ok ") >= 6, proc.stdout  # the three examples and drawn cases (some may repeat)


def test_a_suite_the_cpu_cannot_run_in_bfloat16_runs_again_with_float32_operands(monkeypatch, tmp_path):
  import types  # pylint: disable=import-outside-toplevel
  from midas_jax.checkpoint import LoadedModel  # pylint: disable=import-outside-toplevel
  from midas_jax.evals import suites  # pylint: disable=import-outside-toplevel
  seen = []

  def run_suite(model, workdir, out_dir, options):
    seen.append(model.model_config.matmul_operands)
    if model.model_config.matmul_operands != "float32":
      raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: "
                                       "BF16 x BF16 = F32")
    return {"ran_with": model.model_config.matmul_operands}

  monkeypatch.setitem(suites.SUITES, "fake", types.SimpleNamespace(run_suite=run_suite))
  model = LoadedModel(params={}, model_config=tiny_model(dtype=BF16).with_vocab(300), config=tiny_run(), step=3,
                      stage=1, metadata={})
  record = suites.run("fake", model, str(tmp_path), {})
  assert seen == ["auto", "float32"] and record["results"] == {"ran_with": "float32"}
  seen.clear()  # a float32 model, or any other failure, is not retried
  with pytest.raises(jax.errors.JaxRuntimeError):
    suites.run("fake", dataclasses.replace(model, model_config=tiny_model(dtype=F32).with_vocab(300)),
               str(tmp_path), {})
  assert seen == ["auto"]
