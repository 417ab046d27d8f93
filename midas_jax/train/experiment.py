"""Everything a run needs, built and validated from a RunConfig before anything is compiled."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from midas_jax import sharding
from midas_jax.configs import ModelConfig, RunConfig
from midas_jax.data import seqio_source
from midas_jax.data.pipeline import Pipeline, tokenize_documents
from midas_jax.data.sources import load_documents
from midas_jax.data.store.pipeline import PreparedPipeline
from midas_jax.data.vocab import make_vocabulary
from midas_jax.model import Decoder, attention
from midas_jax.stacking.schedule import schedule_from_config
from midas_jax.train import optimizer as optimizer_lib
from midas_jax.train import step as step_lib
from midas_jax.train.state import StateLayout, TrainState, create_train_state, state_layout


@dataclasses.dataclass
class Experiment:
  config: RunConfig
  model_config: ModelConfig  # config.model with vocab_size filled in
  vocab: Any
  pipeline: Pipeline
  mesh: Mesh
  rules: Tuple[Tuple[str, Any], ...]
  model: Decoder
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  layout: StateLayout

  @contextlib.contextmanager
  def context(self):
    """Mesh and logical-axis rules for tracing: activation sharding constraints resolve here."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(list(self.rules)):
      yield

  def init_state(self) -> TrainState:
    with self.context():
      return create_train_state(self.model, self.tx, self.layout,
                                jax.random.key(self.config.trainer.seed), self.config.data.seq_len)

  def init_state_from_params(self, params) -> TrainState:
    """Step 0 with the given parameters (e.g. an imported model) and fresh optimizer state."""
    def init(p):
      return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=self.tx.init(p))
    with self.context():
      return jax.jit(init, out_shardings=self.layout.shardings)(params)

  def jit_train_step(self):
    trainer = self.config.trainer
    step = step_lib.make_train_step(self.model, self.tx, self.schedule, self.config.optimizer.z_loss,
                                    microbatches=trainer.microbatches, loss_chunk=trainer.loss_chunk,
                                    grad_shardings=self.layout.shardings.params)
    return jax.jit(step, in_shardings=(self.layout.shardings, sharding.batch_sharding(self.mesh)),
                   out_shardings=(self.layout.shardings, sharding.replicated(self.mesh)),
                   donate_argnums=0)

  def jit_eval_step(self):
    return jax.jit(step_lib.make_eval_step(self.model, self.config.trainer.loss_chunk),
                   in_shardings=(self.layout.shardings.params, sharding.batch_sharding(self.mesh)),
                   out_shardings=sharding.replicated(self.mesh))

  def host_batch(self, step: int, split: str = "train") -> Dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`."""
    return self.pipeline.batch(step, split, jax.process_index(), jax.process_count())

  def device_batch(self, step: int, split: str = "train") -> Dict[str, jax.Array]:
    return sharding.shard_batch(self.host_batch(step, split), self.mesh)


def load_token_documents(config: RunConfig, vocab,
                         cache_dir: Optional[str] = None) -> Dict[str, List[np.ndarray]]:
  """cache_dir: the seqio source's token cache (None: ~/.cache/midas_jax/seqio); others ignore it."""
  if config.data.source == "seqio":
    return {split: seqio_source.load_token_documents_from_task(config.data, split, cache_dir, vocab)
            for split in ("train", "validation")}
  return {split: tokenize_documents(load_documents(config.data, split), vocab)
          for split in ("train", "validation")}


def load_data(config: RunConfig) -> Tuple[Any, Pipeline]:
  """The vocabulary and the step-addressed pipeline over the configured source: a prepared store
  is read by index (data/store/), every other source is loaded into memory."""
  vocab = make_vocabulary(config.data)
  if config.data.source == "prepared":
    return vocab, PreparedPipeline(config.data, vocab)
  return vocab, Pipeline(config.data, load_token_documents(config, vocab), vocab.vocab_size, vocab)


def learning_rate(config: RunConfig) -> optax.Schedule:
  """The global schedule, re-warmed after each growth when StackingConfig.lr_schedule = "rewarm"."""
  num_steps = config.trainer.num_steps
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, num_steps)
  stacking = config.stacking
  if stacking.num_stages == 1 or stacking.lr_schedule != "rewarm":
    return schedule
  stages = schedule_from_config(stacking, num_steps, config.model.num_layers)
  return optimizer_lib.with_rewarm(schedule, stages.boundaries,
                                   stacking.resolved_rewarm_steps(config.optimizer.warmup_steps))


def model_and_layout(config: RunConfig, mesh: Mesh, model_config: ModelConfig,
                     platform: Optional[str] = None) -> tuple:
  """(model, optimizer, lr schedule, axis rules, state layout) on `mesh`, checked and allocating nothing.

  platform: where the step will run, for ModelConfig.attention = 'auto'; None takes the mesh's
  devices' platform (an abstract mesh has none: then jax's default backend decides when traced).
  """
  sharding.check_divisibility(model_config, mesh, config.data.batch_size, config.trainer.microbatches)
  if platform is None and isinstance(mesh, Mesh):
    platform = mesh.devices.flat[0].platform
  # The model gets the resolved kernel; the configs (and so checkpoints) keep what the user wrote.
  model = Decoder(dataclasses.replace(model_config, attention=attention.resolve(model_config.attention, platform))
                  if platform else model_config)
  schedule = learning_rate(config)
  tx = optimizer_lib.make_optimizer(config.optimizer, config.trainer.num_steps, schedule)
  rules = config.mesh.rules_as_tuples()
  return model, tx, schedule, rules, state_layout(model, tx, mesh, rules, config.data.seq_len)


def build_experiment(config: RunConfig, devices=None, data: Optional[Tuple[Any, Pipeline]] = None,
                     num_layers: Optional[int] = None) -> Experiment:
  """Reads the data, checks every shape against the mesh, and lays out the state, compiling nothing.

  data: (vocab, pipeline) to reuse instead of loading them again; num_layers: the depth of this
  experiment's model when it differs from the final depth (a stage of a stacked run).
  """
  mesh = sharding.make_mesh(config.mesh, devices)
  vocab, pipeline = data or load_data(config)
  model_config = config.model.with_vocab(vocab.vocab_size)
  if num_layers is not None:
    model_config = dataclasses.replace(model_config, num_layers=num_layers)
  model, tx, schedule, rules, layout = model_and_layout(config, mesh, model_config)
  return Experiment(config=config, model_config=model_config, vocab=vocab, pipeline=pipeline, mesh=mesh,
                    rules=rules, model=model, tx=tx, schedule=schedule, layout=layout)
