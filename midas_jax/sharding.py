"""Device mesh, logical-axis rules, and the shardings of parameters, optimizer state and batches.

Parameters carry logical axis names (batch, length, embed, heads, kv, mlp, vocab, layers); one rule
table per mesh (gin/meshes/) maps them to the mesh axes (data, fsdp, tensor). Optimizer moments
mirror the parameter tree, so an optimizer-state leaf whose path ends with a parameter's path gets
that parameter's axes (less the one a factored moment reduces over); everything else (step counts,
placeholders) is replicated.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from midas_jax.configs import MeshConfig, ModelConfig
from midas_jax.errors import ConfigError, require

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_slice_shape(cfg: MeshConfig, num_devices: int) -> Tuple[int, int, int]:
  """(data, fsdp, tensor) within one slice of num_devices / (dcn_data * dcn_fsdp) devices."""
  slices = cfg.num_slices
  require(num_devices % slices == 0, "MeshConfig.dcn_data",
          f"{num_devices} devices do not split into dcn_data x dcn_fsdp = {slices} slices",
          "set dcn_data x dcn_fsdp to the number of slices")
  per_slice = num_devices // slices
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    require(per_slice % known == 0, "MeshConfig", f"the fixed axis sizes (product {known}) do not divide the "
            f"{per_slice} devices of a slice", "choose axis sizes whose product divides the device count")
    sizes[sizes.index(-1)] = per_slice // known
  shape = tuple(sizes)
  if math.prod(shape) != per_slice:
    where = f"each of {slices} slices has {per_slice}" if slices > 1 else f"{per_slice} are available"
    raise ConfigError("MeshConfig", f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} needs "
                      f"{math.prod(shape)} devices but {where}",
                      "make the product of the axis sizes equal the device count, or set one axis to -1")
  return shape


def dcn_shape(cfg: MeshConfig) -> Tuple[int, int, int]:
  return (cfg.dcn_data, cfg.dcn_fsdp, 1)


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> Tuple[int, int, int]:
  """The whole mesh: each axis its size within a slice times its size across slices."""
  return tuple(i * d for i, d in zip(resolve_slice_shape(cfg, num_devices), dcn_shape(cfg)))


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh with Auto axis types (GSPMD-style sharding constraints work)."""
  return Mesh(device_grid(cfg, list(jax.devices() if devices is None else devices)), MESH_AXES)


def device_grid(cfg: MeshConfig, devices: Sequence[jax.Device]) -> np.ndarray:
  """The devices in mesh order, an array of shape resolve_mesh_shape(cfg, len(devices)).

  Device order follows the hardware: on TPU, mesh_utils maps the axes onto the torus so that neighbours along an
  axis are neighbours on the interconnect; across slices (dcn_data, dcn_fsdp > 1) jax's create_hybrid_device_mesh
  makes each slice (by its devices' slice_index) one block of the data or fsdp axis, so only those axes' collectives
  cross DCN. Devices that carry no slice index (CPU, one GPU node) rehearse slices: consecutive runs of devices
  stand in for them, laid out the same way.
  """
  ici, dcn = resolve_slice_shape(cfg, len(devices)), dcn_shape(cfg)
  slices = _slices(devices, cfg.num_slices)
  if len(slices) == 1:
    return _laid_out(ici, lambda: mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True))
  if len({getattr(d, "slice_index", None) for d in devices}) == len(slices):  # real slices
    return _laid_out(ici, lambda: mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                                      allow_split_physical_axes=True))
  grids = np.empty(dcn, dtype=object)  # the rehearsal: what create_hybrid_device_mesh does with real slices
  for index, members in zip(np.ndindex(*dcn), slices):
    grids[index] = _laid_out(ici, lambda: mesh_utils.create_device_mesh(ici, members, allow_split_physical_axes=True))
  return np.block(grids.tolist())


def _laid_out(shape: Tuple[int, int, int], make) -> np.ndarray:
  try:
    return make()
  except (ValueError, NotImplementedError) as e:
    raise ConfigError("MeshConfig", f"data x fsdp x tensor = {shape} cannot be laid onto these devices' "
                      f"interconnect ({str(e).splitlines()[0]})", "choose axis sizes that tile the slice") from e


