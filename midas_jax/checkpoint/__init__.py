"""Checkpoints (orbax): saving and resuming runs, loading models for eval, params-only exports."""

from midas_jax.checkpoint.export import export_run_params, write_params_export
from midas_jax.checkpoint.load import LoadedModel, is_params_export, load_model
from midas_jax.checkpoint.manager import (CorruptCheckpointError, OrbaxCheckpointer, available_steps,
                                          checkpoint_dir)
