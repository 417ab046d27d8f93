"""Gradient reductions once per step: with microbatches, the reductions over the `data` axis (and its
cross-slice part) run after the microbatch loop, not in it, in the optimized TPU program (libtpu
compiles for a simulated slice on this CPU), and the values are those of one pass. Also the reader
of collectives' replica groups and loops (analysis/hlo_loops.py) that these checks stand on."""

import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import tiny_model, tiny_run, ul2_rows
from midas_jax import configs, sharding
from midas_jax.analysis import hlo_loops, targets
from midas_jax.model import dummy_batch
from midas_jax.train import accumulate, build as build_lib, step as step_lib

MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def test_replica_groups_in_each_spelling_name_the_mesh_axes():
  shape = dict(MESH)  # device i of the program is the mesh's i-th device in row-major order
  line = "%ar = f32[8] all-reduce(%x), channel_id=1, replica_groups={}, to_apply=%add"
  assert hlo_loops.replica_groups(line) is None and hlo_loops.mesh_axes(None, shape) == ("data", "fsdp", "tensor")
  explicit = hlo_loops.replica_groups("all-reduce(%x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%a")
  assert explicit == ((0, 4), (1, 5), (2, 6), (3, 7)) and hlo_loops.mesh_axes(explicit, shape) == ("data",)
  iota = hlo_loops.replica_groups("reduce-scatter(%x), replica_groups=[4,2]<=[8], dimensions={0}")
  assert iota == ((0, 1), (2, 3), (4, 5), (6, 7)) and hlo_loops.mesh_axes(iota, shape) == ("tensor",)
  transposed = hlo_loops.replica_groups("all-reduce(%x), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%a")
  assert transposed == ((0, 2, 4, 6), (1, 3, 5, 7)) and hlo_loops.mesh_axes(transposed, shape) == ("data", "fsdp")
  # The mesh spelling: devices on a mesh of XLA's own axes (ids transposed), grouped along the named ones.
  mesh = ("all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) "
          "{'axis_0'}, use_global_device_ids=true")
  groups = hlo_loops.replica_groups(mesh)
  assert sorted(groups) == [(0, 4), (1, 5), (2, 6), (3, 7)] and hlo_loops.mesh_axes(groups, shape) == ("data",)
  both = hlo_loops.replica_groups(mesh.replace("{'axis_0'}", "{'axis_0','axis_2'}"))
  assert hlo_loops.mesh_axes(both, shape) == ("data", "fsdp")  # axis_2 holds ids 0, 2: the fsdp axis