def _slices(devices: Sequence[jax.Device], count: int) -> list:
  """The devices of each slice, by slice_index (checked here, so that a mismatch names the setting); where devices
  carry none, or all one, consecutive runs of devices stand in for `count` slices."""
  by_slice: dict = {}
  for d in devices:
    by_slice.setdefault(getattr(d, "slice_index", 0), []).append(d)
  if len(by_slice) == count:
    slices = [by_slice[k] for k in sorted(by_slice)]
    require(len({len(s) for s in slices}) == 1, "MeshConfig.dcn_data", "the slices have different numbers of "
            f"devices ({', '.join(str(len(s)) for s in slices)})", "use every device of each slice")
    return slices
  require(len(by_slice) == 1, "MeshConfig.dcn_data", f"the devices form {len(by_slice)} slices, but "
          f"dcn_data x dcn_fsdp = {count}", "set dcn_data x dcn_fsdp to the number of slices")
  per = len(devices) // count
  return [devices[i * per:(i + 1) * per] for i in range(count)]


def check_divisibility(model: ModelConfig, mesh: Mesh, global_batch: int, microbatches: int = 1) -> None:
  """Every sharded dimension must divide by its mesh axes; say which setting to change if not."""
  sizes = dict(mesh.shape)
  batch_shards = sizes["data"] * sizes["fsdp"]
  require(global_batch % batch_shards == 0, "DataConfig.batch_size",
          f"global batch {global_batch} is not divisible by data x fsdp = {batch_shards}",
          f"use a batch size that is a multiple of {batch_shards}")
  require(global_batch % (batch_shards * microbatches) == 0, "TrainerConfig.microbatches",
          f"global batch {global_batch} does not split into {microbatches} microbatches over data x fsdp = "
          f"{batch_shards} devices ({global_batch // batch_shards} rows per device)",
          f"choose microbatches that divide {global_batch // batch_shards}, or raise DataConfig.batch_size")
  tensor = sizes["tensor"]
  for name, value in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads),
                      ("d_ff", model.d_ff), ("vocab_size", model.vocab_size)):
    require(value % tensor == 0, f"ModelConfig.{name}",
            f"{name}={value} is not divisible by the tensor axis ({tensor})",
            f"make {name} a multiple of {tensor} or shrink MeshConfig.tensor")
  require(model.d_model % sizes["fsdp"] == 0, "ModelConfig.d_model",
          f"d_model={model.d_model} is not divisible by the fsdp axis ({sizes['fsdp']})",
          "make d_model a multiple of the fsdp axis size or shrink MeshConfig.fsdp")


def logical_to_sharding(logical_specs: Any, mesh: Mesh, rules) -> Any:
  """A tree of logical PartitionSpecs -> a tree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, list(rules))


def _path_key(path) -> Tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def mirror_param_specs(tree: Any, params: Any, param_specs: Any) -> Any:
  """Logical specs for `tree` (e.g. an optax state) by matching leaf paths against parameters.

  A leaf whose path ends with a parameter's path gets the parameter's spec when the shapes agree
  (Adam's mu and nu). If its shape is the parameter's with one axis removed (Adafactor's factored
  v_row / v_col, which drop one of the two largest axes, not necessarily the last two) it gets the
  spec with that entry removed, so the `layers` axis stays visible to growth. Where equal adjacent
  sizes make the removed axis ambiguous, the entries the candidates disagree on are replicated.
  Any other leaf (a step count, optax's (1,) placeholder) gets P() and is replicated.
  """
  by_path = {}
  for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                jax.tree_util.tree_leaves(param_specs, is_leaf=lambda x: isinstance(x, P))):
    by_path[_path_key(path)] = (np.shape(leaf), spec)

  def factored_spec(shape, spec, leaf_shape):
    # A real factored moment keeps the other (large) factored axis, so it is never the (1,)
    # placeholder optax stores for unfactored parameters; a depth-1 [1, embed] scale would match it.
    if leaf_shape == (1,) or len(leaf_shape) != len(shape) - 1:
      return None
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    candidates = [entries[:k] + entries[k + 1:] for k in range(len(shape))
                  if shape[:k] + shape[k + 1:] == leaf_shape]
    if not candidates:
      return None
    return P(*(col[0] if all(e == col[0] for e in col) else None for col in zip(*candidates)))

  def spec_for(path, leaf):
    key = _path_key(path)
    for start in range(len(key)):
      match = by_path.get(key[start:])
      if match is None:
        continue
      shape, spec = match
      if shape == np.shape(leaf):
        return spec
      reduced = factored_spec(shape, spec, np.shape(leaf))
      if reduced is not None:
        return reduced
    return P()

  return jax.tree_util.tree_map_with_path(spec_for, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict:
  """Places a host's slice of the global batch on the mesh, split over (data, fsdp).

  Each process passes only the rows it built; on one process that is the whole batch.
  """
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}
