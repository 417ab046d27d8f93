"""One training run: every section together, and the checks that span sections."""

from __future__ import annotations

import dataclasses

from midas_jax.configs.data import DataConfig, ObjectivesConfig
from midas_jax.configs.mesh import MeshConfig
from midas_jax.configs.model import ModelConfig
from midas_jax.configs.optimizer import OptimizerConfig
from midas_jax.configs.stacking import StackingConfig
from midas_jax.configs.trainer import CheckpointConfig, TrainerConfig
from midas_jax.errors import require


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one training run needs.

  Checks that need the stacking operators (the depth a schedule reaches, stage lengths against
  warmups) live in stacking/checks.py, which the gin entry point and the stage controller run.
  """

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  objectives: ObjectivesConfig = dataclasses.field(default_factory=ObjectivesConfig)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  stacking: StackingConfig = dataclasses.field(default_factory=StackingConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

  def __post_init__(self):
    require(self.data.seq_len <= self.model.max_seq_len, "DataConfig.seq_len",
            f"seq_len={self.data.seq_len} exceeds ModelConfig.max_seq_len={self.model.max_seq_len}",
            "raise ModelConfig.max_seq_len or lower DataConfig.seq_len")
    require(self.data.batch_size % self.trainer.microbatches == 0, "TrainerConfig.microbatches",
            f"batch_size={self.data.batch_size} does not split into {self.trainer.microbatches} microbatches",
            "choose microbatches that divide DataConfig.batch_size")