def test_loops_trip_counts_and_cross_slice_sends():
  send = ('%s = (f32[4], u32[], token[]) send(%x, %t), channel_id=2, is_host_transfer=true, '
          'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}')
  text = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4] get-tuple-element(%p), index=1
  %ar = f32[4] all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %t = token[] after-all()
  {send}
  ROOT %r = (s32[], f32[4]) tuple(%i, %ar)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4] all-reduce(%a), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add
}
""".replace("{send}", send)
  found = hlo_loops.collectives(text)
  trips = hlo_loops.trip_counts(text)
  assert trips == {"body": 4}
  summary = sorted((c.op, c.loops, c.dcn, hlo_loops.runs(c, trips)) for c in found)
  assert summary == [("all-reduce", (), False, 1), ("all-reduce", ("body",), False, 4),
                     ("all-reduce", ("body",), True, 4)]
  assert hlo_loops.reductions_by_depth(found) == {0: 1, 1: 2}


def test_deferred_axes_and_rules():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.MESH_AXES)
  assert accumulate.deferred_axes(mesh, 1, True) == ()  # one pass: nothing to defer
  assert accumulate.deferred_axes(mesh, 4, False) == ("data",)
  assert accumulate.deferred_axes(mesh, 4, True) == ("data", "fsdp")
  assert accumulate.deferred_axes(jax.sharding.AbstractMesh((1, 8, 1), sharding.MESH_AXES), 4, False) == ()
  rules = accumulate.rules_without(configs.MeshConfig().rules_as_tuples(), ("data",))
  assert dict(rules)["batch"] == "fsdp" and dict(rules)["embed"] == "fsdp"
  assert dict(accumulate.rules_without(rules, ("fsdp",)))["batch"] is None


MESH_RUN = tiny_run(model=tiny_model(vocab_size=512, num_layers=1), mesh=configs.MeshConfig(**MESH),
                    data=configs.DataConfig(seq_len=32, batch_size=16))


@pytest.mark.parametrize("defer_fsdp", [False, True])
def test_deferred_reductions_give_the_one_pass_loss_and_gradients(defer_fsdp):
  """data 2 x fsdp 2 x tensor 2 on the simulated CPU devices: 16 packed UL2 rows in one pass and as
  4 microbatches whose reductions over data (and fsdp) run once; random parameters."""
  mesh = sharding.make_mesh(MESH_RUN.mesh)
  model, _, _, rules, layout = build_lib.model_and_layout(MESH_RUN, mesh, MESH_RUN.model)
  rng = np.random.default_rng(1)
  params = jax.device_put(jax.tree.map(lambda a: rng.normal(0, 0.2, a.shape).astype(np.float32),
                                       layout.abstract.params), layout.shardings.params)
  batch = sharding.shard_batch(ul2_rows(seed=4, num_rows=16, seq_len=32, vocab_size=512), mesh)
  loss_fn = step_lib.make_loss_fn(model, z_loss=1e-3, loss_chunk=16)

  def both(p, b):
    return tuple(step_lib.accumulated_gradients(loss_fn, p, b, n, layout.shardings.params, defer_fsdp) for n in (1, 4))
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
    jitted = jax.jit(both, in_shardings=(layout.shardings.params, sharding.batch_sharding(mesh)),
                     out_shardings=((None, layout.shardings.params),) * 2)
    (one, one_grads), (four, four_grads) = jax.device_get(jitted(params, batch))
  for name in ("loss", "z_loss", "tokens", "objective_loss_sum", "objective_weight_sum"):
    np.testing.assert_allclose(four[name], one[name], rtol=1e-6, atol=1e-7, err_msg=name)
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(four_grads), jax.tree.leaves(four_grads),
                        jax.tree.leaves(one_grads)):
    error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert error <= 1e-6, (jax.tree_util.keystr(path[0]), error)


# --- the optimized TPU program ------------------------------------------------------------------

def _tpu_devices(topology):
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: another process may hold libtpu
  devices, why = targets.tpu_devices(targets.parse_target(topology))
  if devices is None:
    pytest.skip(why)
  return devices


def _tpu_program(devices, mesh_config, microbatches, defer_fsdp=False):
  """The train step of a small model compiled by libtpu for `devices`: (HLO text, mesh shape, temp bytes).
  Dense attention: the Pallas kernels are opaque custom calls to the partitioner and change no reduction."""
  model = tiny_model(d_model=128, num_heads=2, num_kv_heads=2, d_ff=256, vocab_size=512, max_seq_len=128,
                     attention="dot_product", dtype="bfloat16")
  config = tiny_run(model=model, mesh=mesh_config, data=configs.DataConfig(seq_len=128, batch_size=16),
                    trainer=configs.TrainerConfig(microbatches=microbatches, loss_chunk=0,
                                                  defer_fsdp_reduction=defer_fsdp))
  mesh = sharding.make_mesh(config.mesh, devices)
  net, tx, schedule, rules, layout = build_lib.model_and_layout(config, mesh, model, platform="tpu")
  build = build_lib.StageBuild(config=config, model_config=model, vocab=None, pipeline=None, mesh=mesh, rules=rules,
                               model=net, tx=tx, lr_schedule=schedule, layout=layout)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layout.abstract,
                       layout.shardings)
  rows = jax.eval_shape(lambda: dummy_batch(16, 128))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(mesh)) for k, v in rows.items()}
  with build.context():
    compiled = build.jit_train_step().lower(state, batch).compile()
  return compiled.as_text(), dict(mesh.shape), compiled.memory_analysis().temp_size_in_bytes


def _reductions_over(text, mesh_shape, axis):
  """[(loops deep, runs a step)] of the reductions over `axis` (a cross-slice one spans `data`)."""
  trips = hlo_loops.trip_counts(text)
  return [(len(c.loops), hlo_loops.runs(c, trips)) for c in hlo_loops.collectives(text)
          if c.op in hlo_loops.REDUCTIONS and ((c.dcn and axis == "data") or
                                               (not c.dcn and axis in hlo_loops.mesh_axes(c.groups, mesh_shape)))]


@pytest.mark.parametrize("topology, mesh", [
    ("v5p-8", configs.MeshConfig(data=2, fsdp=2, tensor=1)),  # 4 chips: data over ICI
    ("2xv5p-8", configs.MeshConfig(data=1, fsdp=2, tensor=2, dcn_data=2)),  # two slices: data over DCN
])
def test_data_reductions_run_once_per_step_whatever_the_microbatches(topology, mesh):
  devices = _tpu_devices(topology)
  found = {}
  for n in (1, 2, 4):
    text, shape, _ = _tpu_program(devices, mesh, n)
    found[n] = _reductions_over(text, shape, "data")
  assert found[1], "the gradient must be reduced over data at all"
  for n in (2, 4):
    assert all(depth == 0 for depth, _ in found[n]), (n, found[n])  # none inside the microbatch (or layer) loop
  total = {n: sum(r for _, r in found[n]) for n in found}
  assert total[4] == total[2] <= total[1], total  # they do not scale with the microbatches


def test_deferred_fsdp_reduction_leaves_no_gradient_reduction_in_the_loop():
  devices = _tpu_devices("v5p-8")
  mesh = configs.MeshConfig(data=2, fsdp=2, tensor=1)
  text, shape, _ = _tpu_program(devices, mesh, 4, defer_fsdp=True)
  batch_axes = {"data", "fsdp"}
  trips = hlo_loops.trip_counts(text)
  in_loops = [c for c in hlo_loops.collectives(text) if c.op in hlo_loops.REDUCTIONS and c.loops
              and batch_axes & set(hlo_loops.mesh_axes(c.groups, shape))]
  assert not in_loops, [(c.op, len(c.loops), hlo_loops.runs(c, trips), c.text[:160]) for c in in_loops]
