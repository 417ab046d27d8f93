"""The optimizer: learning-rate schedules, the weight-decay mask, AdamW/Adafactor updates, clipping."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from midas_jax.configs import OptimizerConfig
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, dummy_batch
from midas_jax.optimizer import learning_rate_schedule, make_optimizer, weight_decay_mask

PEAK = 1e-2


def lrs(cfg, num_steps, steps):
  schedule = learning_rate_schedule(cfg, num_steps)
  return np.array([float(schedule(jnp.asarray(s, jnp.int32))) for s in steps], np.float64)


def sched(decay, warmup=10, final=0.1):
  return OptimizerConfig(learning_rate=PEAK, warmup_steps=warmup, decay=decay, final_lr_fraction=final)


@functools.lru_cache(maxsize=None)
def _param_shapes(family, overrides):
  kw = dict(family=family)
  if family == "gpt2":
    kw["num_kv_heads"] = None
  kw.update(overrides)
  model = Decoder(tiny_model(**kw).with_vocab(300))
  return jax.eval_shape(lambda key: nn.unbox(model.init(key, dummy_batch(1, 16)))["params"],
                        jax.random.key(0))


def model_params(family="llama", **overrides):
  """The real parameter tree of a tiny Decoder (names, shapes, dtypes), without paying for its init.

  Norm scales are 1 as after init; every other leaf (biases included, so that leaving them alone is
  visible) is N(0, 0.02).
  """
  shapes = _param_shapes(family, tuple(sorted(overrides.items())))
  rng = np.random.default_rng(0)

  def fill(path, leaf):
    if str(path[-1].key) == "scale":
      return jnp.ones(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.normal(0.0, 0.02, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def by_name(tree):
  return {"/".join(str(k.key) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def one_update(cfg, params, grads, num_steps=100):
  tx = make_optimizer(cfg, num_steps)
  state = tx.init(params)
  updates, _ = tx.update(grads, state, params)  # eager: compiling costs more than it saves here
  return updates


# --- schedules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("decay", ["cosine", "linear", "rsqrt", "constant"])
def test_warmup_is_linear_from_zero_to_peak(decay):
  got = lrs(sched(decay), 100, range(11))
  np.testing.assert_allclose(got, PEAK * np.arange(11) / 10, rtol=1e-5, atol=1e-9)
  assert got[0] == 0.0


def test_cosine_ends_at_final_fraction_and_is_monotone_after_warmup():
  got = lrs(sched("cosine"), 100, range(10, 131))
  assert got[0] == pytest.approx(PEAK, rel=1e-6)
  assert np.all(np.diff(got) <= 1e-9), "cosine rose after warmup"
  assert np.all(np.diff(got[:90]) < 0), "cosine is flat somewhere before num_steps"
  assert got[90] == pytest.approx(0.1 * PEAK, rel=1e-5)  # step 100 = num_steps
  np.testing.assert_allclose(got[90:], 0.1 * PEAK, rtol=1e-5)  # and stays there
  # Half way through the decay the cosine is at the mean of peak and final.
  assert got[45] == pytest.approx(0.55 * PEAK, rel=1e-5)
  # final_lr_fraction 0 decays to zero.
  assert lrs(sched("cosine", final=0.0), 100, [100])[0] == pytest.approx(0.0, abs=1e-9)


def test_linear_decay_is_a_straight_line_to_final():
  got = lrs(sched("linear", final=0.2), 100, range(10, 101))
  expected = PEAK + (0.2 * PEAK - PEAK) * np.arange(91) / 90
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_rsqrt_decays_as_peak_times_sqrt_warmup_over_step():
  steps = np.array([10, 11, 20, 40, 90, 250, 1000])
  got = lrs(sched("rsqrt"), 100, steps)
  np.testing.assert_allclose(got, PEAK * np.sqrt(10 / steps), rtol=1e-5)


def test_constant_holds_the_peak():
  np.testing.assert_allclose(lrs(sched("constant"), 100, [10, 50, 100, 500]), PEAK, rtol=1e-6)


@pytest.mark.parametrize("decay", ["cosine", "linear", "rsqrt", "constant"])
def test_no_warmup_starts_at_peak(decay):
  got = lrs(sched(decay, warmup=0), 100, range(0, 101))
  assert got[0] == pytest.approx(PEAK, rel=1e-6)
  assert np.all(np.diff(got) <= 1e-9)
  if decay in ("cosine", "linear"):
    assert got[100] == pytest.approx(0.1 * PEAK, rel=1e-5)
  if decay == "constant":
    np.testing.assert_allclose(got, PEAK, rtol=1e-6)
  if decay == "rsqrt":
    assert got[100] < got[1] < PEAK


# --- weight decay mask ---------------------------------------------------------------------------

LLAMA_DECAYED = {"head", "layers/attn/key", "layers/attn/out", "layers/attn/query", "layers/attn/value",
                 "layers/mlp/down", "layers/mlp/gate", "layers/mlp/up"}
LLAMA_NEVER = {"final_norm/scale", "layers/attn_norm/scale", "layers/mlp_norm/scale"}
GPT2_DECAYED = {"layers/attn/key", "layers/attn/out", "layers/attn/query", "layers/attn/value",
                "layers/mlp/fc", "layers/mlp/proj"}
GPT2_NEVER = {"final_norm/bias", "final_norm/scale", "layers/attn/key_bias", "layers/attn/out_bias",
              "layers/attn/query_bias", "layers/attn/value_bias", "layers/attn_norm/bias",
              "layers/attn_norm/scale", "layers/mlp/fc_bias", "layers/mlp/proj_bias",
              "layers/mlp_norm/bias", "layers/mlp_norm/scale"}


EMBEDDINGS = {"embedding", "position_embedding"}


def should_decay(family, name, decay_embeddings):
  """The expected mask, from the lists above rather than from the code under test."""
  if name in EMBEDDINGS:
    return decay_embeddings
  return name in (LLAMA_DECAYED if family == "llama" else GPT2_DECAYED)


@pytest.mark.parametrize("family,decayed,never,embeddings", [
    ("llama", LLAMA_DECAYED, LLAMA_NEVER, {"embedding"}),
    ("gpt2", GPT2_DECAYED, GPT2_NEVER, {"embedding", "position_embedding"}),
])
@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_weight_decay_mask_on_real_params(family, decayed, never, embeddings, decay_embeddings):
  overrides = {"tie_embeddings": False} if family == "llama" else {}
  params = model_params(family, **overrides)
  mask = weight_decay_mask(params, decay_embeddings)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  flat = by_name(mask)
  assert set(flat) == decayed | never | embeddings  # the lists above name every parameter
  for name, value in flat.items():
    assert isinstance(value, bool), name
    if name in decayed:
      assert value is True, name
    elif name in never:
      assert value is False, name
    else:
      assert value is decay_embeddings, name


# --- updates -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,decay_embeddings", [("llama", True), ("gpt2", False)])
def test_adamw_zero_gradient_step_shrinks_only_decayed_weights(family, decay_embeddings):
  lr, wd = 1e-3, 0.1
  cfg = OptimizerConfig(learning_rate=lr, warmup_steps=0, decay="constant", weight_decay=wd,
                        decay_embeddings=decay_embeddings)
  params = model_params(family)
  zeros = jax.tree.map(jnp.zeros_like, params)
  new = by_name(jax.tree.map(lambda p, u: p + u, params, one_update(cfg, params, zeros)))
  old = by_name(params)
  for name, p in old.items():
    p, q = np.asarray(p), np.asarray(new[name])
    if should_decay(family, name, decay_embeddings):
      np.testing.assert_allclose(q, p * (1 - lr * wd), rtol=1e-6, err_msg=name)
      nonzero = p != 0
      assert np.all(np.abs(q[nonzero]) < np.abs(p[nonzero])), name
    else:
      np.testing.assert_array_equal(q, p, err_msg=name)
  # Norm scales start at 1 and stay exactly there.
  for name in [n for n in old if n.endswith("scale")]:
    np.testing.assert_array_equal(np.asarray(new[name]), 1.0)


def _global_norm(tree):
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


def test_gradient_clipping_bounds_the_update():
  # eps = 1 makes Adam's first step scale with the gradient (|u| = lr |g| / (|g| + 1) <= lr |g|), so
  # the update can only stay small if the gradient was clipped before it reached Adam.
  lr, clip = 1e-2, 1.0
  base = dict(learning_rate=lr, warmup_steps=0, decay="constant", weight_decay=0.0, eps=1.0)
  clipped_cfg = OptimizerConfig(grad_clip_norm=clip, **base)
  unclipped_cfg = OptimizerConfig(grad_clip_norm=None, **base)
  params = model_params("llama")
  rng = np.random.default_rng(1)
  huge = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 1e6, x.shape), x.dtype), params)
  norm = _global_norm(huge)
  assert norm > 1e7

  clipped = one_update(clipped_cfg, params, huge)
  unclipped = one_update(unclipped_cfg, params, huge)
  assert _global_norm(clipped) <= lr * clip * (1 + 1e-4)
  assert _global_norm(unclipped) > 100 * _global_norm(clipped)
  # Clipping is exactly rescaling the gradient to the clip norm.
  rescaled = jax.tree.map(lambda g: g * (clip / norm), huge)
  expected = one_update(unclipped_cfg, params, rescaled)
  for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-12)
  # A gradient already inside the clip norm passes unchanged.
  small = jax.tree.map(lambda g: g * (0.5 * clip / norm), huge)
  for a, b in zip(jax.tree.leaves(one_update(clipped_cfg, params, small)),
                  jax.tree.leaves(one_update(unclipped_cfg, params, small))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-12)


def test_adafactor_builds_and_updates_a_real_param_tree():
  # d_model 128 and a 384-id vocabulary are large enough for Adafactor to factor its statistics.
  cfg = OptimizerConfig(name="adafactor", learning_rate=1e-2, warmup_steps=0, decay="constant")
  params = model_params("llama", d_model=128, num_heads=2, num_kv_heads=1, d_ff=128, num_layers=1,
                        tie_embeddings=False)
  tx = make_optimizer(cfg, 100)
  state = tx.init(params)
  stat_shapes = {tuple(x.shape) for x in jax.tree.leaves(state)}
  assert (384,) in stat_shapes and (128,) in stat_shapes  # row/column statistics of a factored table
  leaves = jax.tree.leaves(params)
  rng = np.random.default_rng(2)
  current = params
  for _ in range(2):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 1.0, x.shape), x.dtype), params)
    updates, state = tx.update(grads, state, current)
    current = jax.tree.map(lambda p, u: p + u, current, updates)
  for name, (p, q) in zip(by_name(params), zip(leaves, jax.tree.leaves(current))):
    q = np.asarray(q)
    assert q.shape == p.shape and q.dtype == p.dtype, name
    assert np.all(np.isfinite(q)), name
    assert not np.allclose(q, np.asarray(p)), name


def test_adafactor_weight_decay_scales_with_the_learning_rate_like_adamw():
  # A zero gradient leaves only the decay term; it must be lr * weight_decay per step, as for AdamW,
  # and skip norms. (An unscaled rate would shrink every matrix by 10% per step at the defaults.)
  lr, wd = 1e-3, 0.1
  cfg = OptimizerConfig(name="adafactor", learning_rate=lr, warmup_steps=0, decay="constant",
                        weight_decay=wd)
  params = model_params("llama")
  zeros = jax.tree.map(jnp.zeros_like, params)
  new = by_name(jax.tree.map(lambda p, u: p + u, params, one_update(cfg, params, zeros)))
  for name, p in by_name(params).items():
    expected = np.asarray(p) * (1 - lr * wd) if should_decay("llama", name, False) else np.asarray(p)
    np.testing.assert_allclose(np.asarray(new[name]), expected, rtol=1e-6, err_msg=name)


# --- config validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("name", "sgd"), ("decay", "exponential"), ("learning_rate", 0.0), ("learning_rate", -1e-3),
    ("warmup_steps", -1), ("final_lr_fraction", -0.1), ("final_lr_fraction", 1.5),
    ("grad_clip_norm", 0.0), ("grad_clip_norm", -1.0), ("z_loss", -1e-4),
])
def test_config_rejects_bad_values_naming_the_setting(field, value):
  with pytest.raises(ConfigError) as info:
    OptimizerConfig(**{field: value})
  assert info.value.setting == f"OptimizerConfig.{field}"
  assert f"OptimizerConfig.{field}" in str(info.value) and "fix:" in str(info.value)


@pytest.mark.parametrize("field,value", [
    ("b1", 1.0), ("b1", -0.1), ("b2", 1.0), ("eps", -1e-8), ("weight_decay", -0.1),
])
def test_config_rejects_bad_adam_hyperparameters(field, value):
  with pytest.raises(ConfigError) as info:
    OptimizerConfig(**{field: value})
  assert info.value.setting == f"OptimizerConfig.{field}"


def test_good_configs_build_with_and_without_clipping():
  params = {"w": jnp.ones((3, 4)), "norm": {"scale": jnp.ones(4)}}
  for cfg in (OptimizerConfig(), OptimizerConfig(grad_clip_norm=None), OptimizerConfig(name="adafactor"),
              OptimizerConfig(name="adafactor", weight_decay=0.0, grad_clip_norm=None)):
    tx = make_optimizer(cfg, 10)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_the_last_fraction():
  cfg = OptimizerConfig(learning_rate=PEAK, warmup_steps=10, decay="wsd", decay_fraction=0.2, final_lr_fraction=0.0)
  got = lrs(cfg, 100, range(0, 101))
  np.testing.assert_allclose(got[:11], PEAK * np.arange(11) / 10, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(got[10:81], PEAK, rtol=1e-6)  # stable until the last 20 steps
  np.testing.assert_allclose(got[80:101], PEAK * (1 - np.arange(21) / 20), rtol=1e-5, atol=1e-9)
  # A shorter run decays over its own last fifth, at the same peak until then.
  short = lrs(cfg, 50, range(0, 51))
  np.testing.assert_allclose(short[10:41], PEAK, rtol=1e-6)
  assert short[50] == pytest.approx(0.0, abs=1e-9)


def test_wsd_settings_are_checked():
  with pytest.raises(ConfigError, match="OptimizerConfig.decay_fraction"):
    OptimizerConfig(decay="wsd", decay_fraction=0.0)
  cfg = OptimizerConfig(decay="wsd", warmup_steps=90, decay_fraction=0.2)
  with pytest.raises(ConfigError, match="OptimizerConfig.decay_fraction") as e:
    learning_rate_schedule(cfg, 100)  # 90 warmup + 20 decay steps overlap
  assert "overlap" in str(e.value)


def test_wsd_gin_file_gives_the_default_job_a_warmup_stable_decay_schedule():
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  gin_config.parse(["experiments/midas_cpu.gin", "schedules/wsd.gin"], [])
  config = gin_config.run_config_from_gin()
  opt, steps = config.optimizer, config.trainer.num_steps
  assert (opt.decay, opt.decay_fraction, opt.final_lr_fraction, steps, opt.warmup_steps) == ("wsd", 0.2, 0.0, 120, 10)
  got = lrs(opt, steps, range(steps + 1)) / opt.learning_rate
  np.testing.assert_allclose(got[:11], np.arange(11) / 10, atol=1e-6)  # warmup
  np.testing.assert_allclose(got[10:97], 1.0, rtol=1e-6)  # the peak, through every growth (12, 36, 72)
  np.testing.assert_allclose(got[96:], 1 - np.arange(25) / 24, atol=1e-6)  # the last 20%: 24 steps to 0
