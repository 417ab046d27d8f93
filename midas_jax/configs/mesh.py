"""The device mesh: axis sizes within and across slices, the logical axis rules, libtpu's flags."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from midas_jax.errors import require


TPU_FLAGS = ("auto", "none")

DEFAULT_RULES: Tuple[Tuple[str, Optional[str | Tuple[str, ...]]], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh with axes (data, fsdp, tensor) and the logical-to-mesh axis rules.

  data, fsdp, tensor are the axis sizes within one slice (the devices joined by the fast
  interconnect, ICI); dcn_data and dcn_fsdp multiply the data and fsdp axes across slices (joined by
  the data-center network, DCN), so the mesh is (data * dcn_data, fsdp * dcn_fsdp, tensor) over
  dcn_data * dcn_fsdp slices. One of data, fsdp, tensor may be -1: it takes all the devices of a
  slice the others leave. `rules` maps each logical axis name to a mesh axis, a tuple of mesh axes,
  or None (replicated). `layers` must stay replicated, so growing the depth never changes how the
  other dimensions are laid out.
  tpu_flags: "auto" sets the libtpu flags this project recommends for the TPU generation named by
  MIDAS_TPU_ACCELERATOR or TPU_ACCELERATOR_TYPE (the launchers set it), before jax starts; flags in
  LIBTPU_INIT_ARGS keep their values. "none" leaves LIBTPU_INIT_ARGS as it is (tpu_flags.py).
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  rules: Tuple[Tuple[str, object], ...] = DEFAULT_RULES
  dcn_data: int = 1
  dcn_fsdp: int = 1
  tpu_flags: str = "auto"

  def __post_init__(self):
    require(self.tpu_flags in TPU_FLAGS, "MeshConfig.tpu_flags", f"must be one of {TPU_FLAGS}, got {self.tpu_flags!r}",
            "'auto' sets the generation's recommended libtpu flags; 'none' leaves LIBTPU_INIT_ARGS as it is")
    sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
    for name, size in sizes.items():
      require(size == -1 or (isinstance(size, int) and size > 0), f"MeshConfig.{name}",
              f"axis size must be a positive int or -1, got {size!r}", "use -1 to fill the remaining devices")
    for name in ("dcn_data", "dcn_fsdp"):
      size = getattr(self, name)
      require(isinstance(size, int) and size >= 1, f"MeshConfig.{name}",
              f"must be a positive int, got {size!r}", "1 means a single slice along this axis")
    require(list(sizes.values()).count(-1) <= 1, "MeshConfig",
            "more than one axis size is -1", "set at most one of data, fsdp, tensor to -1")
    rules = dict(self.rules_as_tuples())
    require(rules.get("layers") is None, "MeshConfig.rules",
            "the 'layers' axis is mapped to a mesh axis",
            "map 'layers' to None: growth must never change the other axes' layout")

  @property
  def num_slices(self) -> int:
    return self.dcn_data * self.dcn_fsdp

  def rules_as_tuples(self) -> Tuple[Tuple[str, object], ...]:
    out = []
    for rule in self.rules:
      logical, mesh_axes = rule
      if isinstance(mesh_axes, list):
        mesh_axes = tuple(mesh_axes)
      out.append((logical, mesh_axes))
    return tuple(out)
