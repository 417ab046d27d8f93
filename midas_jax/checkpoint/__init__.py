"""Checkpoints (orbax): saving and resuming runs, params-only exports, loading models for eval."""

from midas_jax.checkpoint.export import (LoadedModel, export_run_params, is_params_export, load_model,
                                         write_params_export)
from midas_jax.checkpoint.manager import (CorruptCheckpointError, OrbaxCheckpointer, available_steps,
                                          checkpoint_dir)
