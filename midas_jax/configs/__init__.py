"""Plain dataclass configs for every part of a run, one module per section.

Each config validates itself on construction, so a bad value fails with a message that names the
setting and the fix before anything is compiled. gin binds these classes by name
(`ModelConfig.d_model = 256`, see `gin_config.py`); Python and notebook users construct them
directly, from here (`configs.ModelConfig`) or from their section's module.

This package imports nothing of midas_jax but errors.py, so every other module may import it.
"""

from midas_jax.configs.data import ORIGINS, SOURCES, VOCABS, DataConfig, ObjectivesConfig
from midas_jax.configs.mesh import DEFAULT_RULES, TPU_FLAGS, MeshConfig
from midas_jax.configs.model import (ATTENTION_IMPLEMENTATIONS, DTYPES, FAMILIES, INIT_SCHEMES, MATMUL_OPERANDS,
                                     REMAT_POLICIES, ModelConfig)
from midas_jax.configs.optimizer import DECAYS, OPTIMIZERS, OptimizerConfig
from midas_jax.configs.run import RunConfig
from midas_jax.configs.stacking import GROWTH_MOMENTS, LR_SCHEDULES, StackingConfig
from midas_jax.configs.trainer import NO_USABLE_SAVE, CheckpointConfig, TrainerConfig

CONFIG_CLASSES = (ModelConfig, MeshConfig, OptimizerConfig, DataConfig, ObjectivesConfig, TrainerConfig,
                  StackingConfig, CheckpointConfig)

# Settings that moved to another config: gin names the new place when an old binding is parsed,
# and checkpoints saved before the move are read with the setting where it is now.
MOVED_SETTINGS = {f"DataConfig.{name}": f"ObjectivesConfig.{name}"
                  for name in ("causal_rate", "prefix_rate", "span_rate", "span_denoisers", "mode_tokens",
                               "num_sentinels")}
