"""Growth: a gather along the `layers` axis of params and optimizer moments, re-sharded for the new model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import layer_config, tiny_model, tiny_run, to_host, trained_stage
from midas_jax import configs, sharding
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, describe_mask, dummy_batch
from midas_jax.model.layers import Block, Norm
from midas_jax.stacking.grow import grow_tree, layers_axis, make_grower
from midas_jax.train.build import build_stage
from midas_jax.train_state import TrainState

# MIDAS on 2 blocks of 2 layers: the first block copied and inserted after itself.
PROV = np.array([0, 1, 0, 1, 2, 3])
NEW = np.array([False, False, True, True, False, False])  # later occurrences of a source are new
FRESH_PROV = np.array([0, 1, 2, 3, -1, -1])
FSDP = configs.MeshConfig(data=1, fsdp=-1)


def is_spec(x):
  return isinstance(x, P)


def leaves(tree, specs):
  """(path, leaf, logical spec) for every leaf."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(p), x, s) for (p, x), s in zip(flat, jax.tree.leaves(specs, is_leaf=is_spec))]


def grow_host(old, specs, prov, zero_rows=None, fresh=None):
  """The reference: numpy gather along the layers axis; rows in zero_rows zeroed, -1 rows from fresh."""
  def one(x, spec, new=None):
    axis = layers_axis(spec)
    if axis is None:
      return x
    rows = lambda m: m.reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    out = np.take(x, np.maximum(prov, 0), axis=axis)
    if zero_rows is not None:
      out = np.where(rows(zero_rows), 0, out)
    return out if new is None else np.where(rows(prov < 0), new, out)
  return jax.tree.map(one, old, specs) if fresh is None else jax.tree.map(one, old, specs, fresh)


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, to_host(a), to_host(b))


@pytest.fixture(scope="module")
def run():
  """A 4-layer model trained 2 steps on the 8-device FSDP mesh (Adam moments non-zero), its host copy,
  and experiments for the grown depth on 8 devices and on 1."""
  config = tiny_run(model=tiny_model(num_layers=4), mesh=FSDP)
  exp, state = trained_stage(config)
  single = tiny_run(model=config.model, mesh=configs.MeshConfig())
  return dict(config=config, exp=exp, host=to_host(state),
              exp1=build_stage(single, devices=jax.devices()[:1]),
              new=build_stage(config, num_layers=len(PROV)),
              new1=build_stage(single, devices=jax.devices()[:1], num_layers=len(PROV)))


def grown(run, prov=PROV, new_moments="copy", devices=8, fresh=None):
  old, new = (run["exp"], run["new"]) if devices == 8 else (run["exp1"], run["new1"])
  state = jax.device_put(run["host"], old.layout.shardings)
  return make_grower(old.layout, new.layout, prov, new_moments)(state, fresh)


def test_layers_axis_comes_from_the_logical_names():
  assert layers_axis(P("layers", "embed", "heads", "kv")) == 0
  assert layers_axis(P("embed", "layers")) == 1
  assert layers_axis(P("vocab", "embed")) is None and layers_axis(P()) is None
  # A leading dimension equal to the depth is not a layers axis.
  x = {"a": np.arange(12.0).reshape(4, 3), "b": np.arange(12.0).reshape(4, 3)}
  out = grow_tree(x, {"a": P("layers", "embed"), "b": P("vocab", "embed")}, [0, 1, 2, 3, 3])
  assert out["a"].shape == (5, 3) and out["b"] is x["b"]


@pytest.mark.parametrize("new_moments", ["copy", "zero"])
def test_grown_params_and_moments_are_copies_of_their_sources(run, new_moments):
  old, logical = run["host"], run["exp"].layout.logical
  state = to_host(grown(run, new_moments=new_moments, devices=1))
  assert int(state.step) == int(old.step) == 2
  assert_trees_equal(state.params, grow_host(old.params, logical.params, PROV))
  zero = NEW if new_moments == "zero" else None
  assert_trees_equal(state.opt_state, grow_host(old.opt_state, logical.opt_state, PROV, zero))
  moments = [(k, x) for k, x, s in leaves(state.opt_state, logical.opt_state) if layers_axis(s) is not None]
  num_layer_params = sum(layers_axis(s) is not None for s in jax.tree.leaves(logical.params, is_leaf=is_spec))
  assert len(moments) == 2 * num_layer_params and all(".mu" in k or ".nu" in k for k, _ in moments)
  for key, x in moments:
    kept = np.take(x, np.flatnonzero(~NEW), axis=0)
    assert np.any(kept != 0), key  # two real steps: the moments being copied are not trivially zero
    assert np.all(np.take(x, np.flatnonzero(NEW), axis=0) == 0) == (new_moments == "zero"), key
  # grow_host leaves non-layer leaves as they are: embeddings, final norm and optax counts pass through.


