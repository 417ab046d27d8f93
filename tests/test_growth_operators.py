"""Growth operators as functions of the train state: function-preserving depth growth (midas_zero,
gradstack_zero) keeps the logits, trains on after the growth, and zeroes moments as its setting says."""

import jax
import numpy as np
import pytest

from conftest import tiny_model, tiny_run, to_host, trained_stage
from midas_jax import configs
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, dummy_batch
from midas_jax.stacking import operators as ops
from midas_jax.stacking import preserve
from midas_jax.stacking.grow import make_grower
from midas_jax.train.build import build_stage

FSDP = configs.MeshConfig(data=1, fsdp=-1)
BLOCK = 2
PRESERVING = ("midas_zero", "gradstack_zero")


@pytest.fixture(scope="module")
def run():
  """A 4-layer model (2 blocks of 2) trained 2 steps on the 8-device FSDP mesh, so moments are non-zero,
  and the 6-layer stage it grows into."""
  config = tiny_run(model=tiny_model(num_layers=4), mesh=FSDP)
  exp, state = trained_stage(config)
  batch = dummy_batch(2, 16)
  batch["inputs"] = jax.random.randint(jax.random.key(1), (2, 16), 3, 250)
  return dict(exp=exp, host=to_host(state), new=build_stage(config, num_layers=6), batch=batch)


def grown(run, operator, zeroed_moments="zero", new_moments="copy"):
  prov = ops.provenance_for(operator if isinstance(operator, str) else "midas", 4, BLOCK)
  stacking = configs.StackingConfig(operator="midas", new_moments=new_moments, zeroed_moments=zeroed_moments)
  state = jax.device_put(run["host"], run["exp"].layout.shardings)
  grower = make_grower(run["exp"].layout, run["new"].layout, prov, new_moments, operator=operator, stacking=stacking)
  return prov, grower(state)


def logits(stage, params, batch):
  return np.asarray(jax.jit(Decoder(stage.model_config).apply)({"params": to_host(params)}, batch))


def test_operators_declare_whether_they_preserve_the_function():
  for name in ("midas", "gradstack", "gstack", "fresh_block"):
    assert ops.get_operator(name).preserves_function is False and ops.get_operator(name).transform is None
  for name, base in zip(PRESERVING, ("midas", "gradstack")):
    op = ops.get_operator(name)
    assert op.preserves_function and op.transform is not None
    assert ops.provenance_for(name, 6, BLOCK).tolist() == ops.provenance_for(base, 6, BLOCK).tolist()


@pytest.mark.parametrize("operator", PRESERVING)
def test_function_preserving_growth_keeps_the_logits_and_trains_on(run, operator):
  prov, state = grown(run, operator)
  assert ops.new_layer_mask(prov).any()
  params = to_host(state.params)
  before = logits(run["exp"], run["host"].params, run["batch"])
  np.testing.assert_allclose(logits(run["new"], params, run["batch"]), before, rtol=1e-5, atol=1e-5)
  for module, name in (("attn", "out"), ("mlp", "down"), ("attn", "query")):
    new_rows = params["layers"][module][name][ops.new_layer_mask(prov)]
    assert np.all(new_rows == 0) == (name != "query"), (module, name)  # only the outputs start at zero
  new = run["new"]
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(new.layout.shardings)):
    assert leaf.sharding == sharding
  with new.context():
    state, metrics = new.jit_train_step()(state, new.device_batch(2))
  assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))
  # The zeroed projections get gradients at once (the copied weights feed them), so they move.
  assert np.any(np.asarray(state.params["layers"]["mlp"]["down"])[ops.new_layer_mask(prov)] != 0)


def test_a_copy_or_a_half_zeroed_copy_changes_the_logits(run):
  """The check above can fail: plain MIDAS, or zeroing only the attention output, changes the logits."""
  attn_only = ops.GrowthOperator(
      provenance=ops.midas, preserves_function=True,
      transform=lambda s, logical, mask, st: preserve.zero_residual_outputs(s, logical, mask, st,
                                                                             {"attn": ("out", "out_bias")}))
  before = logits(run["exp"], run["host"].params, run["batch"])
  for operator in ("midas", attn_only):
    _, state = grown(run, operator)
    assert np.max(np.abs(logits(run["new"], state.params, run["batch"]) - before)) > 1e-3


@pytest.mark.parametrize("zeroed_moments", ["zero", "copy"])
def test_zeroed_moments_setting(run, zeroed_moments):
  prov, state = grown(run, "midas_zero", zeroed_moments=zeroed_moments)
  new, src = ops.new_layer_mask(prov), prov[ops.new_layer_mask(prov)]
  adam = to_host(state.opt_state)[1][0]
  old = run["host"].opt_state[1][0]
  for moment in ("mu", "nu"):
    for module, name in (("attn", "out"), ("mlp", "down"), ("attn", "query")):
      rows = getattr(adam, moment)["layers"][module][name][new]
      source = getattr(old, moment)["layers"][module][name][src]
      assert np.any(source != 0)
      if name != "query" and zeroed_moments == "zero":
        assert np.all(rows == 0), (moment, module, name)
      else:
        np.testing.assert_array_equal(rows, source)


def test_zeroed_moments_is_validated():
  with pytest.raises(ConfigError, match="StackingConfig.zeroed_moments"):
    configs.StackingConfig(zeroed_moments="reset")
  with pytest.raises(ConfigError, match="new_moments='copy'"):
    configs.StackingConfig(zeroed_moments="copy", new_moments="zero")
