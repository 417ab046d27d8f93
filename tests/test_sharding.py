"""Meshes from gin/meshes/: state created sharded, and the same losses on 1 device and on 8."""

import os
import types

import gin
import jax
import numpy as np
import pytest

from conftest import REPO_ROOT, tiny_model, tiny_run
from midas_jax import configs, gin_config, sharding
from midas_jax.errors import ConfigError
from midas_jax.train.build import build_stage


def mesh_from_gin(name: str) -> configs.MeshConfig:
  gin_config.parse([os.path.join(REPO_ROOT, "gin", "meshes", name)], [])
  try:
    return gin_config.build(configs.MeshConfig)
  finally:
    gin.clear_config()


def run_steps(config, devices, steps=3):
  exp = build_stage(config, devices=devices)
  state = exp.init_state()
  losses = []
  with exp.context():
    step_fn = exp.jit_train_step()
    for s in range(steps):
      state, metrics = step_fn(state, exp.device_batch(s))
      losses.append(float(metrics["loss"]))
  return exp, state, losses


@pytest.mark.parametrize("mesh_file,attention", [("data_parallel.gin", "auto"), ("fsdp.gin", "auto"),
                                                  ("tensor.gin", "flash")])
def test_same_losses_on_one_and_eight_devices(mesh_file, attention):
  # On tensor.gin the eight devices run the flash kernel (interpreted), each on its rows and heads,
  # against dense attention on one device.
  mesh_cfg = mesh_from_gin(mesh_file)
  config = tiny_run(model=tiny_model(num_heads=4, num_kv_heads=2, attention=attention), mesh=mesh_cfg)
  exp8, state8, losses8 = run_steps(config, jax.devices())
  assert exp8.mesh.devices.size == 8
  single = tiny_run(model=tiny_model(num_heads=4, num_kv_heads=2), mesh=configs.MeshConfig())
  _, state1, losses1 = run_steps(single, jax.devices()[:1])
  np.testing.assert_allclose(losses8, losses1, rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               state8.params, state1.params)