def test_fresh_layers_take_fresh_values_and_zero_moments(run):
  # Only the fresh state's params are read; distinct values per leaf show where each row came from.
  abstract = run["new1"].layout.abstract
  fresh_params = jax.tree.map(lambda a: np.full(a.shape, 0.5, a.dtype), abstract.params)
  fresh = TrainState(step=None, params=fresh_params, opt_state=None)
  state = to_host(grown(run, prov=FRESH_PROV, devices=1, fresh=fresh))
  old, logical = run["host"], run["exp"].layout.logical
  assert_trees_equal(state.params, grow_host(old.params, logical.params, FRESH_PROV, fresh=fresh_params))
  assert_trees_equal(state.opt_state, grow_host(old.opt_state, logical.opt_state, FRESH_PROV, FRESH_PROV < 0))
  query = state.params["layers"]["attn"]["query"]
  assert np.all(query[4:] == 0.5) and np.all(query[:4] == old.params["layers"]["attn"]["query"])
  with pytest.raises(ConfigError, match="fresh"):
    grown(run, prov=FRESH_PROV, devices=1)


def test_bad_provenance_is_refused_before_compiling(run):
  for prov in ([0, 1, 2, 3, 4, 4], [0, 1, 2, 3], [0, 1, 0, 1, -2, 3]):
    with pytest.raises(ConfigError, match="provenance"):
      make_grower(run["exp1"].layout, run["new1"].layout, prov)
  with pytest.raises(ConfigError, match="new_moments"):
    make_grower(run["exp1"].layout, run["new1"].layout, PROV, new_moments="reset")


def test_growth_on_the_fsdp_mesh_equals_growth_on_one_device_and_lands_in_the_new_shardings(run):
  state8 = grown(run, devices=8)
  state1 = grown(run, devices=1)
  for a, b, expected in zip(jax.tree.leaves(state8), jax.tree.leaves(state1),
                            jax.tree.leaves(run["new"].layout.shardings)):
    assert a.sharding == expected
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  query = state8.params["layers"]["attn"]["query"]  # [layers, embed, heads, kv]: embed over fsdp
  assert query.shape[0] == len(PROV) and query.sharding.spec[1] == "fsdp"
  assert query.addressable_shards[0].data.shape == (len(PROV), 32 // 8, 4, 8)


def test_grown_forward_equals_per_layer_forward_with_gathered_weights(run):
  old = run["host"].params
  params = to_host(grown(run, devices=1).params)
  cfg = run["new1"].model_config
  batch = dummy_batch(2, 16)
  batch["inputs"] = jax.random.randint(jax.random.key(1), (2, 16), 3, 250)

  @jax.jit
  def per_layer(old, batch):
    mask = describe_mask(batch["segment_ids"], batch["positions"], batch["prefix_mask"])
    x = Decoder(cfg).apply({"params": old}, batch["inputs"], batch["positions"], method=Decoder.embed)
    for source in PROV:
      layer = jax.tree.map(lambda p: p[source], old["layers"])
      x, _ = Block(layer_config(cfg)).apply({"params": layer}, x, batch["positions"], mask)
    x = Norm(cfg).apply({"params": old["final_norm"]}, x)
    return jnp.einsum("btd,vd->btv", x, old["embedding"])

  logits = jax.jit(Decoder(cfg).apply)({"params": params}, batch)
  np.testing.assert_allclose(logits, per_layer(old, batch), atol=1e-5)


def test_training_continues_after_growth(run):
  new = run["new"]
  state = grown(run, devices=8)
  with new.context():
    state, metrics = new.jit_train_step()(state, new.device_batch(2))
  assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))


ADAFACTOR_MODEL = dict(d_model=256, num_heads=2, num_kv_heads=1, head_dim=128, d_ff=512)