def test_state_is_created_sharded_by_the_rules():
  config = tiny_run(mesh=mesh_from_gin("fsdp.gin"))
  exp = build_stage(config)
  state = exp.init_state()
  query = state.params["layers"]["attn"]["query"]  # [layers, embed, heads, kv]
  assert query.sharding.spec[1] == "fsdp"
  assert query.addressable_shards[0].data.shape == (2, 32 // 8, 4, 8)  # embed split 8 ways
  mu = state.opt_state[1][0].mu["layers"]["attn"]["query"]  # clip, then adamw's scale_by_adam
  assert mu.sharding == query.sharding
  tensor = build_stage(tiny_run(mesh=mesh_from_gin("tensor.gin")))
  gate = tensor.init_state().params["layers"]["mlp"]["gate"]
  assert gate.sharding.spec[2] == "tensor"
  assert gate.addressable_shards[0].data.shape == (2, 32, 64 // 2)  # mlp split over tensor=2


def test_mesh_shape_resolution_and_errors():
  assert sharding.resolve_mesh_shape(configs.MeshConfig(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 2)
  with pytest.raises(ConfigError, match="needs 16 devices but 8"):
    sharding.resolve_mesh_shape(configs.MeshConfig(data=4, fsdp=2, tensor=2), 8)
  with pytest.raises(ConfigError, match="do not divide"):
    sharding.resolve_mesh_shape(configs.MeshConfig(data=-1, tensor=3), 8)
  with pytest.raises(ConfigError, match="layers"):
    configs.MeshConfig(rules=(("layers", "data"),))


def test_shapes_that_do_not_divide_the_mesh_are_refused_before_compiling():
  with pytest.raises(ConfigError, match="ModelConfig.num_kv_heads"):
    build_stage(tiny_run(model=tiny_model(num_heads=4, num_kv_heads=1),
                              mesh=configs.MeshConfig(data=-1, tensor=2)))
  with pytest.raises(ConfigError, match="DataConfig.batch_size"):
    build_stage(tiny_run(data=configs.DataConfig(seq_len=32, batch_size=12)))


def test_multi_slice_meshes_put_each_slice_in_one_block_of_its_axis():
  # 8 simulated devices as 2 slices of 4 (CPU devices carry no slice index: consecutive runs stand in).
  cfg = configs.MeshConfig(data=1, fsdp=2, tensor=2, dcn_data=2)
  assert sharding.resolve_mesh_shape(cfg, 8) == (2, 2, 2)
  mesh = sharding.make_mesh(cfg)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert sorted(ids[0].ravel()) == [0, 1, 2, 3] and sorted(ids[1].ravel()) == [4, 5, 6, 7]  # data row = slice
  across_fsdp = sharding.make_mesh(configs.MeshConfig(data=2, fsdp=2, dcn_fsdp=2))
  fsdp_ids = np.vectorize(lambda d: d.id)(across_fsdp.devices)[:, :, 0]
  assert sorted(fsdp_ids[:, :2].ravel()) == [0, 1, 2, 3]  # fsdp columns 0-1: slice 0
  two = mesh_from_gin("tpu_2x_v5p_128.gin")
  assert (two.num_slices, sharding.resolve_mesh_shape(two, 128)) == (2, (2, 64, 1))
  with pytest.raises(ConfigError, match="MeshConfig.dcn_data"):
    sharding.resolve_mesh_shape(configs.MeshConfig(dcn_data=3), 8)
  with pytest.raises(ConfigError, match="MeshConfig.dcn_fsdp"):
    configs.MeshConfig(dcn_fsdp=0)


def test_devices_from_other_slices_than_the_mesh_spans_are_config_errors():
  # Stand-ins for the devices of a multi-slice TPU job: all a mesh reads of them here is their slice.
  two_slices = [types.SimpleNamespace(id=i, slice_index=i // 4) for i in range(8)]
  with pytest.raises(ConfigError, match="the devices form 2 slices, but dcn_data x dcn_fsdp = 1"):
    sharding.make_mesh(configs.MeshConfig(), two_slices)  # one mesh across DCN without saying so
  with pytest.raises(ConfigError, match="the devices form 2 slices, but dcn_data x dcn_fsdp = 4"):
    sharding.make_mesh(configs.MeshConfig(dcn_data=2, dcn_fsdp=2), two_slices)
  uneven = [types.SimpleNamespace(id=i, slice_index=int(i >= 3)) for i in range(8)]
  with pytest.raises(ConfigError, match="different numbers of devices"):
    sharding.make_mesh(configs.MeshConfig(dcn_data=2), uneven)


def test_devices_with_slice_indices_are_grouped_by_slice_not_by_position():
  # Two slices whose devices interleave in the device list: jax's create_hybrid_device_mesh groups them by
  # slice_index, each slice one block of the axis that crosses DCN (stand-ins: a grid, not a jax Mesh).
  interleaved = [types.SimpleNamespace(id=i, slice_index=i % 2, platform="cpu", device_kind="cpu") for i in range(8)]
  ids = np.vectorize(lambda d: d.id)(sharding.device_grid(configs.MeshConfig(fsdp=2, tensor=2, dcn_data=2),
                                                          interleaved))
  assert ids.shape == (2, 2, 2) and sorted(ids[0].ravel()) == [0, 2, 4, 6] and sorted(ids[1].ravel()) == [1, 3, 5, 7]
  ids = np.vectorize(lambda d: d.id)(sharding.device_grid(configs.MeshConfig(data=2, fsdp=2, dcn_fsdp=2),
                                                          interleaved))
  assert sorted(ids[:, :2].ravel()) == [0, 2, 4, 6] and sorted(ids[:, 2:].ravel()) == [1, 3, 5, 7]