def adafactor_run(num_layers, mesh=None):
  return tiny_run(model=tiny_model(num_layers=num_layers, **ADAFACTOR_MODEL), mesh=mesh,
                  optimizer=configs.OptimizerConfig(name="adafactor", learning_rate=1e-2, warmup_steps=1))


def test_adafactor_factored_moments_keep_the_param_axes_they_do_not_reduce():
  # optax factors the two largest axes (>= 128), not necessarily the last two: the query kernel
  # [layers, embed=256, heads=2, kv=128] drops embed from v_row and kv from v_col.
  layout = build_stage(adafactor_run(2), devices=jax.devices()[:1]).layout
  factored = layout.logical.opt_state[1][0]
  shapes = layout.abstract.opt_state[1][0]
  assert shapes.v_row["layers"]["attn"]["query"].shape == (2, 2, 128)
  assert factored.v_row["layers"]["attn"]["query"] == P("layers", "heads", "kv")
  assert factored.v_col["layers"]["attn"]["query"] == P("layers", "embed", "heads")
  assert factored.v_row["layers"]["attn"]["out"] == P("layers", "heads", "kv")  # [.., kv=128, embed=256]
  assert factored.v_col["layers"]["attn"]["out"] == P("layers", "heads", "embed")
  assert factored.v_row["layers"]["mlp"]["down"] == P("layers", "embed")  # [.., mlp=512, embed=256]
  assert factored.v_col["layers"]["mlp"]["down"] == P("layers", "mlp")
  assert factored.v_row["embedding"] == P("embed") and factored.v_col["embedding"] == P("vocab")
  # Unfactored params keep a full-shape v and (1,) placeholders, which stay replicated.
  assert factored.v["layers"]["attn_norm"]["scale"] == P("layers", "embed")
  assert factored.v_row["layers"]["attn_norm"]["scale"] == P() == factored.v["layers"]["attn"]["query"]
  # At depth 1 a [1, embed] scale minus its embed axis has the placeholder's shape: still replicated.
  one = build_stage(adafactor_run(1), devices=jax.devices()[:1]).layout.logical.opt_state[1][0]
  assert one.v_row["layers"]["attn_norm"]["scale"] == P()
  # On the FSDP mesh the factored moments are sharded like their params.
  fsdp = build_stage(adafactor_run(2, FSDP)).layout.shardings.opt_state[1][0]
  assert fsdp.v_col["layers"]["attn"]["query"].spec[1] == "fsdp"  # [layers, embed, heads]


def test_mirror_param_specs_on_equal_sizes_replicates_only_the_ambiguous_entries():
  params = {"w": np.zeros((3, 256, 256)), "s": np.zeros((1, 32))}
  specs = {"w": P("layers", "embed", "mlp"), "s": P("layers", "embed")}
  tree = {"mu": {"w": np.zeros((3, 256, 256))}, "v_row": {"w": np.zeros((3, 256)), "s": np.zeros((1,))},
          "count": np.zeros((), np.int32)}
  out = sharding.mirror_param_specs(tree, params, specs)
  assert out["mu"]["w"] == P("layers", "embed", "mlp")
  assert out["v_row"]["w"] == P("layers", None)  # embed or mlp removed: cannot tell, so replicate it
  assert out["v_row"]["s"] == P() and out["count"] == P()


def test_adafactor_moments_grow_too():
  config = adafactor_run(2)
  exp = build_stage(config, devices=jax.devices()[:1])
  state = exp.init_state()
  with exp.context():
    step = exp.jit_train_step()
    state, _ = step(state, exp.device_batch(0))
  old = to_host(state)
  prov = np.array([0, 1, 0, 1])
  new = build_stage(config, devices=jax.devices()[:1], num_layers=len(prov))
  grown_state = to_host(make_grower(exp.layout, new.layout, prov)(state))
  logical = exp.layout.logical
  assert_trees_equal(grown_state, grow_host(old, logical, prov))
  factored = grown_state.opt_state[1][0]
  for name in ("v_row", "v_col"):
    moment = getattr(factored, name)["layers"]["attn"]["query"]
    assert moment.shape[0] == 4 and np.any(moment != 0)
    np.testing.assert_array_equal(moment[2:], moment[:2])
